"""A stand-in for the Spaces runtime: an exported Space (``python -m rlsync.spaces.deploy --export DIR``) run as
the Hub runs a duplicate, against the Hub stand-in in its own process (:class:`testing.hub.process.HubProcess`).

:class:`SpaceProcess` starts ``python app.py`` in the Space's folder, in a process of its own, with what the runtime
gives a Space's process:

- the runtime's variables: ``SYSTEM=spaces``, ``SPACE_ID``, ``SPACE_AUTHOR_NAME``, ``SPACE_REPO_NAME``,
  ``SPACE_TITLE``, ``SPACE_HOST`` (``<owner>-<name>.hf.space``), ``PORT``;
- for a README with ``hf_oauth: true``, the OAuth app the Hub makes for the Space: ``OAUTH_CLIENT_ID``,
  ``OAUTH_CLIENT_SECRET``, ``OAUTH_SCOPES`` (``openid profile`` and the README's ``hf_oauth_scopes``) and
  ``OPENID_PROVIDER_URL`` (the Hub; here the stand-in, whose provider learns the app and its redirect URI
  ``https://<SPACE_HOST>/login/callback``);
- the variables a duplicate inherits (the template's, :func:`template_variables`) and its own secrets;
- ``HF_ENDPOINT``: the stand-in (the runtime has none: the Hub is huggingface.co).

Two deviations, both for a test machine: the page binds ``127.0.0.1`` (the runtime binds ``0.0.0.0`` behind its
HTTPS proxy), and the proxy itself is the test's: the provider sends the browser back to
``https://<SPACE_HOST>/login/callback``, which a browser test routes to :attr:`SpaceProcess.url`
(:meth:`SpaceProcess.local`).
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import sys
from collections.abc import Mapping
from pathlib import Path

from huggingface_hub import SpaceCard

from testing.hub.process import HubProcess
from testing.served import LoggedProcess

#: Variables of the test's own environment a Space never sees (the runtime starts from a clean one).
_DROPPED = re.compile(r"^(SPACE_|OAUTH_|OPENID_|PANEL_|TRAINER_|ROLLOUT_|ENV_|GRADIO_|HF_|HUGGING_FACE_|TRANSFORMERS_)|^(SYSTEM|PORT)$")
#: Scopes every Hugging Face sign-in gets.
BASE_SCOPES = ("openid", "profile")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def space_host(space_id: str) -> str:
    """The Space's host name, as the runtime sets ``SPACE_HOST``: ``<owner>-<name>.hf.space``, lower case, with
    ``-`` for ``_`` and ``.``."""
    return re.sub(r"[._]", "-", space_id.replace("/", "-")).lower() + ".hf.space"


def template_variables(export: Path, name: str) -> dict[str, str]:
    """The variables the template Space ``name`` has (``variables.env`` of the export): a duplicate inherits them."""
    found: dict[str, str] = {}
    section = None
    for line in (export / "variables.env").read_text().splitlines():
        if line.startswith("# "):
            section = line[2:].strip()
        elif section == name and "=" in line:
            key, _, value = line.partition("=")
            found[key] = value
    return found


class SpaceProcess(LoggedProcess):
    """An exported Space's ``app.py`` run as the Spaces runtime runs a duplicate of it.

    Args:
        folder: The Space's exported folder.
        space_id: ``<owner>/<name>`` of the duplicate.
        hub: The Hub stand-in (it learns the Space's OAuth app).
        secrets: The duplicate's secrets (e.g. ``{"HF_TOKEN": ...}``).
        variables: Its variables (a duplicate's are the template's, :func:`template_variables`, and its own).
        log: Where the process's output goes.
        extra_env: More environment (test settings the runtime would not give, e.g. offline model loading).
    """

    def __init__(
        self,
        folder: Path,
        space_id: str,
        hub: HubProcess,
        *,
        secrets: Mapping[str, str],
        variables: Mapping[str, str] | None = None,
        log: Path,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        owner, name = space_id.split("/")
        self.space_id, self.host, self.port = space_id, space_host(space_id), free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        env = {key: value for key, value in os.environ.items() if not _DROPPED.match(key)}
        env.update(extra_env or {})
        env.update(variables or {})
        env.update(secrets)
        env.update(SYSTEM="spaces", SPACE_ID=space_id, SPACE_AUTHOR_NAME=owner, SPACE_REPO_NAME=name,
                   SPACE_TITLE=SpaceCard.load(folder / "README.md").data.to_dict().get("title", name),
                   SPACE_HOST=self.host, PORT=str(self.port), GRADIO_SERVER_NAME="127.0.0.1", HF_ENDPOINT=hub.url)  # fmt: skip
        env.update(self._oauth(folder, hub))
        super().__init__([sys.executable, "app.py"], cwd=folder, env=env, log=log)

    def _oauth(self, folder: Path, hub: HubProcess) -> dict[str, str]:
        """The OAuth variables of a README with ``hf_oauth: true`` (none otherwise); the stand-in learns the app."""
        data = SpaceCard.load(folder / "README.md").data.to_dict()
        if data.get("hf_oauth") is not True:
            return {}
        client_id, secret = f"client-{secrets.token_hex(8)}", secrets.token_urlsafe(24)
        hub.add_oauth_client(client_id, secret, f"https://{self.host}/login/callback")
        scopes = " ".join(dict.fromkeys((*BASE_SCOPES, *(data.get("hf_oauth_scopes") or ()))))
        return {"OAUTH_CLIENT_ID": client_id, "OAUTH_CLIENT_SECRET": secret, "OAUTH_SCOPES": scopes,
                "OPENID_PROVIDER_URL": hub.url}  # fmt: skip

    def local(self, url: str) -> str:
        """``url`` on ``https://<SPACE_HOST>`` as the runtime's proxy forwards it: the same path on :attr:`url`."""
        prefix = f"https://{self.host}/"
        if not url.startswith(prefix):
            raise ValueError(f"{url} is not on {prefix}")
        return self.url + url[len(prefix) :]

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Wait until the Space's page answers (:meth:`~testing.served.LoggedProcess.wait_served`)."""
        self.wait_served(self.url, self.space_id, timeout)
