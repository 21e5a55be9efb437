"""Change detection, encode, state hash and decode spread their work over the worker threads
(``RLSYNC_THREADS``); whatever the number of threads, the results are the same, bit for bit."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest
import safetensors.torch
import torch

import rlsync.delta_format
import rlsync.detect
import rlsync.hashing
from rlsync.detect import CPU_CHUNK_ELEMENTS, ChangeDetector
from rlsync.dtypes import int_view
from rlsync.delta_format import decode_delta, encode_delta
from rlsync.format import parse_header
from rlsync.protocol.published import lanes_of_changes


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Old and new bf16 states: tensors of several chunks and of less than one block, small weights changing most."""
    g = torch.Generator().manual_seed(0)
    old, new = {}, {}
    for name, numel in (("big", 2 * CPU_CHUNK_ELEMENTS + 12_345), ("mid", 300_001), ("tiny", 50), ("same", 4096)):
        w = (torch.randn(numel, generator=g) * 0.02).to(torch.bfloat16)
        chance = torch.where(w.float().abs() < 0.002, 0.7, 0.3 if name == "tiny" else 0.01) * (name != "same")
        hit = torch.rand(numel, generator=g) < chance
        bits = int_view(w).clone()
        bits[hit] += torch.where(torch.rand(int(hit.sum()), generator=g) < 0.5, 1, -1).to(torch.int16)
        old[name], new[name] = w, bits.view(torch.bfloat16)
    return old, new


@pytest.mark.parametrize("codec", ["classrice", "classgap"])
def test_one_thread_and_several_give_the_same_delta(monkeypatch, codec: str) -> None:
    old, new = _states()
    results = []
    for threads in (1, 3):
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            for module in (rlsync.detect, rlsync.delta_format, rlsync.hashing):
                monkeypatch.setattr(module, "worker_pool", lambda pool=pool: pool)
            detector = ChangeDetector(torch.bfloat16)
            detector.reset(old)
            changes = detector.diff(new)
            data = encode_delta(changes, step=1, base_step=0, base_hash="0" * 64, state_hash="1" * 64, total=1, codec=codec)
            delta = decode_delta(data, old)
            results.append((changes, parse_header(data), safetensors.torch.load(data), delta, lanes_of_changes(changes)))
    (changes, header, entries, delta, lanes), (changes_n, header_n, entries_n, delta_n, lanes_n) = results
    assert sorted(changes) == sorted(changes_n) == ["big", "mid", "tiny"]
    for name, change in changes.items():
        for field in ("index", "old_bits", "new_bits"):
            assert np.array_equal(getattr(change, field), getattr(changes_n[name], field)), (name, field)
        assert np.array_equal(lanes[name], lanes_n[name])
    assert header == header_n and entries.keys() == entries_n.keys()  # the file, but the metadata's key order
    assert all(torch.equal(entries[key], entries_n[key]) for key in entries)
    for name, patch in delta.patches.items():
        assert torch.equal(patch.index, delta_n.patches[name].index) and torch.equal(patch.values, delta_n.patches[name].values)
        assert np.array_equal(patch.index.numpy(), changes[name].index)
        assert np.array_equal(int_view(patch.values).numpy().view(np.uint16), changes[name].new_bits)
