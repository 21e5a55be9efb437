"""What every role's Space page and panel have, built once: the page and its launch, where the panel stands,
its settings form and its Start / Stop controls.

A role's panel (the trainer's, a replica's, the environment's) stands alone on its Space's page, following the
bucket its last Start named, or as a tab of the combined app, reading that app's bucket on that app's timer with
its ids prefixed (:class:`PanelPlace`). :class:`RolePanel` builds the part every panel shares on that place: the
:class:`~rlsync.spaces.live.Live` that refreshes it, the settings form of the role's config (without the
bucket field when the bucket is fixed), and the controls that start and stop the role; each Space's ``app.py``
adds its own inputs and figures. :class:`RoleSpace` is a role's page: its settings read from the environment, its
runner, its panel, and the launch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..roles import Role
from . import forms
from .controls import role_controls
from .live import panel_live
from .page import serve, space_page
from .restarts import resume_at_boot, stop_on_sigterm
from .role_control import RoleRunner
from .snapshots import BucketSource

__all__ = ["PanelPlace", "RolePanel", "RoleSpace"]


@dataclasses.dataclass(frozen=True)
class PanelPlace:
    """Where a role's panel stands.

    Args:
        bucket_url: The bucket the panel reads (fixed, e.g. in the combined app); ``None``: the form has a bucket
            field and the panel follows the bucket of the last Start.
        timer: The ``gr.Timer`` refreshing the panel (default: a new one, ticking every :data:`~.live.REFRESH_S`).
        prefix: Prepended to the components' ``elem_id`` (several panels on one page).
    """

    bucket_url: BucketSource | None = None
    timer: Any | None = None
    prefix: str = ""


class RolePanel:
    """The shared part of one role's panel, built in the current ``gr.Blocks`` context.

    Args:
        runner: The role this panel starts and stops.
        config: The role's settings (a config dataclass with a ``bucket`` field): the form's defaults.
        place: Where the panel stands.
    """

    def __init__(self, runner: RoleRunner, config: Any, place: PanelPlace) -> None:
        self.runner = runner
        self.config = config
        self.prefix = place.prefix
        self._fixed = place.bucket_url is not None
        #: Refreshes the panel's outputs (enter it to build them).
        self.live, self._follow = panel_live(config.bucket, place.bucket_url, place.timer)

    def form(self, overrides: dict[str, Callable[..., Any]] | None = None, skip: Sequence[str] = ()) -> dict[str, Any]:
        """The settings form of the config (:func:`~rlsync.spaces.forms.config_form`), less ``skip`` and, on a
        fixed bucket, the bucket field."""
        skip = ("bucket", *skip) if self._fixed else tuple(skip)
        return forms.config_form(self.config, overrides=overrides, skip=skip, prefix=self.prefix)

    def controls(
        self,
        make_config: Callable[..., Any],
        inputs: Sequence[Any],
    ) -> dict[str, Any]:
        """Start / Stop and the status line (:func:`~rlsync.spaces.controls.role_controls`), built inside
        :attr:`live`; a Start makes the panel follow the bucket it names.

        Args:
            make_config: ``make_config(*values of inputs) -> the role's config`` (may raise ``ValueError``).
            inputs: The form components passed to ``make_config``.

        Returns:
            ``{"start", "stop", "status"}`` components.
        """
        follow = self._follow
        return role_controls(
            self.runner, make_config, inputs, self.live, on_started=lambda c: follow(c.bucket), prefix=self.prefix
        )


@dataclasses.dataclass(frozen=True)
class RoleSpace:
    """One role's Space page (``python -m <role>_space.app``; on the Space, ``python app.py`` at its root).

    Args:
        role: The role (its runner's name).
        title: The page's title (``RL Sync: <title>``).
        description: One line under the title.
        read_config: Reads the form's defaults from the environment (e.g. ``TrainerConfig.from_env``).
        build_roles: What a Start builds: the role objects of the config the form made (:class:`RoleRunner`).
        build_panel: ``build_panel(runner, config, **options)`` creates the panel in the current ``gr.Blocks``.
    """

    role: Role
    title: str
    description: str
    read_config: Callable[[], Any]
    build_roles: Callable[[Any], list[Any]]
    build_panel: Callable[..., dict[str, Any]]

    def make_runner(self) -> RoleRunner:
        """A runner hosting the role (empty until a Start)."""
        return RoleRunner(self.role, self.build_roles)

    def build_app(self, config: Any | None = None, runner: RoleRunner | None = None, **options: Any) -> Any:
        """The page as a ``gr.Blocks`` (not launched).

        Args:
            config: The form's defaults (default: :attr:`read_config`).
            runner: The role's runner (default: a new one, :meth:`make_runner`).
            options: Passed on to :attr:`build_panel`.
        """
        config = config or self.read_config()
        runner = runner or self.make_runner()
        return space_page(self.title, self.description, lambda: self.build_panel(runner, config, **options))

    def main(self) -> None:
        """Launch the page (``GRADIO_SERVER_NAME``, ``PORT``, ``PANEL_AUTH``: :func:`.page.serve`). A role the
        owner left running resumes first, and the runtime's SIGTERM stops it cleanly (:mod:`.restarts`)."""
        config, runner = self.read_config(), self.make_runner()
        stop_on_sigterm(runner)

        def boot() -> Any:  # serve() configures the logging first
            resume_at_boot(runner, config)
            return self.build_app(config, runner)

        serve(boot)
