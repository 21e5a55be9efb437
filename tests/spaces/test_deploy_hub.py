"""rlsync.spaces.deploy with the real HfApi against the local Hub stand-in server (testing/hub/server.py).

The recording stand-in in test_deploy.py checks every call of a full deployment; these tests check
what only the real client shows: the type `create_bucket` really returns, and the messages for the
Hub's refusals (402 on Space creation, 401/403 for a token without write access).
"""

from __future__ import annotations

import io

import pytest
from huggingface_hub import HfApi

from rlsync.spaces import deploy, deploy_hub, deploy_plan
from testing.hub.faults import Fault

TOKEN = "hf_DEPLOYsecretTOKEN0123456789abcdef"


@pytest.fixture
def server(hub, monkeypatch):
    hub.add_token(TOKEN, "write")
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setenv("PANEL_AUTH", "admin:pw-hub-test")  # deploy refuses Spaces without a panel login
    return hub


def test_summary_shows_the_bucket_web_url_not_a_bucketurl_object(server):
    plan = deploy_plan.DeployPlan("someone/rl-sync", None, spaces=())
    summary = deploy_hub.apply_plan(plan, HfApi(token=TOKEN), {"HF_TOKEN": TOKEN})
    assert summary.bucket_web_url == f"{server.url}/buckets/someone/rl-sync"
    assert f"({server.url}/buckets/someone/rl-sync)" in summary.render() and "BucketUrl(" not in summary.render()
    assert "someone/rl-sync" in server.buckets  # the real create_bucket call reached the server


def test_402_on_space_creation_is_explained(server, capsys):
    server.inject("api", Fault(402, message="Payment required to create this Space", path="/api/repos/create"))
    assert deploy.main(["--namespace", "someone"], out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert "402 Payment Required" in err and "cpu-basic" in err
    assert TOKEN not in err


@pytest.mark.parametrize("status", [401, 403])
def test_permission_refusal_names_the_token_and_namespace(server, capsys, status):
    server.inject("api", Fault(status, path="/api/buckets/"))
    assert deploy.main(["--namespace", "someone"], out=io.StringIO()) == 1
    err = capsys.readouterr().err
    assert f"The Hub answered {status}: permission denied" in err and "'someone'" in err
    assert TOKEN not in err
