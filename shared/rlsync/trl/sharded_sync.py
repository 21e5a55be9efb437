"""Sharded weight sync for TRL's ``AsyncGRPOTrainer`` under FSDP2: every rank publishes its own shards.

TRL 1.16 syncs weights in ``AsyncGRPOTrainer._sync_weight_merged`` (on every rank,
between two ``accelerator.wait_for_everyone()`` barriers):

- rank 0 calls ``weight_transfer.send_weights(self._streaming_iter())``;
- every other rank runs ``for _ in self._streaming_iter(): pass``;

and ``_streaming_iter`` calls ``full_tensor()`` on each DTensor parameter, an
all-gather of the whole model that every rank joins, parameter by parameter.

:class:`ShardedWeightTransfer` replaces only that generator. :meth:`~ShardedWeightTransfer.attach`
sets the trainer's ``_streaming_iter`` (an instance attribute, on every rank) to one
that joins a collective :class:`~rlsync.protocol.sharded.ShardedPublisher` publish of
this rank's local shards and yields nothing; rank 0's ``send_weights`` runs the same
publish and leaves its iterator unread. No rank gathers a parameter, pauses, barriers,
version bumps and the rollout worker's model version stay TRL's own, and
:class:`~rlsync.trl.FinalWeightSync` (which calls ``_sync_weight``) publishes the last
steps the same way.

By default each rank publishes in the background
(:class:`~rlsync.protocol.sharded_background.ShardedBackgroundPublisher`): a sync stalls every
rank only to cast its own shards into a staging buffer and to agree, in one tiny all-reduce,
whether the workers are free; the collective publish runs on each rank's worker thread over a
process group of its own while the next step computes. Give
:class:`~rlsync.trl.FinalWeightSync` the transfer (``FinalWeightSync(trainer, transfer)``) so that
every rank flushes at train end: TRL hands the transfer to rank 0 only.

TRL internals relied on (checked by tests/library/trl/test_trl_sharded.py on the pinned TRL):
``_sync_weight_merged`` calling ``self._streaming_iter()`` on every rank and handing
it to ``send_weights`` on the main process only; ``_iter_vllm_named_params`` (the
published names: the same as the gathered path's); ``accelerator.unwrap_model``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator

import torch
from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

from ..bucket import Bucket
from ..protocol import PublishRecord
from ..protocol.sharded import ShardedPublisher
from ..protocol.sharded_background import ShardedBackgroundPublisher, publish_group
from .weight_transfer import BucketWeightTransfer

logger = logging.getLogger(__name__)


class ShardedWeightTransfer(BucketWeightTransfer):
    """TRL ``WeightTransferProtocol`` that publishes from every FSDP2 rank's own shards, gathering nothing.

    Build it on every rank (after the process group exists), pass it as
    ``weight_transfer=`` (TRL keeps it on the main process only) and call
    :meth:`attach` on every rank::

        transfer = ShardedWeightTransfer(bucket)
        trainer = AsyncGRPOTrainer(..., weight_transfer=transfer)
        transfer.attach(trainer)

    Args:
        bucket: Where to publish (every rank needs write access; ignored when ``publisher`` is given).
        publisher: The :class:`ShardedPublisher` to use (default: ``ShardedPublisher(bucket)``, on
            a process group of its own, :func:`~rlsync.protocol.sharded_background.publish_group`,
            when ``background``). With ``background`` it must be built on such a group.
        background: Publish on a worker thread on every rank (the default): a sync stalls only
            for the cast of this rank's shards and a tiny all-reduce. ``False`` publishes within
            the sync, every rank taking part in the publish's collectives.
        **callbacks: ``on_publish`` and ``on_non_finite``, as for :class:`BucketWeightTransfer`,
            called on every rank (a sync that would publish NaN or Inf from any rank's shards is
            refused on every rank; in the background, at the next sync or flush).

    Versions continue from the bucket at the first sync (a collective, so not in
    ``init_weight_transfer``, which TRL calls on the main process only); a resumed run
    publishes an anchor first, as :meth:`ShardedPublisher.resume` explains.
    """

    def __init__(
        self, bucket: Bucket | None = None, *, publisher: ShardedPublisher | None = None, background: bool = True,
        **callbacks: Any,
    ) -> None:  # fmt: skip
        if publisher is None and bucket is not None:
            publisher = ShardedPublisher(bucket, group=publish_group() if background else None)
        super().__init__(bucket, publisher=publisher, background=False, **callbacks)
        self.background = ShardedBackgroundPublisher(self.publisher) if background else None  # type: ignore[assignment,arg-type]
        self._trainer: Any = None

    def attach(self, trainer: Any) -> None:
        """Route ``trainer``'s weight syncs through this transfer (call on every rank, after building it).

        Args:
            trainer: The ``AsyncGRPOTrainer``; its ``_streaming_iter`` is replaced on this instance.
        """
        self._trainer = trainer
        trainer._streaming_iter = self._join_sync

    def init_weight_transfer(self) -> None:
        """Nothing here: the run lock and the versions are taken collectively at the first sync."""

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Rank 0's part of a sync: publish this rank's shards; ``iterator`` is left unread.

        Raises:
            RuntimeError: :meth:`attach` was not called (the iterator would gather the model).
            As :meth:`ShardedPublisher.publish`.
        """
        if self._trainer is None:
            raise RuntimeError("call ShardedWeightTransfer.attach(trainer) on every rank before training")
        close = getattr(iterator, "close", None)
        if close is not None:
            close()  # our own unstarted generator: closing it runs nothing
        self.sync()

    def _join_sync(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's ``_streaming_iter`` on every rank: iterating it (the other ranks do) joins the sync."""
        self.sync()
        yield from ()

    def local_state(self) -> dict[str, torch.Tensor]:
        """This rank's parameters as TRL publishes them (DTensors under FSDP2; nothing gathered)."""
        model = self._trainer.accelerator.unwrap_model(self._trainer.model)
        return {name: param.detach() for name, param in _iter_vllm_named_params(model)}

    def sync(self) -> PublishRecord | None:
        """Publish the next version from this rank's shards (collective: every rank calls it once per sync).

        Returns:
            The record (in the background: of the newest publish finished since the last call, if
            any), or ``None`` when the sync was refused as non-finite and ``on_non_finite`` handled it.
        """
        self.continue_run()
        background = self.background
        if background is None:
            return self._publish(lambda step: [self.publisher.publish(step, self.local_state())])
        return self._publish(lambda step: background.stage(self.local_state())[1])
