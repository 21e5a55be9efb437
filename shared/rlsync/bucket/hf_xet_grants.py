"""Xet access tokens reused until shortly before they expire (:class:`XetGrants`), for the transfers of
:class:`~rlsync.bucket.hf.HfBucket`.

huggingface_hub's bucket upload and download (``batch_bucket_files``, ``download_bucket_files``) hand
hf_xet only the URL of the bucket's Xet token endpoint (``/api/buckets/<id>/xet-{read,write}-token``),
and hf_xet fetches a token from it for every upload commit and every download group, although a
token is valid for an hour: 42% of a fleet's API requests were such fetches (docs/hub-budget.md).

hf_xet also accepts the storage URL, a token and its expiry up front
(``XetSession.new_upload_commit`` / ``new_file_download_group``: ``endpoint``, ``token``,
``token_expiry_unix_secs``), but takes no callable to refresh it, only a URL it fetches itself. So,
within a transfer of this library (:func:`seeding`), hf_xet is handed a grant from :data:`GRANTS`
instead of the URL: one token per token endpoint and Hub token (per bucket and kind) for the whole
process, fetched by this module through huggingface_hub's HTTP client (so counted and paced by the
role's :class:`~rlsync.bucket.budget.RequestMeter`, made once, and retried by
:class:`~rlsync.bucket.retry.RetryingBucket`), by one thread while the others wait, and fetched again
once less than :data:`REFRESH_BEFORE_S` of it is left. hf_xet gets no refresh URL, so it makes no
token request of its own (given one, hf_xet 1.8 fetches a token itself once less than about 30 s are
left, unseen by the meter): every one is counted. A transfer that outlives its token (it can only when
it runs longer than :data:`REFRESH_BEFORE_S`) fails with 401 and is made once more with a new token
(:meth:`~rlsync.bucket.hf_errors.HubCalls.transfer`); one longer than a token's whole life (an hour on
the Hub) cannot complete.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import hashlib
import logging
import threading
import time
from typing import Any, Callable, Iterator

__all__ = ["GRANTS", "REFRESH_BEFORE_S", "XetGrant", "XetGrants", "install_seeding", "seeding"]

logger = logging.getLogger(__name__)

#: A grant is fetched again once less than this many seconds of it are left (the Hub's last an hour).
REFRESH_BEFORE_S = 600.0

_SEEDING: contextvars.ContextVar["list[XetGrant] | None"] = contextvars.ContextVar("xet_seeding", default=None)
_INSTALL_LOCK = threading.Lock()
_installed = False


@dataclasses.dataclass(frozen=True)
class XetGrant:
    """One answer of a Xet token endpoint: where Xet storage is, the token, when it expires.

    Args:
        key: Which cache entry it is (a hash of the token endpoint and the Hub token asking).
        cas_url: The Xet storage (CAS) URL.
        token: The Xet access token.
        expires: When the token expires, in seconds since the epoch.
    """

    key: str
    cas_url: str
    token: str = dataclasses.field(repr=False)
    expires: int

    @classmethod
    def parse(cls, key: str, answer: Any) -> "XetGrant":
        """The grant in a token endpoint's JSON answer (``{"accessToken", "exp", "casUrl"}``).

        Raises:
            ValueError: the answer is not such an object.
        """
        if not isinstance(answer, dict):
            raise ValueError("the Xet token endpoint answered without a JSON object")
        token, expires, cas_url = answer.get("accessToken"), answer.get("exp"), answer.get("casUrl")
        if not (isinstance(token, str) and token and isinstance(cas_url, str) and cas_url):
            raise ValueError("the Xet token endpoint's answer has no accessToken or casUrl")
        if not isinstance(expires, (int, float)) or isinstance(expires, bool):
            raise ValueError("the Xet token endpoint's answer has no numeric exp")
        return cls(key=key, cas_url=cas_url, token=token, expires=int(expires))


class XetGrants:
    """The Xet tokens of this process, one per token endpoint and Hub token, reused until shortly before
    they expire. Thread-safe: one thread fetches a missing or expiring grant while the others asking for
    it wait and then share it.

    Args:
        fetch: Makes the request: ``fetch(url, headers)`` returns the endpoint's JSON answer.
        clock: Seconds since the epoch.
    """

    def __init__(
        self, fetch: Callable[[str, dict[str, str]], Any] | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self._fetch = fetch or _fetch_with_hub_client
        self._clock = clock
        self._lock = threading.Lock()
        self._grants: dict[str, XetGrant] = {}
        self._key_locks: dict[str, threading.Lock] = {}

    def get(self, url: str, headers: dict[str, str]) -> XetGrant:
        """The grant for token endpoint `url` asked with `headers` (their ``Authorization``): the cached
        one while at least `REFRESH_BEFORE_S` of it is left, else a new one (one request).

        Raises:
            Whatever the request raises; ValueError for a malformed answer.
        """
        auth = next((v for k, v in headers.items() if k.lower() == "authorization"), "")
        key = hashlib.sha256(f"{url}\n{auth}".encode()).hexdigest()
        with self._lock:
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:
            grant = self._grants.get(key)
            if grant is not None and grant.expires - self._clock() >= REFRESH_BEFORE_S:
                return grant
            grant = XetGrant.parse(key, self._fetch(url, headers))
            with self._lock:
                self._grants[key] = grant
            logger.debug("new Xet token from %s, valid for %.0f s", url, grant.expires - self._clock())
            return grant

    def drop(self, grants: list[XetGrant]) -> None:
        """Forget these grants (a transfer that used them failed); a newer grant of the same key stays."""
        with self._lock:
            for grant in grants:
                if self._grants.get(grant.key) is grant:
                    del self._grants[grant.key]

    def clear(self) -> None:
        """Forget every grant (a test's Hub stand-in starts again)."""
        with self._lock:
            self._grants.clear()


def _fetch_with_hub_client(url: str, headers: dict[str, str]) -> Any:
    """GET a token endpoint with huggingface_hub's client (the installed transport meters it)."""
    from huggingface_hub.utils import get_session, hf_raise_for_status

    response = get_session().get(url, headers=headers)
    hf_raise_for_status(response)
    return response.json()


#: The grants of this process.
GRANTS = XetGrants()


class _SeededSession:
    """An hf_xet session whose transfers get a grant from :data:`GRANTS` in place of the token URL."""

    def __init__(self, session: Any, used: list[XetGrant]) -> None:
        self._session = session
        self._used = used

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def new_upload_commit(self, **kwargs: Any) -> Any:
        return self._session.new_upload_commit(**self._seed(kwargs))

    def new_file_download_group(self, **kwargs: Any) -> Any:
        return self._session.new_file_download_group(**self._seed(kwargs))

    def _seed(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        url = kwargs.get("token_refresh_url")
        if not url or kwargs.get("token") is not None:
            return kwargs
        grant = GRANTS.get(url, dict(kwargs.get("token_refresh_headers") or {}))
        self._used.append(grant)
        return {
            **kwargs,
            "endpoint": grant.cas_url,
            "token": grant.token,
            "token_expiry_unix_secs": grant.expires,
            "token_refresh_url": None,  # hf_xet must not fetch tokens itself: they would not be counted
            "token_refresh_headers": None,
        }


@contextlib.contextmanager
def seeding() -> Iterator[list[XetGrant]]:
    """Within this block, this thread's Xet transfers through huggingface_hub use grants from
    :data:`GRANTS`; yields the list of those they used."""
    install_seeding()
    used: list[XetGrant] = []
    token = _SEEDING.set(used)
    try:
        yield used
    finally:
        _SEEDING.reset(token)


def install_seeding() -> None:
    """Wrap ``huggingface_hub.utils._xet.get_xet_session`` (once per process) so that, within
    :func:`seeding`, it returns the session wrapped to hand transfers a cached grant.

    Why a patch: huggingface_hub's bucket methods look up ``get_xet_session`` in that module and pass
    hf_xet only a token URL, with no parameter for a token; hf_xet takes no refresh callable. The
    wrapper returns the very same session everywhere else (no :func:`seeding` block in this thread:
    other code in the process, model downloads included, is unchanged), and the session itself (one
    per process, huggingface_hub's) is not replaced.
    """
    global _installed
    with _INSTALL_LOCK:
        if _installed:
            return
        try:
            from huggingface_hub.utils import _xet

            original = _xet.get_xet_session
        except (ImportError, AttributeError):  # another huggingface_hub layout: transfers work as before
            logger.warning("this huggingface_hub has no utils._xet.get_xet_session: hf_xet fetches a Xet token "
                           "per transfer itself (not reused, not counted by the request meter)")  # fmt: skip
            _installed = True
            return

        def get_xet_session() -> Any:
            session = original()
            used = _SEEDING.get()
            return session if used is None else _SeededSession(session, used)

        get_xet_session.__doc__ = original.__doc__
        _xet.get_xet_session = get_xet_session
        _installed = True
