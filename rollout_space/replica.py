"""One replica of the rollout fleet: builds its parts and runs its loop.

A replica follows the bucket's weights (a :class:`~rollout_space.weights.Follower`: downloaded,
decoded and verified in a background thread while the engine keeps generating, applied by that thread
as soon as no batch is being generated, re-hashed in full in another thread; by the engine's own workers, the replica's process
keeping no copy of the model, when the engine follows the bucket itself:
:class:`~rollout_space.bucket_follower.BucketFollower`) and answers the environment's task batches
(:class:`~rollout_space.answerer.TaskAnswerer`); it writes its status
(:class:`~rollout_space.status.StatusWriter`). :class:`Replica` owns the lifecycle: its main loop
(:meth:`Replica.step`), its threads, start, stop and close.

Sharing tasks between replicas: the trainer never knows how many replicas exist.
Each replica claims the oldest task batch that no replica has answered or claimed
(``claims/<batch>/<replica>.json``), so a fleet spreads batches over its members
without a coordinator and no batch is generated twice: two answers of one batch are
twice its samples at one policy version, more than the trainer can take before they
go stale (:mod:`rollout_space.claims`). Before a batch the replica applies the newest
version it holds, and skips a batch that would be too stale (:mod:`rollout_space.answerer`).

The chain (``chain``, :class:`~rlsync.fp8.Chain`): a replica follows the trainer's bf16 weights, or
its FP8 serving chain (``fp8/``, :mod:`rlsync.fp8`), served by the vLLM engine started from the model
quantized to block FP8; the subscriber then checks every FP8 value before it is applied.

In a LoRA run (``lora``) the weights chain holds the base and an
:class:`~rollout_space.adapters.AdapterFollower` serves the adapter chain's versions;
samples then carry the adapter version as their policy version.
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rlsync.bucket import Bucket
from rlsync.bucket.watch import generation, meter_of, wait_for_change
from rlsync.errors import BucketError, ConfigurationError, ReplicaIdInUseError
from rlsync.fp8 import Chain, write_fp8_checkpoint
from rlsync.layout import ROLLOUTS_PREFIX, SCORES_PREFIX, TASKS_PREFIX, check_id
from rlsync.registry import Entry
from rlsync.roles import Role
from rlsync.spaces.exchange import open_role_bucket
from rlsync.spaces.interval_log import IntervalLog
from rlsync.spaces.metrics import ReplicaStatus, Sync
from rlsync.spaces.settings import resolve_device, space_owner
from rlsync.spaces.tiny_model import model_or_default
from rlsync.supervised import SupervisedThread
from rlsync.vllm.support import check_fp8_serving

from env_space.environments import get_environment

from .adapters import AdapterFollower
from .answerer import TaskAnswerer
from .bucket_follower import BucketFollower
from .config import ReplicaConfig, default_replica_id
from .engine import BucketFollowingEngine, Engine, EngineCapability, choose_engine, create_engine
from .identity import check_replica_id
from .status import StatusWriter, replica_status, summary_line
from .weights import Follower, WeightFollower, idle_wait_s

__all__ = ["Replica", "ReplicaConfig", "default_replica_id", "resolve_model", "weights_bytes"]

logger = logging.getLogger(__name__)


class Replica:
    """Follows the bucket's weights and answers task batches.

    Its parts, each with one job: :attr:`weights` (a :class:`~rollout_space.bucket_follower.BucketFollower`
    when the engine follows the bucket itself, else a :class:`~rollout_space.weights.WeightFollower`),
    :attr:`adapters` (an :class:`~rollout_space.adapters.AdapterFollower` in a LoRA run, else ``None``),
    :attr:`tasks` (a :class:`~rollout_space.answerer.TaskAnswerer`) and its status writer.

    Args:
        config: Settings.
        bucket: Bucket to use (default: opened from ``config.bucket``).
        engine: Inference engine (default: created from ``config.engine`` and ``config.model``).

    Raises:
        ValueError: An unknown ``config.chain`` or ``config.engine``, or the FP8 chain with an engine that does not
            serve it (:class:`~rlsync.errors.ConfigurationError`) or with LoRA.
        UnsupportedHardwareError: The FP8 chain where vLLM cannot serve it (:mod:`rlsync.vllm.support`).
    """

    def __init__(self, config: ReplicaConfig, bucket: Bucket | None = None, engine: Engine | None = None) -> None:
        device = resolve_device(config.device)
        self.config = config = config.with_model_defaults(device)
        self.chain = Chain(config.chain)
        fp8 = self.chain is Chain.FP8
        chosen = choose_engine(config.engine, device, fp8) if engine is None else None
        if fp8 and engine is not None:
            choose_engine(engine.name, device, fp8)  # refuses an engine that does not serve the FP8 chain
        if fp8 and config.lora:
            raise ConfigurationError(
                "ROLLOUT_CHAIN=fp8 serves no LoRA adapters: unset ROLLOUT_LORA (or ROLLOUT_CHAIN=bf16)"
            )
        if fp8 and engine is None:
            check_fp8_serving(device)  # before any model is built or loaded: one line, not a worker's traceback
        self.replica_id = check_id(config.replica_id or default_replica_id())
        self.bucket = open_role_bucket(Role.ROLLOUT, config.bucket, bucket)
        self._owns_watch = self.bucket is not bucket  # close() stops the watch this role made
        try:
            check_replica_id(self.bucket, self.replica_id, space_owner(), config.status_every_s)
        except ReplicaIdInUseError:
            if self._owns_watch:
                self.bucket.close()
            raise
        self.meter = meter_of(self.bucket)
        self._since: int | None = None
        model = resolve_model(model_or_default(config.model, device, get_environment))
        self._fp8_dir: Path | None = None
        if self.chain is Chain.FP8:
            model = self._fp8_checkpoint(model)
        self.engine = engine or self._create_engine(chosen, model, device)
        self.summary = IntervalLog(logger, functools.partial(summary_line, self.replica_id))
        max_state_bytes = config.max_model_bytes or weights_bytes(model)  # bounds the first anchor (or adapter)
        self.weights: Follower
        if isinstance(self.engine, BucketFollowingEngine) and self.engine.follows_bucket:
            self.weights = BucketFollower(self.bucket, self.engine, self.chain, config, name=self.replica_id, summary=self.summary)
        else:
            self.weights = WeightFollower(
                self.bucket, self.engine, self.chain, config, name=self.replica_id, max_state_bytes=max_state_bytes,
                summary=self.summary,
            )  # fmt: skip
        #: The weights' subscriber in this process (``None`` when the engine follows the bucket itself), and the
        #: slot of the update waiting to be applied (the follower's).
        self.subscriber = self.weights.subscriber if isinstance(self.weights, WeightFollower) else None
        self.slot = self.weights.slot
        self.adapters = (
            AdapterFollower(self.bucket, self.engine, lambda: self.weights.state_hash, window=config.lora_window,
                            poll_s=config.poll_s, max_state_bytes=max_state_bytes)
            if config.lora else None
        )  # fmt: skip
        self.tasks = TaskAnswerer(
            self.bucket, self.replica_id, self.engine, model, config, weights=self.weights,
            adapters=self.adapters, summary=self.summary,
        )  # fmt: skip
        #: The task batch claims and the refused objects (the answerer's).
        self.batches, self.refusals = self.tasks.batches, self.tasks.refusals
        self._status = StatusWriter(self.bucket, self.replica_id, self.status, config.status_every_s)
        self._stop = threading.Event()
        #: The replica's threads (its main loop's and its background loops').
        self.threads: list[threading.Thread] = []

    def _create_engine(self, chosen: Entry, model: str, device: str) -> Engine:
        """The engine ``chosen`` names, given what it declares it takes (a device, adapter slots)."""
        kwargs: dict[str, Any] = {"device": device} if chosen.has(EngineCapability.DEVICE) else {}
        if self.config.lora and chosen.has(EngineCapability.LORA_SLOTS):
            kwargs.update(max_loras=self.config.lora_window + 1, max_lora_rank=self.config.lora_max_rank)
        return create_engine(chosen.name, model_path=model, **kwargs)

    def _fp8_checkpoint(self, model: str) -> str:
        """The block-FP8 checkpoint of ``model`` the engine starts from when the replica follows the FP8 chain
        (its first anchor replaces every weight and scale; the folder goes with :meth:`close`)."""
        self._fp8_dir = Path(tempfile.mkdtemp(prefix="rlsync-fp8-"))
        return str(write_fp8_checkpoint(model, self._fp8_dir))

    @property
    def syncs(self) -> list[Sync]:
        """The updates applied, the newest last (:attr:`rollout_space.weights.Follower.syncs`)."""
        return self.weights.syncs

    @property
    def completions(self) -> int:
        """Samples written so far."""
        return self.tasks.completions

    def apply_pending(self) -> bool:
        """Apply a downloaded update, pausing generation; returns whether one was applied
        (:meth:`~rollout_space.weights.Follower.apply_pending`)."""
        return self.weights.apply_pending()

    def answer(self, batch: int) -> int:
        """Generate G completions per task of ``batch`` and write them; returns samples written
        (:meth:`~rollout_space.answerer.TaskAnswerer.answer`)."""
        return self.tasks.answer(batch)

    def status(self) -> ReplicaStatus:
        """The status object this replica publishes (:func:`rollout_space.status.replica_status`)."""
        return replica_status(self)

    def publish_status(self, force: bool = False) -> None:
        """Write the status object (on a Hub bucket at most every ``status_every_s`` unless `force`)."""
        self._status.publish(force)

    # -- lifecycle ----------------------------------------------------------

    def step(self) -> bool:
        """One iteration of the main loop; returns whether it did any work."""
        worked = self.apply_pending()
        self._since = generation(self.bucket)
        if self.adapters is not None:
            worked = self.adapters.apply_pending() or worked
        if self.tasks.policy_version is not None:
            batch = self.batches.next_batch()
            if batch is not None and self.tasks.fresh_enough():
                if self.batches.claim(batch):
                    try:
                        self.answer(batch)
                    except BucketError:
                        self.batches.release()  # the others take it instead of waiting for the claim to time out
                        raise
                else:
                    self.summary.add(claims_lost=1)
                worked = True
        self.publish_status()
        self.summary.flush()
        return worked

    def run(self) -> None:
        """Run until :meth:`stop` (fetching in background threads)."""
        loops = [(self.weights.fetch_loop, "fetch"), (self.weights.rehash_loop, "rehash")]
        if self.adapters is not None:
            loops.append((self.adapters.fetch_loop, "adapters"))
        for loop, name in loops:
            thread = SupervisedThread(loop, args=(self._stop,), name=f"{name}-{self.replica_id}", stop=self._stop)
            thread.start()
            self.threads.append(thread)
        try:
            while not self._stop.is_set():
                try:
                    worked = self.step()
                except BucketError as exc:
                    logger.warning("bucket error, retrying: %s", exc)
                    worked = False
                if not worked:
                    self._idle()
        finally:
            self._stop.set()  # a crash of this loop ends the fetch loops too: the replica is not left "running"
        self.batches.release()
        self.publish_status(force=True)

    def _idle(self) -> None:
        """Wait for new tasks (a watched bucket: until they appear; the fetch thread applies new weights itself)."""
        deadline = time.monotonic() + idle_wait_s(self.bucket, self.config.poll_s)
        since = self._since
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            prefixes = (TASKS_PREFIX, ROLLOUTS_PREFIX, SCORES_PREFIX)
            if wait_for_change(self.bucket, self._stop, min(left, 1.0), prefixes, since):
                return

    def start(self) -> None:
        """Run in background threads."""
        if self.running:
            return
        self._stop.clear()
        thread = SupervisedThread(self.run, name=f"replica-{self.replica_id}", stop=self._stop, restart=False)
        self.threads = [thread]  # before it starts: run() appends the fetch threads
        thread.start()

    def stop(self) -> None:
        """Stop the loops; the engine stays loaded so :meth:`start` can resume (see :meth:`close`)."""
        self._stop.set()
        self.weights.wake()
        if self.adapters is not None:
            self.adapters.wake()
        for t in self.threads:
            t.join(timeout=60)

    def close(self) -> None:
        """Stop, release the engine (GPU memory with vLLM) and stop watching the bucket."""
        self.stop()
        self.engine.close()
        if self._fp8_dir is not None:
            shutil.rmtree(self._fp8_dir, ignore_errors=True)
        if self._owns_watch:
            self.bucket.close()

    @property
    def running(self) -> bool:
        """Whether any of the replica's threads is alive."""
        return any(t.is_alive() for t in self.threads)


def weights_bytes(model: str) -> int | None:
    """The bytes of a model folder's weights files (``*.safetensors``): the size of the model the
    engine serves, known before the bucket's first anchor; ``None`` when the folder has none."""
    sizes = [p.stat().st_size for p in Path(model).glob("*.safetensors")]
    return sum(sizes) if sizes else None


def resolve_model(model: str) -> str:
    """A local folder for ``model``: itself if it is a folder, else its Hub snapshot
    (engines such as vLLM's weight patcher read the checkpoint files directly)."""
    if Path(model).is_dir():
        return model
    from huggingface_hub import snapshot_download

    return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"])
