"""Deploy the bucket and the three Spaces (trainer, rollout, env) to the Hugging Face Hub.

``python -m rlsync.spaces.deploy --namespace USER [--bucket NAME] [--prefix NAME] [--private]
[--trainer-hardware FLAVOR] [--rollout-hardware FLAVOR] [--env-hardware FLAVOR] [--replicas N]
[--model NAME] [--mount-model] [--sleep-time S] [--mount-bucket PATH] [--dry-run] [--export DIR]``

What it does, with :class:`huggingface_hub.HfApi` (every call is idempotent, so a second run
updates the deployment in place):

1. ``create_bucket(<ns>/<bucket>, exist_ok=True)``.
2. For each Space (``<prefix>-trainer``, ``<prefix>-env``, and ``<prefix>-rollout`` or
   ``<prefix>-rollout-1`` .. ``-N`` for ``--replicas N``):
   ``create_repo(repo_type="space", space_sdk="gradio", exist_ok=True)``; the ``HF_TOKEN`` secret;
   the model variable when the Space gets GPU hardware, and ``<ROLE>_BUCKET`` only for a bucket other than
   the Space default (``hf://buckets/<namespace>/rl-sync``, :func:`.settings.default_bucket`). Nothing
   owner-specific otherwise: a duplicate inherits the variables, and the defaults (the owner's bucket, a replica id
   from the Space's id; device, engine, learning rate, completion length for the hardware and model) are right
   for whoever owns it; volumes when asked for
   (``set_space_volumes``); the hardware when one is given; and last one commit with the Space's
   files, so the first build already sees its settings.

Volumes (huggingface_hub 2.4 ``Volume`` + ``set_space_volumes``; mounted by the platform, files
fetched lazily): ``--mount-model`` mounts the ``--model`` repo read-only at ``/models/<name>`` on GPU
trainer and rollout Spaces and points ``<ROLE>_MODEL`` at that folder (the engines want a local
folder: vLLM's worker reads the checkpoint's tensor names from it). ``--mount-bucket PATH`` mounts
the bucket read-only for inspection only: the roles keep using the ``hf://`` API, whose ``/batch``
uploads make each object visible atomically, which a file-system mount does not promise.

A Space's files: its role folder; ``rlsync/`` (``shared/rlsync``: the Hub installs ``requirements.txt`` before the
files are there, so the library is a package at the root); files its code imports (:attr:`SpaceRole.extra_files`);
at the root the role's ``README.md`` (``app_file: app.py``), ``requirements.txt``, ``app.py`` (``<role>_space/app.py``).
Only regular files git tracks ship (:mod:`.checkout`): never an untracked ``.env`` or run bucket, nor a link's target.
The commit adds and overwrites files; a file deleted from the checkout stays in the Space until deleted there.

The access token is read from ``HF_TOKEN`` only. It is sent as the Spaces' ``HF_TOKEN`` secret and
never printed or logged; use a fine-grained token that can write to the namespace's repos and
the bucket. Every Space signs its owner in with Hugging Face (``hf_oauth: true`` in each README, checked here), so
its panel's Start/Stop, policy and settings controls work for the owner (and ``PANEL_OAUTH_ORG``'s members) with no
secret but ``HF_TOKEN``. ``PANEL_AUTH`` (``user:password``), when set, becomes every Space's ``PANEL_AUTH`` secret:
a password login besides.
``--dry-run`` prints the calls it would make and calls nothing. ``--export DIR`` writes each Space's
folder exactly as it would be uploaded (:mod:`.export`) and exits; ``--namespace`` defaults to
:data:`TEMPLATE_NAMESPACE` there.

``--sync-readmes`` rewrites the settings table of each role's README from its config dataclass
(this needs the roles' own dependencies, e.g. torch, unlike deploying).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence, TextIO

import httpx2
from huggingface_hub import BucketUrl, CommitOperationAdd, HfApi, SpaceCard, SpaceHardware, Volume
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..errors import DeployError
from ..roles import Role
from .checkout import tracked_files
from .settings import SPACE_BUCKET_NAME

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]  # shared/rlsync/spaces/deploy.py in a checkout
SHARED_FOLDER = "shared"  # the library's distribution folder; a Space gets its package, rlsync/, at its root
SPACE_APP = "app.py"  # a Space's entry at its root (its README's app_file): the role's <role>_space/app.py
DEFAULT_PREFIX = "rl-sync"
#: Owner of the template Spaces (``<TEMPLATE_NAMESPACE>/<prefix>-trainer`` ...) the Space READMEs link to.
TEMPLATE_NAMESPACE = "rlsync"
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
MODEL_MOUNT_ROOT = "/models"
SPACE_SDK = "gradio"
TOKEN_SECRET = "HF_TOKEN"
# Secrets copied from the deploying environment to every Space, with their descriptions.
SECRETS = {
    TOKEN_SECRET: "Hub token: read and write the bucket",
    "PANEL_AUTH": "user:password asked by the panel's controls",
}
REDACTED = "<redacted>"
SETTINGS_BEGIN = "<!-- settings:begin (generated by `python -m rlsync.spaces.deploy --sync-readmes`) -->"
SETTINGS_END = "<!-- settings:end -->"

_SKIPPED_DIRS = frozenset({"__pycache__", ".pytest_cache", ".hypothesis", ".ipynb_checkpoints", ".mypy_cache"})
_SKIPPED_SUFFIXES = (".pyc", ".pyo", ".safetensors")
# ZeroGPU runs functions decorated with ``@spaces.GPU`` only; a resident vLLM engine or trainer cannot use it.
HARDWARE_CHOICES = tuple(h.value for h in SpaceHardware if not h.value.startswith("zero-"))


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


@dataclasses.dataclass(frozen=True)
class SpacePlan:
    """Everything one Space gets.

    Args:
        role: The Space's role.
        repo_id: ``<namespace>/<name>``.
        hardware: Hardware flavor to request, or ``None`` to leave the Space's hardware alone.
        variables: Space variables (public environment variables).
        files: ``(path_in_repo, local_file)`` pairs uploaded in one commit.
        volumes: Volumes to mount (set only when not empty; setting replaces the Space's volumes).
    """

    role: SpaceRole
    repo_id: str
    hardware: str | None
    variables: dict[str, str]
    files: tuple[tuple[str, Path], ...]
    volumes: tuple[Volume, ...] = ()


@dataclasses.dataclass(frozen=True)
class DeployPlan:
    """The bucket and Spaces of one deployment.

    Args:
        bucket_id: ``<namespace>/<bucket>``.
        private: Visibility of new repos and the bucket (``None``: the namespace's default).
        spaces: One plan per Space.
        sleep_time: Seconds of inactivity before upgraded hardware sleeps, or ``None``.
    """

    bucket_id: str
    private: bool | None
    spaces: tuple[SpacePlan, ...]
    sleep_time: int | None = None

    @property
    def bucket_url(self) -> str:
        """The bucket as the Spaces open it: ``hf://buckets/<namespace>/<bucket>``."""
        return f"hf://buckets/{self.bucket_id}"


@dataclasses.dataclass
class DeploySummary:
    """What a deployment created: the bucket's and the Spaces' web addresses.

    Args:
        bucket_url: ``hf://`` URL the Spaces use.
        bucket_web_url: The bucket's page on the Hub.
        spaces: ``(role, repo_id, url, hardware)`` per Space.
    """

    bucket_url: str
    bucket_web_url: str
    spaces: list[tuple[str, str, str, str | None]] = dataclasses.field(default_factory=list)
    secrets: tuple[str, ...] = (TOKEN_SECRET,)

    def render(self) -> str:
        """Human-readable summary (never contains a secret's value)."""
        lines = [f"Bucket: {self.bucket_url}  ({self.bucket_web_url})", "Spaces:"]
        for role, _repo_id, url, hardware in self.spaces:
            lines.append(f"  {role:<8} {url}  hardware: {hardware or 'unchanged (cpu-basic for a new Space)'}")
        lines.append(f"Secrets set on every Space (values not shown): {', '.join(self.secrets)}.")
        return "\n".join(lines)


def is_gpu(hardware: str | None) -> bool:
    """Whether a hardware flavor has a GPU (``None`` and ``cpu-*`` do not)."""
    return hardware is not None and not hardware.startswith("cpu-")


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


def _check_name(repo_id: str, what: str) -> str:
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise ValueError(f"invalid {what} {repo_id!r}: {exc}") from None
    return repo_id


def plan_deployment(
    namespace: str,
    *,
    bucket: str | None = None,
    prefix: str = DEFAULT_PREFIX,
    private: bool | None = None,
    trainer_hardware: str | None = None,
    rollout_hardware: str | None = None,
    env_hardware: str | None = None,
    replicas: int = 1,
    model: str = DEFAULT_MODEL,
    mount_model: bool = False,
    sleep_time: int | None = None,
    mount_bucket: str | None = None,
    root: Path = REPO_ROOT,
) -> DeployPlan:
    """Work out the bucket, Spaces, settings and files of a deployment; calls nothing.

    Args:
        namespace: User or organisation that owns the bucket and the Spaces.
        bucket: Bucket name (default: ``prefix``).
        prefix: Space names are ``<prefix>-trainer``, ``<prefix>-rollout[-<i>]``, ``<prefix>-env``.
        private: Make new repos and the bucket private (``None``: the namespace's default).
        trainer_hardware: Hardware flavor for the trainer Space, or ``None`` to leave it.
        rollout_hardware: Hardware flavor for every rollout Space, or ``None``.
        env_hardware: Hardware flavor for the env Space, or ``None``.
        replicas: Number of rollout Spaces.
        model: Model of the trainer and rollout Spaces when they get GPU hardware.
        mount_model: Mount ``model`` (a Hub model repo) read-only at ``/models/<name>`` on those
            Spaces and set their model setting to that folder instead of the repo id.
        sleep_time: Seconds of inactivity before upgraded hardware sleeps (sent with hardware requests).
        mount_bucket: Mount the bucket read-only at this path in every Space, or ``None``.
        root: Repository root holding the role folders and ``shared/``.

    Returns:
        The plan.

    Raises:
        ValueError: An invalid name, hardware flavor, replica count or mount path.
        DeployError: The checkout lacks a Space's files (see :func:`space_files`).
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    if mount_bucket is not None and not mount_bucket.startswith("/"):
        raise ValueError(f"mount path must be absolute, got {mount_bucket!r}")
    bucket_id = _check_name(f"{namespace}/{bucket or prefix}", "bucket id")
    bucket_url = f"hf://buckets/{bucket_id}"
    model_setting, model_volumes = model, ()
    if mount_model:
        model_setting = f"{MODEL_MOUNT_ROOT}/{_check_name(model, 'model repo id').split('/')[-1]}"
        model_volumes = (Volume(type="model", source=model, mount_path=model_setting, read_only=True),)
    bucket_volumes = () if mount_bucket is None else (
        Volume(type="bucket", source=bucket_id, mount_path=mount_bucket, read_only=True),)  # fmt: skip
    hardware = {Role.TRAINER: trainer_hardware, Role.ROLLOUT: rollout_hardware, Role.ENV: env_hardware}
    for flavor in hardware.values():
        if flavor is not None and flavor not in HARDWARE_CHOICES:
            raise ValueError(f"unknown or unsupported hardware {flavor!r}; choose one of {', '.join(HARDWARE_CHOICES)}")
    rollout = [f"{prefix}-rollout"] if replicas == 1 else [f"{prefix}-rollout-{i}" for i in range(1, replicas + 1)]
    names = {Role.TRAINER: [f"{prefix}-{Role.TRAINER}"], Role.ROLLOUT: rollout, Role.ENV: [f"{prefix}-{Role.ENV}"]}

    spaces = []
    for role_name in Role:
        role = ROLES[role_name]
        files = space_files(role, root)
        flavor = hardware[role_name]
        for name in names[role_name]:
            # No owner-specific variable: a duplicate inherits every variable, and the Space defaults (the owner's
            # hf://buckets/<owner>/rl-sync, a replica id from the Space's id) are right for whoever owns it.
            variables = {} if bucket_id == f"{namespace}/{SPACE_BUCKET_NAME}" else {role.variable("bucket"): bucket_url}
            volumes = bucket_volumes
            if is_gpu(flavor) and role.uses_model:
                variables[role.variable("model")] = model_setting
                volumes = model_volumes + volumes
            repo_id = _check_name(f"{namespace}/{name}", "Space id")
            spaces.append(SpacePlan(role, repo_id, flavor, variables, files, volumes))
    return DeployPlan(bucket_id, private, tuple(spaces), sleep_time=sleep_time)


def apply_plan(plan: DeployPlan, api: Any, secrets: dict[str, str]) -> DeploySummary:
    """Create the bucket and the Spaces of a plan.

    Args:
        plan: What to deploy.
        api: An :class:`~huggingface_hub.HfApi` (or :class:`DryRunApi`, which prints instead).
        secrets: Secrets set on every Space (``HF_TOKEN`` and optionally ``PANEL_AUTH``; see
            :data:`SECRETS`).

    Returns:
        The bucket's and Spaces' addresses.

    Raises:
        huggingface_hub.errors.HfHubHTTPError: The Hub refused a call (the deployment stops there;
            running again resumes, every step is idempotent).
    """
    bucket = api.create_bucket(plan.bucket_id, private=plan.private, exist_ok=True)
    logger.info("bucket %s ready", plan.bucket_id)
    summary = DeploySummary(plan.bucket_url, bucket.url, secrets=tuple(secrets))
    for space in plan.spaces:
        url = api.create_repo(
            space.repo_id, repo_type="space", space_sdk=SPACE_SDK, private=plan.private, exist_ok=True
        )
        for key, value in secrets.items():
            api.add_space_secret(space.repo_id, key, value, description=SECRETS.get(key))
        for key, value in space.variables.items():
            api.add_space_variable(space.repo_id, key, value)
        if space.volumes:
            api.set_space_volumes(space.repo_id, list(space.volumes))
        if space.hardware is not None:
            api.request_space_hardware(space.repo_id, space.hardware, sleep_time=plan.sleep_time)
        operations = [CommitOperationAdd(path_in_repo=path, path_or_fileobj=str(local)) for path, local in space.files]
        api.create_commit(
            space.repo_id,
            operations,
            commit_message=f"Deploy the {space.role.name} Space",
            commit_description=f"{len(operations)} files, uploaded by python -m rlsync.spaces.deploy",
            repo_type="space",
        )
        logger.info("Space %s deployed (%d files)", space.repo_id, len(operations))
        summary.spaces.append((space.role.name, space.repo_id, str(url), space.hardware))
    return summary


class DryRunApi:
    """Stands in for :class:`~huggingface_hub.HfApi` in ``--dry-run``: prints each call, calls nothing.

    Args:
        out: Where to print.
        endpoint: Hub address used for the URLs it returns.
    """

    def __init__(self, out: TextIO, endpoint: str = "https://huggingface.co") -> None:
        self.out = out
        self.endpoint = endpoint

    def _show(self, name: str, *args: Any, **kwargs: Any) -> None:
        shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        print(f"{name}({', '.join(shown)})", file=self.out)

    def create_bucket(self, bucket_id: str, **kwargs: Any) -> BucketUrl:
        self._show("create_bucket", bucket_id, **kwargs)
        return BucketUrl(f"{self.endpoint}/buckets/{bucket_id}", endpoint=self.endpoint)

    def create_repo(self, repo_id: str, **kwargs: Any) -> str:
        self._show("create_repo", repo_id, **kwargs)
        return f"{self.endpoint}/spaces/{repo_id}"

    def add_space_secret(self, repo_id: str, key: str, value: str, **kwargs: Any) -> None:
        self._show("add_space_secret", repo_id, key, REDACTED, **kwargs)

    def add_space_variable(self, repo_id: str, key: str, value: str, **kwargs: Any) -> None:
        self._show("add_space_variable", repo_id, key, value, **kwargs)

    def set_space_volumes(self, repo_id: str, volumes: list[Volume], **kwargs: Any) -> None:
        self._show("set_space_volumes", repo_id, [v.to_dict() for v in volumes], **kwargs)

    def request_space_hardware(self, repo_id: str, hardware: str, **kwargs: Any) -> None:
        self._show("request_space_hardware", repo_id, hardware, **kwargs)

    def create_commit(self, repo_id: str, operations: list[CommitOperationAdd], **kwargs: Any) -> None:
        self._show("create_commit", repo_id, f"<{len(operations)} files>", **kwargs)
        for op in operations:
            print(f"    + {op.path_in_repo}", file=self.out)


# -- README settings tables ------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_markdown(role: SpaceRole) -> str:
    """The role's settings as a Markdown table, generated from its dataclass.

    Args:
        role: The role (its config class is imported).

    Returns:
        A ``| Variable | Default | Description |`` table, one row per setting.
    """
    from .settings import settings_table

    lines = ["| Variable | Default | Description |", "|---|---|---|"]
    for variable, default, description in settings_table(role.config_class(), role.env_prefix):
        lines.append(f"| `{variable}` | `{_cell(default)}` | {_cell(description)} |")
    return "\n".join(lines)


def readme_with_settings(text: str, table: str) -> str:
    """``text`` with the part between the settings markers replaced by ``table``.

    Raises:
        DeployError: The markers are missing or out of order.
    """
    start, end = text.find(SETTINGS_BEGIN), text.find(SETTINGS_END)
    if start < 0 or end < start:
        raise DeployError(f"README lacks the settings markers {SETTINGS_BEGIN!r} ... {SETTINGS_END!r}")
    return f"{text[: start + len(SETTINGS_BEGIN)]}\n{table}\n{text[end:]}"


def sync_readmes(root: Path = REPO_ROOT) -> list[str]:
    """Rewrite each role README's settings table from its dataclass.

    Args:
        root: Repository root.

    Returns:
        The READMEs that changed (paths relative to ``root``).
    """
    changed = []
    for role in ROLES.values():
        path = root / role.folder / "README.md"
        text = path.read_text(encoding="utf-8")
        new = readme_with_settings(text, settings_markdown(role))
        if new != text:
            path.write_text(new, encoding="utf-8")
            changed.append(path.relative_to(root).as_posix())
    return changed


# -- command line ----------------------------------------------------------------------------------


def _hint(exc: BaseException, namespace: str) -> str:
    """What to do about a refusal from the Hub, for the statuses a deployment commonly meets."""
    response = getattr(exc, "response", None)
    status = getattr(response, "status_code", None)
    if status == 402:
        return (
            f"\nThe Hub answered 402 Payment Required: the account {namespace!r} may not create this Space or "
            "request this hardware (free accounts can be refused Gradio Spaces or paid hardware). Use a PRO or "
            "organization namespace with billing, or deploy on cpu-basic (--*-hardware cpu-basic)."
        )
    if status in (401, 403):
        return (
            f"\nThe Hub answered {status}: permission denied. {TOKEN_SECRET} must be a token with write access to "
            f"the namespace {namespace!r} (fine-grained: write on repos and buckets there)."
        )
    return ""


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m rlsync.spaces.deploy`` argument parser."""
    p = argparse.ArgumentParser(prog="python -m rlsync.spaces.deploy", description=__doc__.split("\n\n")[0])
    p.add_argument("--namespace", help="user or organisation owning the bucket and the Spaces")
    p.add_argument("--bucket", help="bucket name (default: the prefix)")
    p.add_argument("--prefix", default=DEFAULT_PREFIX, help="Space name prefix (default: %(default)s)")
    p.add_argument("--private", action="store_true", default=None, help="make the bucket and new Spaces private")
    for role in Role:
        p.add_argument(
            f"--{role}-hardware", choices=HARDWARE_CHOICES, metavar="FLAVOR",
            help=f"hardware of the {role} Space(s), e.g. a10g-small, l4x1, cpu-basic (default: as is)",
        )  # fmt: skip
    p.add_argument("--replicas", type=int, default=1, help="number of rollout Spaces (default: 1)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="model on GPU Spaces (default: %(default)s)")
    p.add_argument(
        "--mount-model", action="store_true",
        help=f"mount the model repo read-only at {MODEL_MOUNT_ROOT}/<name> on GPU Spaces and use that folder",
    )  # fmt: skip
    p.add_argument("--sleep-time", type=int, help="seconds of inactivity before upgraded hardware sleeps")
    p.add_argument("--mount-bucket", metavar="PATH", help="also mount the bucket read-only at PATH in every Space")
    p.add_argument("--dry-run", action="store_true", help="print the planned calls, call nothing")
    p.add_argument("--export", metavar="DIR", help="write each Space's folder as it would be uploaded, then exit")
    p.add_argument("--sync-readmes", action="store_true", help="regenerate the READMEs' settings tables and exit")
    return p


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the command line; returns the exit status.

    Args:
        argv: Arguments (default: ``sys.argv[1:]``).
        out: Where the summary or the dry-run calls go (default: stdout).

    Returns:
        0 on success, 1 when the deployment failed, 2 on a usage error.
    """
    out = out or sys.stdout
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:  # progress lines; a dry run shows only its planned calls
        logging.basicConfig(level=logging.WARNING if args.dry_run else logging.INFO, format="%(message)s")
    if args.sync_readmes:
        for path in sync_readmes():
            print(f"updated {path}", file=out)
        return 0
    if args.export:
        args.namespace = args.namespace or TEMPLATE_NAMESPACE
    if not args.namespace:
        print("error: --namespace is required", file=sys.stderr)
        return 2
    token = os.environ.get(TOKEN_SECRET, "")
    if not token and not (args.dry_run or args.export):
        print(f"error: set {TOKEN_SECRET} to a token with write access to the namespace", file=sys.stderr)
        return 2
    secrets = {key: os.environ.get(key, "") for key in SECRETS}
    secrets = {key: value for key, value in secrets.items() if value or key == TOKEN_SECRET}
    try:
        plan = plan_deployment(
            args.namespace, bucket=args.bucket, prefix=args.prefix, private=args.private,
            trainer_hardware=args.trainer_hardware, rollout_hardware=args.rollout_hardware,
            env_hardware=args.env_hardware, replicas=args.replicas, model=args.model, mount_model=args.mount_model,
            sleep_time=args.sleep_time, mount_bucket=args.mount_bucket,
        )  # fmt: skip
        if args.export:
            from .export import export_spaces

            export_spaces(((s.repo_id.split("/")[1], s.files, s.variables) for s in plan.spaces), Path(args.export), out)
            return 0
        if args.dry_run:
            summary = apply_plan(plan, DryRunApi(out), dict.fromkeys(secrets, REDACTED))
        else:
            summary = apply_plan(plan, HfApi(token=token), secrets)
    except (DeployError, ValueError, OSError, HfHubHTTPError, httpx2.HTTPError) as exc:
        message = f"{type(exc).__name__}: {exc}{_hint(exc, args.namespace)}"
        for value in secrets.values():
            if value:
                message = message.replace(value, REDACTED)
        print(f"error: deployment failed: {message}", file=sys.stderr)
        return 1
    print(("Dry run, nothing was created. Planned result:\n" if args.dry_run else "") + summary.render(), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
