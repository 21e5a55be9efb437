"""Issue 11, findings 1 and 8: hostile exchange, control and lock objects are refused,
counted, and never reach the weights or stop a role.

Each class of hostile field is tested through the one parser of its object type
(:func:`rlsync.spaces.exchange.parse_samples`, :func:`parse_tasks`, :class:`~rlsync.spaces.metrics.ReplicaStatus`,
:func:`rlsync.protocol.policy.policy_from_json`, :func:`rlsync.protocol.lock.parse_lock`),
then through the roles that read them (the env before it scores, the trainer again).
"""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from env_space.simulator import EnvConfig, EnvSimulator
from rlsync.errors import FormatError, NonFiniteError, RunLockedError
from rlsync.hashing import state_hash
from rlsync.layout import CONTROL_KEY, LOCK_KEY, rollout_key, score_key
from rlsync.protocol import FixedInterval, Publisher, Subscriber
from rlsync.protocol.lock import acquire, parse_lock
from rlsync.protocol.policy import policy_from_json
from rlsync.spaces.anchor_policy import ControlledPolicy
from rlsync.spaces.exchange import (
    Refusals,
    SampleLimits,
    parse_samples,
    parse_tasks,
    put_json,
    read_samples,
)
from rlsync.spaces.metrics import HubCounts, MetricsLog, ReplicaStatus, Sync, TrainerMetrics, TrainRow
from tests.helpers import bf16, master_state, rl_step

LIMITS = SampleLimits(vocab_size=100, max_version=5, max_prompt_tokens=16, max_completion_tokens=16, max_samples=8)


def good_sample(**overrides) -> dict:
    sample = {
        "task_id": "t0", "prompt": "abc", "completion": "cba", "prompt_ids": [1, 2, 3], "token_ids": [3, 2, 1],
        "logprobs": [-0.5, -1.0, -0.1], "version": 5, "reward": None,
    }  # fmt: skip
    sample.update(overrides)
    return sample


# One entry per class of hostile field (finding 1): (id, sample overrides, expected message).
HOSTILE_SAMPLES = [
    ("logprob_nan", {"logprobs": [-0.5, float("nan"), -0.1]}, "logprob"),
    ("logprob_inf", {"logprobs": [-0.5, float("-inf"), -0.1]}, "logprob"),
    ("logprob_positive", {"logprobs": [-0.5, 3.0, -0.1]}, "logprob"),
    ("logprob_string", {"logprobs": [-0.5, "-1", -0.1]}, "logprob"),
    ("logprobs_short", {"logprobs": [-0.5]}, "differ in length"),
    ("token_out_of_vocab", {"token_ids": [3, 100, 1]}, "token_ids"),
    ("token_negative", {"token_ids": [3, -1, 1]}, "token_ids"),
    ("token_float", {"token_ids": [3, 2.7, 1]}, "token_ids"),
    ("token_bool", {"token_ids": [3, True, 1]}, "token_ids"),
    ("prompt_token_out_of_vocab", {"prompt_ids": [1, 10**6]}, "prompt_ids"),
    ("completion_empty", {"token_ids": [], "logprobs": []}, "non-empty"),
    ("prompt_empty", {"prompt_ids": []}, "non-empty"),
    ("completion_too_long", {"token_ids": [1] * 17, "logprobs": [-1.0] * 17}, "at most 16"),
    ("prompt_too_long", {"prompt_ids": [1] * 17}, "at most 16"),
    ("version_future", {"version": 10**12}, "version"),
    ("version_negative", {"version": -1}, "version"),
    ("version_float", {"version": 5.0}, "version"),
    ("version_string", {"version": "5"}, "version"),
    ("reward_nan", {"reward": float("nan")}, "reward"),
    ("reward_huge", {"reward": 1e300}, "reward"),
    ("task_id_not_string", {"task_id": ["t0"]}, "task_id"),
    ("completion_not_string", {"completion": 5}, "completion"),
    ("completion_huge_text", {"completion": "x" * (1 << 17)}, "completion"),
]


