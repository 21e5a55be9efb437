"""How the Hub client and hf_xet make their requests for :class:`~rlsync.bucket.hf.HfBucket`.

Two settings, applied once per process before the first bucket request:

- **A timeout on every request.** huggingface_hub's default HTTP client has none (a server that
  accepts a connection and never answers blocks forever), and some of its calls pass
  ``timeout=None`` explicitly. The client installed here fills every missing timeout from
  :class:`HfTransferConfig`; hf_xet gets the same limits through its ``HF_XET_CLIENT_*_TIMEOUT``
  settings.
- **One retry layer.** huggingface_hub retries 408/429/5xx and network errors 5 times inside
  ``http_backoff``, and hf_xet retries inside its CAS client; with :class:`RetryingBucket` on top,
  each failure became dozens of requests and a 429 with ``Retry-After: 30`` cost minutes. During a
  bucket call, the installed transport hands every retryable outcome straight back as
  :class:`RetryableHttpError` (which ``http_backoff`` does not retry) and hf_xet is told to make a
  single attempt, so the only retries are :class:`~rlsync.bucket.retry.RetryingBucket`'s, bounded in
  total time.

- **Counting and pacing.** Within :func:`metering` (every bucket call, and the events feed's thread),
  each request first waits for the :class:`~rlsync.bucket.budget.RequestMeter`'s budget, then is
  counted by class and kind with its status, and the ``RateLimit`` headers of its answer are read.

Outside bucket calls (e.g. a model download through the same library) the library keeps its own
retries; only the timeouts apply. httpcore2's DEBUG trace (raw response headers, where a server may
echo a token) is raised to INFO unless the application set its level.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import threading
from typing import TYPE_CHECKING, Iterator

import httpx2

from ..errors import RetryableHttpError

if TYPE_CHECKING:
    from .budget import RequestMeter

__all__ = ["HfTransferConfig", "RetryableHttpError", "install", "metering", "single_attempt"]

logger = logging.getLogger(__name__)

#: The statuses huggingface_hub's ``http_backoff`` retries.
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})

_SINGLE_ATTEMPT = contextvars.ContextVar("hf_bucket_single_attempt", default=False)
_METER: contextvars.ContextVar["RequestMeter | None"] = contextvars.ContextVar("hf_bucket_meter", default=None)
_INSTALL_LOCK = threading.Lock()
_installed: "HfTransferConfig | None" = None


@dataclasses.dataclass(frozen=True)
class HfTransferConfig:
    """Request timeouts for the Hub API and Xet storage, in seconds.

    Entry points read it from the environment with [`~rlsync.bucket.settings.BucketSettings.from_env`].

    Args:
        connect_timeout (`float`, *optional*, defaults to 10):
            Longest wait to open a connection (env `HF_BUCKET_CONNECT_TIMEOUT`).
        read_timeout (`float`, *optional*, defaults to 60):
            Longest silence while waiting for response bytes (env `HF_BUCKET_READ_TIMEOUT`).
    """

    connect_timeout: float = 10.0
    read_timeout: float = 60.0

    def timeout(self) -> httpx2.Timeout:
        return httpx2.Timeout(self.read_timeout, connect=self.connect_timeout)


class _BucketTransport(httpx2.HTTPTransport):
    """Fills in missing timeouts; during a bucket call, raises instead of returning retryable outcomes."""

    def __init__(self, config: HfTransferConfig) -> None:
        super().__init__()
        self._timeouts = config.timeout().as_dict()

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        given = request.extensions.get("timeout") or {}
        request.extensions["timeout"] = {
            name: given.get(name) if given.get(name) is not None else default
            for name, default in self._timeouts.items()
        }
        meter = _METER.get()
        if meter is None:
            return self._send(request)
        from .budget import LISTING_KIND, classify

        cls, kind = classify(request.method, request.url.path)
        meter.acquire(cls, listing=kind == LISTING_KIND)
        try:
            response = self._send(request)
        except RetryableHttpError as err:
            meter.record(request.method, request.url.path, err.status, err.headers)
            raise
        except httpx2.TransportError:
            meter.record(request.method, request.url.path, None, None)
            raise
        meter.record(request.method, request.url.path, response.status_code, response.headers)
        return response

    def _send(self, request: httpx2.Request) -> httpx2.Response:
        if not _SINGLE_ATTEMPT.get():
            return super().handle_request(request)
        try:
            response = super().handle_request(request)
        except httpx2.TransportError as err:
            raise RetryableHttpError(f"{type(err).__name__} on {request.method} {request.url.path}: {err}") from None
        if response.status_code in RETRYABLE_STATUSES:
            body = response.read()[:300].decode("utf-8", "replace").strip()
            response.close()
            raise RetryableHttpError(
                f"HTTP {response.status_code} on {request.method} {request.url.path}" + (f": {body}" if body else ""),
                response.status_code,
                response.headers,
            )
        return response


@contextlib.contextmanager
def single_attempt() -> Iterator[None]:
    """Within this block, Hub API requests of this thread are made once (no library retries)."""
    token = _SINGLE_ATTEMPT.set(True)
    try:
        yield
    finally:
        _SINGLE_ATTEMPT.reset(token)


@contextlib.contextmanager
def metering(meter: "RequestMeter | None") -> Iterator[None]:
    """Within this block, Hub requests of this thread are paced and counted by `meter` (`None`: not)."""
    token = _METER.set(meter)
    try:
        yield
    finally:
        _METER.reset(token)


def install(config: HfTransferConfig | None = None, *, replace: bool = True) -> None:
    """Install the timeouts and the single-attempt transport for huggingface_hub and hf_xet.

    Args:
        config ([`HfTransferConfig`], *optional*):
            The settings. `None` installs the defaults unless settings are installed already.
        replace (`bool`, *optional*, defaults to `True`):
            An explicit `config` replaces the installed one (and the `HF_XET_CLIENT_*` settings), and
            drops an existing hf_xet session so that the next transfer starts one with the new
            settings. `False` (what every `HfBucket` passes) installs it only when nothing is
            installed yet: the first bucket's settings hold for the process.

    An HTTP client factory the application installed itself is kept, with a warning: bucket requests
    then have that client's timeouts and the library's own retries.
    """
    global _installed
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http, _xet

    with _INSTALL_LOCK:
        if _installed is not None and (config in (None, _installed) or not replace):
            return
        explicit = config is not None and replace
        config = config or HfTransferConfig()
        if _installed is None and _http._GLOBAL_CLIENT_FACTORY is not _http.default_client_factory:
            logger.warning("huggingface_hub has a custom HTTP client factory: bucket requests keep its timeouts")
            _installed = config
            return
        settings = {
            "HF_XET_CLIENT_CONNECT_TIMEOUT": f"{max(1, round(config.connect_timeout * 1000))}ms",
            "HF_XET_CLIENT_READ_TIMEOUT": f"{max(1, round(config.read_timeout * 1000))}ms",
            "HF_XET_CLIENT_RETRY_MAX_ATTEMPTS": "0",
        }
        for name, value in settings.items():
            if explicit:
                os.environ[name] = value
            else:
                os.environ.setdefault(name, value)
        if explicit:
            _xet._GLOBAL_XET_HOLDER.sigint_abort()  # the next transfer creates a session with the new settings
        _installed = config
        # httpcore2's DEBUG trace prints raw response headers: a server echoing a token there would leak it.
        trace = logging.getLogger("httpcore2")
        if trace.level == logging.NOTSET:
            trace.setLevel(logging.INFO)

        def factory() -> httpx2.Client:
            template = _http.default_client_factory()
            hooks = template.event_hooks
            template.close()
            return httpx2.Client(
                event_hooks=hooks, follow_redirects=True, timeout=config.timeout(), transport=_BucketTransport(config)
            )

        set_client_factory(factory)
