"""Typed JSON objects of the bucket: a dataclass written whole and read back field by field, strictly.

A :class:`Record` is a dataclass whose fields say what the JSON object holds; :meth:`Record.to_json`
writes it and :meth:`Record.from_json` reads an untrusted document back into the same type. The
roles write their metrics and status objects (:mod:`.metrics`) this way and the panels read them
through the same classes, so a field is declared once.

Reading checks every field against its annotation: ``int`` (not a bool, below 2**63), ``float``
(finite, below 1e18; an int is taken), ``bool``, ``str`` (at most ``max_chars``), a ``Literal``,
an enum (by value), a nested :class:`Record`, ``list[X]`` (at most ``max_items``: the newest, the
last ones, are kept; bad items are skipped), ``dict[str, X]`` (at most ``max_items`` entries, keys of
at most ``max_key_chars``; bad entries are skipped), ``X | None`` and unions of records (the first
that reads). A field's ``metadata`` may narrow it (``minimum`` for numbers, ``check`` a predicate,
the limits above). A field without a default is required: missing or invalid, the whole object is
refused (:class:`ValueError`); a field with a default falls back to it when missing or invalid, so
one bad figure never hides the rest. Unknown fields are ignored.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from typing import Any, ClassVar, Self

#: Longest string field unless its ``max_chars`` says otherwise.
MAX_CHARS = 1000
#: Most list items or dict entries unless the field's ``max_items`` says otherwise.
MAX_ITEMS = 64
#: Longest dict key unless the field's ``max_key_chars`` says otherwise.
MAX_KEY_CHARS = 200
_MAX_NUMBER = 1e18


def limits(**metadata: Any) -> dict[str, Any]:
    """A field's reading limits (``max_chars``, ``max_items``, ``max_key_chars``, ``minimum``, ``check``),
    as ``dataclasses.field(metadata=limits(...))``."""
    return metadata


class Record:
    """A dataclass that is a JSON object in the bucket (subclasses are ``@dataclasses.dataclass``).

    A subclass that sets :attr:`FORMAT_VERSION` is a whole bucket object: it writes ``format_version``
    and refuses a document of another version (one without the field is read as version 1, the
    format before the field existed).
    """

    FORMAT_VERSION: ClassVar[int | None] = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object (non-finite floats as ``null``: readers refuse ``NaN``/``Infinity``)."""
        out: dict[str, Any] = {} if self.FORMAT_VERSION is None else {"format_version": self.FORMAT_VERSION}
        out.update({f.name: _encode(getattr(self, f.name)) for f in dataclasses.fields(self)})  # type: ignore[arg-type]
        return out

    @classmethod
    def from_json(cls, doc: Any) -> Self:
        """Read an untrusted document.

        Raises:
            ValueError: not an object, another ``format_version``, or a required field missing or invalid.
        """
        if not isinstance(doc, dict):
            raise ValueError(f"{cls.__name__}: not a JSON object")
        if cls.FORMAT_VERSION is not None and doc.get("format_version", 1) != cls.FORMAT_VERSION:
            raise ValueError(f"{cls.__name__}: format_version {str(doc.get('format_version'))[:20]!r}, "
                             f"not {cls.FORMAT_VERSION}")  # fmt: skip
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
            if field.name in doc:
                try:
                    values[field.name] = _decode(hints[field.name], doc[field.name], field.metadata)
                    continue
                except ValueError as exc:
                    if required:
                        raise ValueError(f"{cls.__name__}.{field.name}: {exc}") from None
            elif required:
                raise ValueError(f"{cls.__name__}: no {field.name}")
        return cls(**values)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _encode(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


def _decode(tp: Any, value: Any, meta: Any) -> Any:
    """``value`` read as ``tp``. Raises ValueError when it is not one."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _decode(arg, value, meta)
            except ValueError:
                pass
        raise ValueError(f"not any of {tp}")
    if origin is typing.Literal:
        if value in args and type(value) in {type(a) for a in args}:
            return value
        raise ValueError(f"not one of {args}")
    if origin is list:
        if not isinstance(value, list):
            raise ValueError("not a list")
        out = []
        for item in value[-meta.get("max_items", MAX_ITEMS):]:
            try:
                out.append(_decode(args[0], item, {}))
            except ValueError:
                pass
        return out
    if origin is dict:
        if not isinstance(value, dict) or len(value) > meta.get("max_items", MAX_ITEMS):
            raise ValueError(f"not an object of at most {meta.get('max_items', MAX_ITEMS)} entries")
        entries = {}
        for key, item in value.items():
            try:
                if len(key) <= meta.get("max_key_chars", MAX_KEY_CHARS):
                    entries[key] = _decode(args[1], item, {k: v for k, v in meta.items() if k in ("minimum",)})
            except ValueError:
                pass
        return entries
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp.from_json(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except (ValueError, TypeError):
            raise ValueError(f"not a {tp.__name__}") from None
    return _check(_scalar(tp, value, meta), meta)


def _scalar(tp: Any, value: Any, meta: Any) -> Any:
    if tp is bool and type(value) is bool:
        return value
    if tp is int and type(value) is int and abs(value) < 1 << 63:
        return value
    if tp is float and type(value) in (int, float) and math.isfinite(value) and abs(value) < _MAX_NUMBER:
        return float(value)
    if tp is str and isinstance(value, str) and len(value) <= meta.get("max_chars", MAX_CHARS):
        return value
    raise ValueError(f"not a {getattr(tp, '__name__', tp)}")


def _check(value: Any, meta: Any) -> Any:
    minimum, check = meta.get("minimum"), meta.get("check")
    if minimum is not None and value < minimum or check is not None and not check(value):
        raise ValueError(f"{str(value)[:40]!r} is out of range")
    return value
