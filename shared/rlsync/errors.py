"""Every exception the sync library raises, under one root: :class:`RlsyncError`.

The classes are grouped by what the caller does about them, so a role can catch a
group instead of a list of names:

- :class:`RefusedObjectError`: an object (a bucket object, a file, a state about to be
  published) is refused. Count it, keep the last good state, go on.
- :class:`RetryableError`: a transient failure. Retry with backoff (see :mod:`rlsync.retry`).
- :class:`StopRoleError`: this role must stop doing what it does (another trainer took the
  run over, a stop was requested, the run is not this trainer's to continue).
- :class:`ConfigurationError`: the caller's settings are wrong. Fix them; retrying will not help.

The older family names stay what users catch: :class:`SyncError` (the publish/subscribe
protocol) and :class:`BucketError` (the bucket backends) are both :class:`RlsyncError`.
"""

from __future__ import annotations

from typing import Mapping

__all__ = [
    "RlsyncError",
    "RefusedObjectError",
    "RetryableError",
    "StopRoleError",
    "ConfigurationError",
    "UnknownNameError",
    "UnsupportedHardwareError",
    "SyncError",
    "FormatError",
    "HashMismatchError",
    "ChainError",
    "NonFiniteError",
    "RunLockedError",
    "FencedError",
    "RunExistsError",
    "ShardedPublishError",
    "BucketError",
    "ObjectNotFoundError",
    "ObjectTooLargeError",
    "TransientBucketError",
    "InvalidKeyError",
    "RetryableHttpError",
    "NotRegularFileError",
    "FileTooLargeError",
    "CheckpointError",
    "DeployError",
    "StopRequested",
    "BucketAccessError",
    "ReplicaIdInUseError",
]


class RlsyncError(Exception):
    """The root of every error the sync library raises."""


# -- what the caller does ---------------------------------------------------------------------------


class RefusedObjectError(RlsyncError):
    """An object is refused (malformed, too large, hostile, or not what was promised): count it and go on."""


class RetryableError(RlsyncError):
    """A transient failure that may succeed if retried."""


class StopRoleError(RlsyncError):
    """The role must stop what it is doing; retrying the same call will not help."""


class ConfigurationError(RlsyncError, ValueError):
    """The caller's settings are invalid or inconsistent; fix them."""


class UnknownNameError(ConfigurationError, KeyError):
    """A setting names no registered codec, backend, policy, source, environment or engine (the message lists them)."""

    __str__ = Exception.__str__  # the message as written, not quoted as a KeyError's key


class UnsupportedHardwareError(ConfigurationError):
    """This machine lacks a processor feature or device the chosen setting needs (:mod:`rlsync.cpu`);
    the message names what is missing and what to choose instead."""


# -- the publish/subscribe protocol -----------------------------------------------------------------


class SyncError(RlsyncError):
    """Base class for errors of the publish/subscribe protocol."""


class FormatError(SyncError, RefusedObjectError, ValueError):
    """A file is not a valid anchor or delta: bad header, metadata, names, shapes or indices."""


class HashMismatchError(SyncError, RefusedObjectError):
    """A state's hash differs from the hash a file or the pointer promised."""


class ChainError(SyncError, RefusedObjectError):
    """A delta does not follow the state it would be applied to (gap, replay, out of order)."""


class MissingUpdateError(ChainError):
    """An object the pointer names is not in the bucket (retention dropped it since the pointer was read, or it was
    never written)."""


class NonFiniteError(SyncError, RefusedObjectError):
    """A publish would turn finite published values into NaN or Inf (see ``Publisher(allow_non_finite=...)``)."""


class RunLockedError(SyncError, StopRoleError):
    """Another trainer holds the run lock."""


class FencedError(SyncError, StopRoleError):
    """This trainer's lock was taken over; it must stop publishing."""


class RunExistsError(SyncError, StopRoleError):
    """The bucket holds a run and this trainer neither continues it nor starts a new one explicitly."""


class ShardedPublishError(SyncError, RetryableError):
    """A sharded publish failed on some rank; the previous version stays published."""


# -- buckets ----------------------------------------------------------------------------------------


class BucketError(RlsyncError):
    """A bucket operation failed (the subclasses say whether retrying may help)."""


class ObjectNotFoundError(BucketError, KeyError):
    """The requested object does not exist."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "object not found"


class ObjectTooLargeError(BucketError, RefusedObjectError):
    """An object is larger than the reader allows (checked before its bytes are read)."""


class TransientBucketError(BucketError, RetryableError):
    """A bucket operation failed in a way that may succeed if retried (5xx, 429).

    Args:
        message: What failed.
        retry_after: Seconds the server asked us to wait, if it said.
    """

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BucketAccessError(BucketError, ConfigurationError):
    """The token may not write the bucket a role was given (another owner's namespace, a read-only token): the
    message names the setting to change; retrying will not help."""


class InvalidKeyError(BucketError, RefusedObjectError, ValueError):
    """An object key is not a safe relative path."""


class RetryableHttpError(RetryableError):
    """A Hub API request failed in a retryable way during a bucket call (not retried by the transport).

    Args:
        message: What failed.
        status: The HTTP status, or None for a connection failure or timeout.
        headers: The response headers (for `Retry-After`), empty for a connection failure.
    """

    def __init__(self, message: str, status: int | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers if headers is not None else {}


# -- local files and checkpoints --------------------------------------------------------------------


class NotRegularFileError(RefusedObjectError, OSError):
    """The path names a FIFO, device, directory or (where refused) a symlink."""


class FileTooLargeError(RefusedObjectError, OSError):
    """The file is larger than the caller allows."""


class CheckpointError(RefusedObjectError, ValueError):
    """A checkpoint in the bucket is incomplete, malformed, too large, or not this run's."""


class DeployError(ConfigurationError):
    """The deployment cannot be planned from this checkout (missing or inconsistent Space files)."""


class ReplicaIdInUseError(ConfigurationError):
    """Another host's replica writes a live status object under this replica's id: two replicas of one id would
    overwrite each other's rollouts and status, so this one does not start."""


class StopRequested(StopRoleError, RuntimeError):
    """A stop was requested while the trainer waited for rollouts (see ``BucketRolloutWorker.request_stop``).

    ``AsyncGRPOTrainer`` waits for rollouts inside its data loader, where no callback runs; the
    health check is the one hook it calls there, so a stop requested while the trainer waits ends
    ``train()`` with this exception.
    """
