"""A deployment's plan: the bucket, the Spaces, their hardware, variables, volumes and files
(:func:`plan_deployment`, which calls nothing)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from huggingface_hub import SpaceHardware, Volume
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from ..roles import Role
from .settings import SPACE_BUCKET_NAME
from .space_roles import REPO_ROOT, ROLES, SpaceRole, space_files

DEFAULT_PREFIX = "rl-sync"
#: Owner of the template Spaces (``<TEMPLATE_NAMESPACE>/<prefix>-trainer`` ...) the Space READMEs link to.
TEMPLATE_NAMESPACE = "rlsync"
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"
MODEL_MOUNT_ROOT = "/models"
# ZeroGPU runs functions decorated with ``@spaces.GPU`` only; a resident vLLM engine or trainer cannot use it.
HARDWARE_CHOICES = tuple(h.value for h in SpaceHardware if not h.value.startswith("zero-"))


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


def is_gpu(hardware: str | None) -> bool:
    """Whether a hardware flavor has a GPU (``None`` and ``cpu-*`` do not)."""
    return hardware is not None and not hardware.startswith("cpu-")


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
