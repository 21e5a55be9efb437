"""A role's bucket that does not exist yet: created when the token can write to its namespace, else a
clear error that says how to create it (real huggingface_hub + hf_xet against benchmarks/hub_server.py)."""

from __future__ import annotations

import pytest

from rlsync.bucket import BucketError, open_bucket
from env_space.simulator import EnvConfig, EnvSimulator

WRITE = "hf_WRITEtokenCREATE0123456789abcdefXYZ"
READ = "hf_READtokenCREATE0123456789abcdefXYZ0"


@pytest.fixture
def hub_tokens(hub):
    hub.add_token(WRITE, "write")
    hub.add_token(READ, "read")
    return hub


def test_a_writing_token_creates_the_missing_bucket_once(hub_tokens, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", WRITE)
    bucket = open_bucket("hf://buckets/someone/fresh")
    assert "someone/fresh" in hub_tokens.buckets
    bucket.put("x", b"1")
    created = hub_tokens.count("api", "/api/buckets/someone/fresh$")
    open_bucket("hf://buckets/someone/fresh")  # exists now: looked up, not created again
    assert hub_tokens.count("api", "/api/buckets/someone/fresh$") == created + 1
    assert open_bucket("hf://buckets/someone/fresh").get("x") == b"1"


def test_a_read_only_token_is_told_how_to_create_the_bucket(hub_tokens, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", READ)
    with pytest.raises(BucketError, match=r"does not exist and this token cannot create it.*hf buckets create someone/absent") as info:
        open_bucket("hf://buckets/someone/absent")
    assert READ not in str(info.value)
    assert "someone/absent" not in hub_tokens.buckets


def test_a_read_only_token_opens_an_existing_bucket_without_writing(hub_tokens, monkeypatch):
    hub_tokens.create_bucket("someone/there")
    monkeypatch.setenv("HF_TOKEN", READ)
    assert open_bucket("hf://buckets/someone/there").list() == []


def test_a_role_started_on_a_missing_bucket_creates_it(hub_tokens, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", WRITE)
    EnvSimulator(EnvConfig(bucket="hf://buckets/someone/role-run"))
    assert "someone/role-run" in hub_tokens.buckets
