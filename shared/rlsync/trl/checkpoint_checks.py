"""What a downloaded training checkpoint must hold before a trainer resumes from it.

A checkpoint folder that parses (see :func:`~rlsync.trl.checkpoints.verify_checkpoint_folder`)
may still be planted or edited: a genuine old checkpoint copied under a huge step, a trainer
state claiming step 10^12, an lr of 1e3 in the optimizer or scheduler state, scaled weights,
tensors of the wrong shape or a missing one. :func:`check_checkpoint` ties a checkpoint to the
chain and to the model:

* its weights, cast to the serving dtype, hash to the hash its writer pinned in the pointer
  (:meth:`~rlsync.protocol.Publisher.pin_checkpoint`) for that step;
* the weights name every tensor of the model with its shape, and are finite;
* the optimizer state has one finite entry per parameter, of the parameter's shape, and an lr
  no higher than configured; the scheduler's base lrs are the configured lr;
* the trainer state's step is the checkpoint's step, and the published version it was saved
  at is not ahead of the pointer.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from safetensors import safe_open
from transformers.trainer_pt_utils import safe_globals

from ..errors import CheckpointError
from ..hashing import StateLanes

WEIGHTS_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
TRAINER_STATE_FILE = "trainer_state.json"
LR_TOLERANCE = 1e-6  # relative; the lr is a float that went through JSON or a pickle


@dataclasses.dataclass(frozen=True)
class CheckpointExpectations:
    """What the resuming trainer knows a checkpoint must match.

    Attributes:
        pins: Checkpoint step -> weights hash, from the pointer.
        published_step: The pointer's step.
        shapes: Every tensor ``model.safetensors`` must hold (tied copies may be absent), with its shape.
        param_shapes: The shapes of the parameters the optimizer trains.
        lr: The configured learning rate.
        dtype: The serving dtype the weights are hashed in.
    """

    pins: Mapping[int, str]
    published_step: int
    shapes: Mapping[str, tuple[int, ...]]
    param_shapes: Sequence[tuple[int, ...]]
    lr: float
    dtype: torch.dtype = torch.bfloat16

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, pins: Mapping[int, str], published_step: int, lr: float) -> "CheckpointExpectations":
        """The expectations for ``model`` (tensors sharing storage count once, as ``save_pretrained`` writes them)."""
        seen: set[int] = set()
        shapes = {}
        for name, tensor in model.state_dict().items():
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                shapes[name] = tuple(tensor.shape)
        params = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        return cls(pins=dict(pins), published_step=published_step, shapes=shapes, param_shapes=params, lr=lr)

    def max_file_bytes(self) -> int:
        """The largest checkpoint file this model can have: the optimizer state (two fp32 moments
        per parameter, plus the parameter itself for some optimizers) with room for the pickle's framing."""
        elements = sum(math.prod(s) for s in self.shapes.values())
        return 3 * 4 * elements + (16 << 20)


def weights_hash(path: Path, dtype: torch.dtype = torch.bfloat16) -> str:
    """The hash of a ``model.safetensors`` file's tensors cast to ``dtype`` (floating point ones),
    read one tensor at a time."""
    with safe_open(str(path), "pt") as f:
        tensors = ((name, f.get_tensor(name)) for name in f.keys())
        return StateLanes.of_items((n, t.to(dtype) if t.is_floating_point() else t) for n, t in tensors).hexdigest()


def check_checkpoint(folder: Path, step: int, marker: Mapping[str, Any], expect: CheckpointExpectations) -> None:
    """Check a downloaded checkpoint against the chain and the model (see the module docstring).

    Raises:
        CheckpointError: naming the first thing that does not match.
    """
    check_pinned(step, marker, expect.pins, expect.published_step)
    _check_weights(folder / WEIGHTS_FILE, step, expect)
    check_trainer_state(folder / TRAINER_STATE_FILE, step)
    if (folder / OPTIMIZER_FILE).exists():
        _check_optimizer(_load(folder / OPTIMIZER_FILE), step, expect)
    if (folder / SCHEDULER_FILE).exists():
        _check_scheduler(_load(folder / SCHEDULER_FILE), step, expect.lr)


def check_pinned(step: int, marker: Mapping[str, Any], pins: Mapping[int, str], published_step: int) -> None:
    """Check that a checkpoint belongs to the chain: its writer pinned it in the pointer, and the
    version it was saved at (the marker's ``published_version``) is not ahead of the pointer.

    Raises:
        CheckpointError: it is not pinned, or was saved at a version the pointer has not reached.
    """
    version = marker.get("published_version")
    if version is not None and (type(version) is not int or not 0 <= version <= published_step):
        raise CheckpointError(f"checkpoint {step}: saved at version {version!r}, the pointer is at {published_step}")
    if step not in pins:
        raise CheckpointError(f"checkpoint {step} is not pinned in the pointer (planted, or its pin was cut short)")


