"""Hostile inputs round 4 (issue 33, item 9): deploy and export ship tracked regular files only."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from rlsync.errors import DeployError
from rlsync.spaces import space_roles
from rlsync.spaces.export import export_spaces

ROOT = Path(__file__).resolve().parents[2]


def _git_checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    for folder in [r.folder for r in space_roles.ROLES.values()] + ["shared"]:
        shutil.copytree(ROOT / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    subprocess.run(["git", "-C", str(root), "add", "-A"], check=True)
    return root


def test_untracked_files_never_ship_and_symlinks_are_refused(tmp_path):
    root = _git_checkout(tmp_path)
    secret = tmp_path / "token"
    secret.write_text("hf_SECRET")
    (root / "trainer_space" / ".env").write_text("HF_TOKEN=hf_SECRET\n")
    run = root / "trainer_space" / "runs" / "demo"
    run.mkdir(parents=True)
    (run / "latest.json").write_text("{}")
    files = {path for path, _ in space_roles.space_files(space_roles.ROLES["trainer"], root)}
    assert "trainer_space/app.py" in files
    assert not any(".env" in f or "runs/" in f for f in files)
    os.symlink(secret, root / "trainer_space" / "token.txt")
    subprocess.run(["git", "-C", str(root), "add", "trainer_space/token.txt"], check=True)
    with pytest.raises(DeployError, match="symbolic link"):
        space_roles.space_files(space_roles.ROLES["trainer"], root)
    (root / "trainer_space" / "token.txt").unlink()
    (root / "trainer_space" / "token.txt").write_text("x")
    subprocess.run(["git", "-C", str(root), "add", "trainer_space/token.txt"], check=True)
    (root / "trainer_space" / "token.txt").unlink()
    os.symlink(secret, root / "trainer_space" / "token.txt")  # tracked as a file, a link on disk
    with pytest.raises(DeployError, match="symbolic link"):
        space_roles.space_files(space_roles.ROLES["trainer"], root)


def test_a_folder_that_is_not_a_git_checkout_is_refused(tmp_path):
    root = _git_checkout(tmp_path)
    shutil.rmtree(root / ".git")
    with pytest.raises(DeployError, match="git checkout"):
        space_roles.space_files(space_roles.ROLES["env"], root)


def test_export_refuses_a_symlink_it_is_given(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("hf_SECRET")
    os.symlink(secret, tmp_path / "link.txt")
    with pytest.raises(OSError, match="regular file"):
        export_spaces([("space", [("link.txt", tmp_path / "link.txt")], {})], tmp_path / "out", io.StringIO())
    assert not (tmp_path / "out" / "space" / "link.txt").exists()
