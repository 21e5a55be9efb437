"""TRL rollout worker fed from the bucket's scored rollouts.

:class:`BucketRolloutWorker` implements TRL's ``RolloutWorkerProtocol``
(``trl.experimental.async_grpo``). Instead of generating, it reads the scored
samples that replicas and the environment write under ``scores/`` and turns
them into TRL ``RolloutSample`` objects on ``rollout_buffer``, which
``AsyncGRPOTrainer`` drains (dropping samples more than ``max_staleness``
versions old at dequeue).

Mapping of one scored sample (prompt ids, completion ids, the sampler's
per-token log-probabilities, reward, policy version):

- (:mod:`rlsync.trl.rollout_samples`) ``input_ids`` = prompt ids + completion ids; ``completion_mask`` is 0 on the
  prompt and 1 on the completion; ``old_log_probs`` is 0 on the prompt and the
  sampler's log-probability of each completion token at that token's position.
- samples of one task in one scores object form a group (one ``group_id``); the
  advantage is the reward minus the group mean over the group's std (plus 1e-8),
  as in TRL's own worker. Degenerate groups (one member, or more than
  ``max_group_size``: see :mod:`rlsync.sampling`) are dropped and counted.
- ``model_version`` is the bucket version that generated the sample (its first, the
  oldest, when its generation spanned an update: ``Sample.last_version``), shifted into
  the trainer's numbering (``AsyncGRPOTrainer.model_version``), so TRL's staleness
  check compares like with like after a restart.

Scored objects are untrusted: anything malformed, out of the vocabulary, with a
non-finite reward, a log-probability no sampler reports (below
:data:`~rlsync.sampling.MIN_SAMPLED_LOGPROB`), longer than ``max_tokens`` (default
:data:`DEFAULT_MAX_TOKENS`) or claiming a version newer than the newest published
one (which TRL's staleness check would take as fresh for good) is counted and
skipped, never queued.

Flow figures (:meth:`BucketRolloutWorker.flow`): cumulative counts of samples read,
dropped stale when read, expired unread (queued, then too stale when TRL took them),
the staleness histogram of the samples TRL took in time, the newest task batch read
and the measured latency from a task batch's issue to its scores being read. Drops
are logged as one summary line per ``summary_s``, not one line per sample (the figures:
:class:`~rlsync.trl.rollout_flow.RolloutFlow`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Sequence

from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

from ..bucket import Bucket
from ..bucket.watch import IDLE_WAIT_S, generation, wait_for_change
from ..errors import BucketError, FormatError, StopRequested
from ..layout import SCORES_PREFIX
from ..protocol import read_manifest
from ..supervised import SupervisedThread
from ..sampling import MAX_GROUP_SIZE
from ..scores import Sample
from .logs import quiet_trl_lines
from .rollout_flow import RolloutFlow
from .rollout_samples import SampleGroups, usable_sample

logger = logging.getLogger(__name__)

#: Longest prompt + completion accepted by default (pass the model's context length instead).
DEFAULT_MAX_TOKENS = 4096


#: Reads one scores object: ``(header, samples)``, or ``None`` when it is unusable.
ScoresReader = Callable[[Bucket, str], "tuple[dict[str, Any], Sequence[Sample]] | None"]


class _TakenQueue(queue.Queue):
    """``rollout_buffer``: a queue that reports every sample TRL takes from it."""

    def __init__(self, maxsize: int, on_take: Callable[[RolloutSample], None]) -> None:
        super().__init__(maxsize=maxsize)
        self._on_take = on_take

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        item = super().get(block, timeout)
        self._on_take(item)
        return item


class BucketRolloutWorker:
    """TRL ``RolloutWorkerProtocol`` reading scored samples from a bucket.

    Args:
        bucket: The run's bucket.
        read_scores: Parser of one scores object (e.g. :func:`rlsync.scores.read_samples`).
        vocab_size: Token ids must be below this (a hostile id would crash the embedding).
        max_tokens: Longest prompt + completion accepted (pass the model's context; 0: no limit).
        prefix: Where scored objects are listed.
        poll_s: Seconds between bucket listings (a watched bucket wakes the worker on a change instead).
        queue_maxsize: Bound of ``rollout_buffer`` (0: unbounded).
        max_staleness: Skip samples already this many versions behind when read (``None``: leave it to TRL).
        heartbeat: Called every ``heartbeat_s`` (e.g. :meth:`BucketWeightTransfer.heartbeat`) so
            the run lock stays fresh while the trainer waits for data.
        heartbeat_s: Seconds between heartbeats.
        max_group_size: Largest group kept (larger ones are degenerate: see :mod:`rlsync.sampling`).
        summary_s: Seconds between the summary log lines of reads and drops (``None``: no such line, the
            caller reports :meth:`flow`).
        on_poll: Called after every poll of the bucket (e.g. to refresh a demand object while the
            trainer waits, when no step ends to do it).
        chain: The bucket whose pointer numbers the policy versions (default ``bucket``; the
            adapter chain's view, :func:`rlsync.adapters.adapter_bucket`, in a LoRA run).
    """

    def __init__(
        self,
        bucket: Bucket,
        read_scores: ScoresReader,
        *,
        vocab_size: int,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        prefix: str = SCORES_PREFIX,
        poll_s: float = 0.5,
        queue_maxsize: int = 0,
        max_staleness: int | None = None,
        heartbeat: Callable[[], None] | None = None,
        heartbeat_s: float = 60.0,
        max_group_size: int = MAX_GROUP_SIZE,
        summary_s: float | None = 60.0,
        on_poll: Callable[[], None] | None = None,
        chain: Bucket | None = None,
    ) -> None:
        self.bucket = bucket
        self.chain = chain or bucket
        self.read_scores = read_scores
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.prefix = prefix
        self.poll_s = poll_s
        self.max_staleness = max_staleness
        self.heartbeat = heartbeat
        self.heartbeat_s = heartbeat_s
        self.summary_s = summary_s
        self.on_poll = on_poll
        self.rollout_buffer: queue.Queue = _TakenQueue(queue_maxsize, self._taken)
        self.metrics_queue: queue.Queue = queue.Queue()
        self.model_version = 0
        self.version_offset: int | None = None
        self.figures = RolloutFlow(summary_s)  # the flow figures (see :meth:`flow`)
        self.counts = self.figures.counts
        self._newest_version = 0  # newest published bucket version, read at each poll that finds new objects
        self._consumed: set[str] = set()
        self.groups = SampleGroups(self.counts, max_group_size)
        self._stop = threading.Event()
        self._stop_training = threading.Event()
        self._thread: SupervisedThread | None = None
        self._last_heartbeat = time.monotonic()
        quiet_trl_lines()  # TRL's per-sample drop lines (this worker counts them) and its other per-step lines

    # -- RolloutWorkerProtocol ---------------------------------------------

    def start(self) -> None:
        """Start polling the bucket (TRL calls this after the initial weight sync)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self.align_versions()
        self._stop.clear()
        self._thread = SupervisedThread(self._run, name="bucket-rollouts", stop=self._stop, restart=False)
        self._thread.start()

    def stop(self) -> None:
        """Stop polling (TRL calls this at train end)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def align_versions(self) -> None:
        """Fix the offset between bucket and trainer versions: the live bucket version is the
        trainer's current one (TRL has just synced when it calls :meth:`start`)."""
        if self.version_offset is None:
            manifest = read_manifest(self.chain)
            self.version_offset = (manifest.step if manifest else 0) - self.model_version

    def update_model_version(self, model_version: int) -> None:
        """The trainer's current policy version (its own numbering)."""
        self.model_version = model_version

    def check_health(self, stale_after_s: float) -> None:
        """Raise if polling failed or stopped, or a stop was requested.

        Having no rollouts yet is healthy: replicas may still be loading.

        Raises:
            StopRequested: :meth:`request_stop` was called.
            RuntimeError: the polling thread died.
        """
        if self._stop_training.is_set():
            raise StopRequested("stop requested while waiting for rollouts")
        if self._thread is not None and self._thread.error is not None:  # a bug, not a bad object: logged by the thread
            raise RuntimeError(f"bucket rollout worker failed: {self._thread.error}")
        if self._thread is not None and not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError("bucket rollout worker stopped")
        self._beat()

    # -- stopping ------------------------------------------------------------

    def request_stop(self) -> None:
        """Make the next :meth:`check_health` raise :class:`StopRequested` (ends a waiting ``train()``)."""
        self._stop_training.set()

    # -- reading ---------------------------------------------------------------

    def trainer_version(self, bucket_version: int) -> int:
        """A bucket version in the trainer's numbering."""
        return bucket_version - (self.version_offset or 0)

    def poll(self) -> int:
        """Read new scored objects once; returns samples queued."""
        listed = sorted(o.key for o in self.bucket.list(self.prefix) if o.key.endswith(".json"))
        self._consumed &= set(listed)  # objects the environment pruned will not come back
        if set(listed) - self._consumed:
            self._read_newest_version()
        queued = 0
        for key in listed:
            if key in self._consumed:
                continue
            self._consumed.add(key)
            read = self.read_scores(self.bucket, key)
            if read is None:
                self.counts["unreadable"] += 1
                continue
            self.figures.note_header(read[0])
            queued += self._queue_groups(read[1])
        return queued

    def _read_newest_version(self) -> None:
        try:
            manifest = read_manifest(self.chain)
        except FormatError as exc:  # a damaged pointer: keep the last good version
            logger.warning("reading the pointer failed, keeping version %d: %s", self._newest_version, exc)
            return
        self._newest_version = manifest.step if manifest is not None else 0

    @property
    def newest_batch(self) -> int | None:
        """The newest task batch read."""
        return self.figures.newest_batch

    @property
    def latency_s(self) -> float | None:
        """The measured latency from a task batch's issue to its scores being read."""
        return self.figures.latency_s

    def _taken(self, sample: RolloutSample) -> None:
        """TRL took ``sample`` from the buffer (counted in the flow figures)."""
        self.figures.taken(self.model_version - int(sample.model_version), self.max_staleness)

    def flow(self) -> dict[str, Any]:
        """Cumulative counts, the staleness histogram of samples taken in time, newest batch read, latency."""
        return self.figures.snapshot()

    def _queue_groups(self, samples: Sequence[Sample]) -> int:
        usable = lambda s: usable_sample(s, newest_version=self._newest_version, vocab_size=self.vocab_size, max_tokens=self.max_tokens)  # noqa: E731
        stale = lambda version: self.max_staleness is not None and self.model_version - version > self.max_staleness  # noqa: E731
        queued = 0
        for sample in self.groups.rollouts(samples, usable=usable, version=self.trainer_version, stale=stale):
            self._put(sample)
            queued += 1
        self.counts["queued"] += queued
        return queued

    def _put(self, sample: RolloutSample) -> None:
        while not self._stop.is_set():
            try:
                self.rollout_buffer.put(sample, timeout=self.poll_s)
                return
            except queue.Full:
                self._beat()

    def _beat(self) -> None:
        if self.heartbeat is not None and time.monotonic() - self._last_heartbeat >= self.heartbeat_s:
            self._last_heartbeat = time.monotonic()
            try:
                self.heartbeat()
            except BucketError as exc:
                logger.warning("run-lock heartbeat failed: %s", exc)

    def _run(self) -> None:
        while not self._stop.is_set():
            before = dict(self.counts)
            since = generation(self.bucket)
            try:
                self.poll()
            except BucketError as exc:
                logger.warning("reading %s failed, retrying: %s", self.prefix, exc)
            grown = {k: float(self.counts[k] - before[k]) for k in ("invalid", "dropped_stale", "unreadable", "dropped_degenerate")}
            if any(grown.values()):
                self.metrics_queue.put({f"rollout/{k}_total": v for k, v in grown.items()})
            self.figures.log_summary()
            if self.on_poll is not None:
                self.on_poll()
            self._beat()
            timeout = self.poll_s if since is None else min(IDLE_WAIT_S, self.heartbeat_s)
            wait_for_change(self.bucket, self._stop, timeout, (self.prefix,), since)
