"""Configuration dataclasses overridable from environment variables.

Each component has one dataclass; :func:`from_env` fills it from variables named
``PREFIX_FIELD`` (upper case), which is how a Space passes settings (Space
variables and secrets become environment variables).
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def _convert(raw: str, kind: Any, name: str) -> Any:
    origin = typing.get_origin(kind)
    if origin is typing.Union or origin is types.UnionType:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if raw == "" or raw.lower() == "none":
            return None
        return _convert(raw, args[0], name)
    if kind is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected a boolean, got {raw!r}")
    if kind in (int, float, str):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{name}: expected {kind.__name__}, got {raw!r}") from None
    raise TypeError(f"{name}: unsupported setting type {kind}")


def from_env(cls: type[T], prefix: str, environ: Mapping[str, str] | None = None, **overrides: Any) -> T:
    """Build ``cls`` from its defaults, then ``PREFIX_FIELD`` variables, then ``overrides``.

    Raises:
        ValueError: a variable cannot be converted to its field's type.
    """
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        var = f"{prefix}_{field.name}".upper()
        if var in environ:
            values[field.name] = _convert(environ[var], hints[field.name], var)
    values.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**values)


def settings_table(cls: type, prefix: str) -> list[tuple[str, str, str]]:
    """``(variable, default, description)`` rows for documentation."""
    rows = []
    for field in dataclasses.fields(cls):
        default = field.default if field.default is not dataclasses.MISSING else ""
        rows.append((f"{prefix}_{field.name}".upper(), repr(default), field.metadata.get("help", "")))
    return rows


GPU_DEFAULT_MODEL = "Qwen/Qwen3-0.6B"


def resolve_device(device: str) -> str:
    """``"auto"`` becomes ``"cuda"`` when a GPU is visible, else ``"cpu"``; other values pass through."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def default_model(device: str) -> str | None:
    """The model used when none is set: Qwen3-0.6B on a GPU, ``None`` (the tiny offline model) on CPU."""
    return GPU_DEFAULT_MODEL if device.startswith("cuda") else None
