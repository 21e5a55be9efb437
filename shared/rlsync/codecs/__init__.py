"""Delta codecs, selectable by name (:func:`list_codecs`: each codec's module registers it in :mod:`rlsync.registry`,
``Kind.CODEC``; a new codec is one new file in this package)."""

import torch

from ..defaults import DEFAULT_CODEC
from ..registry import Kind, entries
from .base import Codec, Decoded, DecodeTarget, EncodedTensor, get_codec, list_codecs
from .classgap import ClassGapCodec
from .classrice import ClassRiceCodec
from .gapzz import GapZigzagCodec
from .trl import TrlCodec

#: The capability of the codec for weights on an accelerator (its ranks come from the class order built there).
ACCELERATOR = "accelerator"


def default_codec(device: str | torch.device) -> str:
    """The default codec for weights on ``device`` (``"auto"`` in the trainer's settings).

    Args:
        device: Where the trainer's weights are (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
    """
    if torch.device(device).type == "cpu":
        return DEFAULT_CODEC
    return next(entry.name for entry in entries(Kind.CODEC) if entry.has(ACCELERATOR))

__all__ = [
    "ACCELERATOR",
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
]
