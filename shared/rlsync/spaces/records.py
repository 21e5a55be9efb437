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
one bad figure never hides the rest. Unknown fields are ignored. A JSON value of any other type, in any
field (a list where a ``Literal`` is expected, ``10**400`` for a float), is refused with that same
:class:`ValueError`, never another exception (a property test feeds every field every JSON type).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from collections.abc import Callable
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
        for name, _, _ in _plan(type(self)):
            out[name] = _encode(getattr(self, name))
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
        values: dict[str, Any] = {}
        for name, required, decode in _plan(cls):
            if name in doc:
                try:
                    values[name] = decode(doc[name])
                    continue
                except ValueError as exc:
                    if required:
                        raise ValueError(f"{cls.__name__}.{name}: {exc}") from None
            elif required:
                raise ValueError(f"{cls.__name__}: no {name}")
        return cls(**values)


Decode = Callable[[Any], Any]


@functools.cache
def _plan(cls: type) -> tuple[tuple[str, bool, Decode], ...]:
    """Per field of ``cls``: its name, whether it is required, and its reader (built once per class)."""
    hints = typing.get_type_hints(cls)
    return tuple(
        (f.name, f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING, _reader(hints[f.name], f.metadata))
        for f in dataclasses.fields(cls)
    )  # fmt: skip


_PLAIN = (int, str, bool, type(None))


def _encode(value: Any) -> Any:
    if type(value) in _PLAIN:
        return value
    if isinstance(value, Record):
        return value.to_json()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in value.items()}
    return value


def _reader(tp: Any, meta: Any) -> Decode:
    """The function reading a value of type ``tp`` (narrowed by the field's ``meta``); it raises
    :class:`ValueError` for a value that is not one."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        optional = type(None) in args
        readers = [_reader(a, meta) for a in args if a is not type(None)]

        def union(value: Any) -> Any:
            if value is None and optional:
                return None
            for read in readers:
                try:
                    return read(value)
                except ValueError:
                    pass
            raise ValueError(f"not any of {tp}")

        return union
    if origin is typing.Literal:
        allowed = {(type(a), a) for a in args}
        kinds = {type(a) for a in args}  # hashable: a list or an object is refused before the lookup

        def literal(value: Any) -> Any:
            if type(value) in kinds and (type(value), value) in allowed:
                return value
            raise ValueError(f"not one of {args}")

        return literal
    if origin is list:
        return _list_reader(_reader(args[0], {}), meta.get("max_items", MAX_ITEMS))
    if origin is dict:
        return _dict_reader(_reader(args[1], {k: v for k, v in meta.items() if k == "minimum"}), meta)
    if isinstance(tp, type) and issubclass(tp, Record):
        return tp.from_json
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_reader(tp)
    return _scalar_reader(tp, meta)


def _list_reader(read: Decode, most: int) -> Decode:
    def items(value: Any) -> list[Any]:
        if not isinstance(value, list):
            raise ValueError("not a list")
        out = []
        for item in value[-most:]:  # the newest
            try:
                out.append(read(item))
            except ValueError:
                pass
        return out

    return items


def _dict_reader(read: Decode, meta: Any) -> Decode:
    most, key_chars = meta.get("max_items", MAX_ITEMS), meta.get("max_key_chars", MAX_KEY_CHARS)

    def entries(value: Any) -> dict[str, Any]:
        if not isinstance(value, dict) or len(value) > most:
            raise ValueError(f"not an object of at most {most} entries")
        out = {}
        for key, item in value.items():
            try:
                if len(key) <= key_chars:
                    out[key] = read(item)
            except ValueError:
                pass
        return out

    return entries


def _enum_reader(tp: type[enum.Enum]) -> Decode:
    def member(value: Any) -> Any:
        try:
            return tp(value)
        except (ValueError, TypeError):
            raise ValueError(f"not a {tp.__name__}") from None

    return member


def _scalar_reader(tp: Any, meta: Any) -> Decode:
    minimum, check, chars = meta.get("minimum"), meta.get("check"), meta.get("max_chars", MAX_CHARS)
    if tp is bool:
        accept: Callable[[Any], bool] = lambda v: type(v) is bool  # noqa: E731
    elif tp is int:
        accept = lambda v: type(v) is int and abs(v) < 1 << 63  # noqa: E731
    elif tp is float:
        # an int and a float compare exactly (no overflow: 10**400 is refused); NaN and inf fail the bound
        accept = lambda v: type(v) in (int, float) and abs(v) < _MAX_NUMBER  # noqa: E731
    elif tp is str:
        accept = lambda v: isinstance(v, str) and len(v) <= chars  # noqa: E731
    else:
        raise TypeError(f"a Record field of type {tp} cannot be read")
    convert = float if tp is float else None

    def scalar(value: Any) -> Any:
        if not accept(value):
            raise ValueError(f"not a {tp.__name__}")
        if convert is not None:
            value = convert(value)
        if minimum is not None and value < minimum or check is not None and not check(value):
            raise ValueError(f"{str(value)[:40]!r} is out of range")
        return value

    return scalar
