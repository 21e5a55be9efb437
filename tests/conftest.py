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
    from shared.bucket import LocalBucket

    return LocalBucket(tmp_path / "bucket")
