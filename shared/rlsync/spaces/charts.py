"""Vega-Lite charts of the panels: one :class:`Chart` declaration per plot, one spec builder.

Every plot of the panels is a :class:`Chart` (what to draw: marks, axes, series and their
colours, labels) turned into a Vega-Lite spec by :meth:`Chart.spec` from a DataFrame of
:mod:`.frames`. :func:`~.plots.chart_plot` shows it in a ``gr.Plot``.

Why not Gradio's ``LinePlot`` / ``ScatterPlot`` / ``BarPlot``: their frontend writes a fixed
spec (schema v5.17 against its v6 runtime, a band scale with ``zero``, ``fit-x`` on a discrete
axis: 24-28 console warnings per page load), always sets ``zero: false`` on the y axis (a bar
chart starting at 700) and has no log axis or text labels. ``gr.Plot`` embeds a spec as given,
with the Vega-Lite 5 runtime it bundles (:data:`VEGA_LITE_SCHEMA`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import pandas as pd

#: The Vega-Lite major version that ``gr.Plot``'s frontend bundles (5.x): a spec of another major
#: version draws, but logs a warning on every render.
VEGA_LITE_SCHEMA = "https://vega.github.io/schema/vega-lite/v5.json"
#: Default plot height in pixels.
HEIGHT = 260


class Mark(str, enum.Enum):
    """How the rows are drawn."""

    LINE = "line"  #: one line per series, with a point on each row
    POINT = "point"  #: one filled point per row
    BAR = "bar"  #: one bar per whole-number x value (a histogram's counts)


class Scale(str, enum.Enum):
    """A y-axis scale."""

    LINEAR = "linear"
    LOG = "log"


@dataclasses.dataclass(frozen=True)
class Labels:
    """Text labels on some points: ``text`` of the rows whose ``where`` column equals ``equals``."""

    text: str
    where: str
    equals: str


@dataclasses.dataclass(frozen=True)
class Chart:
    """One plot: which columns of the frame go where, and how they look.

    Attributes:
        title: Title above the plot.
        x: Column on the x axis.
        y: Column on the y axis.
        mark: :class:`Mark`.
        color: Column naming each row's series (``None``: one series).
        series: Colour per series value, in legend order: every series is in the legend from
            the start, and keeps its colour whichever appears first.
        x_title: X-axis title (default: ``x``).
        y_title: Y-axis title (default: ``y``).
        y_scale: :class:`Scale` of the y axis.
        y_domain: Fixed ``(low, high)`` of the y axis (either may be ``None``); a linear y axis
            starts at zero unless ``low`` says otherwise.
        labels: Text labels on some points (e.g. the anchors' versions).
        tooltip: Extra columns in the hover tooltip.
        formats: d3 number format per column, in the tooltip (e.g. ``{"KB": ",.1f"}``).
        height: Plot height in pixels.
        subtitle: A line under the title (e.g. what the points are a sample of).
    """

    title: str
    x: str
    y: str
    mark: Mark = Mark.LINE
    color: str | None = None
    series: Mapping[str, str] = dataclasses.field(default_factory=dict)
    x_title: str | None = None
    y_title: str | None = None
    y_scale: Scale = Scale.LINEAR
    y_domain: tuple[float | None, float | None] | None = None
    labels: Labels | None = None
    tooltip: Sequence[str] = ()
    formats: Mapping[str, str] = dataclasses.field(default_factory=dict)
    height: int = HEIGHT
    subtitle: str = ""

    def _type(self, frame: pd.DataFrame, column: str) -> Literal["quantitative", "nominal"]:
        return "quantitative" if pd.api.types.is_numeric_dtype(frame[column]) else "nominal"

    def _field(self, frame: pd.DataFrame, column: str, title: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"field": column, "type": self._type(frame, column), "title": title or column}
        if column in self.formats:
            out["format"] = self.formats[column]
        return out

    def _y(self, frame: pd.DataFrame) -> dict[str, Any]:
        scale: dict[str, Any] = {"type": self.y_scale.value}
        if self.y_scale is Scale.LINEAR:
            scale["zero"] = True
        low, high = self.y_domain or (None, None)
        if low is not None:
            scale["domainMin"] = low
        if high is not None:
            scale["domainMax"] = high
        return {**self._field(frame, self.y, self.y_title), "scale": scale}

    def columns(self) -> list[str]:
        """The frame's columns this chart uses."""
        columns = [self.x, self.y, *([self.color] if self.color else []), *self.tooltip]
        if self.labels is not None:
            columns += [self.labels.text, self.labels.where]
        return list(dict.fromkeys(columns))

    def rows(self, frame: pd.DataFrame) -> pd.DataFrame:
        """The rows of ``frame`` this chart draws: those with an x and a y (a positive y on a log axis).

        Raises:
            KeyError: ``frame`` lacks a column this chart draws.
        """
        rows = frame[self.columns()].dropna(subset=[self.x, self.y])
        return rows[rows[self.y] > 0] if self.y_scale is Scale.LOG else rows

    def spec(self, frame: pd.DataFrame) -> dict[str, Any]:
        """The Vega-Lite spec of this chart drawing :meth:`rows` of ``frame``.

        Raises:
            KeyError: ``frame`` lacks a column this chart draws.
        """
        columns, rows = self.columns(), self.rows(frame)
        x = self._field(frame, self.x, self.x_title)
        x["scale"] = {"zero": False}
        if pd.api.types.is_integer_dtype(frame[self.x]):
            x["axis"] = {"format": "d", "tickMinStep": 1}
        encoding: dict[str, Any] = {"x": x, "y": self._y(frame)}
        transform: list[dict[str, Any]] = []
        if self.mark is Mark.BAR:  # a bar from x - 0.4 to x + 0.4 on a continuous axis: a discrete axis in a
            # panel that is laid out while hidden (zero width) warns "Dropping fit-x because spec has discrete width"
            transform = [{"calculate": f"datum['{self.x}'] - 0.4", "as": "_from"}, {"calculate": f"datum['{self.x}'] + 0.4", "as": "_to"}]
            low, high = (float(rows[self.x].min()) - 0.5, float(rows[self.x].max()) + 0.5) if len(rows) else (-0.5, 0.5)
            encoding["x"] = {**x, "field": "_from", "scale": {"domain": [low, high], "nice": False}}
            encoding["x2"] = {"field": "_to"}
            encoding["y2"] = {"datum": 0}  # from the value down to zero
        if self.color:
            color: dict[str, Any] = {"field": self.color, "type": "nominal", "legend": {"orient": "bottom", "title": None}}
            if self.series:
                color["scale"] = {"domain": list(self.series), "range": list(self.series.values())}
            encoding["color"] = color
        elif self.series:
            encoding["color"] = {"value": next(iter(self.series.values()))}
        encoding["tooltip"] = [self._field(frame, c) for c in columns if c != (self.labels and self.labels.where)]
        mark: dict[str, Any] = {"type": self.mark.value}
        if self.mark is Mark.LINE:
            mark["point"] = {"size": 12}
        elif self.mark is Mark.POINT:
            mark.update(filled=True, size=36)
        layers: list[dict[str, Any]] = [{"mark": mark, "encoding": encoding}]
        if self.labels is not None:
            layers.append({
                "transform": [{"filter": {"field": self.labels.where, "equal": self.labels.equals}}],
                "mark": {"type": "text", "dy": -9, "fontSize": 10},
                "encoding": {"x": x, "y": encoding["y"], "text": self._field(frame, self.labels.text)},
            })  # fmt: skip
        title: dict[str, Any] = {"text": self.title}
        if self.subtitle:
            title["subtitle"] = self.subtitle
        view = {"layer": layers} if len(layers) > 1 else layers[0]
        return {
            "$schema": VEGA_LITE_SCHEMA,
            "title": title,
            "height": self.height,
            "width": 10_000,  # the panel's width: the frontend fits the plot to its container
            "autosize": {"type": "fit", "contains": "padding"},
            "background": "transparent",
            "data": {"values": _records(rows)},
            **({"transform": transform} if transform else {}),
            **view,
        }

    def to_json(self, frame: pd.DataFrame) -> str:
        """:meth:`spec` as JSON text."""
        return json.dumps(self.spec(frame), separators=(",", ":"), allow_nan=False)


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    """Rows as JSON-safe dicts (NumPy scalars as Python numbers, non-finite floats as ``None``)."""
    out = []
    for row in frame.to_dict(orient="records"):
        clean = {}
        for key, value in row.items():
            if hasattr(value, "item"):
                value = value.item()
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            clean[str(key)] = value
        out.append(clean)
    return out
