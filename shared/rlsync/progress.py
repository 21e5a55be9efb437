"""Progress bars of long commands (``rlsync verify``, ``diff``, ``apply``): tqdm on stderr,
shown on a terminal or when asked (``--progress``), never mixed into stdout."""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(total: int | None, desc: str, *, enabled: bool | None = None, unit: str = "B") -> tqdm:
    """A tqdm bar on stderr.

    Args:
        total: Units of work (bytes by default), or ``None`` if unknown.
        desc: What the bar counts.
        enabled: Show it (``None``: only when stderr is a terminal).
        unit: Unit of ``total``; bytes are scaled (kB, MB, ...).

    Returns:
        The bar (a disabled one counts nothing and prints nothing); use it as a context manager.
    """
    show = sys.stderr.isatty() if enabled is None else enabled
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=sys.stderr, disable=not show, leave=show)
