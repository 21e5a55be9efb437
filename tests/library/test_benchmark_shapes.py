"""The benchmarks' Qwen3 shapes are transformers' own: a benchmark at "Qwen3-0.6B size" measures that size."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmarks.qwen3 import MODELS, model_config, qwen3_shapes


@pytest.mark.parametrize("config", [MODELS["qwen3-0.6b"], model_config(None, 30e6), {**model_config(None, 5e6), "tie_word_embeddings": False}])
def test_qwen3_shapes_are_the_checkpoint_tensors_of_the_transformers_model(config):
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**config))
    expected, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:  # a tied head is the embedding: published once
            seen.add(id(tensor))
            expected[name] = tuple(tensor.shape)
    assert qwen3_shapes(config) == expected
    if config is MODELS["qwen3-0.6b"]:
        assert sum(torch.Size(s).numel() for s in expected.values()) == 596_049_920
