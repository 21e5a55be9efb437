"""``python app.py --lora``: the combined app configures an adapter run, and ``--fresh`` clears the adapter chain."""

from __future__ import annotations

import app
from rlsync.layout import ADAPTER_PREFIX


def test_lora_flag_trains_and_serves_an_adapter(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINER_LORA_RANK", raising=False)
    monkeypatch.delenv("ROLLOUT_LORA", raising=False)
    args = app.parse_args(["--lora", "--bucket", str(tmp_path)])
    stack = app.Stack(args.bucket, args.replicas, lora=args.lora)
    assert stack.trainer_config.lora_rank == app.DEFAULT_LORA_RANK and stack.replica_config.lora
    plain = app.Stack(args.bucket, args.replicas)
    assert plain.trainer_config.lora_rank == 0 and not plain.replica_config.lora
    monkeypatch.setenv("TRAINER_LORA_RANK", "4")
    assert app.Stack(args.bucket, 1, lora=True).trainer_config.lora_rank == 4  # the environment's rank wins


def test_fresh_clears_the_adapter_chain_too(bucket):
    for key in ("latest.json", f"{ADAPTER_PREFIX}latest.json", f"{ADAPTER_PREFIX}deltas/000000000001-e0001.safetensors"):
        bucket.put(key, b"x")
    bucket.put("notes/keep.txt", b"x")
    assert app.clear_run(bucket) == 3
    assert [o.key for o in bucket.list()] == ["notes/keep.txt"]
