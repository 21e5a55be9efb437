"""Bounded JSON parsing of untrusted bytes.

Every JSON document read from the bucket or from a file header goes through
:func:`loads_bounded`: its size, nesting depth and integer length and exponents are checked in
linear time before ``json.loads`` runs, and ``NaN``/``Infinity`` are refused, so a
hostile document costs at most a linear scan and fails with a
:class:`~rlsync.errors.FormatError` instead of ``RecursionError``, ``ValueError``
(Python's 4300-digit limit) or a quadratic integer conversion.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from .errors import FormatError

MAX_DEPTH = 32
MAX_INT_DIGITS = 30
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_LONG_NUMBER = re.compile(rb"[0-9]{%d,}" % (MAX_INT_DIGITS + 1))
_HUGE_EXPONENT = re.compile(rb"[eE]\+?[0-9]{3,}")  # 1e100 and beyond, 1e400 would parse as inf
_OPEN_CLOSE = bytes.maketrans(b"{[}]", b"\x01\x01\xff\xff")
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"{[}]")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"non-finite number {name}")


def json_depth(skeleton: bytes) -> int:
    """Deepest nesting of ``{``/``[`` in JSON text whose strings were blanked out."""
    brackets = skeleton.translate(None, _NOT_BRACKET).translate(_OPEN_CLOSE)
    if not brackets:
        return 0
    return int(np.cumsum(np.frombuffer(brackets, dtype=np.int8), dtype=np.int64).max())


def loads_bounded(data: bytes | bytearray | memoryview | str, *, what: str, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """Parse untrusted JSON with bounded work.

    Args:
        data: The JSON text.
        what: Names the document in error messages.
        max_bytes: Largest accepted document.
        max_depth: Deepest accepted nesting of objects and arrays.

    Returns:
        The parsed document.

    Raises:
        FormatError: too large, too deep, a number with more than
            ``MAX_INT_DIGITS`` digits in a row, a number of 1e100 or more,
            ``NaN``/``Infinity``, or not JSON.
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise FormatError(f"malformed {what}: {len(raw):,} bytes, more than {max_bytes:,}")
    skeleton = _STRING.sub(b'""', raw)
    if json_depth(skeleton) > max_depth:
        raise FormatError(f"malformed {what}: nested deeper than {max_depth} levels")
    if _LONG_NUMBER.search(skeleton):
        raise FormatError(f"malformed {what}: a number longer than {MAX_INT_DIGITS} digits")
    if _HUGE_EXPONENT.search(skeleton):
        raise FormatError(f"malformed {what}: a number of 1e100 or more")
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, non-finite
        raise FormatError(f"malformed {what}: not valid JSON ({exc})") from None
