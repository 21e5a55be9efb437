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

By default a send only casts the weights into a staging buffer and returns; a
:class:`~rlsync.protocol.background.BackgroundPublisher` detects, encodes and
uploads while the next step computes (at most one publish in flight; a send while
the worker is behind coalesces into one delta against the last published version).
:meth:`BucketWeightTransfer.flush` waits for it (``destroy`` at train end, and
:class:`~rlsync.trl.FinalWeightSync`, call it), and a publish that failed in the
background is raised by the next send or flush.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Callable, Iterator

import torch

from ..bucket import Bucket
from ..checkpoint_layout import CheckpointLayout
from ..errors import BucketError, NonFiniteError
from ..fp8 import quantize_stream
from ..protocol import Manifest, Publisher, PublishRecord
from ..protocol.background import BackgroundPublisher
from .run_start import start_run

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class PublishFailures:
    """Background publishes that failed (a bucket error after the bucket's own retries), and how many may fail in a
    row before a send raises. Each is logged and counted; the bucket keeps its last good version, and the next
    version is a delta against it.

    Attributes:
        allowed: Failures in a row a send survives.
        total: Failures so far.
        in_a_row: Failures since the last publish that succeeded.
    """

    allowed: int = 3
    total: int = 0
    in_a_row: int = 0

    def survive(self, exc: BucketError) -> None:
        """Count ``exc``; raise it when more than :attr:`allowed` failed in a row."""
        self.total += 1
        self.in_a_row += 1
        if self.in_a_row > self.allowed:
            raise exc
        logger.error("a background publish failed (%d in a row, %d allowed): %s; the bucket keeps its last good "
                     "version and the next version is a delta against it", self.in_a_row, self.allowed, exc)


