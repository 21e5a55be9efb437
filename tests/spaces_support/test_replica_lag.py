"""A replica keeps up with the trainer whatever its loop does between batches (issue 41, item 5).

On the Hub stand-in at PRO limits (``python -m benchmarks.hub_budget --replicas 16 --tier pro``) the fleet
lagged up to 12-21 versions: a replica applied a fetched version only when its loop came round between
batches, and between batches that loop waits for request budget (a claim, the samples' write), so a replica
fell a version behind per trainer step. The fetch thread now applies each verified update as soon as no batch
is being generated; a batch keeps the version it started with. Counted in versions behind, with the replica's
loop held in a write or its batch held in generation by the test (no wall-clock bound on the replica).
"""

from __future__ import annotations

import threading
import time

from env_space.environments import get_environment
from env_space.simulator import EnvConfig, EnvSimulator
from rlsync.bucket.base import BucketWrapper
from rlsync.hashing import state_hash
from rlsync.layout import CLAIMS_PREFIX, rollout_key
from rlsync.protocol import FixedInterval, Publisher
from rlsync.scores import read_samples
from rlsync.spaces.tiny_model import tiny_model_path
from rollout_space.replica import Replica, ReplicaConfig
from tests.helpers import master_state, rl_step
from tests.library.test_secrets import StubEngine

VERSIONS = 6


def wait_until(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


class HeldClaims(BucketWrapper):
    """A bucket whose claim writes wait until :attr:`release` is set: a replica's loop waiting for request
    budget between batches, as on a Hub token shared by a fleet."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.holding, self.release = threading.Event(), threading.Event()

    def put(self, key: str, data: bytes) -> None:
        if key.startswith(CLAIMS_PREFIX):
            self.holding.set()
            assert self.release.wait(60), "the test never released the claim"
        super().put(key, data)


def replica(bucket, opened=None) -> Replica:
    """A replica of the local ``bucket`` (through ``opened``, a wrapper of it, when given)."""
    model = str(tiny_model_path(environments=get_environment))
    config = ReplicaConfig(bucket=str(bucket.root), replica_id="r0", model=model, device="cpu", poll_s=0.05)
    return Replica(config, bucket=opened or bucket, engine=StubEngine())


def test_a_replica_whose_loop_waits_between_batches_still_takes_every_version(bucket):
    held = HeldClaims(bucket)
    master, pub = master_state(), Publisher(bucket, policy=FixedInterval(100))
    pub.publish(0, master)
    EnvSimulator(EnvConfig(tasks_per_batch=2), bucket).step()  # a task batch to claim
    r = replica(bucket, held)
    r.start()
    try:
        assert held.holding.wait(30), "the replica never claimed the batch"  # its loop now waits in the claim
        records = []
        for step in range(1, VERSIONS):
            rl_step(master, step)
            records.append(pub.publish(step, master))
        wait_until(lambda: r.subscriber.step == VERSIONS - 1)
        behind = VERSIONS - 1 - (r.subscriber.step or 0)
        assert behind == 0, f"{behind} versions behind while the replica's loop waited between batches"
        assert held.holding.is_set() and not held.release.is_set()  # still waiting in the claim: no batch boundary
        assert state_hash(r.subscriber.state) == records[-1].state_hash
    finally:
        held.release.set()
        r.close()


def test_a_batch_keeps_the_version_it_started_with_and_the_next_goes_in_after_it(bucket):
    master, pub = master_state(), Publisher(bucket, policy=FixedInterval(100))
    pub.publish(0, master)
    EnvSimulator(EnvConfig(tasks_per_batch=2), bucket).step()
    r = replica(bucket)
    generate, seen = r.engine.generate, {}

    def trainer_moves_on_mid_batch(prompts, sampling):
        rl_step(master, 1)
        seen["record"] = pub.publish(1, master)
        # fetched and verified meanwhile, then held until the batch ends (or, wrongly, applied at once)
        assert wait_until(lambda: r.slot.update is not None or r.subscriber.step == 1)
        seen["step_mid_batch"] = r.subscriber.step
        return generate(prompts, sampling)

    r.engine.generate = trainer_moves_on_mid_batch
    stop = threading.Event()
    loop = threading.Thread(target=r.weights.fetch_loop, args=(stop,), name="fetch-r0")
    loop.start()
    try:
        assert wait_until(lambda: r.subscriber.step == 0)  # the anchor went in: no batch was being generated
        batch = r.batches.next_batch()
        assert batch is not None and r.batches.claim(batch)
        assert r.answer(batch) > 0
        assert seen["step_mid_batch"] == 0, "an update was applied while a batch was being generated"
        _, samples = read_samples(bucket, rollout_key(batch, "r0"))
        assert {s.version for s in samples} == {0}
        assert wait_until(lambda: r.subscriber.step == 1), "the update held by the batch never went in after it"
        assert state_hash(r.subscriber.state) == seen["record"].state_hash
    finally:
        stop.set()
        r.weights.wake()
        loop.join(10)
        r.close()
