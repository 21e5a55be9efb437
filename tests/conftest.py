"""Shared test fixtures."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Hypothesis profiles, chosen with HYPOTHESIS_PROFILE (default "ci", which scripts/test.sh and CI use):
# - ci: derandomized (the examples are a function of the test alone), so every run checks the same cases;
# - quick: the same, fewer examples (mutation testing runs the property tests once per mutant);
# - explore: random examples, more of them, failures saved in .hypothesis/ and replayed first next time.
_COMMON = dict(deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=300, derandomize=True, database=None, **_COMMON)
settings.register_profile("quick", max_examples=40, derandomize=True, database=None, **_COMMON)
settings.register_profile(
    "explore", max_examples=2000, database=DirectoryBasedExampleDatabase(str(ROOT / ".hypothesis" / "examples")), **_COMMON
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# The fast tier (`pytest -m "not slow"`, docs/testing.md): everything but these. A module here is slow as a
# whole: it starts role processes, trains with TRL, runs vLLM, torchrun ranks, a browser, a fresh venv or a
# soak; SLOW_TESTS names the slow tests of otherwise fast modules. The full suite (no -m) runs them all.
SLOW_MODULES = frozenset({
    "test_adapter_serving", "test_app_lora", "test_browser", "test_checkpoint_chain", "test_codec_classgap", "test_hub_budget",
    "test_space_export", "test_space_restarts", "test_space_duplicates",
    "test_e2e", "test_e2e_lora", "test_env_openenv", "test_env_panel", "test_hub_fleet", "test_sharded", "test_sharded_background",
    "test_trackio", "test_transformers_engine", "test_trl_adapter_sync", "test_trl_bucket_sync", "test_trl_example",
    "test_trl_sharded", "test_trl_trainer", "test_vllm_engine", "test_vllm_gpu_path", "test_vllm_lora",
    "test_vllm_serve", "test_vllm_serve_pause", "test_vllm_fp8", "test_vllm_serve_moe", "test_e2e_moe", "test_role_prefixes",
    "test_vllm_moe", "test_generic_cpu_build",
})  # fmt: skip
SLOW_TESTS = frozenset({
    "test_env_source_registry.py::test_the_panel_offers_the_new_source_and_its_form",
    "test_bucket_hf.py::test_soak_trial_on_a_faulty_hub_converges_bit_exactly",
    "test_hub_xet_storage.py::test_three_processes_write_and_read_one_bucket_at_once_bit_exactly",
    "test_cli.py::test_ls_and_verify_bucket",
    "test_cli.py::test_inspect_reports_kind_steps_and_sparsity",
    "test_cli.py::test_diff_then_apply_reproduces_checkpoint_byte_for_byte",
    "test_cli.py::test_apply_to_wrong_base_fails_without_output",
    "test_cli.py::test_errors_are_clear_and_leave_no_partial_output",
    "test_cli_ux.py::test_diff_of_anchors_takes_their_steps_and_apply_reproduces_the_newer",
    "test_cli_ux.py::test_progress_bars_on_stderr_only_when_asked",
    "test_cli_ux.py::test_inspect_latest_json_shows_the_pointer",
    "test_cli_ux.py::test_inspect_takes_the_anchor_folder_key_that_ls_prints",
    "test_faults.py::test_publisher_killed_at_random_moments_resumes_exactly",
    "test_faults.py::test_publisher_killed_inside_publish_resumes_exactly",
    "test_hostile_env.py::test_soak_trial_hostile_tasks",
    "test_hostile_exchange.py::test_soak_trial_hostile_replicas",
    "test_hostile_hub.py::test_soak_trial_hub_hostile",
    "test_codec_classrice.py::test_kernel_and_torch_class_order_agree",
    "test_panel_access.py::test_planted_notice_shows_as_text_in_the_browser",
    "test_secrets.py::test_three_roles_on_a_flaky_hub_never_show_the_token",
    "test_cli_hostile.py::test_every_command_on_every_hostile_file",
    "test_cli_hostile.py::test_read_only_commands_create_nothing",
    "test_cli_hostile.py::test_ls_escapes_control_characters",
    "test_flow.py::test_trainer_keeps_training_through_logprob_lies_and_a_nan_step",
    "test_hostile_exchange.py::test_trainer_validates_scores_again_and_keeps_training",
    "test_hostile_exchange.py::test_trainer_restores_published_weights_instead_of_publishing_poison",
    "test_new_run.py::test_trainer_space_restart_without_checkpoint_refuses_in_the_panel_then_new_run",
})  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """Mark the slow tests (see SLOW_MODULES) with the ``slow`` marker registered in pyproject.toml."""
    for item in items:
        module = item.path.stem
        if module in SLOW_MODULES or f"{item.path.name}::{item.name.split('[')[0]}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def vllm_cpu_env():
    """The environment of an offline ``vllm.LLM`` on vLLM's CPU build in this process: no thread binding, no
    TorchDynamo, no general plugins, no Hub."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        mp.setenv("TORCHDYNAMO_DISABLE", "1")
        mp.setenv("VLLM_PLUGINS", "")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


@pytest.fixture
def scratch_registry(monkeypatch):
    """:mod:`rlsync.registry` with every home read; what the test registers is gone after it."""
    from rlsync import registry

    for kind in registry.Kind:
        registry.entries(kind)
    monkeypatch.setattr(registry, "_entries", {**registry._entries})
    monkeypatch.setattr(registry, "_homes", [*registry._homes])
    monkeypatch.setattr(registry, "_read", {*registry._read})
    return registry