class BucketWeightTransfer:
    """TRL ``WeightTransferProtocol`` over a bucket :class:`~rlsync.protocol.Publisher`.

    Args:
        bucket: Where to publish (ignored when ``publisher`` is given).
        publisher: The publisher to use (default: ``Publisher(bucket)``, anchor every 10 versions).
        on_publish: Called with the :class:`~rlsync.protocol.PublishRecord` of every publish (figures, logs).
        on_non_finite: Called when a send is refused because it would publish NaN or Inf
            (e.g. to restore the published weights); the send publishes nothing and the
            replicas keep the last good version. Without it the refusal is raised.
        resume_from_checkpoint: The checkpoint the trainer resumes from (the value given to
            ``trainer.train(resume_from_checkpoint=...)``); set, the bucket's run is continued.
        new_run: On a bucket that holds a run and without ``resume_from_checkpoint``, start a
            new run (new run id, its first version an anchor) instead of refusing.
        layout: Where the checkpoint tensors lie in the model's own (a MoE model's fused experts,
            :class:`~rlsync.checkpoint_layout.CheckpointLayout`): the versions are published in
            checkpoint names, one tensor per expert, as views of the tensors TRL streams.
        fp8: The publisher of an FP8 serving chain (:func:`rlsync.fp8.fp8_publisher`): every version
            is also quantized from its bf16 bits as each tensor streams past, and published to
            that chain under the same version number. It continues or starts its run as the bf16
            chain does.
        background: Publish on a worker thread (the default: a send stalls only to cast the weights).
            ``False`` publishes within the send, streaming tensor by tensor (so does a run with an
            ``fp8`` chain, quantized as the tensors stream past).
        on_send: Called with the version number of every send, as it is sent (a background publish
            reaches ``on_publish`` later, at the next send or flush).
        max_failed_publishes: Background publishes that may fail in a row (a bucket error, after the bucket's
            own retries) before a send raises (:class:`PublishFailures`, :attr:`failures`). ``0``: every one raises.

    Runs: :meth:`init_weight_transfer` continues the bucket's run, starts a new one or refuses (:mod:`.run_start`).
    """

    def __init__(
        self,
        bucket: Bucket | None = None,
        *,
        publisher: Publisher | None = None,
        on_publish: Callable[[PublishRecord], None] | None = None,
        on_non_finite: Callable[[NonFiniteError], None] | None = None,
        resume_from_checkpoint: str | os.PathLike[str] | bool | None = None,
        new_run: bool = False,
        layout: CheckpointLayout | None = None,
        fp8: Publisher | None = None,
        background: bool = True,
        on_send: Callable[[int], None] | None = None,
        max_failed_publishes: int = 3,
    ) -> None:
        if publisher is None:
            if bucket is None:
                raise ValueError("give a bucket or a publisher")
            publisher = Publisher(bucket)
        publisher.ownership.new_run = publisher.ownership.new_run or new_run
        self.publisher = publisher
        self.background = BackgroundPublisher(publisher) if background and fp8 is None else None
        self.resume_from_checkpoint = resume_from_checkpoint
        self.on_publish = on_publish
        self.on_send = on_send
        self.on_non_finite = on_non_finite
        self.non_finite_refused = 0
        self.failures = PublishFailures(max_failed_publishes)
        self.records: list[PublishRecord] = []
        self.layout = layout
        self.fp8 = fp8
        self.fp8_records: list[PublishRecord] = []
        self._initialised = False
        #: Without a checkpoint, ``holds_published(pointer)`` tells whether the trainer holds exactly the weights of
        #: the run's newest version (a restart before the first checkpoint: nothing trained was lost), which
        #: continues the run; asked before the run lock is taken.
        self.holds_published: Callable[[Manifest], bool] | None = None

    @property
    def version(self) -> int | None:
        """The newest version sent (``None`` before the first): published, or being published in
        the background (TRL counts a version at its send; a failed one is taken back)."""
        return self.background.version if self.background is not None else self.publisher.step

    @property
    def published_version(self) -> int | None:
        """The newest version in the bucket (``None`` before the first publish): what replicas can
        hold now. It trails :attr:`version` while a background publish is in flight."""
        return self.publisher.step

    def continue_run(self) -> dict[str, torch.Tensor] | None:
        """Take the run lock and continue the bucket's run or start a new one, once (:func:`~.run_start.start_run`).

        Returns:
            The newest published state (serving dtype) on the first call when the bucket's
            run is continued, else ``None``.

        Raises:
            RunExistsError: the bucket holds a run, no checkpoint is resumed from and
                ``new_run`` is off.
            RunLockedError: another trainer holds the run lock.
        """
        if self._initialised:
            return None
        state = start_run(
            self.publisher, self.fp8, resume_from_checkpoint=self.resume_from_checkpoint, holds_published=self.holds_published
        )
        self._initialised = True
        return state

    def init_weight_transfer(self) -> None:
        """Take the run lock; continue the bucket's run or start a new one (TRL calls this at train begin).

        Raises:
            RunExistsError, RunLockedError: as :meth:`continue_run`.
        """
        self.continue_run()

    def pause(self) -> None:
        """Nothing to pause: replicas pause themselves only to apply a version."""

    def resume(self) -> None:
        """Nothing to resume (see :meth:`pause`)."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publish the next version from ``(name, tensor)`` pairs, one tensor at a time.

        Raises:
            RunExistsError: as :meth:`continue_run`.
            SyncError, RunLockedError, FencedError, BucketError: as :meth:`Publisher.publish_stream`.
        """
        self.continue_run()
        pairs = self.layout.stream(iterator) if self.layout is not None else iterator
        if self.fp8 is not None:
            self._send_with_fp8(pairs)
        elif self.background is None:
            self._publish(lambda step: [self.publisher.publish_stream(step, pairs)])
        else:
            background = self.background
            self._publish(lambda step: self._stage(background, pairs))

    def _stage(self, background: BackgroundPublisher, pairs: Iterator[tuple[str, torch.Tensor]]) -> list[PublishRecord]:
        """Stage the version; a background publish that failed since the last send is raised here once, nothing
        staged: :attr:`failures` decides whether to go on (this version is then staged after it)."""
        try:
            return background.stage(pairs)[1]
        except BucketError as exc:
            self.failures.survive(exc)
            return background.stage(pairs)[1]

    def _send_with_fp8(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Publish the bf16 version within the send, quantizing each tensor for the FP8 chain as it streams
        past, then the FP8 version under the same version number."""
        quantized: list[tuple[str, torch.Tensor]] = []
        stream = _quantizing(pairs, self.publisher, quantized)
        record = self._publish(lambda step: [self.publisher.publish_stream(step, stream)])
        if record is not None:
            self.fp8_records.append(self.fp8.publish_stream(record.step, quantized))
            del self.fp8_records[:-100]

    def flush(self) -> None:
        """Wait for the background publish, if any (TRL's final sync, a trainer stopping).

        Raises:
            As :meth:`send_weights`: what a background publish raised.
        """
        if self.background is not None:
            self._publish(lambda step: self.background.flush(), send=False)

    def close(self) -> None:
        """:meth:`flush`, then stop the background worker and free its staging buffer (the worker
        stops even when the flush raises). A closed transfer publishes within the send.

        Raises:
            As :meth:`flush`.
        """
        background, self.background = self.background, None
        if background is not None:
            self._publish(lambda step: background.close(), send=False)

    def _publish(self, publish: Callable[[int], list[PublishRecord]], *, send: bool = True) -> PublishRecord | None:
        """Run ``publish`` for the next version; keep the records it returns (the last is returned),
        or hand a non-finite refusal (of this publish or of a background one) to ``on_non_finite``.
        A ``send`` tells ``on_send`` the version it gave the weights (before any record of it)."""
        step = self.publisher.next_step
        try:
            records = publish(step)
        except NonFiniteError as exc:
            if self.on_non_finite is None:
                raise
            self.non_finite_refused += 1
            self.on_non_finite(exc)
            return None
        if send and self.on_send is not None and self.version is not None:
            self.on_send(self.version)
        if records:
            self.failures.in_a_row = 0
        for record in records:
            self.records.append(record)
            del self.records[:-100]
            if self.on_publish is not None:
                self.on_publish(record)
        return records[-1] if records else None

    def heartbeat(self) -> None:
        """Keep the run lock fresh while no version is published (e.g. while waiting for rollouts)."""
        self.publisher.heartbeat()

    def destroy(self) -> None:
        """Wait for the background publish (TRL calls this at train end; a failure is logged and
        counted, as it may end a run that is already failing). The run lock stays with this owner,
        so a restart takes over at once."""
        try:
            self.flush()
        except Exception as exc:  # the background publisher logged and counted it
            logger.error("the last background publish failed: %s", exc)


def _quantizing(
    pairs: Iterator[tuple[str, torch.Tensor]], publisher: Publisher, out: list[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``pairs`` passed through, each tensor quantized for the FP8 chain into ``out`` as it streams past (in the
    publisher's serving dtype, once it has one)."""
    for name, tensor in pairs:
        yield name, tensor
        out.extend(quantize_stream([(name, tensor)], publisher.dtype or tensor.dtype))
