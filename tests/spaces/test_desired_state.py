"""What the owner wants running (rlsync.spaces.desired) and the boot that follows it (rlsync.spaces.restarts):
Start and Stop record it in the bucket, a SIGTERM stop does not, a role recorded running resumes at boot with
the settings of its Start, a stopped one does not, and a hostile record is refused, counted and resumes nothing."""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest

from rlsync.bucket import LocalBucket
from rlsync.errors import FormatError
from rlsync.layout import desired_key
from rlsync.limits import MAX_DESIRED_BYTES
from rlsync.roles import Role
from rlsync.spaces import desired
from rlsync.spaces.desired import Wanted, config_from_desired, read_desired, write_desired
from rlsync.spaces.restarts import resume_at_boot
from rlsync.spaces.role_control import RoleRunner
from rlsync.spaces.settings import instance_id


@dataclasses.dataclass
class Settings:
    bucket: str = ""
    lr: float = 0.0
    steps: int = 0
    fast: bool = False
    name: str = "a"
    limit: int | None = None


class Role1:
    """A role object as RoleRunner hosts it, writing through its bucket."""

    def __init__(self, config: Settings, bucket: LocalBucket) -> None:
        self.config, self.bucket = config, bucket
        self._running = threading.Event()

    def start(self) -> None:
        self._running.set()

    def stop(self) -> None:
        self._running.clear()

    @property
    def running(self) -> bool:
        return self._running.is_set()


@pytest.fixture()
def store(tmp_path):
    return LocalBucket(tmp_path / "bucket")


def hosted(store: LocalBucket) -> tuple[RoleRunner, list[Role1]]:
    built: list[Role1] = []

    def build(config: Settings) -> list[Role1]:
        built.append(Role1(config, store))
        return built[-1:]

    return RoleRunner(Role.TRAINER, build), built


def test_instance_ids_are_key_safe_and_distinct_per_space():
    assert instance_id({"SPACE_ID": "alice/rl-sync-rollout"}) == "alice--rl-sync-rollout"
    assert instance_id({"SPACE_ID": "bob/rl-sync-rollout"}) != instance_id({"SPACE_ID": "alice/rl-sync-rollout"})
    long = instance_id({"SPACE_ID": "a" * 60 + "/" + "b" * 60})
    assert len(long) == 64 and desired_key(Role.ROLLOUT, long).startswith("control/desired/rollout/")
    assert desired_key(Role.ENV, instance_id({"SPACE_ID": "x/../../etc"})) == "control/desired/env/x--..--..--etc.json"


def test_start_records_running_with_its_settings_stop_records_stopped_sigterm_records_nothing(store):
    runner, _ = hosted(store)
    config = Settings(bucket=str(store.root), lr=0.5, steps=3)
    runner.start(config, wait=True)
    state = read_desired(store, Role.TRAINER)
    assert state.wanted is Wanted.RUNNING and state.settings == dataclasses.asdict(config)
    runner.stop(record=False)  # the runtime's SIGTERM before a restart
    assert read_desired(store, Role.TRAINER).wanted is Wanted.RUNNING
    runner.start(config, wait=True)
    runner.stop()  # the owner's Stop
    assert read_desired(store, Role.TRAINER) == dataclasses.replace(state, wanted=Wanted.STOPPED, settings={}, at=read_desired(store, Role.TRAINER).at)


def test_a_role_recorded_running_resumes_at_boot_with_its_settings_a_stopped_one_does_not(store):
    config = Settings(bucket=str(store.root), lr=0.5, steps=3, limit=7)
    first, _ = hosted(store)
    first.start(config, wait=True)
    first.stop(record=False)
    # the Space restarts: a new process, its settings from the environment (other than those of the Start)
    recorded = store.get(desired_key(Role.TRAINER, instance_id()))
    runner, built = hosted(store)
    line = resume_at_boot(runner, Settings(bucket=str(store.root)))
    for _ in range(500):
        if runner.running:
            break
        threading.Event().wait(0.01)
    assert "resumed" in line and runner.state == "running" and built[-1].config == config
    assert store.get(desired_key(Role.TRAINER, instance_id())) == recorded  # the boot recorded nothing
    runner.stop()
    again, rebuilt = hosted(store)
    assert "stopped by its owner" in resume_at_boot(again, Settings(bucket=str(store.root)))
    assert rebuilt == [] and again.state == "stopped"
    fresh, none = hosted(LocalBucket(store.root.parent / "other"))
    assert "never started" in resume_at_boot(fresh, Settings(bucket=str(store.root.parent / "other"))) and none == []


def test_a_boot_on_a_missing_bucket_creates_nothing_and_resumes_nothing(tmp_path):
    runner, built = hosted(LocalBucket(tmp_path / "unused"))
    assert "not resumed" in resume_at_boot(runner, Settings(bucket=str(tmp_path / "missing")))
    assert not (tmp_path / "missing").exists() and built == []


