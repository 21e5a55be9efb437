"""TRL weight transfer that publishes through the bucket instead of NCCL.

:class:`BucketWeightTransfer` implements TRL's ``WeightTransferProtocol``
(``trl.experimental.async_grpo``): ``AsyncGRPOTrainer`` calls
``init_weight_transfer`` once, then ``pause``, ``send_weights``, ``resume`` at
train begin and every ``weight_sync_steps`` optimizer steps, and ``destroy`` at
train end. Each ``send_weights`` becomes one version in the bucket (an anchor
or a sparse bf16 delta, as the :class:`~rlsync.protocol.Publisher`'s anchor
policy decides), streamed tensor by tensor as TRL's iterator yields them.

Replicas anywhere follow the bucket with a :class:`~rlsync.protocol.Subscriber`,
so ``pause`` and ``resume`` do nothing here: a replica pauses its own engine
only while applying a version.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator

import torch

from ..bucket import Bucket
from ..protocol import NonFiniteError, Publisher, PublishRecord

logger = logging.getLogger(__name__)


class BucketWeightTransfer:
    """TRL ``WeightTransferProtocol`` over a bucket :class:`~rlsync.protocol.Publisher`.

    Args:
        bucket: Where to publish (ignored when ``publisher`` is given).
        publisher: The publisher to use (default: ``Publisher(bucket)``, anchor every 10 versions).
        on_publish: Called with the :class:`~rlsync.protocol.PublishRecord` of every publish (figures, logs).
        on_non_finite: Called when a send is refused because it would publish NaN or Inf
            (e.g. to restore the published weights); the send publishes nothing and the
            replicas keep the last good version. Without it the refusal is raised.

    Versions: on an empty bucket the first send is version 0; on a bucket that already holds
    a run, :meth:`init_weight_transfer` takes the run lock, verifies the published chain and
    the sends continue after its newest version, so none is reused or skipped.
    """

    def __init__(
        self,
        bucket: Bucket | None = None,
        *,
        publisher: Publisher | None = None,
        on_publish: Callable[[PublishRecord], None] | None = None,
        on_non_finite: Callable[[NonFiniteError], None] | None = None,
    ) -> None:
        if publisher is None:
            if bucket is None:
                raise ValueError("give a bucket or a publisher")
            publisher = Publisher(bucket)
        self.publisher = publisher
        self.on_publish = on_publish
        self.on_non_finite = on_non_finite
        self.non_finite_refused = 0
        self.records: list[PublishRecord] = []
        self._initialised = False

    @property
    def version(self) -> int | None:
        """The newest published version (``None`` before the first publish)."""
        return self.publisher.step

    def continue_run(self) -> dict[str, torch.Tensor] | None:
        """Take the run lock and continue the bucket's run, if any (idempotent).

        Returns:
            The newest published state (serving dtype) on the first call when the bucket
            holds a run, else ``None``.

        Raises:
            RunLockedError: another trainer holds the run lock.
        """
        if self._initialised:
            return None
        state = self.publisher.resume()
        self._initialised = True
        if state is not None:
            logger.info("continuing the bucket's run after version %d", self.publisher.step)
        return state

    def init_weight_transfer(self) -> None:
        """Take the run lock; continue version numbers from the bucket (TRL calls this at train begin)."""
        self.continue_run()

    def pause(self) -> None:
        """Nothing to pause: replicas pause themselves only to apply a version."""

    def resume(self) -> None:
        """Nothing to resume (see :meth:`pause`)."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publish the next version from ``(name, tensor)`` pairs, one tensor at a time.

        Raises:
            SyncError, RunLockedError, FencedError, BucketError: as :meth:`Publisher.publish_stream`.
        """
        self.continue_run()
        self._publish(lambda step: self.publisher.publish_stream(step, iterator))

    def _publish(self, publish: Callable[[int], PublishRecord]) -> PublishRecord | None:
        """Run ``publish`` for the next version; keep its record, or hand a non-finite refusal to ``on_non_finite``."""
        step = 0 if self.publisher.step is None else self.publisher.step + 1
        try:
            record = publish(step)
        except NonFiniteError as exc:
            if self.on_non_finite is None:
                raise
            self.non_finite_refused += 1
            self.on_non_finite(exc)
            return None
        self.records.append(record)
        del self.records[:-100]
        if self.on_publish is not None:
            self.on_publish(record)
        return record

    def heartbeat(self) -> None:
        """Keep the run lock fresh while no version is published (e.g. while waiting for rollouts)."""
        self.publisher.heartbeat()

    def destroy(self) -> None:
        """Nothing to release: the run lock stays with this owner, so a restart takes over at once."""
