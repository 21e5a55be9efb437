"""FSDP2 through accelerate on CPU (gloo), for tests and CPU-only machines.

accelerate 1.15 turns ``fsdp_plugin`` (what ``TrainingArguments(fsdp=..., fsdp_config={"version": 2})``
passes it) into ``DistributedType.FSDP`` only on accelerator devices; on a CPU run
(``MULTI_CPU``) the plugin is dropped and the model is wrapped in DDP, which refuses
DTensor parameters. ``fully_shard`` itself runs on a CPU mesh with gloo, so
:func:`allow_cpu_fsdp` makes ``AcceleratorState`` keep the plugin on ``MULTI_CPU``;
the rest is accelerate's own FSDP2 path (``fsdp2_prepare_model``: ``fully_shard`` of
every decoder layer and the root, full state broadcast from rank 0).

On a GPU run nothing changes: the patch applies only where accelerate chose ``MULTI_CPU``.
"""

from __future__ import annotations

import functools

from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType

_original_init = AcceleratorState.__init__


@functools.wraps(_original_init)
def _init(self, *args, fsdp_plugin=None, **kwargs):
    _original_init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        self.distributed_type = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


def allow_cpu_fsdp() -> None:
    """Let accelerate run FSDP (``fsdp_config={"version": 2}``) on a multi-process CPU run (idempotent).

    Call before the ``Trainer`` (or ``Accelerator``) is built, on every rank.
    """
    AcceleratorState.__init__ = _init
