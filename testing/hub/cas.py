"""Xet storage (CAS) of the Hub stand-in, over HTTP, and the Xet tokens that point hf_xet at it.

The Xet token endpoint (``GET /api/buckets/{id}/xet-{read,write}-token``, :func:`grant`) hands hf_xet a token of its
own and ``casUrl: {server}/cas/{storage}``, so hf_xet uses its remote CAS client, as against the Hub, and only the
stand-in's process touches the files (:class:`~testing.hub.xet_storage.XetStorage`): any number of client processes
share one stand-in. (``{storage}`` names the stand-in's current storage, so a reset one is a new endpoint to hf_xet,
whose caches are kept per endpoint.) :func:`serve` answers what xet-core's ``RemoteClient`` sends there:

- ``POST /v1/xorbs/default/{hash}``: a serialized xorb (``{"was_inserted": bool}``);
- ``POST /v2/shards`` (hf_xet 1.8; ``/v1/shards`` before): a shard whose files name uploaded xorbs (v2: one NDJSON
  ``result`` frame; v1: ``{"result": 1}``, 0 when it was stored already);
- ``GET /v1/reconstructions/{file}`` and ``/v2/...`` (the client asks v2 first), with an optional ``Range``: the
  terms trimmed to the chunks the range needs, with a URL and byte range of the xorb for each, served here too
  (``GET /xorbs/default/{hash}`` with ``Range``, no token: the Hub's are presigned);
- ``GET /v1/chunks/{prefix}/{hash}`` (global deduplication): 404, nothing is shared across uploads; and
  ``POST /v1/xorb-grants/default/{hash}`` (hf_xet 1.8 asks it before each xorb upload): 404, on which hf_xet
  uploads the xorb directly, as above.

Every request but a xorb fetch needs the bearer token of an unexpired grant (401 otherwise); uploads need a write
grant (403).
A storage fault (:meth:`HubServer.inject("storage", ...) <testing.hub.server.HubServer.inject>`) is taken when a
token is granted: every request made with that token gets the fault, as from a Hub whose storage refuses or fails
for that token. CAS requests are not counted against the Hub's API or resolver limits (they are not on the Hub).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import secrets
import time

from testing.hub.faults import Fault
from testing.hub.xet_storage import RangeNotSatisfiable, Span

PREFIX = "/cas/"
#: Grants kept; an older token is unknown (401), as one the Hub no longer accepts.
MAX_GRANTS = 10_000


@dataclasses.dataclass(frozen=True)
class Grant:
    """One Xet token: what it may do (``"read"`` or ``"write"``), until when (seconds since the epoch), and the fault
    every request with it gets."""

    kind: str
    expires: float
    fault: Fault | None = None


def grant(handler, kind: str) -> None:
    """Answer a Xet token request of `kind` (checked by the caller) with a new token."""
    hub = handler.hub
    fault = hub._take_fault("storage", "", "")
    token = f"xet-{kind}-{secrets.token_urlsafe(12)}"
    expires = int(time.time() + hub.xet_token_ttl)
    with hub._lock:
        hub.grants[token] = Grant(kind, expires, fault)
        for old in list(itertools.islice(hub.grants, max(0, len(hub.grants) - MAX_GRANTS))):
            del hub.grants[old]
    handler._send(200, {"accessToken": token, "exp": expires, "casUrl": f"{hub.url}{PREFIX}{hub.xet.root.name}"})


def serve(handler, path: str, body: bytes) -> None:
    """Answer one request to Xet storage on `handler` (a :class:`testing.hub.handler.Handler`)."""
    storage, _, route = path[len(PREFIX) :].partition("/")
    if storage != handler.hub.xet.root.name:
        return handler._error(404, "no such storage")
    try:
        _route(handler, route, body)
    except RangeNotSatisfiable as err:
        handler._error(416, str(err))
    except ValueError as err:  # a malformed upload or Range header
        handler._error(400, str(err))


def _route(handler, route: str, body: bytes) -> None:
    hub = handler.hub
    match = re.fullmatch(r"xorbs/default/([0-9a-f]{64})", route)
    if match and handler.command == "GET":
        return _fetch(handler, match[1])
    token = (handler.headers.get("Authorization") or "").removeprefix("Bearer ")
    with hub._lock:
        granted = hub.grants.get(token)
    if granted is None or granted.expires < time.time():
        return handler._error(401, "unknown, missing or expired Xet token")
    if granted.fault is not None:
        return handler._apply_fault(granted.fault)
    match = re.fullmatch(r"v([12])/reconstructions/([0-9a-f]{64})", route)
    if match and handler.command == "GET":
        return _reconstruction(handler, match[2], int(match[1]))
    match = re.fullmatch(r"v1/xorbs/default/([0-9a-f]{64})", route)
    if handler.command == "POST" and (match or route in ("v1/shards", "v2/shards")):
        if granted.kind != "write":
            return handler._error(403, "a read token cannot upload")
        if match:
            return handler._send(200, {"was_inserted": hub.xet.put_xorb(match[1], body)})
        new = hub.xet.put_shard(body)
        if route == "v1/shards":
            return handler._send(200, {"result": int(new)})
        return handler._send(200, b'{"type":"result"}\n', {"Content-Type": "application/x-ndjson"})
    handler._error(404, "not found")


def _reconstruction(handler, file_hash: str, version: int) -> None:
    requested = _range(handler.headers.get("Range"))
    found = handler.hub.xet.reconstruction(file_hash, *(requested or (0, None)))
    if found is None:
        return handler._error(404, "file not found")
    url = f"{handler.hub.url}{PREFIX}{handler.hub.xet.root.name}/xorbs/default"
    fetch = {x: [_fetch_entry(span, f"{url}/{x}", version) for span in spans] for x, spans in found.fetch.items()}
    terms = [{"hash": t.xorb, "unpacked_length": t.length, "range": {"start": t.start, "end": t.end}}
             for t in found.terms]  # fmt: skip
    handler._send(200, {"offset_into_first_range": found.offset, "terms": terms,
                        "fetch_info" if version == 1 else "xorbs": fetch})  # fmt: skip


def _fetch_entry(span: Span, url: str, version: int) -> dict:
    """Where a span's chunks are fetched, as a v1 ``fetch_info`` or a v2 ``xorbs`` entry (one range per URL)."""
    chunks = {"start": span.start, "end": span.end}
    xorb_bytes = {"start": span.first_byte, "end": span.last_byte}
    if version == 1:
        return {"range": chunks, "url": url, "url_range": xorb_bytes}
    return {"url": url, "ranges": [{"chunks": chunks, "bytes": xorb_bytes}]}


def _fetch(handler, xorb_hash: str) -> None:
    requested = _range(handler.headers.get("Range"))
    first, end = requested or (0, None)
    data = handler.hub.xet.read(xorb_hash, first, None if end is None else end - 1)
    if data is None:
        return handler._error(404, "xorb not found")
    if requested is None:
        return handler._send(200, data, {"Content-Type": "application/octet-stream"})
    last = first + len(data) - 1
    handler._send(206, data, {"Content-Type": "application/octet-stream", "Content-Range": f"bytes {first}-{last}/*"})


def _range(header: str | None) -> tuple[int, int] | None:
    """``[start, end)`` of a one-range ``Range: bytes=first-last`` header (None without one)."""
    if not header:
        return None
    match = re.fullmatch(r"bytes=(\d+)-(\d+)", header.strip())
    if match is None or int(match[2]) < int(match[1]):
        raise ValueError(f"unsupported Range header {header!r}")
    return int(match[1]), int(match[2]) + 1
