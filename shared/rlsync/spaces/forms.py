"""Config forms: Gradio inputs for the fields of a role's settings dataclass, and the
dataclass back from the form's values."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Sequence
from typing import Any


def _base_type(kind: Any) -> tuple[Any, bool]:
    """``(type, optional)`` of a field annotation such as ``int`` or ``int | None``."""
    args = typing.get_args(kind)
    if type(None) in args:
        return next(a for a in args if a is not type(None)), True
    return kind, False


def config_form(
    config: Any, overrides: dict[str, Callable[..., Any]] | None = None, skip: Sequence[str] = (), prefix: str = ""
) -> dict[str, Any]:
    """Gradio inputs for each field of a config dataclass, prefilled from ``config``.

    Args:
        config: A config dataclass instance (e.g. ``TrainerConfig.from_env()``).
        overrides: ``field -> factory(value=..., label=..., info=...)`` for special inputs.
        skip: Fields left out of the form (they keep ``config``'s value).

    Returns:
        ``{field name: component}`` in field order.
    """
    import gradio as gr

    hints = typing.get_type_hints(type(config))
    inputs: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        if field.name in skip:
            continue
        value, (kind, _) = getattr(config, field.name), _base_type(hints[field.name])
        kw = {
            "value": value,
            "label": field.name,
            "info": field.metadata.get("help"),
            "elem_id": f"{prefix}cfg-{field.name}",
        }
        if overrides and field.name in overrides:
            inputs[field.name] = overrides[field.name](**kw)
        elif kind is bool:
            inputs[field.name] = gr.Checkbox(**kw)
        elif kind is int:
            inputs[field.name] = gr.Number(precision=0, **kw)
        elif kind is float:
            inputs[field.name] = gr.Number(**kw)
        else:
            inputs[field.name] = gr.Textbox(**{**kw, "value": "" if value is None else str(value)})
    return inputs


def config_from_form(base: Any, names: Sequence[str], values: Sequence[Any]) -> Any:
    """``base`` with the form's values (converted to the field types) replacing its fields.

    Raises:
        ValueError: a value does not fit its field's type.
    """
    hints = typing.get_type_hints(type(base))
    changes = {}
    for name, value in zip(names, values, strict=True):
        kind, optional = _base_type(hints[name])
        if optional and value in (None, ""):
            changes[name] = None
            continue
        if kind is int:
            if value is None or float(value) != int(value):
                raise ValueError(f"{name} must be a whole number, got {value!r}")
            value = int(value)
        elif kind is float:
            value = float(value)
        elif kind is bool:
            value = bool(value)
        elif kind is str:
            value = "" if value is None else str(value).strip()
        changes[name] = value
    return dataclasses.replace(base, **changes)
