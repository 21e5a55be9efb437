"""The Hub stand-in's control routes, for a stand-in running as a process of its own (:mod:`testing.hub.__main__`):
what a test calls on :class:`~testing.hub.server.HubServer` in-process, over HTTP (:class:`~testing.hub.process.HubProcess`).

- ``POST /_standin/users`` ``{"name", "token", "orgs", "role"}``: :meth:`HubServer.add_user`;
- ``POST /_standin/oauth-clients`` ``{"client_id", "secret", "redirect_uri"}``: an OAuth app (:mod:`.openid`);
- ``POST /_standin/limit`` ``{"tier", "window_s"}``: :meth:`HubServer.limit`;
- ``GET /_standin/buckets``: every bucket's keys; ``GET /_standin/signed-in``: the sign-ins completed;
- ``GET /_standin/usage``: per token and request class, the counted requests and the 429s among them
  (:meth:`HubServer.usage`).

The stand-in listens on the loopback interface only; these routes are for the tests that started it.
"""

from __future__ import annotations

import json

from rlsync.bucket.budget import RequestClass

PREFIX = "/_standin/"


def serve(handler, path: str, body: bytes) -> None:
    """Answer one control request on ``handler`` (a :class:`testing.hub.handler.Handler`)."""
    hub = handler.hub
    doc = json.loads(body or b"{}") if handler.command == "POST" else {}
    if path == f"{PREFIX}users" and handler.command == "POST":
        hub.add_user(doc["name"], doc["token"], tuple(doc.get("orgs", ())), doc.get("role", "write"))
        return handler._send(200, {"ok": True})
    if path == f"{PREFIX}oauth-clients" and handler.command == "POST":
        hub.openid.add_client(doc["client_id"], doc["secret"], doc["redirect_uri"])
        return handler._send(200, {"ok": True})
    if path == f"{PREFIX}limit" and handler.command == "POST":
        hub.limit(doc.get("tier"), float(doc.get("window_s", 300)))
        return handler._send(200, {"ok": True})
    if path == f"{PREFIX}buckets":
        with hub._lock:
            return handler._send(200, {bucket: sorted(objects) for bucket, objects in hub.buckets.items()})
    if path == f"{PREFIX}usage":
        counts = {}
        for token in list(hub.log):
            counts[token] = {}
            for cls in RequestClass:
                used = hub.usage(cls, token)
                counts[token][cls.value] = {"requests": len(used), "throttled": sum(r.status == 429 for r in used)}
        return handler._send(200, counts)
    if path == f"{PREFIX}signed-in":
        return handler._send(200, list(hub.openid.signed_in))
    handler._error(404, "not found")
