"""What the parts of a :class:`~rlsync.protocol.Subscriber` share: the state it holds, where that
state stands in the chain, and the counters a replica reports.

The applier writes :class:`HeldState` in the pause; the fetcher reads it (what an update must
follow) and the re-hash reads it a chunk at a time. All of them hold :attr:`HeldState.lock` while
they do, so an update is validated against the state it is then applied to.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Generic, TypeVar, overload

import torch

from ..hashing import StateLanes

T = TypeVar("T")


@dataclasses.dataclass
class SubscriberStats:
    """Counters a replica reports in its status object.

    Attributes:
        reads: Objects read from the bucket (the pointer, update files).
        bytes_downloaded: Bytes of those objects.
        anchors_applied: Anchors written into the state.
        deltas_applied: Deltas written into the state.
        refused: Updates refused, and re-hashes of the weights that found a mismatch.
        last_error: Why the last one was refused.
        last_apply_s: Seconds the last :meth:`~rlsync.protocol.Subscriber.apply` took: the pause.
        rehashes: Full re-hashes of the weights that matched the state hash.
        rehash_mismatches: Those that did not.
        last_rehash_s: Seconds the last matching re-hash took.
        verified_step: The version the last matching re-hash found in the weights.
        verified_hash: Its state hash.
    """

    reads: int = 0
    bytes_downloaded: int = 0
    anchors_applied: int = 0
    deltas_applied: int = 0
    refused: int = 0
    last_error: str = ""
    last_apply_s: float = 0.0
    rehashes: int = 0
    rehash_mismatches: int = 0
    last_rehash_s: float = 0.0
    verified_step: int | None = None
    verified_hash: str = ""


@dataclasses.dataclass(eq=False)
class HeldState:
    """The state a subscriber keeps bit-exact to the published one, and where it stands.

    Attributes:
        state: The published state: each tensor once, under the name the state hash covers
            (an engine's own weights, or tensors of the subscriber's own).
        aliases: Tied names of the state (alias -> name in ``state``), from the last anchor.
        step: The version of ``state`` (``None`` before the first anchor).
        state_hash: Its hash.
        run_id: The run it belongs to.
        lanes: Its hash, per tensor, as the verified updates made it.
        resync: An update was refused: only a verified update (see :mod:`rlsync.protocol.chooser`)
            clears it.
        rebootstrap: The weights differ from the verified state: only an anchor repairs them.
        lock: Held by whoever reads or writes the above.
    """

    state: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    step: int | None = None
    state_hash: str | None = None
    run_id: str | None = None
    lanes: StateLanes | None = dataclasses.field(default=None, repr=False)
    resync: bool = False
    rebootstrap: bool = False
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock, repr=False)


class HeldField(Generic[T]):
    """A read-only attribute of an object that keeps its :class:`HeldState` as ``_held``: the held
    state's field of the same name (how :class:`~rlsync.protocol.Subscriber` shows its state)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> HeldField[T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> T: ...

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        return self if obj is None else getattr(obj._held, self.name)

    def __set__(self, obj: object, value: object) -> None:
        raise AttributeError(f"{self.name} is read-only: the subscriber's updates set it")
