"""``trl``: the plain layout of the public TRL delta-sync design, our baseline.

Per changed tensor, ``{name}.indices`` holds flat positions as ``int32`` (``int64``
for tensors over 2**31 - 1 elements, which int32 cannot address) and
``{name}.values`` the new values in the tensor's own dtype: 6 bytes per changed
bf16 element, uncompressed.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from ..dtypes import int_view, uint_dtype
from ..errors import FormatError
from ..registry import Kind, register
from .base import Codec, Decoded, DecodeTarget, EncodedTensor
from .checks import check_index, require_entry

_INT32_LIMIT = 2**31 - 1


class TrlCodec(Codec):
    """Uncompressed int32 indices and raw values."""

    name = "trl"
    version = 1

    def entry_names(self, name: str) -> list[str]:
        return [f"{name}.indices", f"{name}.values"]

    def encode(
        self, name: str, index: np.ndarray, old_bits: np.ndarray, new_bits: np.ndarray, *, base: torch.Tensor | None = None
    ) -> EncodedTensor:
        wide = index.size > 0 and int(index[-1]) > _INT32_LIMIT
        idx = torch.from_numpy(index.astype(np.int64 if wide else np.int32))
        signed = new_bits.view(np.dtype(f"int{8 * new_bits.itemsize}"))
        return EncodedTensor(
            entries={f"{name}.indices": idx, f"{name}.values": torch.from_numpy(np.ascontiguousarray(signed))},
            params={},
        )

    def decode(self, name: str, entries: Mapping[str, torch.Tensor], params: Mapping[str, Any], target: DecodeTarget) -> Decoded:
        idx_key, val_key = self.entry_names(name)
        if idx_key not in entries:
            raise FormatError(f"missing entry {idx_key!r}")
        idx_dtype = entries[idx_key].dtype
        if idx_dtype not in (torch.int32, torch.int64):
            raise FormatError(f"entry {idx_key!r}: expected int32 or int64 indices, got {idx_dtype}")
        index = require_entry(entries, idx_key, idx_dtype, target.count).numpy().astype(np.int64)
        values = entries.get(val_key)
        if values is None or values.dim() != 1 or values.numel() != target.count or values.element_size() != target.itemsize:
            raise FormatError(f"entry {val_key!r}: expected {target.count} values of {target.itemsize} bytes")
        check_index(name, index, target.numel)
        return Decoded(index, int_view(values).numpy().view(uint_dtype(target.itemsize)))


register(Kind.CODEC, "trl", "rlsync.codecs.trl:TrlCodec",
         summary="the plain layout of the public TRL delta-sync design (baseline)")
