"""Where a trainer Space's Trackio run lasts, and the link its panel shows.

On a Space, the container's disk is wiped at every restart, so Trackio's local database (``report_to`` auto on a
Space) would lose the run. By default the run goes to a Trackio Space of the owner's instead,
``<SPACE_AUTHOR_NAME>/rl-sync-trackio`` (Trackio creates it at the first log when the token can, and keeps its
database in a Hugging Face Bucket of its own); ``TRAINER_TRACKIO_SPACE_ID`` names another. The run's name is the
bucket's run id, which TRL's Trackio callback opens with ``resume="allow"``: a restarted trainer logs on into the
same run.
"""

from __future__ import annotations

import urllib.parse
from typing import Mapping

from .settings import SpaceIdentity

__all__ = ["TRACKIO_SPACE_NAME", "default_trackio_space", "trackio_url"]

#: The name of the Trackio Space a trainer Space logs to by default, in its owner's namespace.
TRACKIO_SPACE_NAME = "rl-sync-trackio"


def default_trackio_space(environ: Mapping[str, str] | None = None) -> str | None:
    """``<owner>/rl-sync-trackio`` on a Space (the owner: ``SPACE_AUTHOR_NAME``, else ``SPACE_ID``'s namespace);
    ``None`` elsewhere (Trackio's local database)."""
    space = SpaceIdentity.from_env(environ)
    owner = space.author_name or space.id.partition("/")[0]
    return f"{owner}/{TRACKIO_SPACE_NAME}" if owner else None


def trackio_url(space_id: str, project: str) -> str:
    """The Trackio dashboard of ``project`` on the Trackio Space ``space_id``."""
    return f"https://huggingface.co/spaces/{space_id}?{urllib.parse.urlencode({'project': project})}"