@pytest.mark.parametrize("overrides, match", [h[1:] for h in HOSTILE_SAMPLES], ids=[h[0] for h in HOSTILE_SAMPLES])
def test_hostile_sample_refused_by_the_parser(overrides: dict, match: str) -> None:
    assert parse_samples({"samples": [good_sample()]}, LIMITS)[1][0].token_ids == [3, 2, 1]
    with pytest.raises(ValueError, match=match):
        parse_samples({"samples": [good_sample(), good_sample(**overrides)]}, LIMITS)


@pytest.mark.parametrize(
    "doc",
    [None, [], "samples", {"samples": "x"}, {"samples": [1]}, {"samples": [good_sample()] * 9}],
    ids=["null", "list", "string", "samples_not_list", "sample_not_object", "too_many_samples"],
)
def test_hostile_rollouts_document_refused(doc) -> None:
    with pytest.raises(ValueError):
        parse_samples(doc, LIMITS)


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
        (b'{"samples": [], "x": ' + b"9" * 5000 + b"}", "longer than 30 digits"),
        (b'{"samples": [], "x": NaN}', "non-finite"),
        (b'{"samples": [], "x": 1e400}', "1e100 or more"),
        (b"\xff\xfe not json", "not valid JSON"),
    ],
    ids=["deep_nesting", "5000_digit_int", "nan_constant", "overflowing_float", "not_json"],
)
def test_malformed_json_objects_refused_and_counted(bucket, raw: bytes, match: str) -> None:
    key = rollout_key(0, "r1")
    bucket.put(key, raw)
    refusals = Refusals()
    assert read_samples(bucket, key, limits=LIMITS, refusals=refusals) is None
    assert refusals.counts == {"rollouts": 1} and match in refusals.last


def test_oversized_object_refused_before_reading(bucket, monkeypatch) -> None:
    """Finding 6: the size is checked before the bytes are read (the local backend never reads them)."""
    from rlsync import scores

    monkeypatch.setattr(scores, "MAX_OBJECT_BYTES", 1000)
    key = rollout_key(0, "r1")
    bucket.put(key, json.dumps({"samples": [good_sample()] * 40}).encode())
    refusals = Refusals()
    read = bucket.get_limited
    monkeypatch.setattr(bucket, "get", lambda *a: pytest.fail("read the whole object"))
    assert read_samples(bucket, key, refusals=refusals) is None and "more than the 1,000 allowed" in refusals.last
    with pytest.raises(Exception, match="more than"):
        read(key, 1000)


def test_hostile_tasks_and_status_refused() -> None:
    assert parse_tasks({"tasks": [{"task_id": "a", "prompt": "p"}]}) == [{"task_id": "a", "prompt": "p"}]
    for doc in ({"tasks": [{"task_id": 1, "prompt": "p"}]}, {"tasks": [{"task_id": "a", "prompt": "p" * (1 << 17)}]},
                {"tasks": [{"task_id": "a", "prompt": "p"}] * 2000}, {"tasks": "x"}, []):  # fmt: skip
        with pytest.raises(ValueError):
            parse_tasks(doc)
    status = ReplicaStatus.from_json({"replica_id": "r1", "lag": 2, "apply_s": float("nan"), "engine": ["x"], "evil": 1,
                                      "recent_syncs": [{"step": 1, "kind": "delta", "idle_s": "slow"}, 5]})  # fmt: skip
    assert status == ReplicaStatus(replica_id="r1", lag=2, recent_syncs=[Sync(step=1, kind="delta")])
    for doc in ({"replica_id": "../x"}, {"replica_id": 5}, None, {"replica_id": "r1", "format_version": 2}):
        with pytest.raises(ValueError):
            ReplicaStatus.from_json(doc)


def test_hostile_hub_counts_in_a_status_are_refused_field_by_field() -> None:
    hub = {"tier": "free", "api": 3, "by_kind": {"GET tree": 7, "POST batch": -1, "x" * 65: 1, "put": 1.5, "resolve": True}}
    assert ReplicaStatus.from_json({"replica_id": "r1", "hub": hub}).hub == HubCounts.from_json({
        "tier": "free", "api": 3, "by_kind": {"GET tree": 7}, "short": False, "pacing": "",
    })  # fmt: skip
    flood = {"tier": "free", "by_kind": {f"k{i}": 1 for i in range(65)}}
    assert ReplicaStatus.from_json({"replica_id": "r1", "hub": flood}).hub.by_kind == {}
    assert ReplicaStatus.from_json({"replica_id": "r1", "hub": {"tier": "gold", "api": 1}}).hub is None


