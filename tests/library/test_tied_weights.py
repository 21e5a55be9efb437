"""Tied weights (rlsync.aliases): a tensor listed under two names by ``model.state_dict()`` is
published once, anchors record the alias, and replicas restore it."""

from __future__ import annotations

import json

import pytest
import torch

from rlsync.aliases import ALIASES_KEY, aliases_from_metadata
from rlsync.bucket import LocalBucket
from rlsync.errors import FormatError
from rlsync.anchor_format import load_anchor
from rlsync.hashing import state_hash
from rlsync.protocol import FixedInterval, Publisher, Subscriber, read_manifest
from rlsync.protocol.background import BackgroundPublisher

TIED, SHARED = "lm_head.weight", "model.embed_tokens.weight"


def tied_model() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(config)


def train_step(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-3)


def unique_bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter once (named_parameters skips the tied name), as served."""
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


@pytest.mark.parametrize("background", [False, True], ids=["publish", "background"])
def test_a_tied_model_is_published_once_and_the_replica_restores_the_alias(tmp_path, background: bool):
    model = tied_model()
    assert model.state_dict()[TIED].data_ptr() == model.state_dict()[SHARED].data_ptr()
    bucket = LocalBucket(tmp_path / "bucket")
    pub = Publisher(bucket, policy=FixedInterval(10))
    bg = BackgroundPublisher(pub) if background else None
    for step in range(3):
        if bg is None:
            pub.publish(step, model.state_dict())  # README's snippet
        else:
            bg.stage(model.state_dict().items())
            bg.flush()
        train_step(model, step)
    if bg is not None:
        bg.close()
    manifest = read_manifest(bucket)
    unique = unique_bf16(tied_model())
    anchor = manifest.anchors[0]
    data_bytes = sum(t.numel() * t.element_size() for t in unique.values())
    assert data_bytes <= anchor.nbytes < data_bytes + 64 * 1024  # the shared tensor once, plus headers
    files = [bucket.root / f.key for f in anchor.files]
    tensors, metadata = load_anchor(files)
    assert TIED not in tensors and json.loads(metadata[ALIASES_KEY]) == {TIED: SHARED}
    total = sum(t.numel() for t in unique.values())
    assert all(d.total == total for d in manifest.deltas)  # changes of the shared tensor counted once
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.step == 2 and sub.state_hash == state_hash(unique_bf16(model_after(2)))
    restored = sub.model_state
    assert restored[TIED] is restored[SHARED]  # one tensor under both names, as in the model
    replica = tied_model().to(torch.bfloat16)
    replica.load_state_dict(restored)  # strict: every name of the tied model is there
    assert state_hash(unique_bf16(replica)) == sub.state_hash


def model_after(steps: int) -> torch.nn.Module:
    model = tied_model()
    for step in range(steps):
        train_step(model, step)
    return model


@pytest.mark.parametrize(
    "aliases, match",
    [
        ({TIED: "model.missing.weight"}, "alias"),
        ({"model.norm.weight": SHARED}, "alias"),
        (["not", "an", "object"], "not an object"),
        ({TIED: 5}, "not an object"),
    ],
    ids=["names_no_stored_tensor", "alias_is_stored", "not_an_object", "not_a_name"],
)
def test_hostile_aliases_in_anchor_metadata_are_refused(aliases, match: str):
    names = unique_bf16(tied_model())
    with pytest.raises(FormatError, match=match):
        aliases_from_metadata({ALIASES_KEY: json.dumps(aliases)}, names)
    assert aliases_from_metadata({ALIASES_KEY: json.dumps({TIED: SHARED})}, names) == {TIED: SHARED}
