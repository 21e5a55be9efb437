"""Errors of the Hugging Face Hub client mapped onto the bucket error types, with no token in any message.

Errors from ``huggingface_hub`` are mapped onto the bucket error types:

- 404 on an object -> :class:`ObjectNotFoundError`;
- 404 on the bucket itself -> :class:`BucketError` (a missing bucket is a configuration error, not
  an empty bucket);
- 404 without the Hub's ``X-Error-Code`` -> :class:`BucketError` (not a Hub answer: wrong endpoint or
  a proxy), never an empty listing;
- 408, 429, 5xx and connection/timeouts -> :class:`TransientBucketError`, with ``retry_after`` taken
  from the ``Retry-After`` header (seconds or HTTP date, or the Hub's ``RateLimit`` header);
- 401/403 -> :class:`BucketError` saying the token lacks access (read or write);
- errors from hf_xet (Xet token endpoint and Xet storage), which arrive as ``RuntimeError`` or
  ``ConnectionError`` carrying the HTTP status in their message, are classified by that status the
  same way (a storage 404 is a missing object, a 401/403 from the token endpoint a permission error);
- anything else -> :class:`BucketError`.

Messages are built from the status code, the server's message and the request id, and scrubbed of
every token the client may send (its own, the client's, and the one ``huggingface_hub`` finds itself),
in case the server echoed it; an original exception whose text carries a token is not chained.
"""

from __future__ import annotations

import email.utils
import re
import time
import traceback
from typing import Callable, TypeVar

import httpx2
from hf_xet import XetAuthenticationError, XetObjectNotFoundError
from huggingface_hub import get_token
from huggingface_hub.errors import (
    BucketBatchError,
    BucketNotFoundError,
    EntryNotFoundError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
)
from huggingface_hub.utils import parse_ratelimit_headers

from ..errors import BucketError, ObjectNotFoundError, RetryableHttpError, TransientBucketError

__all__ = ["HfErrors"]

_T = TypeVar("_T")

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


def _retry_after_seconds(headers: httpx2.Headers) -> float | None:
    """Seconds to wait according to ``Retry-After`` (delay or HTTP date) or the Hub's ``RateLimit`` header."""
    value = headers.get("Retry-After")
    if value:
        value = value.strip()
        try:
            return max(0.0, float(value))
        except ValueError:
            pass
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            when = None
        if when is not None and when.tzinfo is not None:
            return max(0.0, when.timestamp() - time.time())
    info = parse_ratelimit_headers(headers)
    if info is not None and info.remaining == 0:
        return float(info.reset_in_seconds)
    return None