def _load(path: Path) -> Any:
    with safe_globals():
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _check_weights(path: Path, step: int, expect: CheckpointExpectations) -> None:
    if not path.exists():
        raise CheckpointError(f"checkpoint {step} has no {WEIGHTS_FILE}")
    with safe_open(str(path), "pt") as f:
        names = set(f.keys())
        missing = expect.shapes.keys() - names
        if missing:
            raise CheckpointError(f"checkpoint {step}: {len(missing)} tensor(s) missing, e.g. {sorted(missing)[0]!r}")
        for name in names:
            if name not in expect.shapes:
                raise CheckpointError(f"checkpoint {step}: unknown tensor {name!r}")
            tensor = f.get_slice(name)
            if tuple(tensor.get_shape()) != expect.shapes[name]:
                raise CheckpointError(f"checkpoint {step}: {name} has shape {tensor.get_shape()}, the model {expect.shapes[name]}")
    if weights_hash(path, expect.dtype) != expect.pins[step]:
        raise CheckpointError(f"checkpoint {step}: its weights do not hash to the hash pinned in the pointer")


def check_trainer_state(path: Path, step: int) -> None:
    """Check that ``trainer_state.json`` parses and is at ``step``.

    Raises:
        CheckpointError: it does not.
    """
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {step}: unreadable {TRAINER_STATE_FILE}: {exc}") from None
    if not isinstance(state, dict) or type(state.get("global_step")) is not int or state["global_step"] != step:
        raise CheckpointError(f"checkpoint {step}: {TRAINER_STATE_FILE} is not at step {step}")


def _finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    return not isinstance(value, float) or math.isfinite(value)


def _lr_ok(lr: Any, configured: float, *, exact: bool = False) -> bool:
    if type(lr) not in (int, float) or not math.isfinite(lr) or lr < 0:
        return False
    slack = configured * LR_TOLERANCE
    return abs(lr - configured) <= slack if exact else lr <= configured + slack


def _check_optimizer(state: Any, step: int, expect: CheckpointExpectations) -> None:
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict) or not isinstance(state.get("param_groups"), list):
        raise CheckpointError(f"checkpoint {step}: {OPTIMIZER_FILE} is not an optimizer state")
    for group in state["param_groups"]:
        if not isinstance(group, dict) or not _lr_ok(group.get("lr"), expect.lr):
            raise CheckpointError(f"checkpoint {step}: optimizer lr above the configured {expect.lr:g}")
        if "initial_lr" in group and not _lr_ok(group["initial_lr"], expect.lr, exact=True):
            raise CheckpointError(f"checkpoint {step}: optimizer initial lr is not the configured {expect.lr:g}")
    indices = sorted(i for group in state["param_groups"] for i in group.get("params", ()))
    if indices != list(range(len(expect.param_shapes))):
        raise CheckpointError(f"checkpoint {step}: optimizer groups are not the model's {len(expect.param_shapes)} parameters")
    shapes: collections.Counter[tuple[int, ...]] = collections.Counter()
    for index, entry in state["state"].items():
        if type(index) is not int or not 0 <= index < len(expect.param_shapes) or not isinstance(entry, dict):
            raise CheckpointError(f"checkpoint {step}: optimizer state for an unknown parameter {index!r}")
        own = {tuple(v.shape) for v in entry.values() if isinstance(v, torch.Tensor) and v.dim()}
        if len(own) > 1:
            raise CheckpointError(f"checkpoint {step}: optimizer state of parameter {index} mixes shapes")
        shapes.update(own)
        for key, value in entry.items():
            if not _finite(value):
                raise CheckpointError(f"checkpoint {step}: optimizer {key} of parameter {index} is not finite")
    # the optimizer orders parameters by group, so shapes are compared as a multiset
    if shapes - collections.Counter(expect.param_shapes):
        raise CheckpointError(f"checkpoint {step}: optimizer state has shapes the model's parameters do not have")


def _check_scheduler(state: Any, step: int, lr: float) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {step}: {SCHEDULER_FILE} is not a scheduler state")
    base, last = state.get("base_lrs", [lr]), state.get("_last_lr", [lr])
    if not isinstance(base, list) or not all(_lr_ok(v, lr, exact=True) for v in base):
        raise CheckpointError(f"checkpoint {step}: scheduler base lr is not the configured {lr:g}")
    if not isinstance(last, list) or not all(_lr_ok(v, lr) for v in last):
        raise CheckpointError(f"checkpoint {step}: scheduler lr above the configured {lr:g}")
    epoch = state.get("last_epoch", 0)
    if type(epoch) is not int or not 0 <= epoch <= step + 1:
        raise CheckpointError(f"checkpoint {step}: scheduler at epoch {epoch!r}")
