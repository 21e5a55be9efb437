"""Codecs and change detection called directly: empty changes, refusals that name the tensor and the
entry at fault (delta files reach the codecs only after ``decode_delta`` checked the entry names, so
these paths are unreachable through the format), the word scan and schema check of change detection."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from rlsync.codecs import DecodeTarget, GapZigzagCodec, get_codec, list_codecs
from rlsync.codecs.checks import check_index, require_entry
from rlsync.detect import ChangeDetector, changed_elements
from rlsync.errors import FormatError, SyncError

CODECS = ["gapzz", "trl"]


def _no_old_bits(index: np.ndarray) -> np.ndarray:
    return np.zeros(index.size, dtype=np.uint16)


def _target(count: int, numel: int) -> DecodeTarget:
    """A bf16-sized tensor of ``numel`` elements, all bits zero, patched at ``count`` positions."""
    return DecodeTarget(count=count, numel=numel, itemsize=2, bits_at=_no_old_bits)


@pytest.mark.parametrize("codec", CODECS)
def test_empty_change_round_trips(codec: str) -> None:
    codec_ = get_codec(codec)
    empty = np.zeros(0, dtype=np.int64)
    encoded = codec_.encode("w", empty, np.zeros(0, np.uint16), np.zeros(0, np.uint16))
    assert sorted(encoded.entries) == sorted(codec_.entry_names("w"))
    assert encoded.params == ({"gap_bytes": 1} if codec == "gapzz" else {})  # the narrowest width: nothing to hold
    index, bits, _ = codec_.decode("w", encoded.entries, encoded.params, _target(0, 10))
    assert index.size == 0 and bits.size == 0


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("which", [0, 1])
def test_missing_entry_is_named(codec: str, which: int) -> None:
    codec_ = get_codec(codec)
    encoded = codec_.encode("layer.w", np.array([1, 4], np.int64), np.zeros(2, np.uint16), np.ones(2, np.uint16))
    missing = codec_.entry_names("layer.w")[which]
    del encoded.entries[missing]
    with pytest.raises(FormatError, match=re.escape(f"'{missing}'")):
        codec_.decode("layer.w", encoded.entries, encoded.params, _target(2, 8))


@pytest.mark.parametrize("codec", CODECS)
def test_index_refusals_name_the_tensor(codec: str) -> None:
    codec_ = get_codec(codec)
    encoded = codec_.encode("layer.w", np.array([1, 7], np.int64), np.zeros(2, np.uint16), np.ones(2, np.uint16))
    with pytest.raises(FormatError, match=r"^layer\.w: index out of range for a tensor of 7 elements$"):
        codec_.decode("layer.w", encoded.entries, encoded.params, _target(2, 7))


def test_check_index_messages_name_the_tensor() -> None:
    check_index("t", np.array([5], np.int64), 6)  # a single in-range position is fine
    with pytest.raises(FormatError, match=r"^t: index out of range for a tensor of 6 elements$"):
        check_index("t", np.array([-1, 2], np.int64), 6)
    with pytest.raises(FormatError, match=r"^t: indices are not strictly increasing \(duplicates or unsorted\)$"):
        check_index("t", np.array([2, 2], np.int64), 6)


def test_require_entry_checks_dtype_rank_and_length() -> None:
    entries = {"a": torch.zeros(3, dtype=torch.uint8), "b": torch.zeros(1, 3, dtype=torch.uint8)}
    assert require_entry(entries, "a", torch.uint8, 3) is entries["a"]
    with pytest.raises(FormatError, match=r"^entry 'a': expected 1-D torch.int32, got 1-D torch.uint8$"):
        require_entry(entries, "a", torch.int32)
    with pytest.raises(FormatError, match=r"^entry 'b': expected 1-D torch.uint8, got 2-D torch.uint8$"):
        require_entry(entries, "b", torch.uint8)
    with pytest.raises(FormatError, match=r"^entry 'a': expected 4 elements, got 3$"):
        require_entry(entries, "a", torch.uint8, 4)
    with pytest.raises(FormatError, match=r"^missing entry 'c'$"):
        require_entry(entries, "c", torch.uint8)


def test_registered_codecs_are_the_codec_objects() -> None:
    for name in list_codecs():
        assert get_codec(name).name == name
    with pytest.raises(FormatError, match=r"^unknown codec 'zip'; known codecs: \[") as info:
        get_codec("zip")
    assert str(list_codecs()) in str(info.value)


def test_a_registered_codec_is_what_get_codec_returns(scratch_registry) -> None:
    codec = GapZigzagCodec(level=3)
    codec.name = "gapzz-level3"
    assert scratch_registry.register(scratch_registry.Kind.CODEC, "gapzz-level3", codec).load() is codec
    assert get_codec("gapzz-level3") is codec and "gapzz-level3" in list_codecs()


def test_gapzz_compression_level_is_used_and_decodes_the_same() -> None:
    index = np.arange(0, 60_000, 3, dtype=np.int64)
    old = (np.arange(index.size) % 251).astype(np.uint16)
    new = old + (np.arange(index.size) % 3).astype(np.uint16)
    fast, strong = GapZigzagCodec(level=1), GapZigzagCodec(level=19)
    encoded = [c.encode("w", index, old, new) for c in (fast, strong)]
    assert not torch.equal(encoded[0].entries["w.val"], encoded[1].entries["w.val"])  # the level reached zstd
    for enc in encoded:
        got_index, got_bits, _ = fast.decode(
            "w", enc.entries, enc.params, DecodeTarget(count=index.size, numel=60_000, itemsize=2, bits_at=lambda i: old)
        )
        np.testing.assert_array_equal(got_index, index)
        np.testing.assert_array_equal(got_bits, new)


@pytest.mark.parametrize("part", ["pos", "val"])
def test_gapzz_stream_refusals_name_the_entry(part: str) -> None:
    codec = get_codec("gapzz")
    encoded = codec.encode("layer.w", np.array([1, 4], np.int64), np.zeros(2, np.uint16), np.ones(2, np.uint16))
    encoded.entries[f"layer.w.{part}"] = torch.frombuffer(bytearray(b"not zstd at all"), dtype=torch.uint8)
    with pytest.raises(FormatError, match=rf"^entry 'layer\.w\.{part}': not a zstd frame"):
        codec.decode("layer.w", encoded.entries, encoded.params, _target(2, 8))


@pytest.mark.parametrize("swap", [False, True])
def test_change_detection_compares_words_by_bits(swap: bool) -> None:
    """The 8-byte word scan of change detection compares bits: a word whose float64 reading equals
    the other word's integer value (lanes [1, 0, 0, 0] against [0, 0, 0, 0x3FF0], i.e. 1 and 1.0) differs."""
    old = np.array([1, 0, 0, 0, 7, 7, 7, 7, 5], dtype=np.uint16)
    new = np.array([0, 0, 0, 0x3FF0, 7, 7, 7, 8, 5], dtype=np.uint16)
    if swap:
        old, new = new, old
    index, old_bits, new_bits = changed_elements(old, new)
    np.testing.assert_array_equal(index, [0, 3, 7])
    np.testing.assert_array_equal(old_bits, old[[0, 3, 7]])
    np.testing.assert_array_equal(new_bits, new[[0, 3, 7]])


def test_change_detector_needs_the_published_names_shapes_and_dtypes() -> None:
    state = {"a": torch.zeros(4, 3), "b": torch.zeros(5, dtype=torch.int64)}
    detector = ChangeDetector()
    assert not detector.compatible(state)  # nothing published yet
    detector.reset(state)
    assert detector.compatible({"a": torch.ones(4, 3), "b": torch.ones(5, dtype=torch.int64)})
    for other in (
        {"a": state["a"]},  # a tensor less
        {**state, "c": torch.zeros(1)},  # a tensor more
        {**state, "a": torch.zeros(3, 4)},  # same dtype, other shape
        {**state, "b": torch.zeros(5, dtype=torch.int32)},  # same shape, other dtype
    ):
        assert not detector.compatible(other)
        with pytest.raises(SyncError, match="^state does not match the published state's names, shapes and dtypes"):
            detector.diff(other)
