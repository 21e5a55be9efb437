"""What the three Spaces exchange through the bucket besides weights.

Layout (next to ``latest.json``, ``anchors/`` and ``deltas/``)::

    tasks/<batch>.json               env -> replicas: prompts (answers stay in the env)
    rollouts/<batch>/<replica>.json  replica -> env: G completions per task, token ids,
                                     sampling log-probs, the policy version that made them
    scores/<batch>/<replica>.json    env -> trainer: the same samples with rewards
    status/<replica>.json            each replica: version, lag, apply time, throughput (:mod:`.metrics`)
    metrics/<role>.json              trainer and env: recent figures for the panels (:mod:`.metrics`)

Every object is small JSON written whole, and untrusted: replicas anywhere write
``rollouts/`` and ``status/``. The samples of ``rollouts/`` and ``scores/`` are the library's
format (:mod:`rlsync.scores`, re-exported here), the status and metrics objects are typed in
:mod:`.metrics`; the task batches have one parser here that checks them strictly (bounded size
and nesting, exact types, length-capped strings). Readers treat a refused object as absent, log it and
count it in a :class:`Refusals` (shown on the panels): a bad object never stops
a role and never reaches the weights.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..bucket import Bucket, open_bucket
from ..bucket.watch import watch
from ..errors import BucketError
from ..layout import (
    REPORT_PREFIXES,
    ROLE_READS,
    batch_of,
)
from ..roles import Role
from .bucket_access import check_write_access
from ..scores import (  # noqa: F401 - the scores format lives in the library; re-exported for the Spaces
    DEFAULT_LIMITS,
    MAX_REWARD,
    Refusals,
    Sample,
    SampleLimits,
    string_field,
    get_json,
    parse_samples,
    put_json,
    read_samples,
    write_samples,
)

logger = logging.getLogger(__name__)

MAX_TASKS = 1024


def open_role_bucket(role: Role, url: str, bucket: Bucket | None = None) -> Bucket:
    """A role's bucket, watched on the Hub (:func:`~rlsync.bucket.watch.watch`) under the prefixes the
    role reads only (:data:`rlsync.layout.ROLE_READS`); writing its own status and metrics does not make
    it poll sooner.

    Args:
        role: The role: its settings are read from the
            environment (:meth:`~rlsync.bucket.settings.BucketSettings.from_env`), its watched
            prefixes from :data:`rlsync.layout.ROLE_READS`.
        url: The bucket to open when ``bucket`` is ``None``.
        bucket: An opened bucket (tests pass one), watched with the role's settings.

    Raises:
        ValueError: a bucket setting in the environment is invalid.
        BucketAccessError: the token may not write the Hub bucket ``url`` (:mod:`.bucket_access`).
    """
    from ..bucket.settings import BucketSettings

    reads = ROLE_READS[role]
    settings = BucketSettings.from_env(role)
    if bucket is None:
        check_write_access(role, url, settings=settings)  # counted and paced by the meter the bucket gets
    opened = bucket if bucket is not None else open_bucket(url, settings=settings)
    return watch(opened, dataclasses.replace(settings.watch, prefixes=reads, quiet_prefixes=REPORT_PREFIXES))


def parse_tasks(doc: Any, *, max_chars: int = DEFAULT_LIMITS.max_chars) -> list[dict[str, str]]:
    """The ``{"task_id", "prompt"}`` entries of a task batch document.

    Raises:
        ValueError: not an object with a list of at most ``MAX_TASKS`` tasks, each with
            a string ``task_id`` (at most 256 characters) and a string ``prompt``.
    """
    if not isinstance(doc, dict) or not isinstance(doc.get("tasks"), list) or len(doc["tasks"]) > MAX_TASKS:
        raise ValueError(f"not an object with a list of at most {MAX_TASKS} tasks")
    tasks = []
    for t in doc["tasks"]:
        if not isinstance(t, dict):
            raise ValueError("a task must be a JSON object")
        tasks.append({"task_id": string_field(t, "task_id", 256), "prompt": string_field(t, "prompt", max_chars)})
    return tasks


def list_batches(bucket: Bucket, prefix: str) -> dict[int, list[str]]:
    """Keys under ``prefix`` grouped by batch number, ignoring anything unexpected."""
    out: dict[int, list[str]] = {}
    try:
        objects = bucket.list(prefix)
    except BucketError as exc:
        logger.warning("listing %s failed: %s", prefix, exc)
        return out
    for obj in objects:
        batch = batch_of(obj.key)
        if batch is not None:
            out.setdefault(batch, []).append(obj.key)
    return out
