"""What this machine's processor can run, asked the way the libraries that depend on it ask.

Machines differ (AMX or not, AVX-512 or not, Intel or AMD), CI machines too. A path that needs a
processor feature asks here first and refuses with one line that names what is missing and what to use
instead (a test skips with the same line), rather than failing deep inside a kernel:

>>> from rlsync.cpu import CpuFeature, cpu_features
>>> CpuFeature.AVX2 in cpu_features()
True

Each feature is read from the library whose code depends on it: torch's own checks (``torch.cpu``,
which vLLM's CPU kernels use to choose a kernel) and LLVM's view of the host (``llvmlite``, which numba
compiles for). docs/testing.md lists the tests that need a feature and what each does without it.
"""

from __future__ import annotations

import enum
import functools
import platform
from pathlib import Path

__all__ = ["CpuFeature", "cpu_features", "cpu_name", "has_fast_pdep", "has_feature", "is_x86_64", "missing_features"]


class CpuFeature(str, enum.Enum):
    """A processor feature some path of the project needs (x86-64)."""

    AVX2 = "avx2"
    AVX512 = "avx512"
    #: AVX-512 with bf16 dot products: vLLM's CPU build loads its full kernel library only with it.
    AVX512_BF16 = "avx512_bf16"
    VNNI = "vnni"
    #: Intel AMX tiles (Sapphire Rapids or newer): vLLM's CPU FP8 and packed-GEMM kernels.
    AMX_TILE = "amx_tile"
    #: BMI2's ``pdep``, which the ``classrice`` kernels use where numba compiles for this host.
    BMI2 = "bmi2"

    @property
    def label(self) -> str:
        """The name people know it by."""
        return _LABELS[self]


_LABELS = {
    CpuFeature.AVX2: "AVX2",
    CpuFeature.AVX512: "AVX-512",
    CpuFeature.AVX512_BF16: "AVX-512 BF16",
    CpuFeature.VNNI: "VNNI",
    CpuFeature.AMX_TILE: "AMX tiles (Intel Sapphire Rapids or newer)",
    CpuFeature.BMI2: "BMI2",
}

#: Each feature torch checks, by the name of its check in ``torch.cpu``.
_TORCH_CHECKS = {
    CpuFeature.AVX2: "_is_avx2_supported",
    CpuFeature.AVX512: "_is_avx512_supported",
    CpuFeature.AVX512_BF16: "_is_avx512_bf16_supported",
    CpuFeature.VNNI: "_is_vnni_supported",
    CpuFeature.AMX_TILE: "_is_amx_tile_supported",
}


def is_x86_64() -> bool:
    """Whether this is an x86-64 machine (the features above are x86-64 ones)."""
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def has_feature(feature: CpuFeature) -> bool:
    """Whether this machine's processor has ``feature`` (never on other architectures than x86-64).

    BMI2 is read from LLVM (numba's view) only when asked for: a ``vllm serve`` process asks for the others
    before vLLM starts its workers, and vLLM 0.32's CPU kernel-override scan breaks on llvmlite's library
    object once ``llvmlite.binding`` is imported (``AttributeError: '_lib_fn_wrapper' object has no
    attribute 'get'`` in every worker).
    """
    if not is_x86_64():
        return False
    if feature is CpuFeature.BMI2:
        from llvmlite import binding as llvm

        return bool(llvm.get_host_cpu_features().get("bmi2", False))
    import torch

    return bool(getattr(torch.cpu, _TORCH_CHECKS[feature], lambda: False)())


#: LLVM's names of the x86-64 CPUs with BMI2 whose ``pdep`` is microcoded (AMD before Zen 3: hundreds of cycles).
SLOW_PDEP_CPUS = frozenset({"bdver4", "znver1", "znver2"})


@functools.cache
def has_fast_pdep() -> bool:
    """Whether this CPU has BMI2 (:attr:`CpuFeature.BMI2`) with a ``pdep`` of a few cycles (not one of
    :data:`SLOW_PDEP_CPUS`, as LLVM names the host, which numba compiles for)."""
    if not has_feature(CpuFeature.BMI2):
        return False
    from llvmlite import binding as llvm

    return llvm.get_host_cpu_name() not in SLOW_PDEP_CPUS


def cpu_features() -> frozenset[CpuFeature]:
    """Every feature of :class:`CpuFeature` this machine's processor has."""
    return frozenset(feature for feature in CpuFeature if has_feature(feature))


def missing_features(*needed: CpuFeature) -> list[CpuFeature]:
    """Those of ``needed`` this processor lacks, in the order given (only those are looked up)."""
    return [feature for feature in needed if not has_feature(feature)]


@functools.cache
def cpu_name() -> str:
    """This processor's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown processor"
