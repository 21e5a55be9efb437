"""The device path of change detection (a GPU trainer's: compare, extract positions, copy to host), run on the CPU.

No GPU is reachable from CI: :class:`ComparePath.DEVICE` makes :class:`ChangeDetector` take the torch path a
GPU trainer takes, on CPU tensors, through the same code. It must find exactly what the numpy path finds
(positions, old and new bits, for every serving dtype and across chunk boundaries and ragged tails), only
the changed elements are copied to the host, and a publisher on it writes byte-identical deltas.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from rlsync.bucket import LocalBucket
from rlsync.detect import ChangeDetector
from rlsync.device_changes import ComparePath, compare, device_changes, extract_positions
from rlsync.dtypes import int_view
from rlsync.hashing import state_hash
from rlsync.layout import ANCHOR_PREFIX, DELTA_PREFIX
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from tests.helpers import files_under, master_state, rl_step


def _contents(path) -> tuple[dict[str, str], dict[str, bytes]]:
    """A safetensors file's metadata and each tensor's bytes."""
    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: int_view(f.get_tensor(k)).numpy().tobytes() for k in f.keys()}


def _states(dtype: torch.dtype, numel: int, changed: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A published tensor and a current one with about ``changed`` of its elements' bits flipped."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        old = torch.rand(numel, generator=g) < 0.5
    elif dtype.is_floating_point:
        old = (torch.randn(numel, generator=g) * 0.02).to(dtype)
    else:
        old = torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)
    new = old.clone()
    hit = torch.rand(numel, generator=g) < changed
    int_view(new)[hit] ^= 1  # the lowest bit of each hit element: a change of one ulp
    return old, new


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int64, torch.bool])
@pytest.mark.parametrize(("numel", "changed"), [(10_007, 0.02), (4096, 0.0), (333, 1.0), (1, 1.0)])
def test_the_device_path_finds_what_the_numpy_path_finds(dtype, numel, changed):
    old, new = _states(dtype, numel, changed, seed=numel)
    found = {}
    for path in ComparePath:
        detector = ChangeDetector(dtype=None, chunk_elements=1000, compare_path=path)  # ragged chunks: 1000 ... 7
        detector.reset({"w": old})
        found[path] = detector.diff({"w": new}).get("w")
    numpy_path, device_path = found[ComparePath.AUTO], found[ComparePath.DEVICE]
    if changed == 0.0:
        assert numpy_path is None and device_path is None
        return
    for field in ("index", "old_bits", "new_bits"):
        a, b = getattr(numpy_path, field), getattr(device_path, field)
        assert a.dtype == b.dtype and np.array_equal(a, b), field
    expected = np.flatnonzero(int_view(old).numpy() != int_view(new).numpy())
    assert np.array_equal(device_path.index, expected)


def test_only_the_changed_elements_are_extracted_for_the_host():
    old, new = _states(torch.bfloat16, 50_000, 0.01, seed=1)
    old_bits, new_bits = int_view(old), int_view(new)
    mask = compare(old_bits, new_bits)
    positions, old_found, new_found = extract_positions(mask, old_bits, new_bits)
    changed = int(mask.sum())
    assert 0 < changed < 1000
    assert positions.dtype == torch.int32 and positions.numel() == old_found.numel() == new_found.numel() == changed
    idx, old_host, new_host = device_changes(old_bits, new_bits)
    assert idx.dtype == np.int64 and idx.size == old_host.size == new_host.size == changed
    assert old_host.dtype == new_host.dtype == np.uint16


def test_a_publisher_on_the_device_path_writes_the_same_bytes(tmp_path):
    """Anchor and two deltas through the device path and through the numpy path: the bucket files are byte for byte
    the same, and a replica following the device path's bucket hashes as published."""
    roots = {path: tmp_path / path.value for path in ComparePath}
    for path, root in roots.items():
        master = master_state()
        publisher = Publisher(LocalBucket(root), policy=FixedInterval(100))
        publisher.detector.compare_path = path
        for step in range(3):
            if step:
                rl_step(master, step)
            record = publisher.publish(step, master)
            assert record.kind == ("anchor" if step == 0 else "delta")
    keys = [k for k in files_under(roots[ComparePath.DEVICE]) if k.startswith((ANCHOR_PREFIX, DELTA_PREFIX))]
    assert len(keys) == 3
    for key in keys:  # the same metadata and the same tensor bytes (safetensors orders the metadata as it likes)
        device, numpy_path = (_contents(roots[path] / key) for path in (ComparePath.DEVICE, ComparePath.AUTO))
        assert device == numpy_path, key
    replica = Subscriber(LocalBucket(roots[ComparePath.DEVICE]))
    while (update := replica.fetch()) is not None:
        replica.apply(update)
    assert replica.step == 2 and state_hash(replica.state) == replica.state_hash == publisher.manifest.state_hash
