"""An update a :class:`~rlsync.protocol.Subscriber` fetched and verified, ready to apply."""

from __future__ import annotations

import dataclasses

import torch

from ..hashing import StateLanes
from ..patch import TensorPatch


@dataclasses.dataclass
class Update:
    """A downloaded, validated update, ready to apply.

    Attributes:
        kind: ``"anchor"`` or ``"delta"``.
        step: The version after applying it.
        base_step: The version it applies to (``None`` for anchors).
        base_hash: Hash of that version (``None`` for anchors).
        state_hash: Hash of the resulting state.
        nbytes: Bytes downloaded.
        tensors: The full state (anchors; read from the downloaded files, copied into the
            state by :meth:`~rlsync.protocol.Subscriber.apply`).
        patches: Changed elements per tensor (deltas), on the device of the tensor they patch.
        old: The values those elements have before the delta (the rollback of a failed scatter).
        lanes: The state hash after the update (verified against ``state_hash``).
        changed: Changed elements (deltas) or all elements (anchors).
        download_s: Seconds spent downloading.
        decode_s: Seconds spent decoding and verifying (hash included).
        run_id: The run the update belongs to (the pointer's ``run_id``).
        aliases: Tied names of an anchor's state (alias -> name in ``tensors``).
    """

    kind: str
    step: int
    base_step: int | None
    base_hash: str | None
    state_hash: str
    nbytes: int
    tensors: dict[str, torch.Tensor] | None = None
    patches: dict[str, TensorPatch] | None = None
    old: dict[str, torch.Tensor] | None = dataclasses.field(default=None, repr=False)
    lanes: StateLanes | None = dataclasses.field(default=None, repr=False)
    changed: int = 0
    download_s: float = 0.0
    decode_s: float = 0.0
    run_id: str = ""
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
