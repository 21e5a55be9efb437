"""FP8 serving chains of a bf16 trainer: block-quantized e4m3 weights beside the bf16 chain.

A trainer that publishes bf16 weights can publish, beside its bf16 chain, a second chain in the
block-FP8 layout vLLM loads for DeepSeek-V3 and Qwen3-FP8 checkpoints: every quantized
``<module>.weight`` becomes ``float8_e4m3fn`` beside a ``float32`` ``<module>.weight_scale_inv``
holding one scale per 128x128 block (the dequantized weight is ``fp8 * scale``); every other
tensor stays bf16. Version ``N`` of the FP8 chain is :func:`quantize_state` of version ``N`` of
the bf16 chain, computed on the trainer. It has its own anchors and deltas (the changed FP8 bytes
and the changed scales), its own whole-state hash and its own prefix
(:data:`~rlsync.layout.FP8_PREFIX`), and is written and read by the unchanged
:class:`~rlsync.protocol.Publisher` and :class:`~rlsync.protocol.Subscriber` through a
:class:`~rlsync.bucket.PrefixedBucket`::

    latest.json, anchors/, deltas/        the bf16 chain
    fp8/latest.json                       the FP8 chain's pointer; its metadata names the scheme
    fp8/anchors/…, fp8/deltas/…           FP8 versions: e4m3 bytes, block scales, the bf16 rest

A replica chooses the chain it follows. An FP8 replica never quantizes anything itself: its weights
and scales are the trainer's, bit for bit, and its state hash checks it.

Quantization (:func:`quantize_block`), the same bits on any device: per 128x128 block (partial
blocks at the edges), ``amax = max(|w|)`` in fp32, floored at :data:`AMAX_FLOOR`;
``scale = amax / 448``; ``q = e4m3(clamp(w * (448 / amax), -448, 448))`` (IEEE fp32 divide and
multiply, round-to-nearest-even cast). Which tensors (:func:`is_quantized`): the 2-D ``weight`` of
every linear projection (``q/k/v/o_proj``, ``gate/up/down_proj``, per expert in MoE checkpoints),
as vLLM's FP8 checkpoints have them; not embeddings, norms, ``lm_head`` nor MoE routers
(``mlp.gate``). The rule is the chain's metadata (:func:`chain_metadata`), and
:func:`quantization_config` turns a state's names into the ``config.json`` entry vLLM reads
(``modules_to_not_convert`` naming every 2-D weight left in bf16).

Hostile input: an FP8 replica checks every value an anchor or delta would write
(:func:`check_fp8_values`, the subscriber's ``check_values``) before anything is applied: a scale
that is not finite, not positive or outside what the quantizer produces from bf16 weights, or an
FP8 byte that encodes NaN, refuses the update.
"""

from __future__ import annotations

import enum
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping

import torch

from .bucket import Bucket, PrefixedBucket
from .errors import FormatError
from .layout import FP8_PREFIX, POINTER_KEY

if TYPE_CHECKING:  # imported where used: the chain's names stay cheap to import (no numba) for `rlsync.vllm.serve`
    from .protocol import Publisher, Subscriber

FP8_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32
#: Largest finite e4m3 value.
FP8_MAX = 448.0
#: Smallest block maximum the quantizer divides by (an all-zero block gets the scale ``AMAX_FLOOR / 448``).
AMAX_FLOOR = 1e-4
#: Block shape (rows, columns) of vLLM's block-FP8 kernels and of DeepSeek-V3 / Qwen3-FP8 checkpoints.
BLOCK = (128, 128)
SCALE_SUFFIX = "weight_scale_inv"
#: Modules whose 2-D ``weight`` is quantized: the linear projections of attention and MLPs (and experts).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Name of the recipe above; a change of the bytes it produces is a new scheme.
SCHEME = "block-e4m3-v1"
_NAN_BITS = (0x7F, 0xFF)  # e4m3fn's two NaN encodings; the quantizer never writes them


class Fp8Metadata(str, enum.Enum):
    """Keys of an FP8 chain's pointer metadata."""

    SCHEME = "fp8_scheme"
    FORMAT = "fp8_format"


def _fp32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


#: The scales the quantizer can produce from finite bf16 weights: ``[AMAX_FLOOR, bf16 max] / 448`` in fp32.
MIN_SCALE = _fp32(_fp32(AMAX_FLOOR) / FP8_MAX)
MAX_SCALE = _fp32(torch.finfo(torch.bfloat16).max / FP8_MAX)


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the FP8 chain quantizes the tensor ``name`` of ``shape`` (see the module docstring)."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and len(shape) == 2 and module.rpartition(".")[2] in PROJECTIONS


