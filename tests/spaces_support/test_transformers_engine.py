"""The transformers engine: bit-exact weight updates, honest log-probabilities, reproducible sampling."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from rollout_space.engine import SamplingSettings, create_engine
from rollout_space.engines.transformers_engine import TransformersEngine
from rlsync.hashing import state_hash
from rlsync.patch import TensorPatch
from rlsync.spaces.tiny_model import build_tiny_model

PROMPTS = ["reverse 123 =", "what is 3 + 4? answer:", "reverse 98765 ="]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def other_state(tmp_path_factory) -> dict[str, torch.Tensor]:
    """A different full state with the same names (another seed)."""
    return load_file(build_tiny_model(tmp_path_factory.mktemp("tiny1"), seed=1) / "model.safetensors")


@pytest.fixture
def engine(model_dir) -> TransformersEngine:
    return TransformersEngine(model_dir)


def random_patches(state: dict[str, torch.Tensor], seed: int, frac: float = 0.05) -> dict[str, TensorPatch]:
    g = torch.Generator().manual_seed(seed)
    patches = {}
    for name in sorted(state)[::3]:
        t = state[name]
        k = max(1, int(t.numel() * frac))
        index = torch.randperm(t.numel(), generator=g)[:k].sort().values
        values = torch.randn(k, generator=g).to(t.dtype)
        patches[name] = TensorPatch(index=index, values=values, shape=tuple(t.shape))
    return patches


def test_registered_under_transformers(model_dir):
    eng = create_engine("transformers", model_path=model_dir)
    assert isinstance(eng, TransformersEngine) and eng.name == "transformers"


def test_state_dict_is_the_checkpoint(engine, model_dir):
    on_disk = load_file(model_dir / "model.safetensors")
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        assert sorted(engine.state_dict()) == sorted(f.keys())
    assert state_hash(engine.state_dict()) == state_hash(on_disk)


def test_load_state_is_bit_exact(engine, other_state):
    before = state_hash(engine.state_dict())
    engine.load_state(other_state)
    after = state_hash(engine.state_dict())
    assert after == state_hash(other_state) != before
    # the weights used for inference changed, not a side copy
    assert torch.equal(engine.model.lm_head.weight, other_state["lm_head.weight"])


def test_load_state_rejects_bad_states_without_writing(engine, other_state):
    before = state_hash(engine.state_dict())
    missing = dict(other_state)
    missing.pop("model.norm.weight")
    with pytest.raises(KeyError, match="lacks"):
        engine.load_state(missing)
    with pytest.raises(KeyError, match="unknown"):
        engine.load_state({**other_state, "model.extra.weight": torch.zeros(1, dtype=torch.bfloat16)})
    wrong_dtype = {**other_state, "model.norm.weight": other_state["model.norm.weight"].float()}
    with pytest.raises(ValueError, match="dtype"):
        engine.load_state(wrong_dtype)
    wrong_shape = {**other_state, "model.norm.weight": other_state["model.norm.weight"][:-1]}
    with pytest.raises(ValueError, match="shape"):
        engine.load_state(wrong_shape)
    assert state_hash(engine.state_dict()) == before


def test_apply_patches_matches_patching_a_copy_in_place(engine):
    expected = {k: v.clone() for k, v in engine.state_dict().items()}
    patches = random_patches(expected, seed=0)
    for name, patch in patches.items():
        patch.apply_(expected[name])
    storage = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    engine.apply_patches(patches, expected)
    assert state_hash(engine.state_dict()) == state_hash(expected)
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == storage  # written in place
    bad = {"model.norm.weight": TensorPatch(torch.tensor([0]), torch.zeros(1), (128,))}  # float32 values
    with pytest.raises(ValueError, match="dtype"):
        engine.apply_patches(bad, expected)
    with pytest.raises(KeyError):
        engine.apply_patches({"nope": bad["model.norm.weight"]}, expected)


def test_tied_embeddings_are_one_tensor(tmp_path):
    path = build_tiny_model(tmp_path, seed=0, config_overrides={"tie_word_embeddings": True})
    eng = TransformersEngine(path)
    names = eng.checkpoint_names()
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    state = {k: v.clone() for k, v in eng.state_dict().items()}
    patches = random_patches({"model.embed_tokens.weight": state["model.embed_tokens.weight"]}, seed=1)
    eng.apply_patches(patches, state)
    assert torch.equal(eng.model.lm_head.weight, eng.model.model.embed_tokens.weight)
    new = {k: torch.randn(v.shape).to(v.dtype) for k, v in state.items()}
    eng.load_state(new)
    assert torch.equal(eng.model.lm_head.weight, new["model.embed_tokens.weight"])
    # the alias may be sent along, but only with the same bits
    eng.load_state({**new, "lm_head.weight": new["model.embed_tokens.weight"].clone()})
    with pytest.raises(ValueError, match="tied"):
        eng.load_state({**new, "lm_head.weight": torch.zeros_like(new["model.embed_tokens.weight"])})


def recomputed_logprobs(engine, prompt: str, token_ids: list[int], temperature: float) -> torch.Tensor:
    prompt_ids = engine.tokenizer(prompt)["input_ids"]
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.no_grad():
        logits = engine.model(input_ids=ids).logits[0].float()
    rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(token_ids)]
    return torch.log_softmax(rows / temperature, dim=-1).gather(-1, torch.tensor(token_ids)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_logprobs_are_those_of_the_sampling_distribution(engine, temperature):
    out = engine.generate(PROMPTS, SamplingSettings(n=3, max_new_tokens=10, temperature=temperature, seed=0))
    assert [len(group) for group in out] == [3, 3, 3]
    for prompt, group in zip(PROMPTS, out):
        for c in group:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= 10
            assert all(math.isfinite(lp) and lp <= 0.0 for lp in c.logprobs)
            # KV-cached bf16 decoding vs. one full forward: equal up to bf16 rounding
            # (~0.01); leaving out the temperature would be off by >0.3 at T=0.5
            recomputed = recomputed_logprobs(engine, prompt, c.token_ids, temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), recomputed, atol=0.05, rtol=0)


def test_top_p_samples_from_the_nucleus_and_renormalises(engine):
    top_p = 0.3
    out = engine.generate(PROMPTS[:1], SamplingSettings(n=8, max_new_tokens=4, temperature=1.0, top_p=top_p, seed=0))
    prompt_ids = engine.tokenizer(PROMPTS[0])["input_ids"]
    with torch.no_grad():
        probs = engine.model(input_ids=torch.tensor([prompt_ids])).logits[0, -1].float().softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    nucleus = order[: int((sorted_p.cumsum(0) < top_p).sum()) + 1]
    mass = probs[nucleus].sum()
    for c in out[0]:
        first = c.token_ids[0]
        assert first in nucleus.tolist()
        assert c.logprobs[0] == pytest.approx(math.log(probs[first] / mass), abs=0.05)


def test_seeded_sampling_and_greedy_are_reproducible(engine):
    sampled = SamplingSettings(n=4, max_new_tokens=8, temperature=1.0, seed=11)
    a = engine.generate(PROMPTS, sampled)
    assert engine.generate(PROMPTS, sampled) == a
    b = engine.generate(PROMPTS, SamplingSettings(n=4, max_new_tokens=8, temperature=1.0, seed=12))
    assert [c.token_ids for g in a for c in g] != [c.token_ids for g in b for c in g]

    greedy = engine.generate(PROMPTS, SamplingSettings(n=2, max_new_tokens=8, temperature=0.0, seed=1))
    assert engine.generate(PROMPTS, SamplingSettings(n=2, max_new_tokens=8, temperature=0.0, seed=2)) == greedy
    for prompt, group in zip(PROMPTS, greedy):
        assert group[0] == group[1]
        # greedy means argmax of the model at every step
        prompt_ids = engine.tokenizer(prompt)["input_ids"]
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt_ids + group[0].token_ids])).logits[0]
        argmax = logits[len(prompt_ids) - 1 : -1].argmax(-1).tolist()
        assert group[0].token_ids == argmax[: len(group[0].token_ids)]


def test_generation_stops_at_eos_and_decodes_without_special_tokens(engine):
    eos = engine.tokenizer.eos_token_id
    out = engine.generate(["reverse 42 ="], SamplingSettings(n=64, max_new_tokens=16, seed=0))[0]
    stopped = [c for c in out if eos in c.token_ids]
    assert stopped, "the seeded random model samples EOS at least once"
    for c in stopped:
        assert c.token_ids.index(eos) == len(c.token_ids) - 1  # nothing after EOS
    for c in out:
        assert len(c.token_ids) <= 16
        assert c.text == engine.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        assert not any(s in c.text for s in ("<s>", "</s>", "<pad>", "<unk>"))
    assert any(len(c.token_ids) == 16 for c in out)  # the others ran to max_new_tokens
