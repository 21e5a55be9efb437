"""The fixed anchor policy: an anchor every ``interval`` publishes."""

from __future__ import annotations

import dataclasses

from ...defaults import DEFAULT_ANCHOR_INTERVAL
from ...registry import Kind, register
from ..manifest import Manifest
from .base import AnchorPolicy

#: Longest interval: the pointer lists every retained delta (~300 bytes each, more for sharded parts)
#: and must stay under its 16 MiB (the publisher also anchors early when it passes its share).
MAX_INTERVAL = 1_000

register(Kind.ANCHOR_POLICY, "fixed", "rlsync.protocol.policies.fixed:FixedInterval",
         settings="rlsync.protocol.policies.fixed:FixedInterval", summary="an anchor every `interval` publishes")


@dataclasses.dataclass
class FixedInterval(AnchorPolicy):
    """An anchor every ``interval`` publishes (the others are deltas).

    Args:
        interval: Publishes per anchor; 1 makes every publish an anchor.
    """

    interval: int = dataclasses.field(
        default=DEFAULT_ANCHOR_INTERVAL, metadata={"label": "Anchor interval (publishes, fixed)", "minimum": 1, "step": 1}
    )
    name = "fixed"

    def __post_init__(self) -> None:
        if type(self.interval) is not int or not 1 <= self.interval <= MAX_INTERVAL:
            raise ValueError(f"anchor interval must be an integer in [1, {MAX_INTERVAL}], got {self.interval!r}")

    def wants_anchor(self, manifest: Manifest) -> bool:
        return len(manifest.deltas_since(manifest.newest_anchor.step)) + 1 >= self.interval

    def describe(self) -> str:
        return f"fixed, an anchor every {self.interval} publishes"
