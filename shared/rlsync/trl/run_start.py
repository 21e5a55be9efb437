"""How a TRL weight transfer's run starts (:func:`start_run`, when TRL calls ``init_weight_transfer``).

On an empty bucket the first send is version 0 of a new run. On a bucket that already holds a run, it takes the
run lock and, resuming from a checkpoint, verifies the published chain and continues after its newest version (none
reused or skipped); with ``new_run``, starts a new run whose versions follow the old run's; without either, it
continues the run when the trainer holds exactly its newest published weights (``holds_published``); otherwise it
raises :class:`~rlsync.protocol.RunExistsError` naming both ways on, so a restart never publishes the untrained
weights over a run. An FP8 chain follows the bf16 chain's decision.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import torch

from ..protocol import Manifest, Publisher, read_manifest
from ..protocol.run import run_exists_error

logger = logging.getLogger(__name__)

#: How a TRL script goes on from a :class:`~rlsync.protocol.RunExistsError`.
TRL_WAYS_ON = (
    "resume from its checkpoints/ (BucketSync(bucket, resume=True), then "
    "trainer.train(resume_from_checkpoint=sync.checkpoint); with the plug-ins alone, "
    "folder = BucketCheckpoints(bucket).restore(output_dir)[1], BucketWeightTransfer(..., resume_from_checkpoint=folder) "
    "and trainer.train(resume_from_checkpoint=folder); the trainer Space does this by itself), or start a new run "
    "explicitly (BucketSync(bucket, new_run=True); TRAINER_NEW_RUN=1 in the trainer Space)"
)


def start_run(
    publisher: Publisher,
    fp8: Publisher | None,
    *,
    resume_from_checkpoint: str | os.PathLike[str] | bool | None,
    holds_published: Callable[[Manifest], bool] | None,
) -> dict[str, torch.Tensor] | None:
    """Take the run lock and continue the bucket's run or start a new one
    (see :class:`~rlsync.trl.BucketWeightTransfer`, whose arguments these are).

    Returns:
        The newest published state (serving dtype) when the bucket's run is continued, else ``None``.

    Raises:
        RunExistsError: the bucket holds a run, no checkpoint is resumed from, the trainer does not hold its newest
            weights and ``new_run`` is off.
        RunLockedError: another trainer holds the run lock.
    """
    state = None
    continued = bool(resume_from_checkpoint)
    if continued:
        state = publisher.resume()
    else:
        existing = read_manifest(publisher.bucket)
        if existing is not None and not publisher.ownership.new_run:
            continued = holds_published is not None and holds_published(existing)
            if not continued:
                raise run_exists_error(publisher.bucket, existing, TRL_WAYS_ON)
            logger.info("no checkpoint, but the trainer holds version %d's weights: continuing", existing.step)
            state = publisher.resume()
        elif existing is not None:
            publisher.start_new_run()
        else:
            publisher.resume()  # the run lock; the bucket is empty
    if fp8 is not None:  # the FP8 chain follows the bf16 chain's decision
        if continued or read_manifest(fp8.bucket) is None:
            fp8.resume()
        else:
            fp8.start_new_run()
    if state is not None:
        logger.info("continuing the bucket's run after version %d", publisher.step)
    return state
