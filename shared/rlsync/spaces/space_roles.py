"""The three kinds of Space (:data:`ROLES`: trainer, rollout, env) and the files each one ships
(:func:`space_files`; what they are: :mod:`rlsync.spaces.deploy`)."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

from huggingface_hub import SpaceCard

from ..errors import DeployError
from ..roles import Role
from .checkout import tracked_files

REPO_ROOT = Path(__file__).resolve().parents[3]  # shared/rlsync/spaces/space_roles.py in a checkout
SHARED_FOLDER = "shared"  # the library's distribution folder; a Space gets its package, rlsync/, at its root
SPACE_APP = "app.py"  # a Space's entry at its root (its README's app_file): the role's <role>_space/app.py
SPACE_SDK = "gradio"

_SKIPPED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".hypothesis", ".ipynb_checkpoints", ".mypy_cache"})
_SKIPPED_SUFFIXES = (".pyc", ".pyo", ".safetensors")


@dataclasses.dataclass(frozen=True)
class SpaceRole:
    """One kind of Space and where its code and settings live.

    Args:
        name: The role, named in Space names (``<prefix>-<name>``).
        folder: Role folder at the repository root, uploaded as is.
        env_prefix: Prefix of the role's environment variables (``<PREFIX>_<FIELD>``).
        config: ``"module:Class"`` of the role's settings dataclass.
        uses_model: Whether the ``model`` setting is set to ``--model`` on GPU hardware.
        extra_files: Files of other folders the role's code imports, uploaded too.
    """

    name: Role
    folder: str
    env_prefix: str
    config: str
    uses_model: bool = False
    extra_files: tuple[str, ...] = ()

    def variable(self, field: str) -> str:
        """Environment variable of a settings field, e.g. ``TRAINER_BUCKET``."""
        return f"{self.env_prefix}_{field}".upper()

    def config_class(self) -> type:
        """Import and return the role's settings dataclass (imports the role's dependencies)."""
        module, _, name = self.config.partition(":")
        return getattr(importlib.import_module(module), name)


# Trainer and replicas warm up their CPU default model (shared/rlsync/spaces/tiny_model.py) on env_space.environments.
_ENVIRONMENTS = ("env_space/__init__.py", "env_space/environments.py")

ROLES: dict[Role, SpaceRole] = {
    role.name: role
    for role in (
        SpaceRole(Role.TRAINER, "trainer_space", Role.TRAINER.env_prefix, "trainer_space.trainer:TrainerConfig", uses_model=True, extra_files=_ENVIRONMENTS),
        SpaceRole(Role.ROLLOUT, "rollout_space", Role.ROLLOUT.env_prefix, "rollout_space.replica:ReplicaConfig", uses_model=True, extra_files=_ENVIRONMENTS),
        SpaceRole(Role.ENV, "env_space", Role.ENV.env_prefix, "env_space.simulator:EnvConfig"),
    )
}  # fmt: skip


def _included(path: Path) -> bool:
    skipped = any(part in _SKIPPED_DIRS or part.endswith(".egg-info") or part == "build" for part in path.parts)
    return not skipped and not path.name.endswith(_SKIPPED_SUFFIXES)


def _folder_files(root: Path, folder: str, uploaded_from: str = "") -> list[tuple[str, Path]]:
    """The files git tracks under ``root/folder`` (:func:`~.checkout.tracked_files`: regular files only),
    named by their path below ``root/uploaded_from``; caches, compiled files and weights left out."""
    if not (root / folder).is_dir():
        raise DeployError(f"missing folder {folder}/ in {root}")
    return [
        (path.relative_to(root / uploaded_from).as_posix(), path)
        for path in tracked_files(root, folder)
        if _included(path.relative_to(root))
    ]


def space_files(role: SpaceRole, root: Path = REPO_ROOT) -> tuple[tuple[str, Path], ...]:
    """The files of a role's Space, as ``(path_in_repo, local_file)`` pairs.

    Args:
        role: The role.
        root: Repository root.

    Returns:
        ``README.md``, ``requirements.txt`` and ``app.py`` (the role's, at the Space root), then every file of the
        role folder and of ``shared/rlsync/`` as ``rlsync/`` (caches, compiled files and weights left out), then the
        role's extra files.

    Raises:
        DeployError: A folder, the README or requirements is missing; the README front matter is
            not a Gradio Space's, its ``app_file`` is not among the uploaded files, or it lacks ``hf_oauth: true``.
    """
    readme = root / role.folder / "README.md"
    requirements = root / role.folder / "requirements.txt"
    app = root / role.folder / SPACE_APP
    for path in (readme, requirements, app):
        if not path.is_file():
            raise DeployError(f"missing {path.relative_to(root).as_posix()}")
    files = [("README.md", readme), ("requirements.txt", requirements), (SPACE_APP, app)]
    files += _folder_files(root, role.folder) + _folder_files(root, f"{SHARED_FOLDER}/rlsync", SHARED_FOLDER)
    for extra in role.extra_files:
        if tracked_files(root, extra) != [root / extra]:
            raise DeployError(f"missing {extra} (or not tracked by git)")
        files.append((extra, root / extra))
    card = SpaceCard.load(readme)
    if card.data.sdk != SPACE_SDK:
        raise DeployError(f"{role.folder}/README.md: front matter needs sdk: {SPACE_SDK}, has {card.data.sdk!r}")
    if card.data.app_file not in {path for path, _ in files}:
        raise DeployError(f"{role.folder}/README.md: app_file {card.data.app_file!r} is not among the Space's files")
    if card.data.to_dict().get("hf_oauth") is not True:
        raise DeployError(f"{role.folder}/README.md: front matter needs hf_oauth: true (the owner's sign-in to the panel)")
    return tuple(files)
