"""Delta codecs, selectable by name: ``gapzz`` (ours, default) and ``trl`` (baseline)."""

from .base import Codec, EncodedTensor, get_codec, list_codecs, register_codec
from .gapzz import GapZigzagCodec
from .trl import TrlCodec

DEFAULT_CODEC = GapZigzagCodec.name

__all__ = [
    "DEFAULT_CODEC",
    "Codec",
    "EncodedTensor",
    "GapZigzagCodec",
    "TrlCodec",
    "get_codec",
    "list_codecs",
    "register_codec",
]