class HfErrors:
    """Maps the errors of one Hub bucket's calls.

    Args:
        bucket_id: The bucket, ``"namespace/name"`` (named in messages).
        url: Its ``hf://`` URL (named in messages).
        tokens: Returns the tokens the bucket's client holds (its own and the client's), scrubbed from messages.
    """

    def __init__(self, bucket_id: str, url: str, tokens: Callable[[], tuple[str | None, ...]]) -> None:
        self.bucket_id, self.url, self._tokens = bucket_id, url, tokens


    def _scrub(self, text: str) -> str:
        for secret in self._secrets():
            text = text.replace(secret, _REDACTED)
        return text

    def _secrets(self) -> list[str]:
        """Every token the client may send: its own, the client's, and the one the library finds itself."""
        try:
            found = get_token()  # HF_TOKEN, else the saved login
        except Exception:  # noqa: BLE001 - an unreadable token file must not hide the real error
            found = None
        candidates = (*self._tokens(), found)
        return [t for i, t in enumerate(candidates) if isinstance(t, str) and t and t not in candidates[:i]]

    def call(self, op: str, key: str | None, fn: Callable[[], _T]) -> _T:
        """Run ``fn``, mapping its errors onto the bucket error types.

        Raises:
            BucketError: what ``fn`` raised, mapped (see the module docstring).
        """
        try:
            return fn()
        except BucketError:
            raise
        except Exception as err:
            mapped = self._map_error(op, key, err)
            # Keep the original exception (and its chain) for debugging unless its text carries a token.
            text = "".join(traceback.format_exception(err))
            if not any(secret in text for secret in self._secrets()):
                raise mapped from err
        raise mapped  # outside the except block: not even __context__ keeps the token-bearing original

    def _map_error(self, op: str, key: str | None, err: Exception) -> BucketError:
        what = f"{op} {key!r} in {self.url}" if key is not None else f"{op} {self.url}"
        if isinstance(err, BucketNotFoundError):
            return BucketError(
                self._scrub(
                    f"{what} failed: bucket {self.bucket_id!r} not found, or the token cannot access it "
                    f"(create it first or pass create=True){self._detail(err)}"
                )
            )
        if isinstance(err, BucketBatchError):
            failures = "; ".join(f"{f.get('path')}: {f.get('error')}" for f in err.failures) or "unknown"
            return BucketError(self._scrub(f"{what} failed: the server rejected the operation ({failures})"))
        if (isinstance(err, EntryNotFoundError) and not isinstance(err, HfHubHTTPError)) or isinstance(
            err, XetObjectNotFoundError
        ):
            return ObjectNotFoundError(self._scrub(f"{what} failed: no such object"))
        if isinstance(err, RetryableHttpError):
            return self._status_error(what, op, err.status, err.headers, "", str(err))
        if isinstance(err, HfHubHTTPError) and getattr(err, "response", None) is not None:
            status = err.response.status_code
            detail = self._detail(err)
            if status == 404 and not err.response.headers.get("X-Error-Code"):
                return BucketError(
                    self._scrub(
                        f"{what} failed with HTTP 404 without a Hub error code: {err.response.url.host} does not "
                        f"answer like the Hub (check HF_ENDPOINT and proxies){detail}"
                    )
                )
            return self._status_error(what, op, status, err.response.headers, detail, "")
        if isinstance(err, OfflineModeIsEnabled):
            return BucketError(self._scrub(f"{what} failed: HF_HUB_OFFLINE is set, the Hub cannot be reached"))
        if isinstance(err, XetAuthenticationError):
            return self._status_error(what, op, 401, None, "", f"Xet: {err}")
        if isinstance(err, (RuntimeError, OSError)) and (match := _XET_STATUS.search(str(err))):
            # hf_xet: the Xet token endpoint or Xet storage answered with this status.
            return self._status_error(what, op, int(match[1]), None, "", f"Xet: {err}")
        xet_connection = isinstance(err, RuntimeError) and _XET_CONNECTION.search(str(err)) is not None
        if isinstance(err, _TRANSIENT_EXCEPTIONS) or xet_connection:
            return TransientBucketError(self._scrub(f"{what} failed: connection error ({type(err).__name__}: {err})"))
        return BucketError(self._scrub(f"{what} failed: {type(err).__name__}: {err}"))

    def _status_error(
        self, what: str, op: str, status: int | None, headers: httpx2.Headers | None, detail: str, cause: str
    ) -> BucketError:
        """The bucket error for an HTTP status (None: the connection failed or timed out)."""
        because = f" ({cause})" if cause else ""
        if status is None:
            return TransientBucketError(self._scrub(f"{what} failed: connection error{because}"))
        if status == 404:
            return ObjectNotFoundError(self._scrub(f"{what} failed: no such object (HTTP 404){detail}{because}"))
        if _is_transient(status):
            retry_after = _retry_after_seconds(headers) if headers is not None else None
            hint = f", retry after {retry_after:g}s" if retry_after is not None else ""
            return TransientBucketError(
                self._scrub(f"{what} failed with HTTP {status}{hint}{detail}{because}"), retry_after=retry_after
            )
        if status in (401, 403):
            access = "write" if op in ("put", "delete", "create bucket") else "read"
            return BucketError(
                self._scrub(
                    f"{what} failed with HTTP {status}: permission denied; the token (token=, HF_TOKEN or the "
                    f"saved login) needs {access} access to bucket {self.bucket_id!r} (a read-only or revoked "
                    f"token fails like this){detail}{because}"
                )
            )
        return BucketError(self._scrub(f"{what} failed with HTTP {status}{detail}{because}"))

    @staticmethod
    def _detail(err: HfHubHTTPError) -> str:
        parts = []
        if err.server_message:
            parts.append(err.server_message.strip())
        if err.request_id:
            parts.append(f"request id {err.request_id}")
        return (": " + "; ".join(parts)) if parts else ""