def test_env_refuses_hostile_rollouts_counts_them_and_keeps_scoring(bucket) -> None:
    """The env validates before scoring: the hostile object is deleted unscored and counted,
    the good one is scored, the env keeps running (finding 1)."""
    pub = Publisher(bucket, policy=FixedInterval(2))
    pub.publish(0, master_state())
    env = EnvSimulator(EnvConfig(vocab_size=100), bucket)
    env.step()
    tasks = json.loads(bucket.get("tasks/0000000000.json"))["tasks"]
    good = [good_sample(task_id=t["task_id"], prompt=t["prompt"], version=0) for t in tasks]
    for i, (_, overrides, _) in enumerate(HOSTILE_SAMPLES):
        put_json(bucket, rollout_key(0, f"evil{i}"), {"samples": good[:1] + [{**good[0], **overrides}]})
    put_json(bucket, rollout_key(0, "good"), {"samples": good})
    env.step()
    within_env_limits = {"completion_too_long", "prompt_too_long"}  # 17 tokens: only the test's LIMITS refuse them
    assert env.refusals.total == len(HOSTILE_SAMPLES) - len(within_env_limits)
    assert bucket.list("rollouts/") == []  # refused objects are removed
    scored = read_samples(bucket, score_key(0, "good"))
    assert scored is not None and len(scored[1]) == len(good)
    expected = {score_key(0, "good")} | {score_key(0, f"evil{i}") for i, h in enumerate(HOSTILE_SAMPLES) if h[0] in within_env_limits}
    assert {o.key for o in bucket.list("scores/")} == expected
    metrics = json.loads(bucket.get("metrics/env.json"))
    assert metrics["refused"]["total"] == env.refusals.total and metrics["refused"]["by_kind"] == {"rollouts": env.refusals.total}


def test_publisher_refuses_to_introduce_non_finite_values(bucket) -> None:
    """No non-finite model is published (finding 1: 98% NaN weights), unless allowed."""
    master = master_state()
    pub = Publisher(bucket, policy=FixedInterval(3))
    pub.publish(0, master)
    published = state_hash(bf16(master))
    rl_step(master, 1)
    poisoned = {n: t.clone() for n, t in master.items()}
    poisoned["lm_head.weight"][3, 4] = float("nan")
    for step in (1, 3):  # 1: a delta; 3: an anchor with its companion delta
        with pytest.raises(NonFiniteError, match="lm_head.weight: 1 finite published values"):
            pub.publish(step, poisoned)
        inf = {n: t.clone() for n, t in master.items()}
        inf["model.norm.weight"][0] = float("inf")
        with pytest.raises(NonFiniteError):
            pub.publish(step, inf)
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.step == 0 and sub.state_hash == published
    pub.publish(1, master)  # the publisher is still usable
    allowed = Publisher(bucket, owner=pub.ownership.owner, allow_non_finite=True)
    allowed.resume()
    allowed.publish(2, poisoned)
    sub.sync()
    assert sub.step == 2 and torch.isnan(sub.state["lm_head.weight"][3, 4])


def test_already_non_finite_values_may_stay(bucket) -> None:
    """Values that were NaN in the published state may change (another NaN payload) without refusal."""
    master = master_state()
    master["model.norm.weight"][0] = float("nan")
    pub = Publisher(bucket)
    pub.publish(0, master)
    master["model.norm.weight"][0] = float("inf")
    rl_step(master, 1)
    pub.publish(1, master)


# -- finding 8: control and lock values ----------------------------------------------------------