@pytest.fixture
def bucket(tmp_path):
    """An empty local bucket."""
    from rlsync.bucket import LocalBucket

    return LocalBucket(tmp_path / "bucket")


#: Request timeouts while talking to the Hub stand-in (a stall must fail within these).
HUB_TIMEOUT_SECONDS = 2.0


@pytest.fixture(scope="session")
def hub_server(tmp_path_factory):
    """The Hub stand-in server (testing/hub/server.py), one per test session."""
    from huggingface_hub.utils import disable_progress_bars

    from testing.hub.server import HubServer

    disable_progress_bars()
    root = tmp_path_factory.mktemp("hub")
    # hf_xet keeps a cache per Xet storage endpoint, and each reset of the stand-in is a new one: keep them with it
    # (this process's and its children's), not in the user's ~/.cache.
    os.environ["HF_XET_CACHE"] = str(root / "xet-cache")
    server = HubServer(root)
    yield server
    server.close()


@pytest.fixture
def hub(hub_server, monkeypatch):
    """The Hub stand-in, emptied, with huggingface_hub online and pointed at it through HF_ENDPOINT.

    Every request gets `HUB_TIMEOUT_SECONDS` as its connect and read timeout.
    """
    from huggingface_hub import constants

    from rlsync.bucket import hf
    from rlsync.bucket.budget import BudgetConfig, RequestMeter
    from rlsync.bucket.hf_transport import HfTransferConfig, install
    from rlsync.bucket.hf_xet_grants import GRANTS

    hub_server.reset()
    GRANTS.clear()  # Xet tokens granted by the stand-in before its reset point at storage it forgot
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    # The stand-in limits nothing unless a test says so (HubServer.limit): roles (entry points) read
    # HUB_PACING, and a bucket opened without settings gets an unpaced meter.
    monkeypatch.setenv("HUB_PACING", "0")
    monkeypatch.setattr(hf, "RequestMeter", lambda: RequestMeter(BudgetConfig(enabled=False)))
    monkeypatch.setattr(constants, "ENDPOINT", hub_server.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    install(HfTransferConfig(connect_timeout=HUB_TIMEOUT_SECONDS, read_timeout=HUB_TIMEOUT_SECONDS))
    yield hub_server
    hub_server.reset()


@pytest.fixture(scope="session")
def s3_server():
    """The URL of moto's S3 stand-in in server mode (HTTP on a free port of 127.0.0.1), one per test session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """:class:`rlsync.bucket.s3.S3Settings` reaching the S3 stand-in, with made-up credentials in the environment
    (boto3's chain reads them), none of this machine's AWS configuration or ``S3_*`` variables read."""
    import dataclasses

    from rlsync.bucket.s3 import S3Settings

    for name in ("PROFILE", "SESSION_TOKEN", "ENDPOINT_URL", "ENDPOINT_URL_S3", "REGION", "DEFAULT_REGION"):
        monkeypatch.delenv(f"AWS_{name}", raising=False)
    for field in dataclasses.fields(S3Settings):
        monkeypatch.delenv(f"S3_{field.name.upper()}", raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/aws-credentials")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return S3Settings(endpoint_url=s3_server, region="us-east-1", connect_timeout=2.0, read_timeout=5.0)


@pytest.fixture(autouse=True)
def _no_leaked_role_threads():
    """Fail a test that leaves a role's background thread running (a watched bucket's poller, a replica's
    fetch loop...): left running, it keeps sending requests into later tests (the Hub stand-in is shared
    by the session) and competes with them for the CPU. The leaked threads are stopped first."""
    import threading
    import time

    from rlsync.supervised import SupervisedThread

    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 10.0  # a panel's Stop closes its roles on a thread of its own
    while True:
        leaked = [t for t in threading.enumerate() if t not in before and t.is_alive() and _library_owner(t) is not None]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for thread in leaked:
        owner = _library_owner(thread)
        if isinstance(thread, SupervisedThread):
            if hasattr(owner, "watched"):
                owner.watched.close()
            thread._stop_event.set()
        else:  # a background publisher's worker
            owner.close(timeout=5)
    if leaked:
        pytest.fail(f"the test left {len(leaked)} library thread(s) running: {sorted(t.name for t in leaked)}")
    if _DTENSOR_CACHE in _thread_dict():
        pytest.fail(
            "the test ran DTensor ops in the main thread: their per-thread cache holds the process group, and "
            "a child a later test forks from another thread (the env's confined scoring) hangs destroying it; "
            "run them in a thread of their own (tests/library/trl/test_trl_sharded.py: in_own_thread)"
        )


#: The key of DTensor's per-thread op cache in a thread's state dict.
_DTENSOR_CACHE = "__DTensor_fastpath_thread_cache_cleanup"


def _thread_dict() -> dict:
    """The calling thread's state dict (where C extensions keep per-thread objects)."""
    import ctypes

    get = ctypes.pythonapi.PyThreadState_GetDict
    get.restype = ctypes.c_void_p  # NULL while the thread has none
    address = get()
    return ctypes.cast(address, ctypes.py_object).value if address else {}


def _library_owner(thread):
    """The library object whose loop `thread` runs (a supervised role loop not told to stop, or a background
    publisher's worker), else ``None``."""
    from rlsync.protocol.background import PublishWorker
    from rlsync.supervised import SupervisedThread

    if isinstance(thread, SupervisedThread):
        return None if thread._stop_event.is_set() else getattr(thread._loop, "__self__", thread)
    owner = getattr(getattr(thread, "_target", None), "__self__", None)
    return owner if isinstance(owner, PublishWorker) else None
