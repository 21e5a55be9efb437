"""A Space's page (:func:`space_page`: its heading, login button and controls notice) and its launch
(:func:`serve`, :func:`launch_options`: host, port, login)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .access import Login, LoginGate, PanelAccess, control_notice
from .settings import server_port

logger = logging.getLogger(__name__)


def login_button() -> Any | None:
    """A Hugging Face login button when the Space has OAuth enabled (see :mod:`.access`), else nothing."""
    import gradio as gr

    return gr.LoginButton() if PanelAccess.from_env().oauth else None


def space_page(title: str, description: str, build: Callable[[], Any]) -> Any:
    """A Space's page as a ``gr.Blocks`` (not launched): its heading, the login button, whether the controls are on
    for this visitor (:func:`~.access.control_notice`, in the page as served and again at each page load), then what
    ``build`` adds.

    Args:
        title: The role, e.g. ``"trainer"`` (the page is titled ``RL Sync: <title>``).
        description: One line under the heading.
        build: Adds the panel's components (called inside the ``gr.Blocks``).
    """
    import gradio as gr

    with gr.Blocks(title=f"RL Sync: {title}") as demo:
        gr.Markdown(f"# RL Sync: {title}\n{description}")
        login_button()
        notice = gr.Markdown(PanelAccess.from_env().notice(), elem_id="controls-notice")

        def on_load(request):  # annotated below with the real class: Gradio injects the request by type
            return control_notice(request)

        on_load.__annotations__ = {"request": gr.Request}
        demo.load(on_load, outputs=notice, show_progress="hidden", api_visibility="private")
        build()
    return demo


def serve(build_app: Callable[[], Any]) -> None:
    """Launch a Space's page (``GRADIO_SERVER_NAME``, ``PORT``, ``PANEL_AUTH``: :func:`launch_options`), logging at INFO."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    build_app().launch(**launch_options())


def launch_options(host: str | None = None) -> dict[str, Any]:
    """``launch()`` keyword arguments from the environment (see :mod:`.access`).

    The host is ``host``, else ``GRADIO_SERVER_NAME``, else ``127.0.0.1`` (``0.0.0.0`` on a Space);
    the port ``PORT`` / ``GRADIO_SERVER_PORT`` (default 7860). ``PANEL_AUTH="user:password"``, wherever
    it is set, makes the panel ask for that login. A panel reachable by others without a login keeps
    its read-only views and refuses its controls; the launch log says so. With a login, every route
    but the login page and its static files refuses an anonymous call with 401 (:class:`LoginGate`),
    before Gradio validates the request. Gradio's run history is
    off (its routes would answer anonymous callers with the operator's token).

    Raises:
        ValueError: ``PANEL_AUTH`` is not ``user:password``.
    """
    access = PanelAccess.from_env(host)
    options: dict[str, Any] = {
        "server_name": access.host,
        "server_port": server_port(),
        # Gradio's run history mounts /gradio_api/run-history/* outside the login, acting with the
        # operator's HF_TOKEN (creating and listing Hub buckets): a panel has no use for it.
        "run_history": False,
    }
    if access.auth is not None:
        from starlette.middleware import Middleware

        options["auth"] = access.auth
        # Gradio checks the login inside each route, after validating the request: the gate refuses first.
        options["app_kwargs"] = {"middleware": [Middleware(LoginGate)]}
    logger.log(logging.WARNING if access.exposed and access.login is Login.NONE else logging.INFO, "%s", access.describe())
    return options
