"""A Space's restarts: the role the owner left running comes back by itself, and the runtime's SIGTERM stops it
cleanly (a trainer checkpoints) without changing what the owner asked for.

Spaces restart on a hardware change, an update and after sleep, sending SIGTERM first. :func:`stop_on_sigterm`
stops the role then (:meth:`~rlsync.spaces.role_control.RoleRunner.stop` with ``record=False``: the desired state
stays ``running``), and at the next boot :func:`resume_at_boot` reads the desired state (:mod:`.desired`) and
starts the role again with the settings its last Start was given, with no click.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from ..bucket import open_bucket
from ..errors import BucketError, FormatError
from ..roles import Role
from .desired import REFUSED, Wanted, config_from_desired, read_desired

__all__ = ["resume_at_boot", "stop_on_sigterm"]

logger = logging.getLogger(__name__)


def resume_at_boot(runner: Any, config: Any, instance: str | None = None) -> str:
    """At a Space's boot: start ``runner`` again when its role is recorded ``running`` in the bucket ``config``
    names (with the recorded settings), without recording anything.

    Args:
        runner: The role's :class:`~rlsync.spaces.role_control.RoleRunner`.
        config: The role's config from its environment (its ``bucket`` is where the record is read).
        instance: This Space's id (default :func:`~rlsync.spaces.settings.instance_id`).

    Returns:
        What happened, one line (also logged).
    """
    role, url = Role(runner.name), config.bucket
    try:
        bucket = open_bucket(url, create=False)  # a page view never creates a bucket
    except BucketError as exc:
        return _said(f"{role}: not resumed: the bucket cannot be opened: {exc}")
    try:
        state = read_desired(bucket, role, instance)
        wanted = state is not None and state.wanted is Wanted.RUNNING
        resumed = config_from_desired(config, state.settings, url) if wanted else None
    except FormatError as exc:
        REFUSED[role.value] += 1
        return _said(f"{role}: not resumed: refused the desired state: {exc}", logging.WARNING)
    except BucketError as exc:
        return _said(f"{role}: not resumed: the desired state cannot be read: {exc}", logging.WARNING)
    finally:
        getattr(bucket, "close", lambda: None)()
    if resumed is None:
        return _said(f"{role}: {'stopped by its owner' if state else 'never started'}; not resumed")
    runner.start(resumed, record=False)
    return _said(f"{role}: was running before the restart; resumed")


def _said(line: str, level: int = logging.INFO) -> str:
    logger.log(level, "%s", line)
    return line


def stop_on_sigterm(runner: Any) -> None:
    """On SIGTERM (the Spaces runtime, before a restart): stop ``runner``'s role, waiting for it (a trainer saves
    and uploads a checkpoint), without recording a stop; then end the page's serving loop (``KeyboardInterrupt``,
    which Gradio's ``launch`` takes as its signal to close). Call it from the main thread."""

    def handler(signum: int, _frame: Any) -> None:
        logger.info("signal %d: stopping %s before the restart (it resumes at the next boot)", signum, runner.name)
        runner.stop(wait=True, record=False)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)
