"""The ``bucket`` weight-transfer backend's status as one record, read through the same type on both sides.

A vLLM worker builds a :class:`TransferStatus` (:meth:`~rlsync.vllm.transfer.BucketWeightTransferEngine.status`)
and sends it as a JSON-friendly dict (:meth:`TransferStatus.to_wire`, through ``collective_rpc`` or the HTTP
server); the caller reads it back with :meth:`TransferStatus.from_wire`, which refuses another
:data:`FORMAT_VERSION` (a worker of another release) and missing or extra fields, and
:meth:`TransferStatus.merge` joins the statuses of a tensor-parallel group's workers into one.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping

from ..errors import FormatError

__all__ = ["FORMAT_VERSION", "Pause", "Rehash", "TransferStatus"]

#: The version of :meth:`TransferStatus.to_wire`'s dict (its ``format`` key); readers refuse other versions.
FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Rehash:
    """A finished re-hash of the served weights (:meth:`~rlsync.vllm.transfer.BucketWeightTransferEngine.verify`).

    Attributes:
        step: The verified step the weights held.
        expected: Its verified state hash.
        served: The hash of the weights read back from the engine.
    """

    step: int
    expected: str
    served: str

    @property
    def mismatch(self) -> bool:
        """Whether the served weights differ from the verified state."""
        return self.served != self.expected


@dataclasses.dataclass(frozen=True)
class Pause:
    """What the last pause did (:meth:`~rlsync.vllm.transfer.BucketWeightTransferEngine.receive_weights`).

    Attributes:
        s: Its seconds.
        reads: Bucket reads inside it (0 when the update was prepared beforehand).
        applied: Updates it applied.
    """

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
        prepared_step: The prepared update's step, ``None`` when none is held.
        prepared_kind: ``"anchor"`` or ``"delta"``.
        prepared_hash: The state hash it leads to.
        refused: Updates the subscriber refused.
        discarded: Prepared updates dropped as stale.
        pause: The last pause, ``None`` before the first.
        rehashing: A re-hash runs.
        rehash: The last finished re-hash, ``None`` before the first.
        rehash_error: Why the last re-hash failed (``""``: none).
        newest_step: The pointer's newest step, as the subscriber last read it.
        prepared_nbytes: Bytes the prepared update downloaded.
        prepared_download_s: Seconds it downloaded.
        prepared_decode_s: Seconds it decoded and verified.
        reads: Bucket reads of the subscriber.
        bytes_downloaded: Bytes the subscriber downloaded.
    """

    step: int | None = None
    state_hash: str | None = None
    preparing: bool = False
    error: str = ""
    prepared_step: int | None = None
    prepared_kind: str | None = None
    prepared_hash: str | None = None
    refused: int = 0
    discarded: int = 0
    pause: Pause | None = None
    rehashing: bool = False
    rehash: Rehash | None = None
    rehash_error: str = ""
    newest_step: int | None = None
    prepared_nbytes: int = 0
    prepared_download_s: float = 0.0
    prepared_decode_s: float = 0.0
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
            values["pause"] = Pause(**wire["pause"]) if wire["pause"] is not None else None
            values["rehash"] = Rehash(**wire["rehash"]) if wire["rehash"] is not None else None
        except TypeError as exc:
            raise FormatError(f"a transfer status with a malformed pause or re-hash: {exc}") from None
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
        prepared = {(s.prepared_step, s.prepared_hash) for s in statuses}
        if not merged.preparing and len(prepared) != 1:
            raise RuntimeError(f"vLLM's workers prepared different updates: {sorted(prepared, key=str)}")
        return merged
