"""Fencing one trainer's writes into a run: the run lock taken once and checked before every write (its
heartbeat refreshed), and the pointer checked to name only versions this trainer wrote."""

from __future__ import annotations

import collections
import dataclasses
import time

from ..bucket import Bucket
from ..errors import FencedError, FormatError
from ..layout import LOCK_KEY
from .lock import DEFAULT_LOCK_TTL_S, RunLock, acquire, check_fence, write_lock
from .manifest import Manifest
from .run import highest_epoch, read_manifest


class RunFence:
    """The run lock as one trainer holds it, and the versions it wrote.

    Args:
        bucket: The run's bucket.
        owner: Stable id of this trainer (a restart with the same id takes the lock over at
            once; another id is refused while the lock is fresh).
        lock_ttl_s: Age after which another owner's lock may be taken over.
        refused: Where invalid bucket objects met on the way are counted, by key.
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        owner: str,
        lock_ttl_s: float = DEFAULT_LOCK_TTL_S,
        refused: collections.Counter[str] | None = None,
    ) -> None:
        self.bucket = bucket
        self.owner = owner
        self.lock_ttl_s = lock_ttl_s
        self.refused = refused if refused is not None else collections.Counter()
        self.lock: RunLock | None = None
        #: (step, hash) of the pointers this trainer wrote or tried to write.
        self.written: set[tuple[int, str]] = set()

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
            floor = highest_epoch(self.bucket, self.refused)
            self.lock = acquire(self.bucket, self.owner, self.lock_ttl_s, floor=floor, refused=self.refused)
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
