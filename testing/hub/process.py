"""The Hub stand-in in a process of its own (``python -m testing.hub``), and the calls that configure it.

Several processes (the Spaces of :mod:`testing.spaces_runtime`, the test itself) then share one stand-in, as the
Spaces of a real deployment share the Hub.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from testing.served import stop

ROOT = Path(__file__).resolve().parents[2]
#: Seconds the stand-in may take to print its address.
START_TIMEOUT_S = 60.0


class HubProcess:
    """``python -m testing.hub`` started in ``root`` (its storage folder); :meth:`close` stops it.

    Args:
        root: The stand-in's storage folder.
    """

    def __init__(self, root: Path) -> None:
        self._log = open(Path(root) / "hub.log", "wb")  # noqa: SIM115 - held open for the process, closed in close()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "shared"), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "testing.hub", "--root", str(root)], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=self._log,
        )  # fmt: skip
        line = self.proc.stdout.readline().decode().strip() if self.proc.stdout else ""
        if not line.startswith("http://"):
            self.close()
            raise RuntimeError(f"the Hub stand-in did not start: {line!r}")
        self.url = line

    def _call(self, path: str, doc: dict | None = None) -> object:
        data = None if doc is None else json.dumps(doc).encode()
        request = urllib.request.Request(f"{self.url}/_standin/{path}", data=data, method="POST" if data else "GET")
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def add_user(self, name: str, token: str, orgs: tuple[str, ...] = (), role: str = "write") -> None:
        """A user whose ``token`` writes in its own and ``orgs``' namespaces."""
        self._call("users", {"name": name, "token": token, "orgs": list(orgs), "role": role})

    def add_oauth_client(self, client_id: str, secret: str, redirect_uri: str) -> None:
        """An OAuth app (one per ``hf_oauth`` Space) and the one redirect URI it may use."""
        self._call("oauth-clients", {"client_id": client_id, "secret": secret, "redirect_uri": redirect_uri})

    def limit(self, tier: str | None, window_s: float = 300.0) -> None:
        """Enforce ``tier``'s rate limits (``None``: none)."""
        self._call("limit", {"tier": tier, "window_s": window_s})

    def buckets(self) -> dict[str, list[str]]:
        """Every bucket's keys."""
        return self._call("buckets")  # type: ignore[return-value]

    def usage(self) -> dict[str, dict[str, dict[str, int]]]:
        """Per token and request class (``api``, ``resolver``): ``{"requests": counted, "throttled": 429s}``."""
        return self._call("usage")  # type: ignore[return-value]

    def signed_in(self) -> list[str]:
        """The users who completed a sign-in, in order."""
        return self._call("signed-in")  # type: ignore[return-value]

    def close(self) -> None:
        stop(self.proc, 30.0)
        if self.proc.stdout:
            self.proc.stdout.close()
        self._log.close()
