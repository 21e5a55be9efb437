"""Delta codecs, selectable by name: ``classgap`` and ``gapzz`` (ours) and ``trl`` (baseline)."""

from .base import Codec, EncodedTensor, get_codec, list_codecs, register_codec
from .classgap import ClassGapCodec
from .gapzz import GapZigzagCodec
from .trl import TrlCodec

DEFAULT_CODEC = GapZigzagCodec.name

__all__ = [
    "DEFAULT_CODEC",
    "ClassGapCodec",
    "Codec",
    "EncodedTensor",
    "GapZigzagCodec",
    "TrlCodec",
    "get_codec",
    "list_codecs",
    "register_codec",
]