def scale_name(name: str) -> str:
    """The scale tensor of the quantized weight ``name`` (``….weight`` -> ``….weight_scale_inv``)."""
    return name[: -len("weight")] + SCALE_SUFFIX


def quantize_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a 2-D weight to e4m3 with one fp32 scale per :data:`BLOCK` block.

    Args:
        weight: The weight (the FP8 chain passes the bf16 bits the bf16 chain publishes).

    Returns:
        ``(q, scale)``: ``q`` of ``weight``'s shape in ``float8_e4m3fn`` and ``scale`` of shape
        ``(ceil(rows / 128), ceil(cols / 128))`` in ``float32``, on ``weight``'s device.
    """
    rows, cols = weight.shape
    br, bc = BLOCK
    nr, nc = -(-rows // br), -(-cols // bc)
    x = weight.float()
    if (rows, cols) != (nr * br, nc * bc):
        padded = x.new_zeros(nr * br, nc * bc)
        padded[:rows, :cols] = x
        x = padded
    blocks = x.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_(min=AMAX_FLOOR)
    q = (blocks * (FP8_MAX / amax)[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nr * br, nc * bc)[:rows, :cols].contiguous(), amax / FP8_MAX


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``q * scale`` per block, in ``dtype``: what a bf16 engine serves for an FP8 weight."""
    rows, cols = q.shape
    full = scale.repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(BLOCK[1], 1)[:, :cols]
    return (q.float() * full).to(dtype)


def quantize_stream(
    tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype = torch.bfloat16
) -> Iterator[tuple[str, torch.Tensor]]:
    """The FP8 chain's tensors from ``(name, tensor)`` pairs, floating-point ones taken in ``dtype``
    (cast as the bf16 chain casts them).

    Yields ``(name, q)`` and ``(scale_name(name), scale)`` for a quantized weight, every other
    tensor as the bf16 chain publishes it.
    """
    for name, tensor in tensors:
        source = tensor.detach().to(dtype) if tensor.is_floating_point() else tensor.detach()
        if is_quantized(name, tuple(tensor.shape)):
            q, scale = quantize_block(source)
            yield name, q
            yield scale_name(name), scale
        else:
            yield name, source


def quantize_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """:func:`quantize_stream` of a whole state."""
    return dict(quantize_stream(state.items(), dtype))


