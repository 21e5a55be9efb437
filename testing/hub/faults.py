"""The failures a test injects into the Hub stand-in (:meth:`HubServer.inject <testing.hub.server.HubServer.inject>`),
each answered by :mod:`testing.hub.handler`."""

from __future__ import annotations

import dataclasses
import re

#: Longest a stall may hold a request, whatever the test asked (keeps a broken test bounded).
MAX_STALL_SECONDS = 30.0


@dataclasses.dataclass
class Fault:
    """One injected failure, consumed by one matching request.

    Args:
        status: HTTP status to answer with (ignored for ``drop`` and ``stall``).
        headers: Extra response headers (e.g. ``{"Retry-After": "1"}``).
        drop: Close the connection without answering.
        stall: Hold the request this many seconds (at most :data:`MAX_STALL_SECONDS`), then drop it.
        path: Only requests whose path matches this regular expression (``re.search``).
        method: Only requests with this HTTP method.
        message: The error message in the response body (default: "injected HTTP {status}").
    """

    status: int = 503
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    drop: bool = False
    stall: float = 0.0
    path: str = ""
    method: str = ""
    message: str = ""

    def matches(self, method: str, path: str) -> bool:
        return (not self.method or self.method == method) and (not self.path or re.search(self.path, path) is not None)
