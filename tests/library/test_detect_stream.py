"""Change detection of a stream of tensors: the changes of the whole state, whatever arrives when."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlsync.detect import FIRST_ROOM, ChangeDetector, changed_elements
from rlsync.errors import SyncError


def _states(seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A published fp32 state and a next one: tensors of one to several chunks, one unchanged, one all changed."""
    g = torch.Generator().manual_seed(seed)
    old = {f"t{i}": torch.randn(n, generator=g) for i, n in enumerate([5000, 1, 3000, 64, 7001, 2500])}
    new = {name: t.clone() for name, t in old.items()}
    for name, t in new.items():
        if name == "t2":
            continue  # unchanged
        step = 1 if name == "t5" else 7
        t[::step] += 1.0
    return old, new


def _detector(old: dict[str, torch.Tensor]) -> ChangeDetector:
    detector = ChangeDetector(chunk_elements=1000)  # several chunks a tensor, so chunks of two tensors are queued at once
    detector.reset(old)
    return detector


def test_a_stream_finds_the_changes_of_the_whole_state_in_its_order() -> None:
    old, new = _states()
    streaming = _detector(old)
    whole, streamed = _detector(old).diff(new), streaming.diff_stream(iter(new.items()))
    assert list(streamed) == list(whole) == ["t0", "t1", "t3", "t4", "t5"]
    for name, change in whole.items():
        got = streamed[name]
        assert np.array_equal(got.index, change.index) and got.index.dtype == np.int64
        assert np.array_equal(got.old_bits, change.old_bits) and np.array_equal(got.new_bits, change.new_bits)
        assert got.base is streaming.published[name] and torch.equal(got.base, change.base)
    assert streamed["t5"].index.size == 2500 and np.array_equal(streamed["t0"].index, np.arange(0, 5000, 7))


@pytest.mark.parametrize(
    "pairs, message",
    [
        (lambda new: [*new.items(), ("t0", new["t0"])], "'t0' was sent twice"),
        (lambda new: [(n, t) for n, t in new.items() if n != "t4"], "lacks 1 published tensor"),
        (lambda new: [*list(new.items())[:3], ("t3", new["t3"][:10]), *list(new.items())[4:]], "'t3' does not match"),
        (lambda new: [("extra", new["t0"]), *new.items()], "'extra' does not match"),
    ],
    ids=["twice", "missing", "shape", "unknown"],
)
def test_a_stream_that_does_not_name_the_published_tensors_once_is_refused(pairs, message) -> None:
    old, new = _states()
    detector = _detector(old)
    with pytest.raises(SyncError, match=message):
        detector.diff_stream(iter(pairs(new)))
    assert all(torch.equal(detector.published[n], old[n].bfloat16()) for n in old)  # nothing committed


def test_a_chunk_with_more_changes_than_the_first_room_is_compared_again_whole() -> None:
    rng = np.random.default_rng(0)
    old = rng.integers(0, 2**16, FIRST_ROOM * 2 + 5, dtype=np.uint16)
    new = old ^ np.uint16(1)
    new[::3] = old[::3]  # two thirds changed: more than the first comparison has room for
    index, old_bits, new_bits = changed_elements(old, new)
    expected = np.flatnonzero(old != new)
    assert index.size == expected.size > FIRST_ROOM
    assert np.array_equal(index, expected) and np.array_equal(old_bits, old[expected]) and np.array_equal(new_bits, new[expected])
