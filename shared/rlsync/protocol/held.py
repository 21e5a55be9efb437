"""What the parts of a :class:`~rlsync.protocol.Subscriber` share: the state it holds, where that
state stands in the chain, and the counters a replica reports.

The applier writes :class:`HeldState` in the pause; the fetcher reads it (what an update must
follow) and the re-hash reads it a chunk at a time. All of them hold :attr:`HeldState.lock` while
they do, so an update is validated against the state it is then applied to.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from ..hashing import StateLanes


@dataclasses.dataclass
class SubscriberStats:
    """Counters a replica reports in its status object."""

    reads: int = 0
    """Objects read from the bucket (the pointer, update files)."""
    bytes_downloaded: int = 0
    """Bytes of those objects."""
    anchors_applied: int = 0
    deltas_applied: int = 0
    refused: int = 0
    """Updates refused (and weights re-hashes that found a mismatch)."""
    last_error: str = ""
    """Why the last one was refused."""
    last_apply_s: float = 0.0
    """Seconds the last :meth:`~rlsync.protocol.Subscriber.apply` took: the pause."""
    rehashes: int = 0
    """Full re-hashes of the weights that matched the state hash."""
    rehash_mismatches: int = 0
    last_rehash_s: float = 0.0
    verified_step: int | None = None
    """The version the last matching re-hash found in the weights."""
    verified_hash: str = ""
    """Its state hash."""


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
        resync: An update was refused: only a verified update (see :mod:`rlsync.protocol.subscriber`)
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
