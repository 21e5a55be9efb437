"""vLLM apply benchmark: time to apply each synced delta vs a full reload, same run.

Builds a Qwen3-architecture model with random weights locally (nothing is
downloaded), publishes an anchor and RL-like deltas (AdamW steps with random
gradients, as in ``benchmarks.sync``) to a local bucket, follows it with a
Subscriber and hands each verified update to a :class:`VllmEngine`. Per delta it
prints the bytes downloaded, the share of changed elements, the subscriber's
fetch (download, decode, validate) and apply times, the engine's apply time
(generation is paused only for this), and the time of a full reload of the same
model through the same engine; engine times are the best of ``--repeat`` runs
(re-applying an update writes the same values again). After every update the weights read back from
vLLM must hash equal to the publisher's state.

Then, in the same run and on the same engine, vLLM's ``bucket`` weight-transfer backend follows the
bucket itself through ``--pause-deltas`` further deltas, alternating two ways of driving it: the plain
vLLM calls (``update_weights`` downloads and decodes inside vLLM's pause: decode ``inside``), and a
prepare first (``collective_rpc('sync_prepare')``, then ``update_weights`` with ``prepared_only``: decode
``before``). Per delta it prints the pause (``start_weight_update`` to ``reset_prefix_cache``: generation
cannot run), the part of it spent in the backend's ``update_weights`` (``in worker``), the bucket reads
the workers made inside it, the bare scatter of the same patch into a CPU copy of the
state (``Subscriber.apply``), and the engine's own write of the same patch (``VllmEngine.apply_patches``).

On vLLM's CPU backend linear weights are prepacked, so a delta reloads every
touched module in full (see ``shared/rlsync/vllm/worker.py``); on GPU the
same code patches only the changed elements in place.

    python -m benchmarks.vllm_apply                        # ~40M parameters on CPU
    python -m benchmarks.vllm_apply --hidden 1024 --layers 8 --deltas 5
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("benchmarks.vllm_apply")

#: Qwen3-0.6B's architecture (its ``config.json``), for building it locally with random weights.
QWEN3_0_6B: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "hidden_act": "silu",
}


def random_qwen3_state(config: dict[str, Any], *, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """fp32 weights of a Qwen3 checkpoint (Hugging Face names): matrices ~N(0, 0.02), norms near 1."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, inter, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def mat(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device) * 0.02

    def norm(n: int) -> torch.Tensor:
        return 1 + torch.randn(n, generator=gen, device=device) * 0.02

    state = {"model.embed_tokens.weight": mat(config["vocab_size"], h), "model.norm.weight": norm(h)}
    if not config.get("tie_word_embeddings", False):
        state["lm_head.weight"] = mat(config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update(
            {
                p + "self_attn.q_proj.weight": mat(q, h),
                p + "self_attn.k_proj.weight": mat(kv, h),
                p + "self_attn.v_proj.weight": mat(kv, h),
                p + "self_attn.o_proj.weight": mat(h, q),
                p + "self_attn.q_norm.weight": norm(hd),
                p + "self_attn.k_norm.weight": norm(hd),
                p + "mlp.gate_proj.weight": mat(inter, h),
                p + "mlp.up_proj.weight": mat(inter, h),
                p + "mlp.down_proj.weight": mat(h, inter),
                p + "input_layernorm.weight": norm(h),
                p + "post_attention_layernorm.weight": norm(h),
            }
        )
    return state


def write_model_folder(path: Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    """Write a loadable Qwen3 model folder: config, bf16 safetensors, the tiny character tokenizer.

    The tokenizer knows fewer tokens than a large vocabulary; engines built on the
    folder for benchmarks use token-id prompts (``skip_tokenizer_init=True``).
    """
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    from rlsync.spaces.tiny_model import build_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    Qwen3Config(**config, dtype="bfloat16", architectures=["Qwen3ForCausalLM"]).save_pretrained(path)
    save_file({n: t.to(torch.bfloat16).cpu().contiguous() for n, t in state.items()}, str(path / "model.safetensors"))
    build_tokenizer().save_pretrained(path)
    return path


def adamw_deltas(master: dict[str, torch.Tensor], lr: float, steps: int, seed: int):
    """Yield the bf16 state (on CPU) after each AdamW step with random gradients."""
    params = {n: torch.nn.Parameter(t.clone()) for n, t in master.items()}
    opt = torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.0)
    device = next(iter(master.values())).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen, device=device)
        opt.step()
        yield {n: p.detach().to(torch.bfloat16).cpu() for n, p in params.items()}


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Publish, follow and apply; return one row per update plus the full-reload row, and the pause rows."""
    from rollout_space.engines.vllm_engine import VllmEngine
    from rlsync.bucket import LocalBucket
    from rlsync.protocol import FixedInterval, Publisher, Subscriber

    total = args.deltas + args.pause_deltas
    config = {
        **QWEN3_0_6B,
        "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 128),
        "head_dim": 64,
        "vocab_size": args.vocab,
        "max_position_embeddings": 512,
    }
    work = Path(tempfile.mkdtemp(prefix="vllm-apply-"))
    master = random_qwen3_state(config, seed=0)
    n_params = sum(t.numel() for t in master.values())
    model = write_model_folder(work / "model", config, master)
    bucket = LocalBucket(work / "bucket")
    pub = Publisher(bucket, policy=FixedInterval(total + 1))
    records = [pub.publish(0, master)]
    states = adamw_deltas(master, args.lr, total, seed=1)
    for step, state in zip(range(1, args.deltas + 1), states):
        records.append(pub.publish(step, state))
    print(f"model: Qwen3 architecture, {n_params / 1e6:.1f}M parameters, bf16 {2 * n_params / 1e6:.0f} MB; "
          f"{args.deltas} AdamW deltas at lr={args.lr:g}")  # fmt: skip

    t0 = time.perf_counter()
    engine = VllmEngine(model, skip_tokenizer_init=True, max_model_len=256, max_num_seqs=4, weight_transfer_config={"backend": "bucket"})
    startup_s = time.perf_counter() - t0
    rows = []
    try:
        sub = Subscriber(bucket)
        for rec in records:
            t0 = time.perf_counter()
            update = sub.fetch()
            t1 = time.perf_counter()
            sub.apply(update)
            t2 = time.perf_counter()
            apply_s = []
            for _ in range(args.repeat):  # re-applying an update writes the same values again
                t = time.perf_counter()
                if update.kind == "anchor":
                    engine.load_state(sub.state)
                else:
                    engine.apply_patches(update.patches, sub.state)
                apply_s.append(time.perf_counter() - t)
            if engine.state_hash() != rec.state_hash:
                raise AssertionError(f"step {rec.step}: vLLM's weights do not hash equal to the publisher's")
            rows.append(
                {
                    "step": rec.step,
                    "kind": update.kind,
                    "bytes": update.nbytes,
                    "changed_pct": 100.0 * update.changed / n_params,
                    "fetch_s": t1 - t0,
                    "sub_apply_s": t2 - t1,
                    "engine_apply_s": min(apply_s),
                }
            )
        full = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            engine.load_state(sub.state)
            full.append(time.perf_counter() - t0)
        if engine.state_hash() != records[-1].state_hash:
            raise AssertionError("full reload changed the weights")
        pauses = pause_rows(engine, bucket, pub, sub, states, args, n_params)
    finally:
        engine.close()
    rows.append({"step": "full reload", "engine_apply_s": min(full), "startup_s": startup_s})
    return rows, pauses


def _backend_update(llm: Any, step: int | None, *, prepared: bool) -> float:
    """One update through the ``bucket`` backend as ``vllm serve``'s routes run it; returns the pause (s)."""
    t0 = time.perf_counter()
    llm.start_weight_update()
    llm.update_weights({"update_info": {"step": step, "prepared_only": prepared}})
    llm.finish_weight_update()
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")
    return time.perf_counter() - t0


