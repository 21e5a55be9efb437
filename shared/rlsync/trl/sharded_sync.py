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
        publisher: The :class:`ShardedPublisher` to use (default: ``ShardedPublisher(bucket)``).
        **callbacks: ``on_publish`` and ``on_non_finite``, as for :class:`BucketWeightTransfer`,
            called on every rank (a sync that would publish NaN or Inf from any rank's shards is
            refused on every rank).

    Versions continue from the bucket at the first sync (a collective, so not in
    ``init_weight_transfer``, which TRL calls on the main process only); a resumed run
    publishes an anchor first, as :meth:`ShardedPublisher.resume` explains.
    """

    def __init__(self, bucket: Bucket | None = None, *, publisher: ShardedPublisher | None = None, **callbacks: Any) -> None:
        if publisher is None and bucket is not None:
            publisher = ShardedPublisher(bucket)
        super().__init__(bucket, publisher=publisher, background=False, **callbacks)
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
            The record, or ``None`` when the sync was refused as non-finite and ``on_non_finite`` handled it.
        """
        self.continue_run()
        return self._publish(lambda step: [self.publisher.publish(step, self.local_state())])
