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
    server = HubServer(tmp_path_factory.mktemp("hub"))
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

    hub_server.reset()
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
