"""Where the ``bucket`` backend's subscriber writes inside a vLLM worker (:class:`ModelTarget`): the model's own
tensors where a checkpoint tensor is a plain view of one (:meth:`~.model_weights.ModelWeights.views`), a copy for
the other modules, which is loaded into vLLM after every update (prepacked CPU kernels cannot be written
element-wise)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import torch

from rlsync.protocol import Subscriber, Update

from .model_weights import ModelWeights
from .plan import plan_update

if TYPE_CHECKING:
    from vllm.config import ModelConfig

logger = logging.getLogger(__name__)


class ModelTarget:
    """The model's weights as the subscriber writes them.

    Args:
        current: The model receiving updates now and its ``model_config`` (the engine's, which vLLM may point at
            another model: that model gets new :class:`ModelWeights`).

    Attributes:
        views: The model's own tensors the subscriber writes, by checkpoint name.
        diverged: Whether the copied modules may differ from the subscriber's state (a fresh start, or an apply
            that failed half-way): :meth:`catch_up` reloads them.
    """

    def __init__(self, current: Callable[[], tuple[torch.nn.Module, "ModelConfig"]]) -> None:
        self.current = current
        self._weights: ModelWeights | None = None
        self.views: dict[str, torch.Tensor] = {}
        self.diverged = False

    def weights(self) -> ModelWeights:
        """The current model's :class:`ModelWeights` (made at the first call, and for another model)."""
        model, model_config = self.current()
        if self._weights is None or self._weights.model is not model:
            self._weights = ModelWeights(model, model_config)
        return self._weights

    def subscriber(self, sub: Subscriber | None, open_: Callable[[dict[str, torch.Tensor]], Subscriber]) -> Subscriber:
        """``sub`` while it still writes into the model's own tensors, else a new one from ``open_(weights)``,
        which starts from an anchor (the model's tensors were replaced since: another loader ran)."""
        weights = self.weights()
        views = weights.views()
        if sub is not None and views.keys() == self.views.keys() and all(
            views[n].data_ptr() == self.views[n].data_ptr() for n in views
        ):  # fmt: skip
            return sub
        if sub is not None:
            logger.warning("bucket weight transfer: the model's tensors were replaced: starting again from an anchor")
        copies = weights.read([n for n in weights.checkpoint_names if n not in views])  # prepacked, sharded, quantized
        sub = open_({**views, **copies})
        self.views = views
        self.diverged = True
        logger.info("bucket weight transfer: %d tensors written in place, %d kept as a copy", len(views), len(copies))
        return sub

    def apply(self, sub: Subscriber, update: Update) -> None:
        """Write one verified update: the subscriber's scatter into the viewed tensors (the model's own) and
        the copies, then the copied modules' reload through vLLM."""
        weights = self.weights()
        sub.apply(update)
        self.diverged = True
        if update.kind == "anchor":
            weights.apply({}, self._copied(sub.state))
        else:
            copied = {n: p for n, p in (update.patches or {}).items() if n not in self.views}
            sparse, full = plan_update(weights.layout(), copied, sub.state)
            weights.apply(sparse, full)
        self.diverged = False

    def catch_up(self, sub: Subscriber) -> None:
        """Reload the copied modules from the subscriber's state when they may differ from it."""
        if self.diverged and sub.step is not None:
            self.weights().apply({}, self._copied(sub.state))
            self.diverged = False

    def memory(self, sub: Subscriber | None) -> dict[str, int]:
        """What the subscriber writes: tensors that are the model's own (``in_place``), and those kept
        as a copy (``copied``, ``copied_bytes``); all 0 before the first update."""
        copies = [t for n, t in (sub.state if sub is not None else {}).items() if n not in self.views]
        return {
            "in_place": len(self.views) if sub is not None else 0, "copied": len(copies),
            "copied_bytes": sum(t.numel() * t.element_size() for t in copies),
        }  # fmt: skip

    def reset(self) -> None:
        """Forget the model's weights and views (the subscriber is dropped)."""
        self._weights = None
        self.views = {}

    def _copied(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The state's copies (the tensors that are not the model's own), to load into the model."""
        names = set(self.weights().checkpoint_names)
        missing = names - set(state)
        if missing:
            raise KeyError(f"bucket state lacks {len(missing)} tensors the model loads, e.g. {sorted(missing)[:3]}")
        return {n: state[n] for n in names if n not in self.views}
