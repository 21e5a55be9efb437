"""Which task batch a replica takes next, and its claim on it.

Each replica takes the oldest task batch that no replica has answered or claimed, and claims it
(``claims/<batch>/<replica>.json``, :func:`rlsync.layout.claim_key`) before generating it, so that a
fleet spreads batches over its members without a coordinator and no batch is generated twice: two
answers of one batch are twice its samples at one policy version, more than the trainer can take
before they go stale (issue 31: a third of the scored samples expired).

Buckets have no compare-and-swap. After writing its claim a replica lists the batch's claims and
withdraws if another one is there: two that write at the same moment both withdraw and take a batch
at their next turn (counted in :attr:`BatchClaims.lost`); one that writes after the other's claim is
listed yields. A replica that stops, or fails to write its answer, withdraws its claim
(:meth:`BatchClaims.release`); one that dies
leaves it, and the others ignore a claim older than :data:`CLAIM_TIMEOUT_S` that was never answered.
The env prunes claims with their batch.
"""

from __future__ import annotations

import logging
import time

from rlsync.bucket import Bucket
from rlsync.errors import BucketError
from rlsync.layout import CLAIMS_PREFIX, ROLLOUTS_PREFIX, SCORES_PREFIX, TASKS_PREFIX, claim_key, replica_of
from rlsync.spaces.exchange import list_batches, put_json

logger = logging.getLogger(__name__)

#: Seconds after which another replica's claim on a batch it never answered is ignored (it stopped or died).
CLAIM_TIMEOUT_S = 120.0


class BatchClaims:
    """The batches one replica takes and claims (see the module docstring).

    Args:
        bucket: The run's bucket.
        replica_id: The replica's id (its claims' key).
    """

    def __init__(self, bucket: Bucket, replica_id: str) -> None:
        self.bucket = bucket
        self.replica_id = replica_id
        self.done: set[int] = set()  # batches this replica took (answered, or found unusable)
        self.claimed: int | None = None  # the batch it claimed and has not answered yet
        self.lost = 0  # claims withdrawn because another replica's was there
        self._seen: dict[int, float] = {}  # batch -> when another replica's claim on it was first seen

    def next_batch(self) -> int | None:
        """The oldest task batch that nobody has answered or claimed (a claim older than
        :data:`CLAIM_TIMEOUT_S` without an answer does not count) and this replica has not taken."""
        answered = set(list_batches(self.bucket, ROLLOUTS_PREFIX)) | set(list_batches(self.bucket, SCORES_PREFIX))
        claimed = {b for b, keys in list_batches(self.bucket, CLAIMS_PREFIX).items()
                   if any(replica_of(k) != self.replica_id for k in keys)}  # fmt: skip
        now = time.monotonic()
        self._seen = {b: t for b, t in self._seen.items() if b in claimed}
        for batch in sorted(list_batches(self.bucket, TASKS_PREFIX)):
            if batch in answered or batch in self.done:
                continue
            if batch in claimed and now - self._seen.setdefault(batch, now) < CLAIM_TIMEOUT_S:
                continue
            return batch
        return None

    def claim(self, batch: int) -> bool:
        """Claim ``batch``; ``False`` (and this replica's claim withdrawn) when another replica's claim is there
        and has not timed out."""
        key = claim_key(batch, self.replica_id)
        put_json(self.bucket, key, {"replica": self.replica_id, "batch": batch, "claimed_at": time.time()})
        others = [k for k in list_batches(self.bucket, CLAIMS_PREFIX).get(batch, []) if k != key]
        if others and batch not in self._seen:
            self.bucket.delete([key])
            self.lost += 1
            return False
        self.claimed = batch
        return True

    def taken(self, batch: int) -> None:
        """This replica took ``batch``: it will not take it again (answered, or its task object unusable)."""
        self.done.add(batch)

    def answered(self) -> None:
        """The claimed batch's answer is written: the claim has done its job (the env prunes it with the batch)."""
        self.claimed = None

    def release(self) -> None:
        """Withdraw the claim of a batch this replica will not answer (it stops, or writing its answer failed)."""
        if self.claimed is None:
            return
        try:
            self.bucket.delete([claim_key(self.claimed, self.replica_id)])
        except BucketError as exc:
            logger.warning("replica %s: could not withdraw its claim: %s", self.replica_id, exc)
        self.claimed = None
