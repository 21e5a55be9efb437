"""Delta codecs, selectable by name: ``classgap`` and ``gapzz`` (ours) and ``trl`` (baseline)."""

import torch

from .base import Codec, EncodedTensor, get_codec, list_codecs, register_codec
from .classgap import ClassGapCodec
from .gapzz import GapZigzagCodec
from .trl import TrlCodec

#: The codec for weights on CPU (and the library default): its encode stays within ~2-3x a bare
#: comparison of the two states, while classgap's per-chunk sort costs ~18-45x that on CPU (README).
DEFAULT_CODEC = GapZigzagCodec.name
#: The codec for weights on an accelerator, where classgap's sorts run beside the comparison.
ACCELERATOR_CODEC = ClassGapCodec.name


def default_codec(device: str | torch.device) -> str:
    """The default codec for weights on ``device``: ``classgap`` on an accelerator, ``gapzz`` on CPU.

    Args:
        device: Where the trainer's weights are (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
    """
    return DEFAULT_CODEC if torch.device(device).type == "cpu" else ACCELERATOR_CODEC

__all__ = [
    "ACCELERATOR_CODEC",
    "DEFAULT_CODEC",
    "ClassGapCodec",
    "Codec",
    "EncodedTensor",
    "GapZigzagCodec",
    "TrlCodec",
    "default_codec",
    "get_codec",
    "list_codecs",
    "register_codec",
]
