"""A local stand-in for the Hugging Face Hub's bucket API and its Xet storage, for tests and soak trials.

The real ``huggingface_hub`` + ``hf_xet`` client code talks to this server through ``HF_ENDPOINT``
(the ``hub`` fixture in ``tests/conftest.py`` points the library at it; the soak trial
``hub_storage`` passes its URL to ``HfApi(endpoint=...)``). It implements the HTTP calls
huggingface_hub 2.4.0's bucket methods make (:mod:`testing.hub.buckets`: create, info, tree, paths-info,
batch commits, resolve, the live-follow feed of :mod:`testing.hub.events`, whoami of :mod:`testing.hub.accounts`),
the Xet token endpoint and Xet storage (:mod:`testing.hub.cas`), and the OpenID Connect provider of "Sign in with
Hugging Face" (:mod:`testing.hub.openid`). :mod:`testing.hub.handler` reads each request and routes it.

Xet storage is served over HTTP by this server, which alone holds its files (:mod:`testing.hub.xet_storage`): the
bytes are chunked, deduplicated, uploaded, reconstructed and downloaded by the real hf_xet code, as against the Hub.
``python -m testing.hub`` runs the stand-in as a process that several processes share (:mod:`testing.hub.__main__`).

Rate limits (:meth:`HubServer.limit`) are the Hub's: per token, in fixed windows, API requests (every
``/api/...`` endpoint, Xet token endpoints and the feed included) and resolver requests
(``/resolve/...``) counted apart against the tier's limits (``rlsync.bucket.budget.HUB_LIMITS``,
scaled to a shortened window for tests). Over the limit a request gets 429 with ``RateLimit``,
``RateLimit-Policy`` and ``Retry-After``; every counted response carries ``RateLimit`` headers.
:attr:`HubServer.log` keeps every counted request per token and class for benchmarks.

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
import random
import re
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

from rlsync.bucket.budget import WINDOW_S, RequestClass, Tier, scaled_limit
from testing.hub import openid
from testing.hub.accounts import Accounts
from testing.hub.cas import Grant
from testing.hub.faults import Fault
from testing.hub.handler import Handler
from testing.hub.xet_storage import XetStorage

#: Changes the events feed can replay; an older cursor gets a ``reset`` event.
FEED_REPLAY = 10_000


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
        root: Folder for the Xet storage (a new folder in it at each :meth:`reset`).
        page_size: Entries per page of a tree listing.
    """

    def __init__(self, root: Path, page_size: int = 100) -> None:
        self.root = Path(root)
        self._default_page_size = page_size
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._changed = threading.Condition(self._lock)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
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
            self.rates: dict[str, float] = {}
            self._rng = random.Random(0)
            self.chaotic: dict[str, int] = {"api": 0, "token": 0, "storage": 0}
            #: token -> "read" or "write"; a request with any other bearer token gets 401.
            self.tokens: dict[str, str] = {}
            #: How long the Xet tokens granted from now on are valid (their ``exp``), in seconds: the
            #: Hub's last an hour; 0 grants tokens that are expired as they are handed out (which hf_xet then
            #: refuses to use without a refresh route).
            self.xet_token_ttl = 3600.0
            #: Xet storage (its files in a new folder), and the Xet tokens granted for it (token -> grant).
            self.xet = XetStorage(Path(tempfile.mkdtemp(prefix="xet-", dir=self.root)))
            self.grants: dict[str, Grant] = {}
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

    def _record(self, method: str, path: str, side: str, authorization: str | None) -> None:
        with self._lock:
            self.requests.append(Request(method, path, side, authorization))

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
