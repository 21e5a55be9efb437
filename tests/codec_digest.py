"""The bytes the compiled codec paths write for a fixed run, one digest per file in the bucket.

``python -m tests.codec_digest FOLDER`` prints, as JSON, the digests and what numba compiled for
(``NUMBA_CPU_NAME``, and whether the ``classrice`` kernels use BMI2's ``pdep``).
:mod:`tests.library.test_generic_cpu_build` runs it in a child compiled for a generic x86-64 and
compares it with the same run in its own process (this machine's build): the files must be equal,
byte for byte, and each follower bit-exact by hash.

The run: every numba codec (``classrice``, ``classgap``) publishes an anchor and deltas of a state of
several dtypes and sizes at densities from RL-like (0.5%, 3%) to dense classes (30%, 100%), and a
subscriber follows each version, checked by whole-state hash.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

#: The codecs whose encode, decode or hash runs numba kernels.
CODECS = ("classrice", "classgap")
#: The changed fraction of each delta.
DENSITIES = (0.005, 0.03, 0.3, 1.0)
#: ``name: (dtype, numel)`` of the published state: row counts not multiples of the 64-element blocks.
SHAPES = {
    "embed": (torch.bfloat16, 300_001),
    "proj": (torch.bfloat16, 65_537),
    "norm": (torch.bfloat16, 1_000),
    "head": (torch.float32, 20_011),
    "gate": (torch.float16, 4_099),
}


def _state(rng: np.random.Generator) -> dict[str, torch.Tensor]:
    return {
        name: torch.from_numpy(rng.standard_normal(numel).astype(np.float32) * 0.02).to(dtype)
        for name, (dtype, numel) in SHAPES.items()
    }


def _step(rng: np.random.Generator, state: dict[str, torch.Tensor], density: float) -> dict[str, torch.Tensor]:
    """``state`` with ``density`` of each tensor's elements moved by a few units in the last place."""
    out = {}
    for name, tensor in state.items():
        bits = tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32).clone()
        count = max(1, int(density * bits.numel()))
        where = torch.from_numpy(rng.choice(bits.numel(), size=count, replace=False))
        bits[where] += torch.from_numpy(rng.integers(1, 4, size=count)).to(bits.dtype)
        out[name] = bits.view(tensor.dtype)
    return out


def file_digest(data: bytes) -> str:
    """SHA-256 of a safetensors file up to its header's key order (safetensors writes the metadata map in no
    fixed order): the header as sorted JSON, then every byte after it."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode() + data[8 + size :]).hexdigest()


def corpus_digests(root: Path) -> dict[str, str]:
    """Publish and follow the fixed run under ``root``; :func:`file_digest` of every anchor and delta file by key."""
    from rlsync.bucket import LocalBucket
    from rlsync.hashing import state_hash
    from rlsync.protocol import FixedInterval, Publisher, Subscriber

    digests: dict[str, str] = {}
    for codec in CODECS:
        rng = np.random.default_rng(0)
        state = _state(rng)
        bucket = LocalBucket(root / codec)
        publisher = Publisher(bucket, policy=FixedInterval(100), codec=codec, dtype=None, run_id="digest")
        subscriber = Subscriber(bucket)
        for step in range(len(DENSITIES) + 1):
            if step:
                state = _step(rng, state, DENSITIES[step - 1])
            publisher.publish(step, state)
            subscriber.sync()
            if subscriber.state_hash != state_hash(state):
                raise AssertionError(f"{codec}: the follower is not bit-exact at step {step}")
        for info in bucket.list():
            if info.key.startswith(("anchors/", "deltas/")):
                digests[f"{codec}/{info.key}"] = file_digest(bucket.get(info.key))
    return digests


def main(root: str) -> None:
    import numba

    from rlsync import bitops

    report = {"cpu_name": numba.config.CPU_NAME, "has_pdep": bitops.HAS_PDEP, "digests": corpus_digests(Path(root))}
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
