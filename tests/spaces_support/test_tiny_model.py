"""The offline tiny model: deterministic bytes, loadable by transformers, a tokenizer that covers the prompts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from env_space.environments import get_environment
from rlsync.spaces import tiny_model
from rlsync.spaces.tiny_model import (
    BOS_TOKEN,
    EOS_TOKEN,
    WarmupSettings,
    build_tiny_model,
    tiny_model_path,
)


def weights_sha(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def test_same_seed_gives_identical_bytes_and_seed_matters(model_dir, tmp_path):
    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    assert weights_sha(again) == weights_sha(model_dir)
    assert weights_sha(other) != weights_sha(model_dir)


def test_warmup_is_deterministic_and_trains(model_dir, tmp_path):
    settings = WarmupSettings(steps=2, batch_size=4)
    a = build_tiny_model(tmp_path / "a", seed=0, warmup=settings, environments=get_environment)
    b = build_tiny_model(tmp_path / "b", seed=0, warmup=settings, environments=get_environment)
    assert weights_sha(a) == weights_sha(b)
    assert weights_sha(a) != weights_sha(model_dir)


def test_warmup_without_environments_is_refused(tmp_path):
    with pytest.raises(ValueError, match="environments"):
        build_tiny_model(tmp_path / "c", seed=0, warmup=WarmupSettings(steps=1, batch_size=2))


def test_folder_loads_with_transformers(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3ForCausalLM

    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (model_dir / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert isinstance(model, Qwen3ForCausalLM)
    assert model.dtype == torch.bfloat16
    cfg = model.config
    assert cfg.head_dim in (32, 64) and cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.tie_word_embeddings is False
    assert cfg.vocab_size == len(tok)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert GenerationConfig.from_pretrained(model_dir).eos_token_id == tok.eos_token_id
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    ids = torch.tensor([tok("reverse 123 =")["input_ids"]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], cfg.vocab_size) and torch.isfinite(logits).all()


def test_tokenizer_round_trips_every_prompt_character(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts = []
    for name in ("reverse", "arithmetic"):
        tasks = get_environment(name).tasks(300, seed=7)
        texts += [t.prompt for t in tasks] + [t.answer for t in tasks]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert len(ids) == len(text) + 1  # one token per character, after BOS
        assert tok.unk_token_id not in ids, text
        assert tok.decode(ids, skip_special_tokens=True) == text
        assert tok.decode(ids) == BOS_TOKEN + text
    # special tokens written in text are recognised as such (used for EOS-terminated targets)
    assert tok("12" + EOS_TOKEN, add_special_tokens=False)["input_ids"][-1] == tok.eos_token_id


def test_tiny_model_path_builds_once_and_reuses(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSYNC_CACHE", str(tmp_path / "cache"))
    first = tiny_model_path(warmup=None)
    assert first.parent == tmp_path / "cache" and first.name.startswith("tiny-model-")
    assert weights_sha(first) == weights_sha(build_tiny_model(tmp_path / "ref", seed=0))

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny_model, "build_tiny_model", no_rebuild)
    assert tiny_model_path(warmup=None) == first
    # another seed or config is another folder (and needs a build)
    with pytest.raises(AssertionError, match="rebuilt"):
        tiny_model_path(warmup=None, seed=1)
    with pytest.raises(AssertionError, match="rebuilt"):
        tiny_model_path(warmup=None, config_overrides={"num_hidden_layers": 1})
    assert list((tmp_path / "cache").iterdir()) == [first]  # failed builds leave no temp folders
