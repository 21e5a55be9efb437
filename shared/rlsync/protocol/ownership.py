"""Who may write a run: the run lock, fencing, epochs and new runs of one publishing trainer.

A :class:`~rlsync.protocol.Publisher` owns one :class:`RunOwnership`. It takes the run lock
before the first write, checks before every commit that the lock is still its own (fencing)
and that the pointer names only versions it wrote, and decides what happens on a bucket that
already holds a run: continue it (``resume``), start a new one (``new_run``), or refuse.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time

from ..bucket import Bucket
from ..errors import FencedError, FormatError, SyncError
from ..layout import LOCK_KEY
from .lock import DEFAULT_LOCK_TTL_S, RunLock, acquire, check_fence, write_lock
from .manifest import Manifest
from .run import new_run_id, read_manifest, run_exists_error

logger = logging.getLogger(__name__)


class RunOwnership:
    """The run lock and the run identity of one publishing trainer.

    Args:
        bucket: The run's bucket.
        owner: Stable id of this trainer (a restart with the same id takes the lock over at
            once; another id is refused while the lock is fresh).
        lock_ttl_s: Age after which another owner's lock may be taken over.
        new_run: On a bucket that holds a run this trainer does not continue, start a new run
            at the first publish instead of refusing with :class:`~rlsync.errors.RunExistsError`.
        refused: Where invalid bucket objects met on the way are counted, by key.
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        owner: str,
        lock_ttl_s: float = DEFAULT_LOCK_TTL_S,
        new_run: bool = False,
        refused: collections.Counter[str] | None = None,
    ) -> None:
        self.bucket = bucket
        self.owner = owner
        self.lock_ttl_s = lock_ttl_s
        self.new_run = new_run
        self.refused = refused if refused is not None else collections.Counter()
        self.lock: RunLock | None = None
        #: (step, hash) of the pointers this trainer wrote or tried to write.
        self.written: set[tuple[int, str]] = set()
        #: The newest version of the run a new run replaces.
        self.floor: int | None = None
        #: Whether the bucket's run was adopted (resumed) or replaced (a new run) already.
        self.settled = False

    @property
    def epoch(self) -> int:
        """The epoch of the held lock (the keys this trainer writes carry it)."""
        assert self.lock is not None, "the run lock is taken before anything is written"
        return self.lock.epoch

    def claim(self) -> None:
        """Take the run lock once; after that, check that it is still ours (:meth:`fence`).

        Raises:
            RunLockedError: another trainer holds a fresh lock.
            FencedError: the lock was taken over since.
        """
        if self.lock is None:
            self.lock = acquire(self.bucket, self.owner, self.lock_ttl_s, floor=self._highest_epoch())
        else:
            self.fence()

    def fence(self) -> None:
        """Check the run lock is still ours; an unreadable lock object is written again and counted.

        Raises:
            FencedError: another owner or epoch holds the lock.
        """
        assert self.lock is not None
        held = check_fence(self.bucket, self.lock)
        if held is not self.lock:
            self.refused[LOCK_KEY] += 1
            self.lock = held

    def heartbeat(self) -> None:
        """Refresh the lock's heartbeat (while training without publishing for long)."""
        if self.lock is not None:
            self.fence()
            self.lock = dataclasses.replace(self.lock, heartbeat=time.time())
            write_lock(self.bucket, self.lock)

    def _highest_epoch(self) -> int:
        """The highest run-lock epoch the pointer's files were written under (0 without a readable pointer),
        so that a trainer taking a run whose lock object was deleted never reuses a writer's epoch."""
        try:
            manifest = read_manifest(self.bucket)
        except FormatError:
            return 0
        return max(manifest.epochs()) if manifest else 0

    def adopt(self, manifest: Manifest | None) -> None:
        """Continue the bucket's run at ``manifest`` (after a resume)."""
        self.settled = True
        self.written = {(manifest.step, manifest.state_hash)} if manifest is not None else set()

    def settle(self, run_id: str) -> str:
        """Before the first publish of a trainer that neither resumed nor started a new run: refuse to
        publish over the bucket's run, or replace it when ``new_run`` is set.

        Args:
            run_id: The run id the trainer asked for (may be empty).

        Returns:
            The run id to publish under.

        Raises:
            RunExistsError: the bucket holds a run and ``new_run`` is off.
        """
        if self.settled:
            return run_id
        existing = read_manifest(self.bucket)
        if existing is not None and not self.new_run:
            raise run_exists_error(self.bucket, existing)
        if existing is not None:
            return self.start_new_run(run_id)[1]
        return run_id

    def start_new_run(self, run_id: str) -> tuple[Manifest | None, str]:
        """Take the run lock and start a new run, replacing the bucket's run (if any) at the next publish.

        Args:
            run_id: The new run's id; empty for a fresh :func:`~rlsync.protocol.run.new_run_id`.

        Returns:
            The replaced run's pointer (``None`` on an empty bucket) and the new run id.

        Raises:
            SyncError: ``run_id`` is the old run's id.
            RunLockedError: another trainer holds the run lock.
        """
        self.settled = True
        self.claim()
        old = read_manifest(self.bucket)
        if old is not None and run_id and run_id == old.run_id:
            raise SyncError(f"a new run needs another run id than the bucket's run {old.run_id!r}")
        run_id = run_id or new_run_id()
        if old is not None:
            self.floor = old.step
            self.written = {(old.step, old.state_hash)}
            logger.warning(
                "starting new run %r after run %r (version %d): its first publish is an anchor, version %d",
                run_id, old.run_id, old.step, old.step + 1,
            )  # fmt: skip
        return old, run_id

    def check_pointer(self, published: Manifest | None) -> None:
        """Refuse to write when the pointer names a version this trainer did not write.

        A trainer taken over while its publish was in flight can land that pointer after the
        new trainer resumed; publishing on would overwrite the objects it names. An unreadable
        pointer (an upload cut short) is ours to rewrite.

        Args:
            published: What this trainer last published (``None``: nothing yet, nothing to check).

        Raises:
            FencedError: the pointer moved to a version this trainer did not publish.
        """
        if published is None:
            return
        try:
            current = read_manifest(self.bucket, uncached=True)  # a watched bucket's cached pointer may be stale
        except FormatError:
            return
        if current is None or (current.step, current.state_hash) in self.written:
            return
        raise FencedError(
            f"{self.bucket.url}: the pointer names step {current.step}, which this trainer did not publish "
            f"(its last was {published.step}); another trainer wrote into the chain; resume() before publishing"
        )

    def before_commit(self, published: Manifest | None, pruned: Manifest) -> None:
        """Right before the pointer for ``pruned`` is written: the lock is still ours (the data may
        have taken long to upload), and both the published and the new version count as ours (a put
        that failed may still have landed).

        Raises:
            FencedError: the lock was taken over during the upload.
        """
        if self.lock is not None:
            self.fence()
        self.written = {(published.step, published.state_hash)} if published is not None else set()
        self.written.add((pruned.step, pruned.state_hash))
