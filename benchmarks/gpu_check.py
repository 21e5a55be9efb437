"""GPU check, vLLM half: the vLLM engine with a Qwen3-0.6B-sized model, RL-like deltas, one GPU, < 5 minutes.

Needs a CUDA GPU and the GPU build of vLLM (``requirements-vllm-gpu.txt``); the torch-only
half, for a GPU machine without vLLM, is ``benchmarks.gpu_check_torch``. Builds
a model with Qwen3-0.6B's configuration and random weights locally (nothing is
downloaded), publishes an anchor and ``--deltas`` AdamW deltas to a local bucket,
follows it with a Subscriber and applies each verified delta to a
:class:`~rollout_space.engines.vllm_engine.VllmEngine`; on GPU that goes through
vLLM's ``load_checkpoint_weight_patches`` (sparse, in place). It prints, per delta:

* bytes downloaded and share of changed elements,
* fetch time (download, decode, validate; overlaps generation),
* inference idle per sync: the engine's apply time, during which generation is paused,
* the same for a full ``model.load_weights`` of the whole state (the usual RL refit)
  and for the engine's full layerwise reload,

and checks after every delta that the weights read back from the GPU hash equal
to the publisher's state, and at the end that greedy tokens equal those of the
reference state loaded in full.

    python -m benchmarks.gpu_check                   # 5 deltas at lr 1e-6
    python -m benchmarks.gpu_check --deltas 3 --lr 3e-6
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.vllm_apply import QWEN3_0_6B, adamw_deltas, random_qwen3_state, write_model_folder

logger = logging.getLogger("benchmarks.gpu_check")


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deltas", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--repeat", type=int, default=2, help="timed repeats of the full loads (best kept)")
    ap.add_argument("--workdir", default=None, help="folder for the model and the bucket (default: a temp folder)")
    ap.add_argument("--spool", default=None, help="payload spool folder (default: WORKDIR/spool, on disk: "
                    "/dev/shm is 64 MB in many containers and a full payload is 1.2 GB)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU")

    from rlsync.bucket import LocalBucket
    from rlsync.protocol import FixedInterval, Publisher, Subscriber
    from rlsync.vllm.payload import pack_tensors

    from rollout_space.engines.vllm_engine import VllmEngine

    t_start = time.perf_counter()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-check-"))
    spool = args.spool or str(work / "spool")
    config = dict(QWEN3_0_6B)
    master = random_qwen3_state(config, seed=0, device="cuda")
    n_params = sum(t.numel() for t in master.values())
    model = write_model_folder(work / "model", config, master)
    bucket = LocalBucket(work / "bucket")
    pub = Publisher(bucket, policy=FixedInterval(args.deltas + 1))
    records = [pub.publish(0, {n: t.cpu() for n, t in master.items()})]
    for step, state in enumerate(adamw_deltas(master, args.lr, args.deltas, seed=1), start=1):
        records.append(pub.publish(step, state))
    del master
    torch.cuda.empty_cache()  # vLLM's workers size their memory from what is free on the GPU
    print(f"{torch.cuda.get_device_name()}: Qwen3-0.6B config, {n_params / 1e6:.0f}M parameters, "
          f"bf16 {2 * n_params / 1e9:.2f} GB; built and published in {time.perf_counter() - t_start:.0f} s")  # fmt: skip

    t0 = time.perf_counter()
    engine = VllmEngine(
        model,
        skip_tokenizer_init=True,
        max_model_len=1024,
        max_num_seqs=32,
        gpu_memory_utilization=0.3,
        spool_dir=spool,
    )
    print(f"vLLM {__import__('vllm').__version__} engine up in {time.perf_counter() - t0:.0f} s; "
          f"{len(engine.layout.in_place)} of {len(set(engine.layout.module_of.values()))} modules patched in place")  # fmt: skip
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(64)] for i in range(8)]
    try:
        sub = Subscriber(bucket)
        rows = []
        for rec in records:
            t0 = time.perf_counter()
            update = sub.fetch()
            sub.apply(update)
            fetch_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            if update.kind == "anchor":
                engine.load_state(sub.state)
            else:
                engine.apply_patches(update.patches, sub.state)
            idle_s = time.perf_counter() - t0
            ok = engine.state_hash() == rec.state_hash
            rows.append((rec.step, update.kind, update.nbytes, 100.0 * update.changed / n_params, fetch_s, idle_s, ok))
            if update.kind == "anchor":
                _greedy_tokens(engine, prompts, 8)  # warm up generation once
        tokens = _greedy_tokens(engine, prompts, 32)

        def plain_load_weights() -> None:
            payload = pack_tensors(sub.state, spool_dir=spool)
            try:
                engine.llm.collective_rpc("sync_load_weights", args=(payload,))
            finally:
                if "path" in payload:
                    Path(payload["path"]).unlink(missing_ok=True)

        full_plain_s = _best(plain_load_weights, args.repeat)
        full_reload_s = _best(lambda: engine.load_state(sub.state), args.repeat)
        same_after_full = engine.state_hash() == records[-1].state_hash
        same_tokens = _greedy_tokens(engine, prompts, 32) == tokens
    finally:
        engine.close()

    print(f"\n{'step':>4s} {'kind':>6s} {'bytes':>14s} {'changed':>8s} {'fetch s':>8s} {'idle s':>8s} {'hash ok':>7s}")
    for step, kind, nbytes, changed, fetch_s, idle_s, ok in rows:
        print(f"{step:>4d} {kind:>6s} {nbytes:>14,d} {changed:>7.2f}% {fetch_s:>8.3f} {idle_s:>8.3f} {str(ok):>7s}")
    deltas = [r for r in rows if r[1] == "delta"]
    mean_idle = sum(r[5] for r in deltas) / max(1, len(deltas))
    mean_bytes = sum(r[2] for r in deltas) / max(1, len(deltas))
    print(f"\nmean delta: {mean_bytes / 1e6:.1f} MB ({mean_bytes / (2 * n_params):.2%} of the bf16 model), "
          f"inference idle per sync {mean_idle:.3f} s")  # fmt: skip
    print(f"full model.load_weights of the same state (incl. payload): {full_plain_s:.3f} s "
          f"-> delta apply is {mean_idle / full_plain_s:.2f}x of it")  # fmt: skip
    print(f"full layerwise reload (engine.load_state):                {full_reload_s:.3f} s")
    print(f"hashes equal after every update: {all(r[6] for r in rows)}; after full reloads: {same_after_full}; "
          f"greedy tokens identical after full reload: {same_tokens}")  # fmt: skip
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if not (all(r[6] for r in rows) and same_after_full and same_tokens):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
