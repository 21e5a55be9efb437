"""Applying a deployment's plan on the Hub (:func:`apply_plan`, with :class:`~huggingface_hub.HfApi`, every call
idempotent), or printing the calls (:class:`DryRunApi`); the secrets each Space gets."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, TextIO

from huggingface_hub import BucketUrl, CommitOperationAdd, Volume

from .deploy_plan import DeployPlan
from .space_roles import SPACE_SDK

logger = logging.getLogger(__name__)

TOKEN_SECRET = "HF_TOKEN"
# Secrets copied from the deploying environment to every Space, with their descriptions.
SECRETS = {
    TOKEN_SECRET: "Hub token: read and write the bucket",
    "PANEL_AUTH": "user:password asked by the panel's controls",
}
REDACTED = "<redacted>"


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
