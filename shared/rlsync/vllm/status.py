"""The ``bucket`` weight-transfer backend's status as one record, read through the same type on both sides.

A vLLM worker builds a :class:`TransferStatus` (:meth:`~rlsync.vllm.transfer.BucketWeightTransferEngine.status`)
and sends it as a JSON-friendly dict (:meth:`TransferStatus.to_wire`, through ``collective_rpc`` or the HTTP
server); the caller reads it back with :meth:`TransferStatus.from_wire`, which refuses another
:data:`FORMAT_VERSION` (a worker of another release) and missing or extra fields, and
:meth:`TransferStatus.merge` joins the statuses of a tensor-parallel group's workers into one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Literal, Mapping

from ..errors import FormatError

__all__ = ["FORMAT_VERSION", "Pause", "Prepared", "Rehash", "TransferStatus"]

#: The version of :meth:`TransferStatus.to_wire`'s dict (its ``format`` key); readers refuse other versions.
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Rehash:
    """A finished re-hash of the served weights (:meth:`~rlsync.vllm.transfer.BucketWeightTransferEngine.verify`):
    the verified ``step`` the weights held, its ``expected`` state hash, and the hash of the weights ``served``,
    read back from the engine."""

    step: int
    expected: str
    served: str

    @property
    def mismatch(self) -> bool:
        """Whether the served weights differ from the verified state."""
        return self.served != self.expected


@dataclasses.dataclass(frozen=True)
class Prepared:
    """An update the workers prepared (downloaded, decoded, verified) in the background, waiting for the pause.

    Attributes:
        step: Its step.
        kind: ``"anchor"`` or ``"delta"``.
        state_hash: The state hash it leads to.
        nbytes: Bytes it downloaded.
        download_s: Seconds it downloaded.
        decode_s: Seconds it decoded and verified.
    """

    step: int
    kind: Literal["anchor", "delta"]
    state_hash: str
    nbytes: int = 0
    download_s: float = 0.0
    decode_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Pause:
    """What the last pause did (:meth:`~rlsync.vllm.transfer.BucketWeightTransferEngine.receive_weights`): its
    seconds ``s``, the bucket ``reads`` inside it (0 when the update was prepared beforehand), updates ``applied``."""

    s: float = 0.0
    reads: int = 0
    applied: int = 0


@dataclasses.dataclass(frozen=True)
class TransferStatus:
    """Where a worker's ``bucket`` backend stands.

    Attributes:
        step: The verified step the weights hold (``None`` before the first anchor).
        state_hash: Its state hash.
        preparing: An update is being downloaded, decoded and verified in the background.
        error: Why the last prepared update was refused (``""``: none).
        prepared: The prepared update, ``None`` when none is held.
        refused: Updates the subscriber refused.
        discarded: Prepared updates dropped as stale.
        pause: The last pause, ``None`` before the first.
        rehashing: A re-hash runs.
        rehash: The last finished re-hash, ``None`` before the first.
        rehash_error: Why the last re-hash failed (``""``: none).
        newest_step: The pointer's newest step, as the subscriber last read it.
        reads: Bucket reads of the subscriber.
        bytes_downloaded: Bytes the subscriber downloaded.
    """

    step: int | None = None
    state_hash: str | None = None
    preparing: bool = False
    error: str = ""
    prepared: Prepared | None = None
    refused: int = 0
    discarded: int = 0
    pause: Pause | None = None
    rehashing: bool = False
    rehash: Rehash | None = None
    rehash_error: str = ""
    newest_step: int | None = None
    reads: int = 0
    bytes_downloaded: int = 0

    def to_wire(self) -> dict[str, Any]:
        """The status as a JSON-friendly dict, with its ``format`` version."""
        return {"format": FORMAT_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> "TransferStatus":
        """Read a status :meth:`to_wire` wrote (in another process).

        Raises:
            FormatError: another format version, or fields missing or unknown.
        """
        if not isinstance(wire, Mapping) or wire.get("format") != FORMAT_VERSION:
            version = wire.get("format") if isinstance(wire, Mapping) else type(wire).__name__
            raise FormatError(f"a transfer status of format {version!r}, not {FORMAT_VERSION} (mixed rlsync releases?)")
        fields = {f.name for f in dataclasses.fields(cls)}
        if set(wire) - {"format"} != fields:
            raise FormatError(f"a transfer status with fields {sorted(set(wire) ^ fields ^ {'format'})} wrong")
        values = {name: wire[name] for name in fields}
        try:
            for name, record in (("prepared", Prepared), ("pause", Pause), ("rehash", Rehash)):
                values[name] = record(**wire[name]) if wire[name] is not None else None
        except TypeError as exc:
            raise FormatError(f"a transfer status with a malformed prepared update, pause or re-hash: {exc}") from None
        return cls(**values)

    @classmethod
    def merge(cls, statuses: Iterable["TransferStatus"]) -> "TransferStatus":
        """One status for a tensor-parallel group's workers: the first's, with any worker's error, preparing or
        re-hashing, and a re-hash that found a mismatch on any worker.

        Raises:
            RuntimeError: the workers, all done preparing, hold different prepared updates.
        """
        statuses = list(statuses)
        first = statuses[0]
        merged = dataclasses.replace(
            first,
            error=next((s.error for s in statuses if s.error), ""),
            preparing=any(s.preparing for s in statuses),
            rehashing=any(s.rehashing for s in statuses),
            rehash=next((s.rehash for s in statuses if s.rehash is not None and s.rehash.mismatch), first.rehash),
        )
        prepared = {(s.prepared.step, s.prepared.state_hash) if s.prepared else None for s in statuses}
        if not merged.preparing and len(prepared) != 1:
            raise RuntimeError(f"vLLM's workers prepared different updates: {sorted(prepared, key=str)}")
        return merged