@pytest.mark.parametrize(
    "doc",
    [
        b'{"policy": "adaptive", "max_catchup_ratio": NaN}',
        b'{"policy": "adaptive", "max_catchup_ratio": Infinity}',
        b'{"policy": "adaptive", "max_catchup_ratio": 1e400}',
        b'{"policy": "adaptive", "max_catchup_ratio": 1e30}',
        b'{"policy": "adaptive", "max_catchup_ratio": "3"}',
        b'{"policy": "adaptive", "max_catchup_ratio": true}',
        b'{"policy": "adaptive", "max_catchup_ratio": 0.5}',
        b'{"policy": "fixed", "interval": 0}',
        b'{"policy": "fixed", "interval": 10000000000}',
        b'{"policy": "fixed", "interval": 2.5}',
        b'{"policy": "fixed", "interval": ' + b"9" * 5000 + b"}",
        b"[" * 10000 + b"]" * 10000,
    ],
    ids=["nan", "inf", "overflow", "huge", "string", "bool", "below_1", "interval_0", "interval_huge", "interval_float",
         "interval_5000_digits", "deep"],  # fmt: skip
)
def test_hostile_control_values_refused(bucket, doc: bytes) -> None:
    with pytest.raises(FormatError):
        policy_from_json(doc)
    master = master_state()
    policy = ControlledPolicy(bucket, FixedInterval(2))
    pub = Publisher(bucket, policy=policy)
    pub.publish(0, master)
    bucket.put(CONTROL_KEY, doc)
    for step in range(1, 5):  # the trainer keeps its policy: anchors still come every 2 publishes
        rl_step(master, step)
        pub.publish(step, master)
    assert policy.policy == FixedInterval(2) and [a.step for a in pub.manifest.anchors] == [2, 4]
    assert policy.refused[CONTROL_KEY] == 4  # read and refused at every publish


def test_panel_refuses_nan_ratio() -> None:
    from rlsync.spaces.anchor_policy import make_policy

    for value in (float("nan"), float("inf"), 1e300):
        with pytest.raises(ValueError):
            make_policy("adaptive", {"max_catchup_ratio": value})


@pytest.mark.parametrize(
    "heartbeat", [b"1e308", b"Infinity", b"NaN", b"1e999", str(time.time() + 10 * 86400).encode(), b'"now"'],
    ids=["1e308", "inf", "nan", "overflow", "ten_days_ahead", "string"],
)
def test_hostile_lock_heartbeat_does_not_lock_trainers_out(bucket, heartbeat: bytes) -> None:
    bucket.put(LOCK_KEY, b'{"owner": "evil", "epoch": 7, "heartbeat": ' + heartbeat + b"}")
    lock = acquire(bucket, "trainer", ttl_s=600)
    assert lock.owner == "trainer"


def test_fresh_lock_still_holds_and_lock_fields_are_checked(bucket) -> None:
    bucket.put(LOCK_KEY, json.dumps({"owner": "other", "epoch": 3, "heartbeat": time.time()}).encode())
    with pytest.raises(RunLockedError):
        acquire(bucket, "trainer", ttl_s=600)
    for doc in (b'{"owner": "", "epoch": 1, "heartbeat": 1}', b'{"owner": "a", "epoch": 1.5, "heartbeat": 1}',
                b'{"owner": "a", "epoch": 9007199254740993, "heartbeat": 1}', b'{"owner": "a", "epoch": 1}'):  # fmt: skip
        with pytest.raises(FormatError):
            parse_lock(doc)
    assert math.isfinite(parse_lock(b'{"owner": "a", "epoch": 1, "heartbeat": 1.5}').heartbeat)


