"""Where a run goes on (:func:`resume_point`, the job of :meth:`rlsync.trl.BucketSync.prepare`): the newest
checkpoint in the bucket that verifies against the published chain and the model, downloaded into the
trainer's ``output_dir``, and the weight transfer told to continue from it (or to start a new run).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from ..detect import serving_copy
from ..hashing import StateLanes
from ..protocol import Manifest, read_manifest
from .checkpoint_checks import CheckpointExpectations
from .checkpoints import BucketCheckpoints

__all__ = ["ResumePoint", "resume_point", "holds_weights"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from.

    Args:
        step: Its optimizer step (``None``: a fresh or new run).
        folder: The local checkpoint folder (``None``: a fresh or new run).
        notice: What is worth telling ('' when nothing).
    """

    step: int | None = None
    folder: str | None = None
    notice: str = ""


def resume_point(trainer: Any, checkpoints: BucketCheckpoints, transfer: Any, *, resume: bool, sharded: bool) -> ResumePoint:
    """Take the run lock and find where to continue (see :meth:`rlsync.trl.BucketSync.prepare`).

    Args:
        trainer: The attached ``AsyncGRPOTrainer``.
        checkpoints: The run's checkpoints in the bucket.
        transfer: The weight transfer (told the checkpoint it continues from).
        resume: Continue from the newest checkpoint that verifies.
        sharded: DCP checkpoints (:func:`~rlsync.trl.sharded_checkpoints.restore_sharded`).

    Returns:
        The checkpoint downloaded, or an empty :class:`ResumePoint`.

    Raises:
        RunExistsError: the bucket holds a run, no checkpoint is resumed from, the model is not bit for bit the
            run's newest version (:func:`holds_weights`) and the transfer starts no new run.
        RunLockedError: another trainer holds the run lock.
    """
    dest = trainer.args.output_dir
    if sharded:
        from .sharded_checkpoints import restore_sharded

        found = restore_sharded(checkpoints, dest) if resume else None
        transfer.resume_from_checkpoint = found[1] if found else None  # continued at the first sync
        return ResumePoint(found[0], str(found[1])) if found else ResumePoint()
    manifest = read_manifest(transfer.publisher.bucket)  # checkpoints are checked against the chain it names
    expect = CheckpointExpectations.for_model(
        trainer.model, pins={p.step: p.weights_hash for p in manifest.checkpoints} if manifest else {},
        published_step=manifest.step if manifest else 0, lr=trainer.args.learning_rate,
    )  # fmt: skip
    restored = checkpoints.restore(dest, expect) if resume else None
    transfer.resume_from_checkpoint = restored[1] if restored else None
    if resume:  # a restart before the first checkpoint, on weights that are still the published ones, goes on
        transfer.holds_published = functools.partial(holds_weights, trainer, transfer)
    transfer.continue_run()
    if restored is None:
        return ResumePoint()
    step, folder, marker = restored
    saved = marker.get("published_version")
    notice = ""
    if isinstance(saved, int) and transfer.version is not None and transfer.version > saved:
        notice = (
            f"published version {transfer.version} is newer than checkpoint {step} (saved at version {saved}): "
            f"resumed from the checkpoint; the next version is a delta from {transfer.version}"
        )
        logger.warning(notice)
    logger.info("resuming from checkpoint %d", step)
    return ResumePoint(step, str(folder), notice)


def holds_weights(trainer: Any, transfer: Any, manifest: Manifest) -> bool:
    """Whether the trainer's model, as its weight sync streams it (in the checkpoint layout, cast to the serving
    dtype), has the state hash of the run's newest version (names, shapes, dtypes and every bit; one tensor at a
    time, nothing downloaded). A trainer restarted before its first checkpoint holds the weights it started from:
    when they are the run's newest version (its cold sync, version 0), continuing the run loses and regresses nothing.
    """
    pairs = trainer._streaming_iter()  # what TRL's weight sync sends
    if transfer.layout is not None:
        pairs = transfer.layout.stream(pairs)
    dtype = transfer.publisher.dtype
    return StateLanes.of_items((name, serving_copy(t, dtype)) for name, t in pairs).hexdigest() == manifest.state_hash
