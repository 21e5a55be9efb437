"""The codec interface: how one tensor's changed elements are stored in a delta.

A codec turns (sorted flat positions, old bits, new bits) of one tensor into
named safetensors entries plus a few JSON-able parameters, and back. Change
detection (which elements changed) is not the codec's job; see
:mod:`rlsync.detect`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Mapping, NamedTuple

import numpy as np
import torch

from ..errors import ConfigurationError, UnknownNameError
from ..registry import Kind, get, names


@dataclasses.dataclass
class EncodedTensor:
    """One tensor's share of a delta file.

    Attributes:
        entries: safetensors entries to store, keyed by their full name.
        params: Small JSON-able values the decoder needs (stored in the metadata).
    """

    entries: dict[str, torch.Tensor]
    params: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class DecodeTarget:
    """What a decode patches: one tensor as the receiver holds it, and how many of its elements change.

    Attributes:
        count: The number of changed elements the delta's metadata declares.
        numel: The tensor's number of elements.
        itemsize: Bytes per element.
        bits_at: Returns the tensor's current bit patterns at given flat positions.
        tensor: The tensor itself (only read), for codecs whose coding order derives from the old
            weights; without it they read the old bits through ``bits_at``.
    """

    count: int
    numel: int
    itemsize: int
    bits_at: Callable[[np.ndarray], np.ndarray]
    tensor: torch.Tensor | None = None


class Decoded(NamedTuple):
    """One tensor's decoded patch (see :meth:`Codec.decode`)."""

    index: np.ndarray
    new_bits: np.ndarray
    old_bits: np.ndarray | None = None


class Codec(abc.ABC):
    """Encodes and decodes the changed elements of one tensor."""

    #: Name written into the delta's metadata and used with :func:`get_codec`.
    name: str
    #: Version written into the metadata; decoders refuse other versions.
    version: int
    #: Whether :meth:`decode` can only yield new bit patterns that differ from the old ones (the
    #: encoding has no zero difference), so that readers need not gather the old bits to check.
    changes_nonzero: bool = False

    @abc.abstractmethod
    def entry_names(self, name: str) -> list[str]:
        """The safetensors entry names this codec stores for tensor ``name``."""

    @abc.abstractmethod
    def encode(
        self, name: str, index: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray, *, base: torch.Tensor | None = None
    ) -> EncodedTensor:
        """Encode the changed elements of tensor ``name``.

        Args:
            name: The tensor's name (entries are named after it).
            index: Sorted, unique flat positions, ``int64``.
            old_bits: The published bit patterns at ``index`` (unsigned ints of the dtype's width).
            new_bits: The new bit patterns at ``index``, same dtype as ``old_bits``.
            base: The whole published tensor (on any device), which the receiver
                holds; context codecs derive their coding order from it, others ignore it.
        """

    @abc.abstractmethod
    def decode(self, name: str, entries: Mapping[str, torch.Tensor], params: Mapping[str, Any], target: DecodeTarget) -> Decoded:
        """Decode one tensor's entries into the changed positions and their new bit patterns.

        Args:
            name: The tensor's name.
            entries: Its safetensors entries, as read from the file.
            params: The parameters :meth:`encode` returned.
            target: The tensor being patched, as the receiver holds it, and the declared count.

        Returns:
            Sorted, unique, in-range ``int64`` positions, the new bit patterns, and the old bit
            patterns at those positions where the decoder read them anyway (``None`` otherwise:
            the caller gathers them with ``target.bits_at``).

        Raises:
            FormatError: the entries are malformed or hostile (out-of-range or
                duplicate indices, wrong sizes or dtypes).
        """


_INSTANCES: dict[int, Codec] = {}


def get_codec(name: str) -> Codec:
    """The codec registered under ``name`` (:data:`rlsync.registry.Kind.CODEC`), one instance per entry.

    Raises:
        FormatError: no codec has that name.
    """
    from ..errors import FormatError

    try:
        entry = get(Kind.CODEC, name)
    except UnknownNameError:
        raise FormatError(f"unknown codec {name!r}; known codecs: {list_codecs()}") from None
    found = entry.load()
    codec = found if isinstance(found, Codec) else _INSTANCES.setdefault(id(found), found())
    if codec.name != name:
        raise ConfigurationError(f"codec {name!r} is registered to a codec named {codec.name!r}")
    return codec


def list_codecs() -> list[str]:
    """Names of all registered codecs."""
    return names(Kind.CODEC)
