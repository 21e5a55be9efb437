"""Configuration from environment variables, and the GPU/CPU defaults of the roles."""

from __future__ import annotations

import dataclasses

import pytest

from rlsync.spaces.settings import GPU_DEFAULT_MODEL, default_model, from_env, resolve_device


@dataclasses.dataclass
class Example:
    name: str = "a"
    count: int = 1
    ratio: float = 0.5
    flag: bool = False
    limit: int | None = None


def test_from_env_converts_types_and_overrides_win():
    env = {"X_NAME": "b", "X_COUNT": "7", "X_RATIO": "2.5", "X_FLAG": "yes", "X_LIMIT": "none", "OTHER": "1"}
    cfg = from_env(Example, "X", environ=env, count=9)
    assert cfg == Example(name="b", count=9, ratio=2.5, flag=True, limit=None)
    assert from_env(Example, "X", environ={"X_LIMIT": "3"}).limit == 3


@pytest.mark.parametrize("var,value", [("X_COUNT", "many"), ("X_FLAG", "maybe"), ("X_RATIO", "fast")])
def test_from_env_rejects_bad_values_with_the_variable_name(var, value):
    with pytest.raises(ValueError, match=var):
        from_env(Example, "X", environ={var: value})


def test_real_model_only_on_a_gpu():
    import torch

    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu" and resolve_device("cuda:1") == "cuda:1"
    assert default_model("cuda") == GPU_DEFAULT_MODEL == "Qwen/Qwen3-0.6B"
    assert default_model("cpu") is None  # the tiny offline model: nothing is downloaded on CPU


def test_model_or_default_prefers_the_setting_then_the_device_default():
    from pathlib import Path

    from env_space.environments import get_environment
    from rlsync.spaces.tiny_model import model_or_default

    assert model_or_default("my/model", "cpu") == "my/model"
    assert model_or_default("", "cuda") == GPU_DEFAULT_MODEL
    tiny = Path(model_or_default("", "cpu", get_environment))
    assert (tiny / "model.safetensors").is_file() and (tiny / "tokenizer.json").is_file()


def test_optimizer_defaults_follow_the_model_that_trains():
    from trainer_space.trainer import TrainerConfig

    tiny = TrainerConfig().with_model_defaults("cpu")  # the tiny offline model: the CPU demo's sparse-delta optimizer
    assert (tiny.lr, tiny.adam_epsilon) == (5e-4, 3e-3)
    for config, device in ((TrainerConfig(), "cuda"), (TrainerConfig(model="some/model"), "cpu")):  # a real model
        real = config.with_model_defaults(device)
        assert (real.lr, real.adam_epsilon) == (1e-6, 1e-8)
    chosen = TrainerConfig(lr=2e-5, adam_epsilon=1e-6).with_model_defaults("cuda")
    assert (chosen.lr, chosen.adam_epsilon) == (2e-5, 1e-6)  # a setting always wins
