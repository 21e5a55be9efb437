"""The Hub stand-in's HTTP request handler (:class:`testing.hub.server.HubServer`): reads a request, records it,
counts it against its token's rate limits, applies an injected fault, and passes it to the module that answers
it: the control routes (:mod:`.control`), the OpenID provider (:mod:`.openid`), Xet storage and its tokens
(:mod:`.cas`), the bucket API (:mod:`.buckets`)."""

from __future__ import annotations

import json
import re
import socket
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlsplit

from rlsync.bucket.budget import RequestClass
from testing.hub import buckets, cas, control, openid
from testing.hub.faults import MAX_STALL_SECONDS, Fault

#: Largest request body the server accepts (a xorb holds up to 64 MiB of chunks, with headers and a footer).
MAX_BODY_BYTES = 80 << 20


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "HubStandIn/1.0"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - silence the default stderr log
        pass

    @property
    def hub(self):  # noqa: ANN201 - the HubServer serving this request (importing its module here would be a cycle)
        return self.server.hub  # type: ignore[attr-defined]

    # -- plumbing, used by the modules that answer -------------------------------------------------------------------

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise ValueError("request body too large")
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: object = b"", headers: dict[str, str] | None = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        for name, value in {**getattr(self, "_limits", {}), **(headers or {})}.items():
            self.send_header(name, value)
        if not isinstance(body, bytes):
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        # Like the Hub: the message in the JSON body and in X-Error-Message (a HEAD response has no body).
        self._send(status, {"error": message}, {"X-Error-Message": message, **(headers or {})})

    def _drop(self) -> None:
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _apply_fault(self, fault: Fault) -> None:
        if fault.stall:
            self.hub._release.wait(min(fault.stall, MAX_STALL_SECONDS))
            self._drop()
        elif fault.drop:
            self._drop()
        else:
            self._error(fault.status, fault.message or f"injected HTTP {fault.status}", fault.headers)

    # -- dispatch ----------------------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        side = _side(url.path)
        auth = self.headers.get("Authorization")
        self.hub._record(self.command, url.path, side, auth)
        try:
            body = self._body()
        except ValueError as err:
            return self._error(413, str(err))
        cls = RequestClass.RESOLVER if "/resolve/" in url.path else RequestClass.API if url.path.startswith("/api/") else None
        self._limits = {}
        if cls is not None:
            token = buckets.bearer(auth) or "anonymous"
            self._limits = self.hub._count(token, cls, self.command, url.path)
            if "Retry-After" in self._limits:
                return self._error(429, "You have exceeded our rate limits", self._limits)
        if url.path in openid.PATHS:
            return openid.serve(self, url.path, parse_qs(url.query), body)
        if url.path.startswith(control.PREFIX):
            return control.serve(self, url.path, body)
        if side == "storage":  # its faults come with the token a request carries (cas.grant)
            return cas.serve(self, url.path, body)
        fault = self.hub._take_fault(side, self.command, url.path)
        if fault is not None:
            return self._apply_fault(fault)
        role = self.hub.tokens.get(buckets.bearer(auth) or "")
        if role is None:
            return self._error(401, "Invalid credentials in Authorization header")
        if side == "token":
            return self._token(url.path, role)
        buckets.serve(self, url.path, parse_qs(url.query), body, role)

    do_GET = do_POST = do_HEAD = do_DELETE = do_PUT = lambda self: self._dispatch()  # noqa: E731

    def _token(self, raw_path: str, role: str) -> None:
        match = re.fullmatch(r"/api/buckets/([^/]+/[^/]+)/xet-(read|write)-token", raw_path)
        if match is None:
            return self._error(404, "not found")
        bucket_id, kind = match.groups()
        if kind == "write" and not buckets.may_write(self, role, bucket_id):
            return self._error(403, "You don't have write access to this bucket")
        if bucket_id not in self.hub.buckets:
            return self._error(404, "Bucket not found", {"X-Error-Code": "RepoNotFound"})
        cas.grant(self, kind)


def _side(path: str) -> str:
    """Which side of the Hub a request is for: ``"storage"`` (Xet storage), ``"token"`` (the Xet token endpoint) or
    ``"api"`` (the rest)."""
    if path.startswith(cas.PREFIX):
        return "storage"
    if re.search(r"/xet-(read|write)-token$", path):
        return "token"
    return "api"
