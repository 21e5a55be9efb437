"""Registration of the ``bucket`` weight-transfer backend with vLLM.

vLLM's ``WeightTransferEngineFactory`` takes a module path and a class name and imports
the backend lazily, so registering needs neither :mod:`.transfer` (the backend)
nor :mod:`.worker` (the worker extension, which calls :func:`register` on import).
"""

from __future__ import annotations

BACKEND_NAME = "bucket"
BACKEND_MODULE = "rlsync.vllm.transfer"
BACKEND_CLASS = "BucketWeightTransferEngine"
#: The ``--worker-extension-cls`` (``worker_extension_cls``) that gives vLLM's workers the ``sync_*`` methods.
WORKER_EXTENSION = "rlsync.vllm.worker.SyncWorkerExtension"


def register() -> None:
    """Register the ``bucket`` backend with vLLM (the ``vllm.general_plugins`` entry point).

    Safe to call more than once per process.
    """
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, BACKEND_MODULE, BACKEND_CLASS)
    except ValueError:  # already registered in this process
        pass