def dequantize_state(state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """An FP8 chain state as the checkpoint a bf16 engine serves (each quantized weight ``q * scale``)."""
    return {
        name: dequantize_block(t, state[scale_name(name)], dtype) if t.dtype == FP8_DTYPE else t
        for name, t in state.items()
        if not name.endswith(SCALE_SUFFIX)
    }


def quantization_config(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The ``quantization_config`` entry of ``config.json`` that makes vLLM load an FP8 chain state.

    ``modules_to_not_convert`` names the module of every 2-D weight left in bf16 (``lm_head``,
    MoE routers, embeddings).
    """
    kept = sorted(n[: -len(".weight")] for n, t in state.items() if n.endswith(".weight") and t.dim() == 2 and t.dtype != FP8_DTYPE)
    return {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK), "modules_to_not_convert": kept,
    }  # fmt: skip


def chain_metadata() -> dict[str, str]:
    """The FP8 chain's pointer metadata: the scheme, and which tensors it quantizes and how."""
    fmt = {"fmt": "e4m3", "weight_block_size": list(BLOCK), "scale": SCALE_SUFFIX, "quantized_modules": list(PROJECTIONS),
           "not_quantized": "embeddings, norms, lm_head, MoE routers, every tensor that is not a 2-D projection weight"}
    return {Fp8Metadata.SCHEME.value: SCHEME, Fp8Metadata.FORMAT.value: json.dumps(fmt, sort_keys=True)}


def check_fp8_values(name: str, values: torch.Tensor) -> None:
    """Refuse values an FP8 anchor or delta would write that the trainer's quantizer never produces.

    Scales (``*.weight_scale_inv``) must be float32, finite and within ``[MIN_SCALE, MAX_SCALE]``
    (so never zero or negative); FP8 weights must not encode NaN. Other tensors pass.

    Raises:
        FormatError: naming the tensor, how many values and the first one.
    """
    if name.endswith(SCALE_SUFFIX):
        if values.dtype != SCALE_DTYPE:
            raise FormatError(f"{name}: FP8 scales are float32, not {values.dtype}")
        bad = ~(torch.isfinite(values) & (values >= MIN_SCALE) & (values <= MAX_SCALE))
        if bool(bad.any()):
            raise FormatError(
                f"{name}: {int(bad.sum())} scale(s) non-finite, zero or outside [{MIN_SCALE:.4g}, {MAX_SCALE:.4g}] "
                f"(e.g. {float(values[bad][0])!r}); refused before applying"
            )
    elif values.dtype == FP8_DTYPE:
        bits = values.view(torch.uint8)
        nan = int(((bits == _NAN_BITS[0]) | (bits == _NAN_BITS[1])).sum())
        if nan:
            raise FormatError(f"{name}: {nan} FP8 value(s) encode NaN; refused before applying")


class Chain(str, enum.Enum):
    """The weight chain a replica follows: the trainer's bf16 weights, or their FP8 serving chain."""

    BF16 = "bf16"
    FP8 = "fp8"

    @property
    def pointer_key(self) -> str:
        """The chain's pointer key in the run's bucket (what a replica watches for new versions)."""
        return POINTER_KEY if self is Chain.BF16 else FP8_PREFIX + POINTER_KEY

    def bucket(self, bucket: Bucket) -> Bucket:
        """The view of the run's ``bucket`` the chain is read from."""
        return bucket if self is Chain.BF16 else fp8_bucket(bucket)

    def subscriber(self, bucket: Bucket, **kwargs: Any) -> Subscriber:
        """A :class:`~rlsync.protocol.Subscriber` of the chain (:func:`fp8_subscriber` for FP8).

        Args:
            bucket: The run's bucket.
            **kwargs: Further :class:`~rlsync.protocol.Subscriber` arguments.
        """
        from .protocol import Subscriber

        return Subscriber(bucket, **kwargs) if self is Chain.BF16 else fp8_subscriber(bucket, **kwargs)


def fp8_bucket(bucket: Bucket) -> PrefixedBucket:
    """The view of ``bucket`` the FP8 chain is published in and read from."""
    return PrefixedBucket(bucket, FP8_PREFIX)


def fp8_publisher(bucket: Bucket, **kwargs: Any) -> Publisher:
    """A :class:`~rlsync.protocol.Publisher` of the FP8 chain of ``bucket``: tensors published in the
    dtypes :func:`quantize_state` gives them, the scheme in the pointer's metadata.

    Args:
        bucket: The run's bucket (the chain goes under :data:`~rlsync.layout.FP8_PREFIX`).
        **kwargs: Further :class:`~rlsync.protocol.Publisher` arguments (policy, codec, owner...).
    """
    from .protocol import Publisher

    return Publisher(fp8_bucket(bucket), dtype=None, metadata=chain_metadata(), **kwargs)


def fp8_subscriber(bucket: Bucket, **kwargs: Any) -> Subscriber:
    """A :class:`~rlsync.protocol.Subscriber` of the FP8 chain of ``bucket``: a chain of another scheme is
    refused before any download, and every value is checked (:func:`check_fp8_values`) before it is applied."""
    expect = {Fp8Metadata.SCHEME.value: SCHEME}
    from .protocol import Subscriber

    return Subscriber(fp8_bucket(bucket), expect_metadata=expect, check_values=check_fp8_values, **kwargs)


def write_fp8_checkpoint(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """The FP8 checkpoint an engine serving the FP8 chain starts from: ``source``'s bf16 checkpoint quantized
    (:func:`quantize_state`), ``config.json`` with its :func:`quantization_config`, the other files copied.

    vLLM builds a model's FP8 modules from the checkpoint it starts with; the chain's first anchor then
    replaces every weight and scale, so the folder only gives vLLM the layout (the trainer's quantization of
    the same bf16 weights, should they be the run's base).

    Args:
        source: A model folder with ``config.json`` and ``*.safetensors`` (bf16).
        target: The folder to write (created; existing files are overwritten).

    Returns:
        ``target`` as a :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: ``source`` has no safetensors weights.
    """
    from safetensors.torch import load_file, save_file

    source, target = Path(source), Path(target)
    files = sorted(source.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {source}")
    target.mkdir(parents=True, exist_ok=True)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    quantized = quantize_state(state)
    for entry in source.iterdir():
        if entry.is_file() and entry.suffix != ".safetensors" and entry.name != "model.safetensors.index.json":
            shutil.copyfile(entry, target / entry.name)
    save_file(quantized, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization_config(quantized)
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return target
