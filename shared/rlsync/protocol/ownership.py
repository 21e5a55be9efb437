"""Who may write a run: the run lifecycle of one publishing trainer.

A :class:`~rlsync.protocol.Publisher` owns one :class:`RunOwnership`, which holds everything about
the run apart from encoding and committing versions: the run lock (taken before the first write),
fencing (before every commit, the lock is still its own and the pointer names only versions it
wrote; :class:`~.fence.RunFence`, its base), the run's identity and epochs, what happens on a bucket that already holds a run (continue
it with :meth:`~RunOwnership.resume`, start a new one, or refuse), the heartbeat and checkpoint pins.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Mapping

from ..bucket import Bucket
from ..errors import SyncError
from ..layout import MAX_STEP
from .fence import RunFence
from .lock import DEFAULT_LOCK_TTL_S
from .manifest import MAX_CHECKPOINT_PINS, CheckpointPin, Manifest
from .run import base_step, check_takeover, check_writable, new_run_id, read_manifest, run_exists_error
from .subscriber import Subscriber

logger = logging.getLogger(__name__)


class RunOwnership(RunFence):
    """The run identity and the run's lifecycle of one publishing trainer, on its fence (:class:`~.fence.RunFence`:
    the run lock, the versions it wrote).

    Args:
        bucket, owner, lock_ttl_s, refused: As :class:`~.fence.RunFence`.
        new_run: On a bucket that holds a run this trainer does not continue, start a new run
            at the first publish instead of refusing with :class:`~rlsync.errors.RunExistsError`.
        run_id: The run's id (empty: a fresh :func:`~rlsync.protocol.run.new_run_id` when a run
            starts; a resumed run keeps its own).
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        owner: str,
        lock_ttl_s: float = DEFAULT_LOCK_TTL_S,
        new_run: bool = False,
        refused: collections.Counter[str] | None = None,
        run_id: str = "",
    ) -> None:
        super().__init__(bucket, owner=owner, lock_ttl_s=lock_ttl_s, refused=refused)
        self.new_run = new_run
        self.run_id = run_id
        #: The newest version of the run a new run replaces.
        self.floor: int | None = None
        #: Whether the bucket's run was adopted (resumed) or replaced (a new run) already.
        self.settled = False

    def next_step(self, published: int | None) -> int:
        """The version the next publish should have: after ``published`` (the last published step), or
        after the replaced run's newest version for a new run (version numbers never go back)."""
        if published is not None:
            return published + 1
        return 0 if self.floor is None else self.floor + 1

    def open_run(self) -> Manifest | None:
        """Take the run lock to continue the bucket's run, and read its pointer.

        Raises:
            RunLockedError: another trainer holds the run lock.
            SyncError: the run is in an older format version.
        """
        self.settled = True
        self.claim()
        manifest = read_manifest(self.bucket)
        if manifest is not None:
            check_writable(manifest)
        return manifest

    def resume(self, metadata: Mapping[str, str]) -> tuple[Manifest, Subscriber] | None:
        """Continue the bucket's run: take the run lock, check every file its pointer names, and replay its
        newest chain with a :class:`~rlsync.protocol.Subscriber`, verifying every hash.

        Args:
            metadata: The chain's metadata the trainer publishes (empty: any).

        Returns:
            The run's pointer and the subscriber holding its last version, or ``None`` for an empty bucket.

        Raises:
            FormatError: the pointer names a file the bucket lacks, or of another size.
            SyncError: the chain's metadata differs, or the bucket changed while resuming.
            RunLockedError: another trainer holds the run lock.
        """
        manifest = self.open_run()
        if manifest is None:
            return None
        check_takeover(self.bucket, manifest, metadata)
        sub = Subscriber(self.bucket)
        sub.sync()
        if sub.step != manifest.step:
            manifest = read_manifest(self.bucket)  # a version landed meanwhile; not expected with one trainer
            if manifest is None or sub.step != manifest.step:
                raise SyncError("the bucket changed while resuming; is another trainer publishing?")
        self.adopt(manifest)
        logger.info("resumed at step %d (hash %s)", manifest.step, manifest.state_hash[:12])
        return manifest, sub

    def adopt(self, manifest: Manifest | None) -> None:
        """Continue the bucket's run at ``manifest`` (after a resume); keep its run id unless one was given."""
        self.settled = True
        self.written = {(manifest.step, manifest.state_hash)} if manifest is not None else set()
        if manifest is not None:
            self.run_id = self.run_id or manifest.run_id

    def settle(self) -> None:
        """Before the first publish of a trainer that neither resumed nor started a new run: refuse to
        publish over the bucket's run, or replace it when ``new_run`` is set.

        Raises:
            RunExistsError: the bucket holds a run and ``new_run`` is off.
        """
        if self.settled:
            return
        existing = read_manifest(self.bucket)
        if existing is not None and not self.new_run:
            raise run_exists_error(self.bucket, existing)
        if existing is not None:
            self.start_new_run()

    def start_new_run(self) -> Manifest | None:
        """Take the run lock and start a new run, replacing the bucket's run (if any) at the next publish.

        The new run gets a new run id (``run_id`` if given and different from the old one) and
        its first publish is an anchor whose version follows the old run's newest, so replicas
        see the run change, log it and re-bootstrap from that anchor. Retention then deletes the
        old run's anchors and deltas.

        Returns:
            The replaced run's pointer, or ``None`` on an empty bucket.

        Raises:
            SyncError: ``run_id`` is the old run's id.
            RunLockedError: another trainer holds the run lock.
        """
        self.settled = True
        self.claim()
        old = read_manifest(self.bucket)
        if old is not None and self.run_id and self.run_id == old.run_id:
            raise SyncError(f"a new run needs another run id than the bucket's run {old.run_id!r}")
        self.run_id = self.run_id or new_run_id()
        if old is not None:
            self.floor = base_step(self.bucket, old, self.refused)
            self.written = {(old.step, old.state_hash)}
            logger.warning(
                "starting new run %r after run %r (version %d): its first publish is an anchor, version %d",
                self.run_id, old.run_id, old.step, self.next_step(None),
            )  # fmt: skip
        return old

    def check_publish(self, published: Manifest | None, step: int) -> None:
        """The run's checks before every publish of version ``step`` after ``published`` (``None``: the first).

        Raises:
            SyncError: ``step`` does not advance, or is past :data:`~rlsync.layout.MAX_STEP`.
            RunExistsError, RunLockedError, FencedError: as :meth:`settle`, :meth:`claim`, :meth:`check_pointer`.
        """
        if published is None:
            self.settle()
        self.claim()
        self.check_pointer(published)
        next_step = self.next_step(published.step if published else None)
        if step > MAX_STEP:
            raise SyncError(f"version {step} is past the largest a key holds ({MAX_STEP}); publish to a new bucket")
        if step < next_step:
            raise SyncError(
                f"step {step} does not advance past the published step {next_step - 1}"
                + (" of the run this new run replaces (versions never go back; see next_step)" if published is None else "")
            )

    def pinned(self, published: Manifest, step: int, weights_hash: str) -> Manifest:
        """``published`` with a training checkpoint's weights hash pinned (the newest ``MAX_CHECKPOINT_PINS``
        are kept), once the run lock and the pointer are checked to be this trainer's.

        Raises:
            RunLockedError, FencedError: as :meth:`claim` and :meth:`check_pointer`.
        """
        self.claim()
        self.check_pointer(published)
        pins = tuple(p for p in published.checkpoints if p.step < step) + (CheckpointPin(step, weights_hash),)
        return dataclasses.replace(published, checkpoints=pins[-MAX_CHECKPOINT_PINS:])

