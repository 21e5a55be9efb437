"""A local stand-in for the Hugging Face Hub's bucket API and its Xet storage, for tests and soak trials.

The real ``huggingface_hub`` + ``hf_xet`` client code talks to this server through ``HF_ENDPOINT``
(the ``hub`` fixture in ``tests/conftest.py`` points the library at it; the soak trial
``hub_storage`` passes its URL to ``HfApi(endpoint=...)``). It implements the HTTP calls
huggingface_hub 2.4.0's bucket methods make:

- ``POST /api/buckets/{ns}/{name}`` (create_bucket) and ``GET`` (bucket_info);
- ``GET /api/buckets/{id}/tree[/{prefix}]`` (list_bucket_tree, paginated with a ``Link`` header);
- ``POST /api/buckets/{id}/paths-info`` (get_bucket_paths_info);
- ``POST /api/buckets/{id}/batch`` (batch_bucket_files' ndjson commit of add/delete operations);
- ``HEAD /buckets/{id}/resolve/{path}`` (get_bucket_file_metadata: Xet hash and token refresh route);
- ``GET /api/buckets/{id}/xet-{read,write}-token`` (the Xet token endpoint hf_xet calls itself);
- ``GET /api/whoami-v2`` (:mod:`testing.hub.accounts`: users' tokens write only in their namespaces), and the
  OpenID Connect provider of "Sign in with Hugging Face" (:mod:`testing.hub.openid`);
- ``GET /api/buckets/{id}/events?cursor=...|since=...`` (the live-follow feed of
  ``huggingface_hub._bucket_live_follow``: server-sent ``changes``, ``ready``, ``reset`` and
  ``reconnect`` events, keep-alive comments; :meth:`HubServer.feed` turns it off or forces a reset).

Of concurrent creates of one bucket one wins, the others get 409 as from the Hub. ``python -m testing.hub`` runs
the stand-in as a process that several processes share (:mod:`testing.hub.__main__`).

Rate limits (:meth:`HubServer.limit`) are the Hub's: per token, in fixed windows, API requests (every
``/api/...`` endpoint, Xet token endpoints and the feed included) and resolver requests
(``/resolve/...``) counted apart against the tier's limits (``rlsync.bucket.budget.HUB_LIMITS``,
scaled to a shortened window for tests). Over the limit a request gets 429 with ``RateLimit``,
``RateLimit-Policy`` and ``Retry-After``; every counted response carries ``RateLimit`` headers.
:attr:`HubServer.log` keeps every counted request per token and class for benchmarks.

The Xet token endpoint hands hf_xet a ``local://`` CAS URL, which makes hf_xet use xet-core's
file-backed CAS client in a folder of this server: the bytes are chunked, deduplicated, stored and
reconstructed by the real hf_xet code. Storage-side faults are real HTTP responses too: while a
storage fault is pending, the token endpoint hands out ``{server}/cas`` instead, and every CAS request
hf_xet sends there gets the injected fault.

Faults (:meth:`HubServer.inject`) are queued per side (``"api"``: the Hub API, ``"token"``: the
Xet token endpoint, ``"storage"``: Xet storage) and each is consumed by one request (one token grant
for storage: the transfers that use that grant get the fault, as from a Hub whose storage refuses or
fails for that token; ``rlsync`` reuses a grant until it expires or a transfer with it fails, so a
storage fault reaches the transfers after the next grant): an HTTP status with headers, a dropped
connection, or a stall (the server holds the request for ``stall`` seconds, bounded, then drops it).
:meth:`HubServer.chaos` adds random faults (429 with ``Retry-After: 0``, 503, dropped connections) at a
given rate per side, drawn from a seeded generator. :attr:`HubServer.xet_token_ttl` sets how long the
Xet tokens it grants are valid.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import json
import random
import re
import socket
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from rlsync.bucket.budget import WINDOW_S, RequestClass, Tier, scaled_limit
from testing.hub import control, openid
from testing.hub.accounts import Accounts
from testing.hub.events import serve_events
from testing.hub.shards import xet_file_size

#: Longest a stall may hold a request, whatever the test asked (keeps a broken test bounded).
MAX_STALL_SECONDS = 30.0
#: Largest request body the server accepts.
MAX_BODY_BYTES = 64 << 20
#: Changes the events feed can replay; an older cursor gets a ``reset`` event.
FEED_REPLAY = 10_000


@dataclasses.dataclass
class Fault:
    """One injected failure, consumed by one matching request.

    Args:
        status: HTTP status to answer with (ignored for ``drop`` and ``stall``).
        headers: Extra response headers (e.g. ``{"Retry-After": "1"}``).
        drop: Close the connection without answering.
        stall: Hold the request this many seconds (at most ``MAX_STALL_SECONDS``), then drop it.
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


