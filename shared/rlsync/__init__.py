"""rlsync: sparse, bit-exact bf16 weight sync for asynchronous RL through one object-store bucket.

>>> from rlsync import open_bucket, Publisher, Subscriber, FixedInterval
>>> bucket = open_bucket("./runs/bucket")              # or "hf://buckets/OWNER/NAME"
>>> publisher = Publisher(bucket, policy=FixedInterval(10))
>>> publisher.publish(step, model.state_dict())         # an anchor or a sparse delta
>>> subscriber = Subscriber(open_bucket("./runs/bucket"))
>>> update = subscriber.fetch()                         # validated and hash-checked, weights untouched
>>> subscriber.apply(update)                            # the scatter into subscriber.state, nothing else

The plug-ins live in submodules: :mod:`rlsync.trl` (TRL's ``AsyncGRPOTrainer``) and :mod:`rlsync.vllm`
(vLLM's weight-transfer API, registered as the ``bucket`` backend by the ``vllm.general_plugins`` entry
point). Names are imported on first use, so ``import rlsync`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# public name -> module that defines it
_EXPORTS = {
    "Bucket": "rlsync.bucket",
    "LocalBucket": "rlsync.bucket",
    "RetryingBucket": "rlsync.bucket",
    "HfBucket": "rlsync.bucket",
    "open_bucket": "rlsync.bucket",
    "register": "rlsync.registry",
    "Kind": "rlsync.registry",
    "Publisher": "rlsync.protocol",
    "PublishRecord": "rlsync.protocol",
    "ShardedPublisher": "rlsync.protocol.sharded",
    "Subscriber": "rlsync.protocol",
    "SubscriberStats": "rlsync.protocol",
    "Update": "rlsync.protocol",
    "Manifest": "rlsync.protocol",
    "read_manifest": "rlsync.protocol",
    "AnchorPolicy": "rlsync.protocol",
    "FixedInterval": "rlsync.protocol",
    "Adaptive": "rlsync.protocol",
    "ChangeDetector": "rlsync.detect",
    "RlsyncError": "rlsync.errors",
    "RefusedObjectError": "rlsync.errors",
    "RetryableError": "rlsync.errors",
    "StopRoleError": "rlsync.errors",
    "ConfigurationError": "rlsync.errors",
    "SyncError": "rlsync.errors",
    "FormatError": "rlsync.errors",
    "HashMismatchError": "rlsync.errors",
    "ChainError": "rlsync.errors",
    "BucketError": "rlsync.errors",
    "ObjectNotFoundError": "rlsync.errors",
    "TransientBucketError": "rlsync.errors",
    "InvalidKeyError": "rlsync.errors",
    "RunLockedError": "rlsync.errors",
    "FencedError": "rlsync.errors",
    "NonFiniteError": "rlsync.errors",
    "RunExistsError": "rlsync.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

if TYPE_CHECKING:
    from .bucket import Bucket, HfBucket, LocalBucket, RetryingBucket, open_bucket
    from .registry import Kind, register
    from .detect import ChangeDetector
    from .errors import (
        BucketError,
        ChainError,
        ConfigurationError,
        FencedError,
        FormatError,
        HashMismatchError,
        InvalidKeyError,
        NonFiniteError,
        ObjectNotFoundError,
        RefusedObjectError,
        RetryableError,
        RlsyncError,
        RunExistsError,
        RunLockedError,
        StopRoleError,
        SyncError,
        TransientBucketError,
    )
    from .protocol import (
        Adaptive,
        AnchorPolicy,
        FixedInterval,
        Manifest,
        Publisher,
        PublishRecord,
        Subscriber,
        SubscriberStats,
        Update,
        read_manifest,
    )
    from .protocol.sharded import ShardedPublisher


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'rlsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
