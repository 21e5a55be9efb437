"""One Hub request of :class:`~rlsync.bucket.hf.HfBucket` and its errors (:class:`HubCalls`).

Each call is metered and made once (:mod:`rlsync.bucket.hf_transport`), and what ``huggingface_hub`` or
hf_xet raises is mapped onto the bucket error types (see :mod:`rlsync.bucket.hf` for the table), every
message scrubbed of the tokens the client may send.
"""

from __future__ import annotations

import logging
import re
import traceback
from typing import Callable, TypeVar

import httpx2
from hf_xet import XetAuthenticationError, XetObjectNotFoundError
from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import (
    BucketBatchError,
    BucketNotFoundError,
    EntryNotFoundError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
)

from ..errors import BucketError, ObjectNotFoundError, RetryableHttpError, TransientBucketError
from ..retry import retry_after_seconds
from .budget import RequestMeter
from .hf_transport import metering, single_attempt
from .hf_xet_grants import GRANTS, seeding

__all__ = ["HubCalls"]

_T = TypeVar("_T")

logger = logging.getLogger(__name__)

#: HTTP statuses worth retrying: request timeout, rate limit, server errors.
_TRANSIENT_STATUSES = frozenset({408, 429})
#: Connection-level failures (no HTTP status) worth retrying.
_TRANSIENT_EXCEPTIONS: tuple[type[BaseException], ...] = (
    httpx2.TimeoutException,
    httpx2.NetworkError,
    httpx2.RemoteProtocolError,
    ConnectionError,
    TimeoutError,
)
#: The HTTP status hf_xet (reqwest) writes into its error messages, e.g. "(503 Service Unavailable)".
_XET_STATUS = re.compile(r"HTTP status (?:client|server) error \((\d{3})\b")
#: hf_xet's wording for a connection that failed, was dropped or timed out.
_XET_CONNECTION = re.compile(r"error sending request|timed out|connection (?:reset|refused|closed)", re.IGNORECASE)
_REDACTED = "<redacted>"


def _is_transient(status: int) -> bool:
    return status in _TRANSIENT_STATUSES or status >= 500


def xet_status(err: BaseException) -> int | None:
    """The HTTP status of Xet storage's answer in an error hf_xet raised (``None``: not such an error)."""
    if isinstance(err, XetAuthenticationError):
        return 401
    if isinstance(err, (RuntimeError, OSError)) and not isinstance(err, HfHubHTTPError):
        match = _XET_STATUS.search(str(err))
        return int(match[1]) if match else None
    return None


