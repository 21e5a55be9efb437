"""The trainer's reader of ``scores/`` objects: the library's parser within the trainer's own limits."""

from __future__ import annotations

from typing import Any, Callable

from ..bucket import Bucket
from ..scores import Refusals, Sample, SampleLimits, read_samples


class TrainerScores:
    """Reads one scores object for :class:`~rlsync.trl.BucketRolloutWorker` (its ``read_scores``).

    Each object is checked by :func:`rlsync.scores.read_samples` against the trainer's vocabulary, the
    newest published version and the model's context; refusals are counted in :attr:`refusals`. In a
    new run, samples scored for the replaced run's versions are dropped (counted): another run's
    policy sampled them.

    Args:
        limits: Returns the current ``(vocab_size, newest published version, model context or None)``.
        replaced_step: Returns the newest version of the run this one replaced (``None``: none).
    """

    def __init__(
        self, limits: Callable[[], tuple[int, int | None, int | None]], replaced_step: Callable[[], int | None]
    ) -> None:
        self.limits = limits
        self.replaced_step = replaced_step
        self.refusals = Refusals()

    def __call__(self, bucket: Bucket, key: str) -> tuple[dict[str, Any], list[Sample]] | None:
        """``(header, samples)`` of the object at ``key``, or ``None`` when refused or empty."""
        vocab_size, newest, context = self.limits()
        limits = SampleLimits(vocab_size=vocab_size, max_version=newest, max_total_tokens=context)
        read = read_samples(bucket, key, limits=limits, refusals=self.refusals)
        replaced = self.replaced_step()
        if read is None or replaced is None:
            return read
        header, samples = read
        kept = [s for s in samples if s.version > replaced]
        if len(kept) < len(samples):
            self.refusals.add(key, f"{len(samples) - len(kept)} sample(s) of the replaced run (version <= {replaced})")
        return (header, kept) if kept else None
