"""The adaptive anchor policy: an anchor when catching up would cost a new replica too much."""

from __future__ import annotations

import dataclasses
import math

from ...defaults import DEFAULT_MAX_CATCHUP_RATIO
from ...registry import Kind, register
from ..manifest import Manifest
from .base import AnchorPolicy

#: Largest bound: catching up costs the newest anchor plus every delta since, so at most this many anchors' worth.
MAX_CATCHUP_RATIO = 100.0

register(Kind.ANCHOR_POLICY, "adaptive", "rlsync.protocol.policies.adaptive:Adaptive",
         summary="an anchor when catching up from the newest anchor costs more than `max_catchup_ratio` anchors",
         settings="rlsync.protocol.policies.adaptive:Adaptive")


@dataclasses.dataclass
class Adaptive(AnchorPolicy):
    """An anchor when catching up would cost a new replica too much.

    A replica joining now downloads the newest anchor plus every delta after it.
    When that, plus one more delta the size of the last one, would exceed
    ``max_catchup_ratio`` anchors, the next publish is an anchor.

    Args:
        max_catchup_ratio: Bound on catch-up bytes relative to one anchor (> 1).
    """

    max_catchup_ratio: float = dataclasses.field(
        default=DEFAULT_MAX_CATCHUP_RATIO, metadata={"label": "Max catch-up ratio (anchors, adaptive)", "minimum": 1.0, "step": 0.5}
    )
    name = "adaptive"

    def __post_init__(self) -> None:
        ratio = self.max_catchup_ratio
        if type(ratio) not in (int, float) or not math.isfinite(ratio) or not 1.0 < ratio <= MAX_CATCHUP_RATIO:
            raise ValueError(f"max_catchup_ratio must be a finite number in (1, {MAX_CATCHUP_RATIO:g}], got {ratio!r}")

    def wants_anchor(self, manifest: Manifest) -> bool:
        anchor = manifest.newest_anchor
        since = manifest.deltas_since(anchor.step)
        next_delta = since[-1].nbytes if since else 0
        return manifest.catchup_bytes() + next_delta > self.max_catchup_ratio * anchor.nbytes

    def describe(self) -> str:
        return f"adaptive, anchor when catch-up would exceed {self.max_catchup_ratio:g} anchors"