class HubCalls:
    """Makes one bucket's Hub calls: metered, single attempts, errors mapped and scrubbed.

    Args:
        api: The Hub client.
        token: The token passed to every call (``None``: the client's own lookup).
        bucket_id: ``"namespace/name"``, for messages and the Xet token path.
        url: The bucket's URL, for messages.
        meter: Counts and paces the requests.
    """

    def __init__(self, *, api: HfApi, token: str | None, bucket_id: str, url: str, meter: RequestMeter) -> None:
        self.api = api
        self.token = token
        self.bucket_id = bucket_id
        self.url = url
        self.meter = meter

    def call(self, op: str, key: str | None, fn: Callable[[], _T]) -> _T:
        """Run one `huggingface_hub` call, mapping its errors onto the bucket error types.

        Raises:
            TransientBucketError: worth retrying (408, 429, 5xx, connection errors).
            ObjectNotFoundError: no such object.
            BucketError: anything else.
        """
        try:
            with metering(self.meter), single_attempt():
                return fn()
        except BucketError:
            raise
        except Exception as err:
            mapped = self.map_error(op, key, err)
            # Keep the original exception (and its chain) for debugging unless its text carries a token.
            text = "".join(traceback.format_exception(err))
            if not any(secret in text for secret in self.secrets()):
                raise mapped from err
        raise mapped  # outside the except block: not even __context__ keeps the token-bearing original

    def transfer(self, op: str, key: str | None, fn: Callable[[], _T]) -> _T:
        """:meth:`call` for a call that moves bytes through Xet storage: hf_xet gets this process's
        cached Xet token (:mod:`rlsync.bucket.hf_xet_grants`). A token the call used is dropped when the
        call fails (the next attempt fetches one); one that Xet storage refused (401/403: expired or
        revoked) is replaced at once and the call made once more.

        Raises:
            As :meth:`call`.
        """
        refused = False

        def attempt() -> _T:
            nonlocal refused
            with seeding() as used:
                try:
                    return fn()
                except Exception as err:
                    GRANTS.drop(used)
                    refused = bool(used) and xet_status(err) in (401, 403)
                    raise

        try:
            return self.call(op, key, attempt)
        except BucketError:
            if not refused:
                raise
        logger.info("%s %s: Xet storage refused the Xet token; fetching a new one", op, self.url)
        return self.call(op, key, attempt)

    def scrub(self, text: str) -> str:
        """``text`` with every token the client may send replaced."""
        for secret in self.secrets():
            text = text.replace(secret, _REDACTED)
        return text

    def secrets(self) -> list[str]:
        """Every token the client may send: its own, the client's, and the one the library finds itself."""
        try:
            found = get_token()  # HF_TOKEN, else the saved login
        except Exception:  # noqa: BLE001 - an unreadable token file must not hide the real error
            found = None
        candidates = (self.token, getattr(self.api, "token", None), found)
        return [t for i, t in enumerate(candidates) if isinstance(t, str) and t and t not in candidates[:i]]

    def map_error(self, op: str, key: str | None, err: Exception) -> BucketError:
        """The bucket error for what a Hub call of ``op`` on ``key`` raised."""
        what = f"{op} {key!r} in {self.url}" if key is not None else f"{op} {self.url}"
        if isinstance(err, BucketNotFoundError):
            return BucketError(
                self.scrub(
                    f"{what} failed: bucket {self.bucket_id!r} not found, or the token cannot access it "
                    f"(create it first or pass create=True){self._detail(err)}"
                )
            )
        if isinstance(err, BucketBatchError):
            failures = "; ".join(f"{f.get('path')}: {f.get('error')}" for f in err.failures) or "unknown"
            return BucketError(self.scrub(f"{what} failed: the server rejected the operation ({failures})"))
        if (isinstance(err, EntryNotFoundError) and not isinstance(err, HfHubHTTPError)) or isinstance(
            err, XetObjectNotFoundError
        ):
            return ObjectNotFoundError(self.scrub(f"{what} failed: no such object"))
        if isinstance(err, RetryableHttpError):
            return self._status_error(what, op, err.status, err.headers, "", str(err))
        if isinstance(err, HfHubHTTPError) and getattr(err, "response", None) is not None:
            status = err.response.status_code
            detail = self._detail(err)
            if status == 404 and not err.response.headers.get("X-Error-Code"):
                return BucketError(
                    self.scrub(
                        f"{what} failed with HTTP 404 without a Hub error code: {err.response.url.host} does not "
                        f"answer like the Hub (check HF_ENDPOINT and proxies){detail}"
                    )
                )
            return self._status_error(what, op, status, err.response.headers, detail, "")
        if isinstance(err, OfflineModeIsEnabled):
            return BucketError(self.scrub(f"{what} failed: HF_HUB_OFFLINE is set, the Hub cannot be reached"))
        if (status := xet_status(err)) is not None:
            # hf_xet: Xet storage answered with this status.
            return self._status_error(what, op, status, None, "", f"Xet: {err}")
        xet_connection = isinstance(err, RuntimeError) and _XET_CONNECTION.search(str(err)) is not None
        if isinstance(err, _TRANSIENT_EXCEPTIONS) or xet_connection:
            return TransientBucketError(self.scrub(f"{what} failed: connection error ({type(err).__name__}: {err})"))
        return BucketError(self.scrub(f"{what} failed: {type(err).__name__}: {err}"))

    def _status_error(
        self, what: str, op: str, status: int | None, headers: httpx2.Headers | None, detail: str, cause: str
    ) -> BucketError:
        """The bucket error for an HTTP status (None: the connection failed or timed out)."""
        because = f" ({cause})" if cause else ""
        if status is None:
            return TransientBucketError(self.scrub(f"{what} failed: connection error{because}"))
        if status == 404:
            return ObjectNotFoundError(self.scrub(f"{what} failed: no such object (HTTP 404){detail}{because}"))
        if _is_transient(status):
            retry_after = retry_after_seconds(headers) if headers is not None else None
            hint = f", retry after {retry_after:g}s" if retry_after is not None else ""
            return TransientBucketError(
                self.scrub(f"{what} failed with HTTP {status}{hint}{detail}{because}"), retry_after=retry_after
            )
        if status in (401, 403):
            access = "write" if op in ("put", "delete", "create bucket") else "read"
            return BucketError(
                self.scrub(
                    f"{what} failed with HTTP {status}: permission denied; the token (token=, HF_TOKEN or the "
                    f"saved login) needs {access} access to bucket {self.bucket_id!r} (a read-only or revoked "
                    f"token fails like this){detail}{because}"
                )
            )
        return BucketError(self.scrub(f"{what} failed with HTTP {status}{detail}{because}"))

    @staticmethod
    def _detail(err: HfHubHTTPError) -> str:
        parts = []
        if err.server_message:
            parts.append(err.server_message.strip())
        if err.request_id:
            parts.append(f"request id {err.request_id}")
        return (": " + "; ".join(parts)) if parts else ""
