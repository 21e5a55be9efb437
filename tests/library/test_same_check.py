"""The same bounded JSON check for every object a role reads (issue 41, docs/safety.md): the LoRA settings
in an adapter chain's metadata and a checkpoint's ``COMPLETE.json`` marker went through plain
``json.loads``; a hostile one now fails with the library's error, as the other objects do."""

from __future__ import annotations

import pytest

from rlsync.adapters import LoraSpec
from rlsync.errors import CheckpointError, FormatError
from rlsync.layout import CHECKPOINT_MARKER, checkpoint_folder

HOSTILE = {
    "deep": "[" * 100_000 + "]" * 100_000,  # RecursionError out of json.loads
    "long number": '{"rank": ' + "9" * 5000 + "}",  # past int()'s digit limit
    "nan": '{"rank": NaN, "alpha": 1, "target_modules": ["q"]}',
}


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_lora_settings_are_a_format_error(text):
    with pytest.raises(FormatError):
        LoraSpec.from_json(text)


@pytest.mark.parametrize("text", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_checkpoint_marker_is_a_checkpoint_error(bucket, text):
    from rlsync.trl.checkpoints import BucketCheckpoints

    bucket.put(f"{checkpoint_folder(3)}/{CHECKPOINT_MARKER}", text.encode())
    with pytest.raises(CheckpointError, match="malformed"):
        BucketCheckpoints(bucket).marker(3)
