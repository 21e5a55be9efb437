"""The vLLM backend's status is one record (rlsync.vllm.status.TransferStatus): what a worker sends is read back
through the same type, another format version or a malformed record is refused, and a tensor-parallel group's
statuses merge into one."""

from __future__ import annotations

import dataclasses

import pytest

from rlsync.errors import FormatError
from rlsync.vllm.status import FORMAT_VERSION, Pause, Prepared, Rehash, TransferStatus

STATUS = TransferStatus(
    step=3, state_hash="h3", prepared=Prepared(4, "delta", "h4", 100), pause=Pause(0.5, 0, 1),
    rehash=Rehash(3, "h3", "h3"), reads=7,
)  # fmt: skip


def test_a_status_reads_back_as_it_was_sent():
    wire = STATUS.to_wire()
    assert wire["format"] == FORMAT_VERSION and wire["pause"] == {"s": 0.5, "reads": 0, "applied": 1}
    assert TransferStatus.from_wire(wire) == STATUS


@pytest.mark.parametrize(
    "change, match",
    [
        ({"format": FORMAT_VERSION + 1}, "format 2"),
        ({"format": None}, "format None"),
        ({"surprise": 1}, "surprise"),
        ({"rehash": {"step": 3}}, "malformed"),
        ({"pause": {"s": 1, "seconds": 2}}, "malformed"),
        ({"prepared": {"step": 4}}, "malformed"),
    ],
)
def test_another_version_or_a_malformed_status_is_refused(change, match):
    with pytest.raises(FormatError, match=match):
        TransferStatus.from_wire({**STATUS.to_wire(), **change})
    missing = STATUS.to_wire()
    del missing["reads"]
    with pytest.raises(FormatError, match="reads"):
        TransferStatus.from_wire(missing)


def test_a_groups_statuses_merge_into_one():
    other = dataclasses.replace(STATUS, error="refused", rehash=Rehash(3, "h3", "bad"), preparing=False)
    merged = TransferStatus.merge([STATUS, other])
    assert merged.error == "refused" and merged.rehash.mismatch and merged.step == 3
    with pytest.raises(RuntimeError, match="different updates"):
        TransferStatus.merge([STATUS, dataclasses.replace(STATUS, prepared=Prepared(5, "delta", "h5"))])
    assert TransferStatus.merge([STATUS, dataclasses.replace(STATUS, preparing=True, prepared=None)]).preparing
