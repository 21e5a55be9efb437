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
import logging
import os
import sys
from pathlib import Path
from typing import Sequence, TextIO

import httpx2
from huggingface_hub import HfApi
from huggingface_hub.errors import HfHubHTTPError

from ..errors import DeployError
from ..roles import Role
from .deploy_hub import REDACTED, SECRETS, TOKEN_SECRET, DryRunApi, apply_plan
from .deploy_plan import DEFAULT_MODEL, DEFAULT_PREFIX, HARDWARE_CHOICES, MODEL_MOUNT_ROOT, TEMPLATE_NAMESPACE, plan_deployment
from .readme_settings import sync_readmes


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