def _prepare(llm: Any, step: int) -> float:
    """``sync_prepare`` and wait until the workers are done (generation could run meanwhile); returns seconds."""
    from rlsync.vllm.status import TransferStatus

    t0 = time.perf_counter()
    status = TransferStatus.from_wire(llm.collective_rpc("sync_prepare", args=(step,))[0])
    while status.preparing:
        time.sleep(0.01)
        status = TransferStatus.from_wire(llm.collective_rpc("sync_transfer_status")[0])
    if status.error or status.prepared is None or status.prepared.step != step:
        raise RuntimeError(f"prepare of step {step} failed: {status}")
    return time.perf_counter() - t0


def pause_rows(engine: Any, bucket: Any, pub: Any, sub: Any, states: Any, args: argparse.Namespace, n_params: int) -> list[dict[str, Any]]:
    """The ``bucket`` backend's pause with and without a prepare, alternating, against the bare scatter and
    the engine's write of the same patch (see the module docstring)."""
    from rlsync.vllm.status import TransferStatus

    llm = engine.llm
    llm.init_weight_transfer_engine({"init_info": {"bucket": bucket.url}})
    _backend_update(llm, None, prepared=False)  # the backend's subscriber catches up (anchor and deltas), untimed
    rows = []
    for step, state in zip(range(args.deltas + 1, args.deltas + args.pause_deltas + 1), states):
        record = pub.publish(step, state)
        update = sub.fetch()
        t0 = time.perf_counter()
        sub.apply(update)  # the bare scatter of the patch into a CPU copy of the state
        scatter_s = time.perf_counter() - t0
        prepared = (step - args.deltas) % 2 == 0
        prepare_s = _prepare(llm, step) if prepared else 0.0
        pause_s = _backend_update(llm, step, prepared=prepared)
        pause = TransferStatus.from_wire(llm.collective_rpc("sync_transfer_status")[0]).pause
        if engine.state_hash() != record.state_hash:
            raise AssertionError(f"step {step}: the bucket backend's weights do not hash equal to the publisher's")
        write_s = []
        for _ in range(args.repeat):  # the engine's own write of the same patch (the same values again)
            t0 = time.perf_counter()
            engine.apply_patches(update.patches, sub.state)
            write_s.append(time.perf_counter() - t0)
        rows.append({
            "step": step, "mode": "before" if prepared else "inside", "changed_pct": 100.0 * update.changed / n_params,
            "prepare_s": prepare_s, "pause_s": pause_s, "worker_s": pause.s, "pause_reads": pause.reads,
            "scatter_s": scatter_s, "engine_write_s": min(write_s),
        })  # fmt: skip
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    """Print the per-update table and the full-reload comparison."""
    full = rows[-1]
    print(f"\n{'step':>5s} {'kind':>6s} {'bytes':>12s} {'changed':>8s} {'fetch s':>8s} {'sub s':>7s} "
          f"{'engine apply s':>15s} {'vs full reload':>15s}")  # fmt: skip
    for r in rows[:-1]:
        print(f"{r['step']:>5} {r['kind']:>6s} {r['bytes']:>12,d} {r['changed_pct']:>7.2f}% {r['fetch_s']:>8.3f} "
              f"{r['sub_apply_s']:>7.3f} {r['engine_apply_s']:>15.3f} {r['engine_apply_s'] / full['engine_apply_s']:>14.2f}x")  # fmt: skip
    deltas = [r for r in rows[:-1] if r["kind"] == "delta"]
    print(f"\nfull reload of the same model through the same engine: {full['engine_apply_s']:.3f} s; "
          f"engine startup {full['startup_s']:.1f} s; engine times are best of the repeats")  # fmt: skip
    if deltas:
        mean = sum(r["engine_apply_s"] for r in deltas) / len(deltas)
        mean_bytes = sum(r["bytes"] for r in deltas) / len(deltas)
        print(f"mean delta: {mean_bytes / 1e6:.2f} MB, engine apply {mean:.3f} s = {mean / full['engine_apply_s']:.2f}x a full reload")


