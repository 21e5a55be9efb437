"""A duplicated Space works for its new owner (issue 39), in-process parts:

- the bucket and replica id defaults of a Space, derived the same way by the three roles;
- a bucket in a namespace the token cannot write fails the role, naming the variable (Hub stand-in ``whoami``);
- a replica id whose live status another host writes refuses the start;
- the Hub stand-in answers racing bucket creates as the Hub does (one 200, 409 to the others);
- the panel: a crashed role reads "failed: <reason>", a refused action's message is not refreshed away, the MoE chart
  of a dense model is not drawn, and a page view opens the bucket without creating it.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from env_space.config import EnvConfig
from rlsync.bucket import LocalBucket
from rlsync.errors import BucketAccessError, BucketError, ReplicaIdInUseError
from rlsync.layout import status_key
from rlsync.roles import Role
from rlsync.spaces import role_control, snapshots
from rlsync.spaces.controls import role_controls
from rlsync.spaces.live import Live
from rlsync.spaces.plots import expert_plot
from rlsync.spaces.access import PanelAccess
from rlsync.spaces.bucket_access import check_write_access, writable_namespaces
from rlsync.spaces.exchange import put_json
from rlsync.spaces.metrics import ReplicaStatus
from rlsync.spaces.settings import LOCAL_BUCKET, default_bucket
from rlsync.supervised import SupervisedThread
from rollout_space.config import ReplicaConfig, default_replica_id
from rollout_space.identity import check_replica_id
from trainer_space.config import TrainerConfig

SPACE = {"SYSTEM": "spaces", "SPACE_ID": "alice/rl-sync-rollout-2", "SPACE_AUTHOR_NAME": "alice"}


def test_a_space_defaults_to_its_owners_bucket_in_all_three_roles(monkeypatch):
    for key, value in SPACE.items():
        monkeypatch.setenv(key, value)
    for prefix in ("TRAINER", "ROLLOUT", "ENV"):
        monkeypatch.delenv(f"{prefix}_BUCKET", raising=False)
    assert {TrainerConfig.from_env().bucket, ReplicaConfig.from_env().bucket, EnvConfig.from_env().bucket} == {
        "hf://buckets/alice/rl-sync"}
    assert default_replica_id() == "alice--rl-sync-rollout-2"  # two duplicates of one owner: two Space ids
    monkeypatch.setenv("ENV_BUCKET", "hf://buckets/team/x")
    assert EnvConfig.from_env().bucket == "hf://buckets/team/x"  # a variable still wins


def test_off_a_space_the_bucket_is_local_and_the_id_host_pid(monkeypatch):
    assert default_bucket({"SPACE_ID": "alice/x", "SPACE_AUTHOR_NAME": "alice"}) == LOCAL_BUCKET  # no SYSTEM=spaces
    monkeypatch.delenv("SYSTEM", raising=False)
    assert default_replica_id().endswith(f"-{__import__('os').getpid()}")


WHOAMI = {"name": "alice", "orgs": [{"name": "team"}], "auth": {"accessToken": {"role": "write"}}}


@pytest.mark.parametrize("info, expected", [
    (WHOAMI, ("alice", {"alice", "team"})),
    ({**WHOAMI, "auth": {"accessToken": {"role": "read"}}}, ("alice", set())),
    ({"name": "alice", "auth": {"accessToken": {"role": "fineGrained", "fineGrained": {"scoped": [
        {"entity": {"type": "user", "name": "alice"}, "permissions": ["repo.content.read", "repo.write"]},
        {"entity": {"type": "org", "name": "team"}, "permissions": ["repo.content.read"]}]}}}}, ("alice", {"alice"})),
    ({"orgs": []}, None),
])  # fmt: skip
def test_writable_namespaces_from_whoami(info, expected):
    found = writable_namespaces(info)
    assert (found if found is None else (found[0], set(found[1]))) == expected


def test_a_bucket_of_another_namespace_fails_naming_the_variable(hub):
    """On the Hub stand-in: alice's token may write alice's and team's buckets; rlsync's bucket is refused before any
    write, the message naming ROLLOUT_BUCKET and alice's own default; a token of nobody is not checked here."""
    from huggingface_hub import HfApi

    hub.add_user("alice", "hf_alice", orgs=("team",))
    api = HfApi(endpoint=hub.url, token="hf_alice")
    check_write_access(Role.ROLLOUT, "hf://buckets/alice/rl-sync", api)
    check_write_access(Role.ROLLOUT, "hf://buckets/team/runs/prefix", api)
    check_write_access(Role.ROLLOUT, "./runs/bucket", api)
    with pytest.raises(BucketAccessError) as refused:
        check_write_access(Role.ROLLOUT, "hf://buckets/rlsync/rl-sync", api)
    message = str(refused.value)
    assert "ROLLOUT_BUCKET" in message and "'rlsync'" in message and "hf://buckets/alice/rl-sync" in message
    hub.add_token("hf_nobody")
    check_write_access(Role.ROLLOUT, "hf://buckets/rlsync/rl-sync", HfApi(endpoint=hub.url, token="hf_nobody"))
    assert hub.count("api", "/api/buckets") == 0  # refused before any bucket call


def test_the_token_check_of_a_start_is_counted_by_the_roles_meter(hub, monkeypatch):
    """A Start's ``whoami`` goes through the meter of the role's bucket (paced by it, counted in the panel's totals)."""
    from rlsync.bucket.watch import meter_of
    from rlsync.spaces.exchange import open_role_bucket

    hub.add_user("alice", "hf_alice")
    monkeypatch.setenv("HF_TOKEN", "hf_alice")
    watched = open_role_bucket(Role.ROLLOUT, "hf://buckets/alice/rl-sync")
    try:
        meter = meter_of(watched)
        assert hub.count("api", "/api/whoami-v2") == 1
        assert meter.totals["GET whoami"] == 1, meter.totals
    finally:
        watched.close()