HOSTILE = {
    "oversized": b"{" + b'"x": "' + b"y" * (MAX_DESIRED_BYTES + 10) + b'"}',
    "not json": b"\xff\xfe running",
    "a list": b"[]",
    "deep": b'{"role": "trainer", "wanted": "running", "at": 1, "settings": {"lr": [[[[1]]]]}}',
    "extra key": json.dumps({"role": "trainer", "wanted": "running", "settings": {}, "at": 1, "x": 1}).encode(),
    "another role": json.dumps({"role": "env", "wanted": "running", "settings": {}, "at": 1}).encode(),
    "unknown state": json.dumps({"role": "trainer", "wanted": "sprinting", "settings": {}, "at": 1}).encode(),
    "settings not an object": json.dumps({"role": "trainer", "wanted": "running", "settings": [], "at": 1}).encode(),
    "infinite time": b'{"role": "trainer", "wanted": "running", "settings": {}, "at": Infinity}',
    "unknown setting": json.dumps({"role": "trainer", "wanted": "running", "settings": {"evil": 1}, "at": 1}).encode(),
    "bool as int": json.dumps({"role": "trainer", "wanted": "running", "settings": {"steps": True}, "at": 1}).encode(),
    "str as float": json.dumps({"role": "trainer", "wanted": "running", "settings": {"lr": "1e9"}, "at": 1}).encode(),
    "float as int": json.dumps({"role": "trainer", "wanted": "running", "settings": {"steps": 1.5}, "at": 1}).encode(),
    "huge string": json.dumps({"role": "trainer", "wanted": "running", "settings": {"name": "n" * 5000}, "at": 1}).encode(),
    "another bucket": json.dumps({"role": "trainer", "wanted": "running", "settings": {"bucket": "/etc"}, "at": 1}).encode(),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_desired_state_is_refused_counted_and_resumes_nothing(store, case):
    store.put(desired_key(Role.TRAINER, instance_id()), HOSTILE[case])
    runner, built = hosted(store)
    before = desired.REFUSED[Role.TRAINER.value]
    line = resume_at_boot(runner, Settings(bucket=str(store.root)))
    assert "not resumed: refused" in line and built == [] and runner.state == "stopped"
    assert desired.REFUSED[Role.TRAINER.value] == before + 1


def test_settings_are_checked_against_their_fields():
    base = Settings(bucket="b")
    got = config_from_desired(base, {"lr": 1, "steps": 2, "fast": True, "name": "x", "limit": None, "bucket": "b"}, "b")
    assert got == Settings(bucket="b", lr=1.0, steps=2, fast=True, name="x", limit=None) and type(got.lr) is float
    with pytest.raises(FormatError, match="not a valid int"):
        config_from_desired(base, {"limit": "7"}, "b")
    with pytest.raises(FormatError, match="not a valid float"):
        config_from_desired(base, {"lr": float("nan")}, "b")


def test_a_failed_record_leaves_the_role_running(tmp_path, caplog):
    store = LocalBucket(tmp_path / "bucket")
    runner, built = hosted(store)
    (tmp_path / "bucket" / "control").write_text("a file where the folder goes")
    runner.start(Settings(bucket=str(store.root)), wait=True)
    assert runner.state == "running" and "could not record running" in caplog.text
    runner.stop(record=False)
    write_desired(LocalBucket(tmp_path / "ok"), Role.TRAINER, Wanted.STOPPED)
    assert read_desired(LocalBucket(tmp_path / "ok"), Role.TRAINER).settings == {}


def test_the_rollout_space_records_its_replica_count_and_a_restart_resumes_as_many(store):
    from rollout_space.app import SPACE
    from rollout_space.config import ReplicaConfig

    built: list[ReplicaConfig] = []

    def build(config: ReplicaConfig) -> list[Role1]:
        built.append(config)
        return [Role1(config, store) for _ in range(config.replicas)]

    rollout = dataclasses.replace(SPACE, build_roles=build)
    runner = rollout.make_runner()
    started = ReplicaConfig(bucket=str(store.root), replicas=3, samples_per_task=2)
    runner.start(started, wait=True)
    assert len(runner.objects) == 3
    runner.stop(record=False)  # the runtime's SIGTERM: the owner still wants 3 running
    recorded = read_desired(store, Role.ROLLOUT).settings
    assert recorded["replicas"] == 3 and recorded == desired.settings_of(started)
    again = rollout.make_runner()
    assert "resumed" in resume_at_boot(again, ReplicaConfig(bucket=str(store.root)))
    for _ in range(500):
        if again.running:
            break
        threading.Event().wait(0.01)
    assert built[-1] == started and len(again.objects) == 3 and again.state == "running"
    again.stop()
    assert read_desired(store, Role.ROLLOUT).wanted is Wanted.STOPPED


def test_a_recorded_replica_count_below_one_is_refused(store):
    from rollout_space.config import ReplicaConfig

    with pytest.raises(FormatError, match="ROLLOUT_REPLICAS"):
        config_from_desired(ReplicaConfig(bucket=str(store.root)), {"replicas": 0}, str(store.root))