def print_pauses(rows: list[dict[str, Any]]) -> None:
    """Print the pause table and the best of each mode."""
    print(f"\n{'step':>5s} {'decode':>7s} {'changed':>8s} {'prepare s':>10s} {'pause s':>8s} {'in worker s':>12s} {'reads':>6s} "
          f"{'bare scatter s':>15s} {'engine write s':>15s} {'pause/scatter':>14s} {'pause/write':>12s}")  # fmt: skip
    for r in rows:
        print(f"{r['step']:>5} {r['mode']:>7s} {r['changed_pct']:>7.2f}% {r['prepare_s']:>10.3f} {r['pause_s']:>8.3f} "
              f"{r['worker_s']:>12.3f} {r['pause_reads']:>6d} {r['scatter_s']:>15.4f} {r['engine_write_s']:>15.3f} "
              f"{r['pause_s'] / r['scatter_s']:>13.1f}x {r['pause_s'] / r['engine_write_s']:>11.2f}x")  # fmt: skip
    for mode in ("inside", "before"):
        picked = [r for r in rows if r["mode"] == mode]
        if picked:  # best of each mode, as the engine times above (a loaded machine only ever adds time)
            best = min(r["pause_s"] for r in picked)
            scatter, write = min(r["scatter_s"] for r in picked), min(r["engine_write_s"] for r in picked)
            print(f"best pause, download and decode {mode} the pause: {best:.3f} s = {best / scatter:.1f}x the best bare "
                  f"scatter, {best / write:.2f}x the engine's best write")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (heads of 64)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--deltas", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--pause-deltas", type=int, default=6, help="deltas for the bucket backend's pause, half of them prepared")
    ap.add_argument("--repeat", type=int, default=3, help="timed repeats of each apply and of the full reload (best kept)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    rows, pauses = run(args)
    print_table(rows)
    print_pauses(pauses)
    if args.json:
        Path(args.json).write_text(json.dumps({"apply": rows, "pause": pauses}, indent=1))


if __name__ == "__main__":
    main()
