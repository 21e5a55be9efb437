"""A publisher's run: the chain it writes and the run it owns, under one lock.

:class:`PublisherRun`, a :class:`~rlsync.protocol.Publisher`'s base, builds the publisher's
:class:`~rlsync.protocol.ownership.RunOwnership` (the run lock, fencing, new runs, checkpoint pins) and
:class:`~rlsync.protocol.writer.ChainWriter` (the versions' objects, the pointer), answers what was published
last and what comes next, and runs the checks before each publish. Its lock serializes a background publish
with the calls other threads make (a checkpoint pin, a new run).
"""

from __future__ import annotations

import collections
import functools
import socket
import threading
from typing import Any, Callable, TypeVar

from ..bucket import Bucket
from ..errors import SyncError
from .manifest import Manifest
from .ownership import RunOwnership
from .policy import AnchorPolicy, FixedInterval
from .writer import ChainWriter

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _serialized(method: _Method) -> _Method:
    """Run ``method`` under the publisher's lock: a background publish and a checkpoint pin from
    another thread never interleave their reads and writes of the chain."""

    @functools.wraps(method)
    def locked(self: "PublisherRun", *args: Any, **kwargs: Any) -> Any:
        with self._mutex:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


class PublisherRun:
    """The run and the chain of one publisher.

    Args:
        bucket, policy, keep_anchors, codec, max_shard_bytes, run_id, owner, lock_ttl_s, new_run: As
            :class:`~rlsync.protocol.Publisher`.
    """

    def __init__(
        self, bucket: Bucket, *, policy: AnchorPolicy | None, keep_anchors: int, codec: str, max_shard_bytes: int,
        run_id: str, owner: str | None, lock_ttl_s: float, new_run: bool,
    ) -> None:  # fmt: skip
        self.bucket = bucket
        self.policy = policy or FixedInterval()
        self.refused: collections.Counter[str] = collections.Counter()  # invalid bucket objects ignored, by key
        self.ownership = RunOwnership(
            bucket, owner=owner or socket.gethostname(), lock_ttl_s=lock_ttl_s,
            new_run=new_run, refused=self.refused, run_id=run_id,
        )  # fmt: skip
        self.writer = ChainWriter(
            bucket, self.ownership, codec=codec, max_shard_bytes=max_shard_bytes, keep_anchors=keep_anchors
        )
        self._mutex = threading.RLock()  # see _serialized

    @property
    def manifest(self) -> Manifest | None:
        """The pointer published (or resumed) last; ``None`` before the first publish."""
        return self.writer.manifest

    @property
    def step(self) -> int | None:
        """The last published step, or ``None``."""
        return self.manifest.step if self.manifest else None

    @property
    def next_step(self) -> int:
        """The version the next publish should have (:meth:`RunOwnership.next_step`)."""
        return self.ownership.next_step(self.step)

    @property
    def replaced_step(self) -> int | None:
        """The newest version of the run this new run replaced (``None``: not a new run over one)."""
        return self.ownership.floor

    def heartbeat(self) -> None:
        """Refresh the run lock's heartbeat (while training without publishing; never waits for a publish)."""
        self.ownership.heartbeat()

    @_serialized
    def start_new_run(self) -> Manifest | None:
        """Replace the bucket's run (if any) by a new one at the next publish (:meth:`RunOwnership.start_new_run`)."""
        return self.ownership.start_new_run()

    @_serialized
    def pin_checkpoint(self, step: int, weights_hash: str) -> None:
        """Record a training checkpoint's weights hash in the pointer (:meth:`RunOwnership.pinned`),
        so a restart can tell it from a planted one.

        Raises:
            SyncError: nothing is published yet.
            FencedError, BucketError: as :meth:`~rlsync.protocol.Publisher.publish`.
        """
        if self.manifest is None:
            raise SyncError("pin_checkpoint before the first publish")
        self.writer.commit(self.ownership.pinned(self.manifest, step, weights_hash))

    def _prepare(self, step: int) -> bool:
        """The run's checks before every publish (:meth:`RunOwnership.check_publish`); whether the policy,
        an empty chain or a full pointer (:attr:`ChainWriter.pointer_full`) asks for an anchor."""
        self.ownership.check_publish(self.manifest, step)
        return self.manifest is None or self.policy.wants_anchor(self.manifest) or self.writer.pointer_full
