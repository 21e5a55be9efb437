"""LoRA runs of TRL's ``AsyncGRPOTrainer`` synced through the bucket as adapter versions.

Given a ``peft_config`` and a ``weight_transfer``, ``AsyncGRPOTrainer`` syncs through
``_sync_weight_merged``: it merges the adapter into the base weights, streams every base
weight to the transfer, and unmerges. That would publish dense deltas (a merged update moves
nearly every weight) and leaves the trainer's base weights rounded by each merge/unmerge.
Its own adapter path, ``_sync_weight_lora``, talks to a vLLM server over HTTP instead.

:class:`BucketAdapterSync` is the smallest override that fixes this: it replaces the
trainer's ``_sync_weight_merged`` (on the instance) with a sync that publishes only the
adapter tensors to the bucket's adapter chain (:mod:`rlsync.adapters`), through an ordinary
:class:`~rlsync.trl.BucketWeightTransfer`. The base weights are published once to the
weights chain (or checked against it on a restart), and the adapter chain names their hash.

TRL privates it relies on (``trl==1.16``):

- ``AsyncGRPOTrainer._sync_weight_merged(t0) -> (t_pause, t_barrier, t_transfer)``, which
  ``_sync_weight`` calls when a ``weight_transfer`` is given; replaced;
- ``AsyncGRPOTrainer._adapter_name``, the adapter TRL captured as the policy; read;
- ``model_version`` and ``rollout_worker.update_model_version``, bumped after each publish
  exactly as TRL's own syncs do.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..adapters import AdapterChain, LoraSpec, adapter_bucket
from ..lora import adapter_tensors, base_parameters
from ..bucket import Bucket
from ..detect import serving_copy
from ..errors import SyncError
from ..hashing import state_hash
from ..protocol import Publisher
from .weight_transfer import BucketWeightTransfer

logger = logging.getLogger(__name__)


class BucketAdapterSync:
    """Publishes a peft ``AsyncGRPOTrainer``'s adapter to the bucket's adapter chain.

    >>> sync = BucketAdapterSync(bucket)
    >>> trainer = AsyncGRPOTrainer(model=..., peft_config=LoraConfig(...), weight_transfer=sync.transfer, ...)
    >>> sync.attach(trainer)  # before trainer.train()

    Args:
        bucket: The run's bucket: the base goes to its weights chain, the adapter under ``adapters/``.
        base_publisher: Publisher of the weights chain (default ``Publisher(bucket)`` with the same run-lock owner).
        **publisher_kwargs: Arguments of the adapter chain's :class:`~rlsync.protocol.Publisher`
            (anchor policy, codec, retention, run-lock owner...).

    Attributes:
        transfer: The :class:`~rlsync.trl.BucketWeightTransfer` of the adapter chain; pass it to the
            trainer as ``weight_transfer`` (its ``on_publish`` and ``on_non_finite`` may be set).
        chain: The adapter chain (base name and hash, LoRA settings), once attached.
    """

    def __init__(self, bucket: Bucket, *, base_publisher: Publisher | None = None, **publisher_kwargs: Any) -> None:
        self.base_publisher = base_publisher or Publisher(bucket, owner=publisher_kwargs.get("owner"))
        self.transfer = BucketWeightTransfer(publisher=Publisher(adapter_bucket(bucket), **publisher_kwargs))
        self.chain: AdapterChain | None = None
        self.trainer: Any = None

    @property
    def publisher(self) -> Publisher:
        """The adapter chain's publisher."""
        return self.transfer.publisher

    def attach(self, trainer: Any) -> AdapterChain:
        """Bind the adapter chain to the trainer's base and make its weight syncs publish the adapter.

        Publishes the base weights as the weights chain's version 0 on an empty bucket; on a
        bucket that holds a run, checks that its weights chain is this base.

        Returns:
            The adapter chain, as written into its pointer.

        Raises:
            ValueError: the trainer's model is not a peft model.
            SyncError: the bucket's weights chain holds another base than the trainer's.
        """
        model = trainer.accelerator.unwrap_model(trainer.model)
        if not hasattr(model, "peft_config"):
            raise ValueError("BucketAdapterSync needs an AsyncGRPOTrainer built with a peft_config")
        name = trainer._adapter_name
        lora = LoraSpec.from_peft(model.peft_config[name])
        if trainer.accelerator.is_main_process:
            base_hash = self._publish_base(model)
            base_model = str(getattr(model.config, "_name_or_path", "") or "base")[-256:]
            self.chain = AdapterChain(base_model, base_hash, lora)
            self.publisher.metadata = self.chain.metadata()
        self.trainer = trainer
        trainer._sync_weight_merged = self._sync
        return self.chain

    def _publish_base(self, model: torch.nn.Module) -> str:
        """Publish (or find) the base weights in the weights chain; returns their state hash."""
        base = {n: p.detach() for n, p in base_parameters(model)}
        published = self.base_publisher.resume() is not None
        if not published:
            return self.base_publisher.publish(0, base).state_hash
        expected = state_hash({n: serving_copy(t, self.base_publisher.dtype) for n, t in base.items()})
        if expected != self.base_publisher.manifest.state_hash:
            raise SyncError(
                f"{self.base_publisher.bucket.url} holds another base model (hash {self.base_publisher.manifest.state_hash[:12]}) "
                f"than this trainer's ({expected[:12]}): use a new bucket"
            )
        return expected

    def _sync(self, t0: float) -> tuple[float, float, float]:
        """Replaces ``AsyncGRPOTrainer._sync_weight_merged``: publish the adapter, then bump the version."""
        trainer = self.trainer
        model = trainer.accelerator.unwrap_model(trainer.model)
        t_pause = time.time()
        trainer.accelerator.wait_for_everyone()
        t_barrier = time.time()
        tensors = adapter_tensors(model, trainer._adapter_name)  # a collective under FSDP
        if trainer.accelerator.is_main_process:
            self.transfer.send_weights(iter(tensors.items()))
        t_transfer = time.time()
        trainer.accelerator.wait_for_everyone()
        if trainer.accelerator.is_main_process:
            trainer.model_version += 1
            if trainer.rollout_worker:
                trainer.rollout_worker.update_model_version(trainer.model_version)
        return t_pause, t_barrier, t_transfer

    def restore(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load published adapter tensors (peft names) back into the trainer's adapter.

        Raises:
            SyncError: a tensor names no adapter weight of the model.
        """
        from peft.utils import set_peft_model_state_dict

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        dtype = next(p.dtype for n, p in model.named_parameters() if "lora_" in n)
        result = set_peft_model_state_dict(
            model, {n: t.to(dtype) for n, t in tensors.items()}, adapter_name=self.trainer._adapter_name
        )
        if result.unexpected_keys:
            raise SyncError(f"published adapter tensors the model lacks: {result.unexpected_keys[:3]}")