@dataclasses.dataclass
class Request:
    """One request the server received (for assertions on what the client sent)."""

    method: str
    path: str
    side: str
    authorization: str | None
    status: int = 0


@dataclasses.dataclass
class Logged:
    """One request counted against a token's rate limits."""

    time: float
    method: str
    path: str
    status: int


class HubServer:
    """The Hub stand-in: a threaded HTTP server on the loopback interface.

    Args:
        root: Folder for the ``local://`` Xet storage.
        page_size: Entries per page of a tree listing.
    """

    def __init__(self, root: Path, page_size: int = 100) -> None:
        self.root = Path(root)
        self._default_page_size = page_size
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self.openid = openid.OpenIdProvider()
        self.reset()
        self._thread.start()

    # -- test controls ---------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget buckets, faults, tokens, recorded requests and test settings (the page size); release
        stalled requests."""
        self._release.set()
        with self._lock:
            self.page_size = self._default_page_size
            self.buckets: dict[str, dict[str, dict]] = {}
            self.faults: dict[str, list[Fault]] = {"api": [], "token": [], "storage": []}
            self.requests: list[Request] = []
            self.storage_fault = Fault()
            self.rates: dict[str, float] = {}
            self._rng = random.Random(0)
            self.chaotic: dict[str, int] = {"api": 0, "token": 0, "storage": 0}
            #: token -> "read" or "write"; a request with any other bearer token gets 401.
            self.tokens: dict[str, str] = {}
            #: How long the Xet tokens granted from now on are valid (their ``exp``), in seconds: the
            #: Hub's last an hour; 0 grants tokens that are expired as they are handed out.
            self.xet_token_ttl = 3600.0
            self.storage = Path(tempfile.mkdtemp(prefix="xet-", dir=self.root))
            #: Rate limits: the tier (None: unlimited) and the window length in seconds.
            self.tier: Tier | None = None
            self.window_s = WINDOW_S
            #: token -> class -> counted requests (``"anonymous"`` for requests without a token).
            self.log: dict[str, dict[RequestClass, list[Logged]]] = collections.defaultdict(
                lambda: {cls: [] for cls in RequestClass}
            )
            self._windows: dict[tuple[str, RequestClass], tuple[float, int]] = {}
            #: bucket id -> [(cursor, time, change)] for the events feed, and the feed's settings.
            self.changes: dict[str, list[tuple[int, float, dict]]] = {}
            self._seq = 0
            self.feed_enabled = True
            self.feed_session_s = 300.0
            self.feed_ping_s = 15.0
            self._reset_pending = 0
            self.accounts = Accounts()
        self.openid.reset()
        self._release = threading.Event()

    def add_token(self, token: str, role: str = "write") -> None:
        """Accept `token` with `role` ("read" or "write")."""
        with self._lock:
            self.tokens[token] = role

    def add_user(self, name: str, token: str, orgs: tuple[str, ...] = (), role: str = "write") -> None:
        """Accept `token` as user `name`'s (in `orgs`): it writes only in their namespaces."""
        self.accounts.add_user(name, token, orgs, role)
        self.add_token(token, role)

    def create_bucket(self, bucket_id: str) -> bool:
        """Create `bucket_id`; whether it was created (``False``: it existed)."""
        with self._lock:
            if bucket_id in self.buckets:
                return False
            self.buckets[bucket_id] = {}
            self.changes.setdefault(bucket_id, [])
            return True

    def limit(self, tier: Tier | str | None, window_s: float = WINDOW_S) -> None:
        """Enforce `tier`'s limits per token in fixed windows of `window_s` seconds (the limits scaled
        to it); `None` lifts them. Restarts every token's window."""
        with self._lock:
            self.tier = Tier(tier) if tier is not None else None
            self.window_s = float(window_s)
            self._windows.clear()

    def feed(self, enabled: bool = True, *, session_s: float | None = None, ping_s: float | None = None,
             reset: int = 0) -> None:
        """Serve the events feed or not (off: 404, as on a deployment without live-follow); end each
        session with a ``reconnect`` after `session_s`; answer the next `reset` sessions with ``reset``."""
        with self._lock:
            self.feed_enabled = enabled
            self.feed_session_s = session_s if session_s is not None else self.feed_session_s
            self.feed_ping_s = ping_s if ping_s is not None else self.feed_ping_s
            self._reset_pending = reset
            self._changed.notify_all()

    def usage(self, cls: RequestClass | str, token: str | None = None, since: float = 0.0) -> list[Logged]:
        """The counted requests of `cls` (of one token, or of all), from time `since` on."""
        cls = RequestClass(cls)
        with self._lock:
            tokens = [token] if token is not None else list(self.log)
            return sorted((r for t in tokens for r in self.log[t][cls] if r.time >= since), key=lambda r: r.time)

    def throttled(self, token: str | None = None) -> int:
        """How many counted requests were answered 429 for exceeding the limits."""
        return sum(1 for cls in RequestClass for r in self.usage(cls, token) if r.status == 429)

    def chaos(self, rates: dict[str, float], seed: int = 0) -> None:
        """Fail this share of the requests of each side ("api", "token"; "storage": of the token grants)
        with a random retryable fault; `{}` stops. :attr:`chaotic` counts the faults served."""
        with self._lock:
            self.rates = dict(rates)
            self._rng = random.Random(seed)

    def plant(self, bucket_id: str, paths: list[str], like: str) -> None:
        """Add `paths` to `bucket_id` as copies of its object `like`, at once, each announced on the feed
        (a key flood without uploading anything)."""
        with self._lock:
            objects = self.buckets[bucket_id]
            meta = dict(objects[like])
            for path in paths:
                objects[path] = dict(meta)
                self._record_change(bucket_id, {"path": path, "op": "add", "size": meta["size"], "xetHash": meta["xetHash"]})

    def announce(self, bucket_id: str, *changes: dict) -> None:
        """Send `changes` on the feed as they are (hostile ones included), changing no object."""
        with self._lock:
            for change in changes:
                self._record_change(bucket_id, change)

    def inject(self, side: str, *faults: Fault) -> None:
        """Queue faults for `side` ("api", "token" or "storage")."""
        with self._lock:
            self.faults[side].extend(faults)

    def clear_faults(self) -> None:
        """Drop every queued fault."""
        with self._lock:
            for queue in self.faults.values():
                queue.clear()

    def pending(self, side: str, path: str = "") -> int:
        """How many queued faults of `side` are for paths matching `path` (as a fault's own pattern)."""
        with self._lock:
            return sum(1 for f in self.faults[side] if f.path == path)

    def count(self, side: str, path: str = "") -> int:
        """How many requests reached `side` (optionally only those whose path matches `path`)."""
        with self._lock:
            return sum(1 for r in self.requests if r.side == side and re.search(path, r.path))

    def close(self) -> None:
        self._release.set()
        with self._lock:
            self.feed_enabled = False
            self._changed.notify_all()
        self._httpd.shutdown()
        self._httpd.server_close()

    # -- used by the handler ---------------------------------------------------------------------

    def _take_fault(self, side: str, method: str, path: str) -> Fault | None:
        with self._lock:
            for i, fault in enumerate(self.faults[side]):
                if fault.matches(method, path):
                    return self.faults[side].pop(i)
            if self.rates and self._rng.random() < self.rates.get(side, 0.0):
                self.chaotic[side] += 1
                return self._rng.choice([Fault(429, {"Retry-After": "0"}), Fault(503), Fault(drop=True)])
        return None

    def _count(self, token: str, cls: RequestClass, method: str, path: str) -> dict[str, str]:
        """Count one request; returns the rate-limit headers, with ``Retry-After`` when it is over."""
        with self._lock:
            now = time.time()
            entry = Logged(now, method, path, 200)
            self.log[token][cls].append(entry)
            if self.tier is None:
                return {}
            quota = scaled_limit(self.tier, cls, self.window_s)
            start, used = self._windows.get((token, cls), (now, 0))
            if now >= start + self.window_s:
                start, used = start + (now - start) // self.window_s * self.window_s, 0
            over = used >= quota
            used += 0 if over else 1
            self._windows[(token, cls)] = (start, used)
            reset = max(1, int(start + self.window_s - now + 0.999))
            headers = {
                "RateLimit": f'"{cls.value}";r={max(0, quota - used)};t={reset}',
                "RateLimit-Policy": f'"fixed window";"{cls.value}";q={quota};w={int(self.window_s)}',
            }
            if over:
                entry.status = 429
                headers["Retry-After"] = str(reset)
            return headers

    def _record_change(self, bucket_id: str, change: dict) -> None:
        """Add a change to the feed's log (the lock is held)."""
        self._seq += 1
        log = self.changes.setdefault(bucket_id, [])
        log.append((self._seq, time.time(), change))
        del log[:-FEED_REPLAY]
        self._changed.notify_all()


