"""What vLLM can serve on this machine, known before an engine starts (no vLLM import).

vLLM chooses its kernels when it loads a model, and a kernel this machine cannot run fails then, in
a worker process, with a traceback. The FP8 chain (:mod:`rlsync.fp8`) is served from a block-FP8
checkpoint, whose CPU kernel (vLLM's ``CPUFp8BlockScaledMMKernel``) needs AMX tiles and the kernel
library vLLM's CPU build loads only with AVX-512 BF16; :func:`fp8_serving_refusal` asks the same
questions as vLLM's kernel does (``torch.cpu``) and says what to do instead, before any model loads.
"""

from __future__ import annotations

from ..cpu import CpuFeature, cpu_name, missing_features
from ..errors import UnsupportedHardwareError

__all__ = ["FP8_CPU_FEATURES", "MIN_FP8_CUDA_CAPABILITY", "check_fp8_serving", "fp8_serving_refusal"]

#: What vLLM's CPU block-FP8 kernel needs: AMX tiles (its ``is_supported``), and AVX-512 BF16, without
#: which vLLM's CPU build loads a kernel library that has no ``fp8_scaled_mm_cpu``.
FP8_CPU_FEATURES = (CpuFeature.AMX_TILE, CpuFeature.AVX512_BF16)
#: The oldest CUDA compute capability vLLM serves block FP8 on (Ampere, through its FP8 Marlin kernel).
MIN_FP8_CUDA_CAPABILITY = (8, 0)
#: What to use instead, in every refusal.
INSTEAD = "set ROLLOUT_CHAIN=bf16 to serve the bf16 weights, or serve the FP8 chain on a GPU"


def fp8_serving_refusal(device: str = "cpu") -> str | None:
    """Why vLLM cannot serve the FP8 chain on ``device`` here, as one line; ``None`` when it can.

    Args:
        device: ``"cpu"``, or a CUDA device (``"cuda"``, ``"cuda:1"``).
    """
    if device.startswith("cuda"):
        import torch

        capability = torch.cuda.get_device_capability(device)
        if tuple(capability) >= MIN_FP8_CUDA_CAPABILITY:
            return None
        need = ".".join(map(str, MIN_FP8_CUDA_CAPABILITY))
        return (
            f"the FP8 chain cannot be served on this GPU ({torch.cuda.get_device_name(device)}, compute capability "
            f"{capability[0]}.{capability[1]}): vLLM's block-FP8 kernels need {need} or newer; {INSTEAD}"
        )
    missing = missing_features(*FP8_CPU_FEATURES)
    if not missing:
        return None
    return (
        f"the FP8 chain cannot be served on this CPU ({cpu_name()}): vLLM's CPU block-FP8 kernel needs "
        f"{' and '.join(f.label for f in missing)}, which it lacks; {INSTEAD}"
    )


def check_fp8_serving(device: str = "cpu") -> None:
    """Refuse to serve the FP8 chain where vLLM cannot (:func:`fp8_serving_refusal`).

    Raises:
        UnsupportedHardwareError: With the refusal's line.
    """
    if (refusal := fp8_serving_refusal(device)) is not None:
        raise UnsupportedHardwareError(refusal)
