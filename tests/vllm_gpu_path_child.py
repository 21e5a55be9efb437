"""The vLLM GPU code path, run on CPU in child processes for tests/library/vllm/test_vllm_gpu_path.py.

``python -m tests.vllm_gpu_path_child SPEC.json`` starts ``world_size`` ranks (gloo, tensor
parallel). Each rank builds vLLM's model class directly (``initialize_model`` + ``load_weights``,
as a GPU worker does; the CPU backend's prepacking step, ``process_weights_after_loading``, is
never run), follows a local bucket with a Subscriber, applies every delta through
:class:`~rlsync.vllm.model_weights.ModelWeights`' sparse path (vLLM's
``load_checkpoint_weight_patches``), and records after each update whether the weights read back
hash equal to the published state, then whether they equal a fresh load of the final state. Each
rank writes ``rank{N}.json`` into the spec's ``out`` folder.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch


def _build(vllm_config) -> torch.nn.Module:
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
        return initialize_model(vllm_config=vllm_config)


def _configs(model: str, world_size: int):
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig

    model_config = ModelConfig(model=model, dtype="bfloat16", max_model_len=128, skip_tokenizer_init=True)
    return model_config, VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig("cpu"),
        parallel_config=ParallelConfig(tensor_parallel_size=world_size),
    )


def _skipped_tensor_is_caught(model: torch.nn.Module, weights, patch_name: str, patch) -> bool:
    """Make the model's loader skip one tensor; the update must fail at once."""
    original = model.load_weights
    model.load_weights = lambda ws: original([(n, t) for n, t in ws if n != patch_name])
    try:
        weights.apply({patch_name: patch}, {})
    except RuntimeError as err:
        return "skipped" in str(err)
    finally:
        del model.load_weights
    return False


def run_case(case: dict[str, Any], world_size: int) -> dict[str, Any]:
    from rlsync.bucket import LocalBucket
    from rlsync.hashing import state_hash
    from rlsync.protocol import Subscriber
    from rlsync.vllm.payload import pack_patches, unpack_patches
    from rlsync.vllm.model_weights import ModelWeights
    from rlsync.vllm.plan import plan_update
    from vllm.config import set_current_vllm_config

    model_config, vllm_config = _configs(case["model"], world_size)
    with set_current_vllm_config(vllm_config):
        model = _build(vllm_config)
        sub = Subscriber(LocalBucket(case["bucket"]))
        weights = None
        steps, index_dtypes, reloads = [], set(), 0
        last_patch = None
        while (update := sub.fetch()) is not None:
            sub.apply(update)
            if update.kind == "anchor":
                model.load_weights(list(sub.state.items()))  # what vLLM's loader does at startup
                weights = ModelWeights(model, model_config)  # checkpoint names from model_config.model
            else:
                sparse, full = plan_update(weights.layout(), update.patches or {}, sub.state)
                reloads += len(full)
                sparse = unpack_patches(pack_patches(sparse))  # as sent to the workers: int32 indices
                index_dtypes |= {str(p.index.dtype) for p in sparse.values()}
                weights.apply(sparse, full)
                last_patch = next(iter(sparse.items()))
            served = weights.lanes().hexdigest()
            expected = state_hash({n: sub.state[n] for n in weights.checkpoint_names})
            steps.append({"step": update.step, "kind": update.kind, "equal": served == expected})

    _, fresh_config = _configs(case["model"], world_size)  # a new config: its own attention-layer registry
    with set_current_vllm_config(fresh_config):
        fresh = _build(fresh_config)
        fresh.load_weights(list(sub.state.items()))
        fresh_weights = ModelWeights(fresh, model_config, weights.checkpoint_names)
        patched, loaded = weights.read(), fresh_weights.read()
        embed = model.get_submodule("model.embed_tokens")
        result = {
            "steps": steps,
            "reloads": reloads,
            "index_dtypes": sorted(index_dtypes),
            "names": len(weights.checkpoint_names),
            "equal_to_fresh_load": all(torch.equal(patched[n], loaded[n]) for n in patched),
            "fresh_hash_equal": fresh_weights.lanes().hexdigest() == weights.lanes().hexdigest(),
            "packed": sorted({path.rsplit(".", 1)[-1] for path in weights.layout().module_of.values()}
                             & {"qkv_proj", "gate_up_proj"}),
            "vocab": [embed.org_vocab_size, embed.num_embeddings_padded],
            "tied": bool(model.config.tie_word_embeddings),
            "has_lm_head_name": "lm_head.weight" in weights.checkpoint_names,
        }
        if case.get("check_skip"):
            result["skip_caught"] = _skipped_tensor_is_caught(model, weights, *last_patch)
    if world_size == 1:
        result["views"] = _follow_in_views(case, weights)
    return result


def _follow_in_views(case: dict[str, Any], weights) -> dict[str, Any]:
    """The ``bucket`` backend's GPU path: a Subscriber writing the model's own tensors (``ModelWeights.views``),
    following the bucket again from its anchor; after each update the weights read back must hash equal to
    the subscriber's verified state, which then is the model's (no copy)."""
    from rlsync.bucket import LocalBucket
    from rlsync.protocol import Subscriber

    views = weights.views()
    sub = Subscriber(LocalBucket(case["bucket"]), weights=views)
    equal = []
    while (update := sub.fetch()) is not None:
        sub.apply(update)
        equal.append(weights.lanes().hexdigest() == sub.state_hash)
    return {"all_viewed": sorted(views) == weights.checkpoint_names, "equal": equal}


def run_rank(rank: int, spec: dict[str, Any]) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    world_size = spec["world_size"]
    torch.set_num_threads(1)
    _, first = _configs(spec["cases"][0]["model"], world_size)
    with set_current_vllm_config(first):
        init_distributed_environment(
            world_size=world_size, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{spec['port']}",
            local_rank=rank, backend="gloo",
        )  # fmt: skip
        initialize_model_parallel(tensor_model_parallel_size=world_size)
    results = {case["name"]: run_case(case, world_size) for case in spec["cases"]}
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(results))


def main(argv: list[str]) -> None:
    spec = json.loads(Path(argv[0]).read_text())
    if spec["world_size"] == 1:
        run_rank(0, spec)
    else:
        import torch.multiprocessing as mp

        mp.spawn(run_rank, args=(spec,), nprocs=spec["world_size"], join=True)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    main(sys.argv[1:])
