"""Which files of a git checkout a Space ships: the regular files git tracks, nothing else.

Deploy and export (:mod:`.deploy`, :mod:`.export`) take a Space's files from here, so an untracked
file (a ``.env`` holding ``HF_TOKEN``, a local run bucket inside a Space folder, a scratch file)
never ships, and a symbolic link is refused (tracked as one, or a tracked file replaced by one on
disk): a Space never ships what a link points to (a token file, say).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ..errors import DeployError

__all__ = ["tracked_files"]

#: git's modes of a symbolic link and of a submodule (``git ls-files --stage``).
_GIT_SYMLINK, _GIT_SUBMODULE = "120000", "160000"


def _ls_files(root: Path, path: str) -> list[tuple[str, str]]:
    """``(mode, path)`` of every file git tracks at or under ``path`` of the checkout ``root``."""

    def git(*args: str) -> bytes:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, check=True, timeout=120).stdout

    try:
        top = Path(os.fsdecode(git("rev-parse", "--show-toplevel").strip()))
        listed = git("ls-files", "--stage", "-z", "--", path)
    except (OSError, subprocess.SubprocessError) as exc:
        raise DeployError(f"{root} is not a git checkout: a Space ships the files git tracks, nothing else ({exc})") from None
    if top.resolve() != root.resolve():
        raise DeployError(f"{root} is not the top of its git checkout ({top})")
    entries = []
    for entry in listed.split(b"\0"):
        if entry:
            meta, _, name = entry.partition(b"\t")
            entries.append((meta.split()[0].decode(), os.fsdecode(name)))
    return entries


def tracked_files(root: Path, path: str) -> list[Path]:
    """The regular files git tracks at or under ``path`` (a folder or one file) of the checkout ``root``,
    sorted; submodules left out.

    Raises:
        DeployError: ``root`` is not the top of a git checkout; a file is a symbolic link (tracked as
            one, or replaced by one on disk); a tracked file is missing from the checkout.
    """
    files = []
    for mode, rel in _ls_files(root, path):
        local = root / rel
        if mode == _GIT_SYMLINK or local.is_symlink():
            raise DeployError(f"{rel} is a symbolic link: a Space ships regular files only (replace it by the file)")
        if mode == _GIT_SUBMODULE:
            continue
        if not local.is_file():
            raise DeployError(f"{rel} is tracked but missing from the checkout (commit its deletion, or restore it)")
        files.append(local)
    return sorted(files)
