"""Delta codecs, selectable by name: ``classrice``, ``classgap`` and ``gapzz`` (ours) and ``trl`` (baseline)."""

import torch

from ..defaults import DEFAULT_CODEC
from .base import Codec, Decoded, DecodeTarget, EncodedTensor, get_codec, list_codecs, register_codec
from .classgap import ClassGapCodec
from .classrice import ClassRiceCodec
from .gapzz import GapZigzagCodec
from .trl import TrlCodec

#: The codec for weights on an accelerator (the same: its ranks come from the class order built there).
ACCELERATOR_CODEC = ClassRiceCodec.name


def default_codec(device: str | torch.device) -> str:
    """The default codec for weights on ``device`` (``"auto"`` in the trainer's settings).

    Args:
        device: Where the trainer's weights are (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
    """
    return DEFAULT_CODEC if torch.device(device).type == "cpu" else ACCELERATOR_CODEC

__all__ = [
    "ACCELERATOR_CODEC",
    "DEFAULT_CODEC",
    "ClassGapCodec",
    "ClassRiceCodec",
    "Codec",
    "DecodeTarget",
    "Decoded",
    "EncodedTensor",
    "GapZigzagCodec",
    "TrlCodec",
    "default_codec",
    "get_codec",
    "list_codecs",
    "register_codec",
]
