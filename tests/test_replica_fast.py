"""A replica's ENGINE ends up with the published weights, bit for bit, after an anchor and after deltas.

The subscriber's state is hash-checked by the protocol; this checks the copy that
actually serves: the transformers engine's own tensors (the tiny offline model, a
few seconds on CPU), so a replica that verified an update but never handed it to
its engine fails here, not only in the two-minute end-to-end test.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rollout_space.replica import Replica, ReplicaConfig
from rlsync.hashing import state_hash
from rlsync.protocol import FixedInterval, Publisher
from rlsync.spaces.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


def _nudge(master: dict[str, torch.Tensor], seed: int) -> None:
    """An RL-like update of the fp32 master: enough to flip a few percent of the bf16 weights."""
    g = torch.Generator().manual_seed(seed)
    for t in master.values():
        t += torch.randn(t.shape, generator=g) * t.abs().mean() * 0.02


def _sync_once(replica: Replica) -> None:
    replica.slot.put(replica.subscriber.fetch())
    assert replica.slot.update is not None
    assert replica.apply_pending()


@pytest.mark.parametrize("verify_engine", [False, True])
def test_engine_weights_follow_anchor_and_deltas_bit_exactly(bucket, model_dir, verify_engine):
    master = {n: t.float() for n, t in load_file(model_dir / "model.safetensors").items()}
    _nudge(master, 0)  # the anchor differs from the weights the engine starts with
    pub = Publisher(bucket, policy=FixedInterval(100))
    replica = Replica(
        ReplicaConfig(bucket=str(bucket.root), replica_id="r", engine="transformers", model=str(model_dir),
                      device="cpu", verify_engine=verify_engine),
        bucket=bucket,
    )  # fmt: skip
    engine_start = state_hash(replica.engine.state_dict())
    records = [pub.publish(0, master)]
    assert records[0].state_hash != engine_start
    _sync_once(replica)
    assert state_hash(replica.engine.state_dict()) == records[0].state_hash

    for step in (1, 2):
        before = state_hash(replica.engine.state_dict())
        _nudge(master, step)
        records.append(pub.publish(step, master))
        assert records[-1].kind == "delta" and 0 < records[-1].changed < records[-1].total
        _sync_once(replica)
        engine_hash = state_hash(replica.engine.state_dict())
        assert engine_hash == records[-1].state_hash == replica.subscriber.state_hash != before
        # the serving tensors themselves moved (not a side copy): the model's parameters hash the same
        assert state_hash({n: p.detach() for n, p in replica.engine.model.named_parameters() if n in
                           replica.engine.state_dict()}) == engine_hash  # fmt: skip
    assert replica.engine_state_hash == (records[-1].state_hash if verify_engine else None)
    status = replica.status()
    assert status["applied_step"] == 2 and status["refused"] == 0
    replica.close()
