"""Bucket snapshots: what the panels read from the bucket, and the token redaction.

A :class:`Snapshot` holds ``metrics/trainer.json``, ``metrics/env.json``, the
``status/*.json`` objects, the pointer object and the anchor-policy control object,
read at one moment. A :class:`BucketView` (one per bucket URL and process, from
:func:`bucket_view`) caches snapshots for a few seconds so that every refresh handler
of a page reads the bucket once. Everything a panel shows comes from here, so a panel
works the same whether the roles run in this process or in three Spaces.

The Hugging Face token is never shown: bucket URLs carry none, and any text that
reaches the page goes through :func:`redact`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable

from ..adapters import adapter_bucket
from ..bucket import Bucket, open_bucket
from ..bucket.watch import listing_error, watch
from ..errors import BucketError, FormatError, ObjectNotFoundError
from ..layout import CONTROL_KEY, STATUS_PREFIX
from ..limits import MAX_CONTROL_BYTES, MAX_STATUS_BYTES, MAX_STATUS_OBJECTS
from ..protocol import AnchorPolicy, Manifest, policy_from_json, read_manifest
from ..scores import Refusals
from .metrics import EnvMetrics, ReplicaStatus, Sync, TrainerMetrics, read_metrics, read_status

logger = logging.getLogger(__name__)

#: Seconds a bucket snapshot is reused by the refresh handlers of one process (local folder).
SNAPSHOT_TTL_S = 1.0
#: The same for a remote bucket (``hf://``), where one snapshot costs several HTTP requests.
REMOTE_SNAPSHOT_TTL_S = 3.0
_REDACTED = "***"
#: Syncs (replica, version) a view remembers.
MAX_SYNC_HISTORY = 5000

BucketSource = str | Callable[[], str]
"""A bucket URL, or a function returning the current one (a panel's form may change it)."""


def redact(text: str) -> str:
    """Remove the Hugging Face token (``HF_TOKEN`` / ``HUGGING_FACE_HUB_TOKEN``) from ``text``."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        secret = os.environ.get(var)
        if secret and len(secret) >= 4:
            text = text.replace(secret, _REDACTED)
    return text


@dataclasses.dataclass
class Snapshot:
    """What a panel shows, read from the bucket at ``read_at`` (missing objects are empty).

    Attributes:
        trainer: ``metrics/trainer.json`` (empty when missing or refused).
        env: ``metrics/env.json`` (empty when missing or refused).
        statuses: The ``status/<replica>.json`` objects (refused ones left out).
        manifest: The pointer object, or ``None`` (nothing published, or invalid).
        adapters: The LoRA adapter chain's pointer object (:mod:`rlsync.adapters`), or ``None`` (no adapter chain).
        policy: The anchor policy of the control object, or ``None`` if there is none.
        read_at: ``time.time()`` of the read.
        error: A read problem to show (already redacted), or ``""``.
        refused: The objects this read refused (one warning per snapshot): invalid, too large, or status
            objects past :data:`~rlsync.limits.MAX_STATUS_OBJECTS`.
    """

    trainer: TrainerMetrics = dataclasses.field(default_factory=TrainerMetrics)
    env: EnvMetrics = dataclasses.field(default_factory=EnvMetrics)
    statuses: list[ReplicaStatus] = dataclasses.field(default_factory=list)
    manifest: Manifest | None = None
    adapters: Manifest | None = None
    policy: AnchorPolicy | None = None
    read_at: float = 0.0
    error: str = ""
    refused: int = 0


def read_snapshot(bucket: Bucket) -> Snapshot:
    """Read everything the panels show from ``bucket``.

    Bucket errors are logged and reported in :attr:`Snapshot.error`; what could
    be read is still returned. Refused objects are counted in :attr:`Snapshot.refused`;
    the status objects cost bounded time: at most :data:`~rlsync.limits.MAX_STATUS_OBJECTS`
    of them, each refused from its listed size before any download when over
    :data:`~rlsync.limits.MAX_STATUS_BYTES`.
    """
    snap = Snapshot(read_at=time.time())
    refusals = Refusals(log=False)  # one line per snapshot, not one per object
    try:
        snap.trainer = read_metrics(bucket, TrainerMetrics, refusals) or TrainerMetrics()
        snap.env = read_metrics(bucket, EnvMetrics, refusals) or EnvMetrics()
        snap.statuses = _read_statuses(bucket, refusals)
        try:
            snap.manifest = read_manifest(bucket)
        except FormatError as exc:
            snap.error = redact(f"invalid latest.json: {exc}")
            logger.warning("%s", snap.error)
        try:
            snap.adapters = read_manifest(adapter_bucket(bucket))
        except FormatError as exc:
            logger.warning("invalid adapter chain pointer: %s", redact(str(exc)))
        try:
            snap.policy = policy_from_json(bucket.get_limited(CONTROL_KEY, MAX_CONTROL_BYTES))
        except ObjectNotFoundError:
            pass
        except FormatError as exc:
            logger.warning("invalid control object: %s", redact(str(exc)))
    except BucketError as exc:
        snap.error = redact(_missing_bucket(bucket) if _not_found(exc) else f"bucket read failed: {exc}")
        logger.warning("%s: %s", getattr(bucket, "url", "bucket"), snap.error)
    stale = listing_error(bucket)
    if stale and not snap.error:
        snap.error = redact(f"bucket listing failed (showing the last good one): {stale}")
    snap.refused = refusals.total
    if snap.refused:
        logger.warning("the snapshot refused %d objects %s; the last: %s", snap.refused, dict(refusals.counts), refusals.last)
    return snap


def _read_statuses(bucket: Bucket, refusals: Refusals) -> list[ReplicaStatus]:
    """The readable status objects: any over :data:`~rlsync.limits.MAX_STATUS_BYTES` refused from its
    listed size, then the first :data:`~rlsync.limits.MAX_STATUS_OBJECTS` by key read (a flood is one warning)."""
    listed = sorted(bucket.list(STATUS_PREFIX), key=lambda o: o.key)
    large = [o.key for o in listed if o.size > MAX_STATUS_BYTES]
    if large:
        refusals.add(large[0], f"more than the {MAX_STATUS_BYTES:,} bytes allowed", len(large))
    keys = [o.key for o in listed if o.size <= MAX_STATUS_BYTES]
    excess = keys[MAX_STATUS_OBJECTS:]
    if excess:
        refusals.add(excess[0], f"more than {MAX_STATUS_OBJECTS} status objects", len(excess))
    statuses = (read_status(bucket, key, refusals) for key in keys[:MAX_STATUS_OBJECTS])
    return [status for status in statuses if status is not None]


def _not_found(exc: BucketError) -> bool:
    """Whether the Hub answered that the bucket does not exist (or is not this token's to see)."""
    from huggingface_hub.errors import BucketNotFoundError

    return isinstance(exc.__cause__, BucketNotFoundError)


def _missing_bucket(bucket: Bucket) -> str:
    return f"no bucket at {getattr(bucket, 'url', 'this address')} yet (or this token cannot read it): a Start creates it"


class BucketView:
    """A bucket's snapshots, shared by every refresh handler of a process.

    Snapshots are cached for ``ttl`` seconds so that several plots refreshing
    at once read the bucket once. The view also remembers, per replica, the
    apply time seen in its status at each applied version (the status object
    holds only its last 50), to plot every version each replica applied.

    Args:
        url: Bucket URL or path.
        ttl: Seconds a snapshot is reused.
    """

    def __init__(self, url: str, ttl: float = SNAPSHOT_TTL_S) -> None:
        self.url = url
        self.ttl = ttl
        self._bucket: Bucket | None = None
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()
        #: (replica, applied version) -> the sync, from the status objects' ``recent_syncs`` (kept across refreshes)
        self.sync_history: dict[tuple[str, int], Sync] = {}

    @property
    def bucket(self) -> Bucket:
        """The bucket, to read: never created here, as a page view creates nothing (a role's Start does, when its
        token can). Raises :class:`BucketError` while it does not exist."""
        return self.open(create=False)

    def open(self, create: bool) -> Bucket:
        """The bucket, opened once (``create``: an action writing to it, e.g. the anchor policy's Apply, creates a
        missing one)."""
        if self._bucket is None:
            from ..bucket.settings import BucketSettings

            settings = BucketSettings.from_env()  # the panel is an entry point: HF_BUCKET_*, HUB_*
            # on the Hub: listings from the feed, reads only on change
            self._bucket = watch(open_bucket(self.url, create=create, settings=settings), settings.watch)
        return self._bucket

    def snapshot(self) -> Snapshot:
        """A snapshot no older than ``ttl`` seconds."""
        with self._lock:
            now = time.time()
            if self._snapshot is not None and now - self._snapshot.read_at < self.ttl:
                return self._snapshot
            try:
                snap = read_snapshot(self.bucket)
            except BucketError as exc:  # opening the bucket failed
                snap = Snapshot(read_at=now, error=redact(f"cannot open the bucket (a Start creates a missing one): {exc}"))
                logger.warning("%s: %s", self.url, snap.error)
            self._remember_syncs(snap)
            self._snapshot = snap
            return snap

    def close(self) -> None:
        """Stop watching the bucket (a later snapshot opens it again)."""
        with self._lock:
            bucket, self._bucket, self._snapshot = self._bucket, None, None
        close = getattr(bucket, "close", None)
        if close is not None:
            close()

    def _remember_syncs(self, snap: Snapshot) -> None:
        for st in snap.statuses:
            for sync in st.syncs:
                self.sync_history[(st.replica_id, sync.step)] = sync
        if len(self.sync_history) > MAX_SYNC_HISTORY:
            for key in sorted(self.sync_history, key=lambda k: k[1])[: len(self.sync_history) - MAX_SYNC_HISTORY]:
                del self.sync_history[key]


_VIEWS: dict[str, BucketView] = {}
_VIEWS_LOCK = threading.Lock()


def bucket_view(source: BucketSource) -> BucketView:
    """The process-wide :class:`BucketView` of a bucket URL (or of the URL ``source()`` returns)."""
    url = source() if callable(source) else source
    with _VIEWS_LOCK:
        view = _VIEWS.get(url)
        if view is None:
            remote = "://" in url and not url.startswith("file://")
            view = _VIEWS[url] = BucketView(url, ttl=REMOTE_SNAPSHOT_TTL_S if remote else SNAPSHOT_TTL_S)
        return view