def _bearer(auth: str | None) -> str | None:
    """The token of an ``Authorization: Bearer`` header."""
    return auth[len("Bearer ") :] if auth and auth.startswith("Bearer ") else None


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _file_entry(path: str, meta: dict) -> dict:
    mtime = time.strftime("%Y-%m-%dT%H:%M:%S.000Z", time.gmtime((meta["mtime"] or 0) / 1000))
    return {"type": "file", "path": path, "size": meta["size"], "xetHash": meta["xetHash"], "mtime": mtime}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "HubStandIn/1.0"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - silence the default stderr log
        pass

    @property
    def hub(self) -> HubServer:
        return self.server.hub  # type: ignore[attr-defined]

    # -- plumbing ----------------------------------------------------------------------------------

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

    def _side(self, path: str) -> str:
        if path.startswith("/cas"):
            return "storage"
        if re.search(r"/xet-(read|write)-token$", path):
            return "token"
        return "api"

    def _dispatch(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        side = self._side(url.path)
        auth = self.headers.get("Authorization")
        with self.hub._lock:
            self.hub.requests.append(Request(self.command, url.path, side, auth))
        try:
            body = self._body()
        except ValueError as err:
            return self._error(413, str(err))
        cls = RequestClass.RESOLVER if "/resolve/" in url.path else RequestClass.API if url.path.startswith("/api/") else None
        self._limits = {}
        if cls is not None:
            token = _bearer(auth) or "anonymous"
            self._limits = self.hub._count(token, cls, self.command, url.path)
            if "Retry-After" in self._limits:
                return self._error(429, "You have exceeded our rate limits", self._limits)
        if url.path in openid.PATHS:
            return openid.serve(self, url.path, parse_qs(url.query), body)
        if url.path.startswith(control.PREFIX):
            return control.serve(self, url.path, body)
        if side == "storage":  # only reached through a grant that handed out a storage fault
            return self._apply_fault(self.hub.storage_fault)
        fault = self.hub._take_fault(side, self.command, url.path)
        if fault is not None:
            return self._apply_fault(fault)
        if side == "token":
            return self._token(url.path, auth)
        role = self._role(auth)
        if role is None:
            return self._error(401, "Invalid credentials in Authorization header")
        self._api(path, url.path, parse_qs(url.query), body, role)

    def _role(self, auth: str | None) -> str | None:
        return self.hub.tokens.get(_bearer(auth) or "")

    do_GET = do_POST = do_HEAD = do_DELETE = do_PUT = lambda self: self._dispatch()  # noqa: E731

    # -- Xet tokens ----------------------------------------------------------------------------

    def _token(self, raw_path: str, auth: str | None) -> None:
        match = re.fullmatch(r"/api/buckets/([^/]+/[^/]+)/xet-(read|write)-token", raw_path)
        if match is None:
            return self._error(404, "not found")
        bucket_id, kind = match.groups()
        role = self._role(auth)
        if role is None:
            return self._error(401, "Invalid credentials in Authorization header")
        if kind == "write" and not self._may_write(role, auth, bucket_id):
            return self._error(403, "You don't have write access to this bucket")
        if bucket_id not in self.hub.buckets:
            return self._error(404, "Bucket not found", {"X-Error-Code": "RepoNotFound"})
        fault = self.hub._take_fault("storage", "", "")
        if fault is not None:  # this grant points hf_xet at storage that answers every request with the fault
            with self.hub._lock:
                self.hub.storage_fault = fault
            cas_url = f"{self.hub.url}/cas"
        else:
            cas_url = f"local://{self.hub.storage}"
        expires = int(time.time() + self.hub.xet_token_ttl)
        self._send(200, {"accessToken": "xet-token", "exp": expires, "casUrl": cas_url})

    # -- Hub API --------------------------------------------------------------------------------

    def _may_write(self, role: str, auth: str | None, bucket_id: str) -> bool:
        return role == "write" and self.hub.accounts.may_write(_bearer(auth), bucket_id.split("/")[0])

    def _api(self, path: str, raw_path: str, query: dict, body: bytes, role: str) -> None:
        if raw_path == "/api/whoami-v2":
            found = self.hub.accounts.whoami(_bearer(self.headers.get("Authorization")))
            return self._send(200, found) if found else self._error(401, "Invalid credentials in Authorization header")
        match = re.fullmatch(r"/api/buckets/([^/]+)/([^/]+)", raw_path)
        if match:
            return self._bucket(f"{match[1]}/{match[2]}", role)
        match = re.fullmatch(r"/api/buckets/([^/]+/[^/]+)/events", raw_path)
        if match and self.command == "GET":
            return self._events(match[1], query)
        match = re.fullmatch(r"/api/buckets/([^/]+/[^/]+)/(tree|paths-info|batch)(/.*)?", raw_path)
        if match:
            bucket_id, op = match[1], match[2]
            if bucket_id not in self.hub.buckets:
                return self._error(404, "Bucket not found", {"X-Error-Code": "RepoNotFound"})
            if op == "tree":
                return self._tree(bucket_id, unquote((match[3] or "/")[1:]), query)
            if op == "paths-info":
                return self._paths_info(bucket_id, json.loads(body or b"{}").get("paths", []))
            if not self._may_write(role, self.headers.get("Authorization"), bucket_id):
                return self._error(403, "You don't have write access to this bucket")
            return self._batch(bucket_id, body)
        match = re.fullmatch(r"/buckets/([^/]+/[^/]+)/resolve/(.+)", raw_path)
        if match:
            return self._resolve(match[1], unquote(match[2]))
        self._error(404, "not found")

    def _bucket(self, bucket_id: str, role: str) -> None:
        exists = bucket_id in self.hub.buckets
        if self.command == "POST":
            if not self._may_write(role, self.headers.get("Authorization"), bucket_id):
                return self._error(403, "You don't have the rights to create a bucket in this namespace")
            if not self.hub.create_bucket(bucket_id):  # checked and created at once: one of two racing creates wins
                message = "You already created this bucket"  # with its url, which create_bucket(exist_ok=True) reads
                return self._send(409, {"error": message, "url": f"{self.hub.url}/buckets/{bucket_id}"},
                                  {"X-Error-Message": message})  # fmt: skip
            return self._send(200, {"url": f"{self.hub.url}/buckets/{bucket_id}", "id": bucket_id})
        if not exists:
            return self._error(404, "Bucket not found", {"X-Error-Code": "RepoNotFound"})
        changes = self.hub.changes.get(bucket_id) or []
        updated = _iso(changes[-1][1]) if changes else "2026-01-01T00:00:00.000Z"
        self._send(200, {"id": bucket_id, "private": False, "createdAt": "2026-01-01T00:00:00.000Z",
                         "updatedAt": updated, "size": 0, "totalFiles": len(self.hub.buckets[bucket_id])})

    def _tree(self, bucket_id: str, prefix: str, query: dict) -> None:
        objects = self.hub.buckets[bucket_id]
        recursive = query.get("recursive", ["False"])[0].lower() == "true"
        start = int(query.get("cursor", ["0"])[0])
        paths = sorted(p for p in objects if p.startswith(prefix))
        if not recursive:
            raise NotImplementedError("only recursive listings are served")
        if prefix and not paths:
            return self._error(404, "Path not found", {"X-Error-Code": "EntryNotFound"})
        page = paths[start : start + self.hub.page_size]
        headers = {}
        if start + self.hub.page_size < len(paths):
            nxt = f"{self.hub.url}/api/buckets/{bucket_id}/tree?recursive=true&cursor={start + self.hub.page_size}"
            if prefix:
                nxt = nxt.replace("/tree?", f"/tree/{prefix}?")
            headers["Link"] = f'<{nxt}>; rel="next"'
        self._send(200, [_file_entry(p, objects[p]) for p in page], headers)

    def _paths_info(self, bucket_id: str, paths: list[str]) -> None:
        if len(paths) > 1000:
            return self._error(400, "too many paths")
        objects = self.hub.buckets[bucket_id]
        self._send(200, [_file_entry(p, objects[p]) for p in paths if p in objects])

    def _batch(self, bucket_id: str, body: bytes) -> None:
        operations = [json.loads(line) for line in body.splitlines() if line.strip()]
        if len(operations) > 1000:
            return self._error(400, "too many operations in one batch")
        objects = self.hub.buckets[bucket_id]
        failed = []
        with self.hub._lock:
            for op in operations:
                if op["type"] == "addFile":
                    size = xet_file_size(self.hub.storage, op["xetHash"])
                    if size is None:
                        failed.append({"path": op["path"], "error": "unknown xet hash"})
                        continue
                    change = "update" if op["path"] in objects else "add"
                    objects[op["path"]] = {"size": size, "xetHash": op["xetHash"], "mtime": op.get("mtime")}
                    self.hub._record_change(bucket_id, {"path": op["path"], "op": change, "size": size,
                                                        "xetHash": op["xetHash"], "uploadedAt": _iso(time.time())})
                elif op["type"] == "deleteFile":
                    if objects.pop(op["path"], None) is not None:
                        self.hub._record_change(bucket_id, {"path": op["path"], "op": "delete"})
                else:
                    failed.append({"path": op.get("path"), "error": f"unsupported operation {op['type']}"})
        self._send(422 if failed and len(failed) == len(operations) else 200, {"failed": failed})

    def _events(self, bucket_id: str, query: dict) -> None:
        serve_events(self, bucket_id, query)

    def _resolve(self, bucket_id: str, path: str) -> None:
        meta = self.hub.buckets.get(bucket_id, {}).get(path)
        if meta is None:
            return self._error(404, "Entry not found", {"X-Error-Code": "EntryNotFound"})
        refresh = f"{self.hub.url}/api/buckets/{bucket_id}/xet-read-token"
        self._send(200, b"", {"X-Xet-Hash": meta["xetHash"], "Link": f'<{refresh}>; rel="xet-auth"',
                              "X-Linked-Size": str(meta["size"])})
