"""``python -m rlsync.spaces.deploy --export DIR``: each Space's folder, exactly as deploy uploads it.

Every Space of a deployment plan (:class:`~rlsync.spaces.deploy_plan.DeployPlan`) becomes ``DIR/<space name>/`` holding the
files of its one commit (the same ``(path_in_repo, local_file)`` pairs: regular files git tracks), byte for
byte, and nothing else; the Space variables deploy would set go to ``DIR/variables.env``, outside the Space folders.
Run an exported Space as the Hub does (``pip install -r requirements.txt`` then ``python app.py``), or
headless from its folder with ``python -m <role>_space``: the Space ships ``rlsync`` as a package at its root,
beside the role folder, so both import it from there.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TextIO

#: The Spaces' variables, one ``# <space name>`` section each, in this file of DIR (outside every Space folder).
VARIABLES_FILE = "variables.env"


def export_spaces(
    spaces: Iterable[tuple[str, Sequence[tuple[str, Path]], Mapping[str, str]]], dest: Path, out: TextIO | None = None
) -> list[Path]:
    """Write each Space's files under ``dest/<space name>/``.

    Args:
        spaces: ``(space name, (path_in_repo, local_file) pairs, variables)`` per Space, as a
            :class:`~rlsync.spaces.deploy_plan.SpacePlan` has them.
        dest: The export folder; created if missing. A Space folder already in it is replaced.
        out: Where to list the Space folders and their variables (``None``: nowhere).

    Returns:
        The Space folders written, in the plan's order.

    Raises:
        OSError: A file could not be read or written, or is not a regular file (a symbolic link is
            refused, never followed).
    """
    dest.mkdir(parents=True, exist_ok=True)
    folders, variables = [], []
    for name, files, space_variables in spaces:
        folder = dest / name
        if folder.exists():
            shutil.rmtree(folder)
        for path_in_repo, local in files:
            if Path(local).is_symlink() or not Path(local).is_file():
                raise OSError(f"{local} is not a regular file: a Space ships regular files only, never a link's target")
            target = folder / path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(local, target, follow_symlinks=False)
        folders.append(folder)
        variables.append(f"# {folder.name}")
        variables += [f"{key}={value}" for key, value in space_variables.items()]
        if out is not None:
            print(f"{folder}  ({len(files)} files; variables: {', '.join(space_variables)})", file=out)
    (dest / VARIABLES_FILE).write_text("\n".join(variables) + "\n", encoding="utf-8")
    return folders