def test_racing_bucket_creates_get_one_create_and_409s(hub):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    hub.add_user("alice", "hf_alice")
    api = HfApi(endpoint=hub.url, token="hf_alice")
    barrier = threading.Barrier(8)

    def create(exist_ok: bool) -> int:
        barrier.wait()
        try:
            api.create_bucket("alice/rl-sync", exist_ok=exist_ok)
            return 200
        except HfHubHTTPError as err:
            return err.response.status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = sorted(pool.map(create, [False] * 8))
    assert codes == [200] + [409] * 7
    hub.reset()
    hub.add_user("alice", "hf_alice")
    barrier.reset()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(create, [True] * 8)) == [200] * 8  # what the roles call: every Start goes on
    with pytest.raises(HfHubHTTPError, match="403"):
        api.create_bucket("bob/rl-sync")  # not alice's namespace


def _status(bucket, host: str, updated_at: float) -> None:
    put_json(bucket, status_key("r1"), ReplicaStatus(replica_id="r1", host=host, updated_at=updated_at).to_json())


def test_a_live_status_of_another_host_refuses_the_replica_id(bucket):
    now = 1_000_000.0
    check_replica_id(bucket, "r1", "alice/rl-sync-rollout", 30.0, now)  # no status yet
    _status(bucket, "alice/rl-sync-rollout", now - 5)
    check_replica_id(bucket, "r1", "alice/rl-sync-rollout", 30.0, now)  # its own (a restart)
    with pytest.raises(ReplicaIdInUseError, match="ROLLOUT_REPLICA_ID") as refused:
        check_replica_id(bucket, "r1", "bob/rl-sync-rollout", 30.0, now)
    assert "'alice/rl-sync-rollout'" in str(refused.value)
    check_replica_id(bucket, "r1", "bob/rl-sync-rollout", 30.0, now + 91)  # stopped for 3 intervals: free
    _status(bucket, "alice/rl-sync-rollout", now + 50)  # a clock ahead counts as live too
    with pytest.raises(ReplicaIdInUseError):
        check_replica_id(bucket, "r1", "bob/rl-sync-rollout", 30.0, now)
    _status(bucket, "", now)  # a status without a host (older replicas) refuses nothing
    check_replica_id(bucket, "r1", "bob/rl-sync-rollout", 30.0, now)


class Crashing:
    """A role object whose thread fails after its start."""

    def __init__(self) -> None:
        self.threads: list[SupervisedThread] = []

    def start(self) -> None:
        def fail() -> None:
            raise RuntimeError("CUDA out of memory")

        self.threads = [SupervisedThread(fail, name="crashing", restart=False)]
        self.threads[0].start()

    def stop(self) -> None:
        pass

    @property
    def running(self) -> bool:
        return any(t.is_alive() for t in self.threads)


def test_a_crashed_role_reads_failed_with_its_reason():
    runner = role_control.RoleRunner(Role.ENV, lambda config: [Crashing()])
    runner.start(None, wait=True)
    deadline = time.monotonic() + 10
    while runner.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.status() == "**env**: failed: RuntimeError: CUDA out of memory"
    runner.stop()
    assert runner.state == "stopped"


def test_a_refused_start_stays_shown_and_the_moe_chart_of_a_dense_run_is_not_drawn(tmp_path, monkeypatch):
    """The Start's message goes to its own line, which no refresh writes; the expert chart is hidden while empty."""
    import gradio as gr

    monkeypatch.setenv("SPACE_ID", "alice/rl-sync-env")  # exposed, no login: every control refused
    for key in ("PANEL_AUTH", "OAUTH_CLIENT_ID", "GRADIO_SERVER_NAME"):
        monkeypatch.delenv(key, raising=False)
    runner = role_control.RoleRunner(Role.ENV, lambda config: [])
    with gr.Blocks():
        with Live(str(tmp_path / "bucket")) as live:
            controls = role_controls(runner, lambda: None, [], live)
            experts = expert_plot(live)
    refresh_outputs = {id(output) for output in live._outputs}
    assert id(controls["status"]) in refresh_outputs and id(controls["result"]) not in refresh_outputs
    assert experts.visible is False
    values = live.values()
    hidden = values[[id(o) for o in live._outputs].index(id(experts))]
    assert hidden["visible"] is False and hidden["value"] is None
    assert "Controls are off" in PanelAccess.from_env().notice()
    assert not (tmp_path / "bucket").exists()  # the refresh read nothing into existence


def test_a_page_view_creates_no_bucket_and_an_action_does(tmp_path):
    view = snapshots.BucketView(str(tmp_path / "bucket"))
    assert "a Start creates a missing one" in view.snapshot().error
    with pytest.raises(BucketError):
        view.bucket  # noqa: B018 - the property opens it
    assert not (tmp_path / "bucket").exists()
    assert isinstance(view.open(create=True), object) and LocalBucket(tmp_path / "bucket", create=False)


def test_a_panel_on_a_hub_bucket_not_created_yet_says_a_start_creates_it(hub):
    hub.add_user("alice", "hf_alice")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_TOKEN", "hf_alice")
        view = snapshots.BucketView("hf://buckets/alice/rl-sync")
        try:
            error = view.snapshot().error
        finally:
            view.close()
    assert error.startswith("no bucket at hf://buckets/alice/rl-sync yet") and "a Start creates it" in error
    assert "alice/rl-sync" not in hub.buckets  # the page view created nothing
