"""Trial ``hostile_positions``: ``classrice`` deltas whose Rice-coded position is hostile, for tensors
of 2^23 to 2^24 elements (embedding-sized): quotients around the point where ``q << k`` passes 2^63
(a wrap to a negative position, -3 among them), around the tensor's end for every Rice parameter, and
at random. Each delta is refused with a ``FormatError`` exactly when its position is outside the
tensor, and otherwise decodes to that position; no other exception escapes ``decode_delta``."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import safetensors.torch
import torch

from rlsync.codecs.classrice import MAX_RICE_K, TABLE, _kernels
from rlsync.errors import FormatError
from rlsync.delta_format import Change, decode_delta, encode_delta
from rlsync.format import parse_header
from rlsync.hashing import state_hash

from ..invariants import TrialResult

DEFAULT_TRIALS = 4
CASES = 40
NAME = "w"


def one_change_delta(base: torch.Tensor) -> bytes:
    """A genuine ``classrice`` delta changing element 0 of the 1-D bf16 ``base`` to 1.0."""
    new = base[:1].clone().fill_(1.0)
    bits = lambda t: t.view(torch.int16).numpy()  # noqa: E731
    change = Change(index=np.array([0]), old_bits=bits(base[:1]), new_bits=bits(new), dtype=base.dtype, shape=tuple(base.shape), base=base)
    return encode_delta({NAME: change}, step=1, base_step=0, base_hash="0" * 64, state_hash="1" * 64, total=base.numel(), codec="classrice")


def rice_position_delta(template: bytes, quotient: int, remainder: int, k: int) -> bytes:
    """``template`` (:func:`one_change_delta`) with its one position Rice-coded, flat order, as
    ``quotient << k | remainder`` (the encoder's own kernel writes the streams)."""
    _, metadata = parse_header(template)
    entries = safetensors.torch.load(template)
    table = np.zeros(1, TABLE)
    table[0] = (0, k, 1)
    unary, rem = np.zeros(quotient // 8 + 1, np.uint8), np.zeros((k + 7) // 8, np.uint8)
    _kernels().rice_encode(np.array([quotient << k | remainder], np.uint64), k, unary, 0, rem, 0)
    entries[f"{NAME}.pos"] = torch.from_numpy(np.concatenate([table.view(np.uint8), unary, rem]))
    tensors = json.loads(metadata["tensors"])
    tensors[NAME].update(order="flat", classes=1, unary_bytes=int(unary.size))
    return safetensors.torch.save(entries, metadata={**metadata, "tensors": json.dumps(tensors)})


def _case(rng: random.Random, numel: int) -> tuple[str, int, int, int]:
    """``(class, quotient, remainder, k)`` of one hostile position (quotients bounded by the tensor's size,
    so a case's unary stream stays under its 2 MB)."""
    kind = rng.choice(["wrap", "end", "random"])
    if kind == "wrap":  # q << k at or past 2^63: needs k >= 63 - log2(numel)
        k = rng.randint(64 - numel.bit_length(), MAX_RICE_K)
        quotient = rng.choice([1 << (63 - k), (1 << (64 - k)) - 1, (1 << (63 - k)) + rng.randrange(1 << 10)])
        remainder = rng.choice([(1 << k) - 3, (1 << k) - 1, 0, rng.randrange(1 << k)])
        return kind, min(quotient, numel), remainder, k
    k = rng.randint(0, MAX_RICE_K)
    if kind == "end":
        quotient = max(0, (numel >> k) + rng.randint(-1, 1))
    else:
        quotient = rng.randrange(min(numel, (1 << 62) >> k) + 1)
    remainder = rng.choice([0, (1 << k) - 1, rng.randrange(1 << k)])
    return kind, min(quotient, numel), remainder, k


def trial_hostile_positions(rng: random.Random, workdir: Path) -> TrialResult:
    """Decode :data:`CASES` deltas with hostile positions against one large tensor."""
    del workdir  # nothing is written
    result = TrialResult("hostile_positions")
    numel = rng.choice([1 << 23, (1 << 23) + rng.randrange(1, 1 << 22), 1 << 24])
    state = {NAME: torch.zeros(numel, dtype=torch.bfloat16)}
    before = state_hash(state)
    template = one_change_delta(state[NAME])
    for _ in range(CASES):
        kind, quotient, remainder, k = _case(rng, numel)
        position = quotient << k | remainder
        inside = position < numel
        result.faults[f"{kind} position {'inside' if inside else 'outside'}"] += 1
        data = rice_position_delta(template, quotient, remainder, k)
        try:
            delta = decode_delta(data, state)
        except FormatError:
            result.check(not inside, f"a position inside the tensor ({position}, k={k}) was refused")
            result.notes["refused"] += 1
        except Exception as exc:  # noqa: BLE001 - the invariant: only FormatError escapes
            result.fail(f"position q={quotient} k={k} r={remainder}: {type(exc).__name__}: {exc}")
        else:
            got = delta.patches[NAME].index.tolist()
            result.check(inside and got == [position], f"position q={quotient} k={k} r={remainder} decoded as {got}")
    result.check(state_hash(state) == before, "a decode changed the state")
    return result