def test_trainer_validates_scores_again_and_keeps_training(tmp_path) -> None:
    """Scores written straight into the bucket (bypassing the env) are checked again by the
    trainer: the hostile ones are refused and counted, the good ones train, every published
    weight stays finite, and the trainer never raises (finding 1: IndexError, NaN publish)."""
    from rlsync.bucket import LocalBucket
    from trainer_space.trainer import Trainer, TrainerConfig

    bucket = LocalBucket(tmp_path / "bucket")
    trainer = Trainer(TrainerConfig(bucket=str(tmp_path / "bucket"), batch_size=2, max_steps=1, device="cpu", max_staleness=100,
                                    poll_s=0.05), bucket)  # fmt: skip
    vocab = trainer.trl.model.get_input_embeddings().num_embeddings
    hostile = {
        "nan_logprobs": {"logprobs": [float("nan")] * 3},
        "out_of_vocab": {"token_ids": [1, vocab, 2]},
        "negative_id": {"prompt_ids": [-5]},
        "empty_completion": {"token_ids": [], "logprobs": []},
        "empty_prompt": {"prompt_ids": []},
        "future_version": {"version": 10**12},
        "float_ids": {"token_ids": [1.9, 2.0, 3.0]},
    }
    for i, overrides in enumerate(hostile.values()):
        put_json(bucket, score_key(0, f"evil{i}"), {"samples": [good_sample(**{"version": 0, "reward": 1.0, **overrides})] * 2})
    for b in (1, 2):  # TRL's data loader reads one batch ahead: two batches of two for one step
        put_json(bucket, score_key(b, "good"), {"samples": [good_sample(version=0, reward=r) for r in (1.0, 0.0)]})
    trainer.run()
    trainer.close()
    assert trainer.refusals.total == len(hostile)
    assert trainer.opt_steps == 1 and trainer.version == 1
    sub = Subscriber(bucket)
    sub.sync()
    assert sub.step == 1 and all(torch.isfinite(t).all() for t in sub.state.values() if t.is_floating_point())
    assert json.loads(bucket.get("metrics/trainer.json"))["refused"]["total"] == len(hostile)


def test_soak_trial_hostile_replicas(tmp_path) -> None:
    """The soak's hostile-replica trial with a fixed seed: malformed objects among good ones,
    0 states lost, 0 non-finite publishes, every role alive, refusals counted and shown."""
    import random

    from testing.soak.kinds.hostile_replicas import trial_hostile_replicas

    result = trial_hostile_replicas(random.Random(3), tmp_path)
    assert not result.violations and result.lost == 0, result.violations
    assert sum(n for k, n in result.faults.items() if k.startswith("hostile rollouts")) > 0
    assert result.notes["refused by the env"] > 0 and result.notes["non-finite publishes"] == 0


def test_metrics_with_a_diverged_loss_stay_readable(bucket) -> None:
    """Readers refuse NaN/Infinity, so the metrics writer stores non-finite figures as null."""
    from rlsync.layout import metrics_key
    from rlsync.spaces.exchange import get_json
    from rlsync.spaces.metrics import read_metrics

    log = MetricsLog(bucket, TrainerMetrics)
    log.add(TrainRow(kind="train", loss=float("nan"), mean_reward=float("inf"), opt_step=3))
    log.flush()
    rows = get_json(bucket, metrics_key("trainer"))["rows"]
    assert rows[-1]["loss"] is None and rows[-1]["mean_reward"] is None and rows[-1]["opt_step"] == 3
    assert read_metrics(bucket, TrainerMetrics).steps[-1].opt_step == 3


def test_trainer_restores_published_weights_instead_of_publishing_poison(tmp_path) -> None:
    """If training still produced NaN weights, the trainer refuses to publish them, goes back to the
    published weights with a fresh optimizer, and keeps running."""
    from rlsync.bucket import LocalBucket
    from trainer_space.trainer import Trainer, TrainerConfig

    bucket = LocalBucket(tmp_path / "bucket")
    trainer = Trainer(TrainerConfig(bucket=str(tmp_path / "bucket"), device="cpu"), bucket)
    trainer.prepare()
    trainer.trl._sync_weight()  # TRL's weight sync: version 0
    trainer.transfer.flush()  # published in the background
    params = dict(trainer.trl.model.named_parameters())
    names = trainer.publisher.detector.published.keys()
    published = state_hash({n: params[n].detach().to(torch.bfloat16) for n in names})
    with torch.no_grad():
        params[next(iter(names))].view(-1)[:10] = float("nan")
    trainer.trl._sync_weight()  # refused in the background: nothing published
    trainer.transfer.flush()  # the refusal reaches on_non_finite here (or at the next send)
    assert trainer.transfer.non_finite_refused == 1 and trainer.version == 0 == trainer.transfer.version
    assert state_hash({n: params[n].detach().to(torch.bfloat16) for n in names}) == published
    trainer.trl._sync_weight()  # still alive: publishes the restored weights
    trainer.close()
    assert trainer.version == 1
