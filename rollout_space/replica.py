"""One replica of the rollout fleet.

A replica follows the bucket with the shared :class:`~rlsync.protocol.Subscriber`
and generates completions for the environment's task batches. Downloading, decoding
and verifying the next update (its state hash updated from the changed elements)
runs in a background thread while the engine keeps generating; only writing it
pauses generation: for a delta, the scatter of the changed elements into the
engine's own weights (an engine that exposes them, :meth:`~rollout_space.engine.Engine.weights`,
is the subscriber's state: no second copy of the model). That pause is measured as
"inference idle per sync".

Another background thread re-hashes the engine's weights in full after every anchor
and every ``rehash_every_s`` seconds (reading them a chunk at a time, so syncs go
on); a mismatch (memory corruption, a write outside the protocol) is counted in the
status (``rehash_mismatches``) and the replica re-bootstraps from the newest anchor.

Sharing tasks between replicas: the trainer never knows how many replicas exist.
Each replica claims the oldest task batch that no replica has answered or claimed
(``claims/<batch>/<replica>.json``), so a fleet spreads batches over its members
without a coordinator and no batch is generated twice: two answers of one batch are
twice its samples at one policy version, more than the trainer can take before they
go stale (:mod:`rollout_space.claims`). Every replica writes
``status/<replica>.json`` so any panel can show the fleet.

Demand (``control/demand.json``, :mod:`rlsync.spaces.demand`): before a batch the
replica applies the newest version it holds, and does not start a batch whose
samples would be too stale by the time the trainer gets them (its version too far
behind the trainer's, given its own measured generation time); it waits for newer
weights instead and counts the skip.

The chain (``chain``, :class:`~rlsync.fp8.Chain`): a replica follows the trainer's bf16 weights, or
its FP8 serving chain (``fp8/``, :mod:`rlsync.fp8`), served by the vLLM engine started from the model
quantized to block FP8; the subscriber then checks every FP8 value before it is applied.

In a LoRA run (``lora``) the weights chain holds the base and an
:class:`~rollout_space.adapters.AdapterFollower` serves the adapter chain's versions;
samples then carry the adapter version as their policy version.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path

from rlsync.bucket import Bucket
from rlsync.bucket.watch import IDLE_WAIT_S, generation, meter_of, wait_for_change
from rlsync.errors import BucketError, SyncError
from rlsync.fp8 import Chain, write_fp8_checkpoint
from rlsync.layout import (
    ROLLOUTS_PREFIX,
    SCORES_PREFIX,
    TASKS_PREFIX,
    check_id,
    rollout_key,
    status_key,
    task_key,
)
from rlsync.protocol import Update
from rlsync.spaces.demand import newest_version, read_demand, would_be_stale
from rlsync.spaces.exchange import (
    Refusals,
    Sample,
    get_json,
    open_role_bucket,
    parse_tasks,
    put_json,
    write_samples,
)
from rlsync.spaces.interval_log import IntervalLog
from rlsync.spaces.metrics import ReplicaStatus
from rlsync.spaces.settings import resolve_device
from rlsync.spaces.tiny_model import model_or_default
from rlsync.supervised import SupervisedThread

from env_space.environments import get_environment

from .adapters import AdapterFollower
from .claims import BatchClaims
from .config import ReplicaConfig, default_replica_id
from .engine import Engine, SamplingSettings, create_engine
from .status import replica_status, summary_line
from .token_budget import TokenBudget, context_length, plan_batch
from .update_slot import UpdateSlot

logger = logging.getLogger(__name__)



class Replica:
    """Follows the bucket's weights and answers task batches.

    Args:
        config: Settings.
        bucket: Bucket to use (default: opened from ``config.bucket``).
        engine: Inference engine (default: created from ``config.engine`` and ``config.model``).

    Raises:
        ValueError: An unknown ``config.chain``, or the FP8 chain with an engine other than vLLM or with LoRA.
    """

    def __init__(self, config: ReplicaConfig, bucket: Bucket | None = None, engine: Engine | None = None) -> None:
        from transformers import AutoTokenizer

        device = resolve_device(config.device)
        self.config = config = config.with_model_defaults(device)
        self.chain = Chain(config.chain)
        kind = config.engine if config.engine != "auto" else "vllm" if self.chain is Chain.FP8 else _auto_engine(device)
        if self.chain is Chain.FP8 and ((engine.name if engine is not None else kind) != "vllm" or config.lora):
            raise ValueError(f"the fp8 chain is served by the vllm engine without LoRA (engine {kind!r}, lora {config.lora})")
        self.replica_id = check_id(config.replica_id or default_replica_id())
        self.bucket = open_role_bucket("rollout", config.bucket, bucket)
        self._owns_watch = self.bucket is not bucket  # close() stops the watch this role made
        self.meter = meter_of(self.bucket)
        self._status_at = -float("inf")
        self._status_progress: tuple | None = None
        self._since: int | None = None
        model = resolve_model(model_or_default(config.model, device, get_environment))
        self._fp8_dir: Path | None = None
        if self.chain is Chain.FP8:
            model = self._fp8_checkpoint(model)
        engine_kwargs = {"device": device} if kind == "transformers" else {}
        if config.lora and kind == "vllm":
            engine_kwargs.update(max_loras=config.lora_window + 1, max_lora_rank=config.lora_max_rank)
        self.engine = engine or create_engine(kind, model_path=model, **engine_kwargs)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.budget = TokenBudget(
            max_prompt_tokens=config.max_prompt_tokens or max(1, context_length(model) - config.max_new_tokens),
            max_new_tokens=config.max_new_tokens, n=config.samples_per_task,
            max_batch_tokens=config.max_batch_tokens, chunk_tokens=config.chunk_tokens,
        )  # fmt: skip
        self._engine_weights = self.engine.weights()  # None: the engine is fed from the subscriber's copy
        max_state_bytes = config.max_model_bytes or weights_bytes(model)  # bounds the first anchor (or adapter)
        self.subscriber = self.chain.subscriber(self.bucket, weights=self._engine_weights, max_state_bytes=max_state_bytes)
        self.adapters = (
            AdapterFollower(self.bucket, self.engine, lambda: self.subscriber.state_hash, window=config.lora_window,
                            poll_s=config.poll_s, max_state_bytes=max_state_bytes)
            if config.lora else None
        )  # fmt: skip
        self.slot = UpdateSlot()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.syncs: list[dict] = []
        self.batches = BatchClaims(self.bucket, self.replica_id)
        self.tokens = 0
        self.gen_s = 0.0
        self.completions = 0
        self.batch_gen_s: float | None = None  # EMA of one batch's generation time
        self.skipped_stale = 0
        self.refusals = Refusals()
        self.newest_step: int | None = None
        self._rehash_now = threading.Event()  # set after an anchor: re-hash the weights it wrote
        self.summary = IntervalLog(logger, functools.partial(summary_line, self.replica_id))

    # -- weights ------------------------------------------------------------

    def _fp8_checkpoint(self, model: str) -> str:
        """The block-FP8 checkpoint of ``model`` the engine starts from when the replica follows the FP8 chain
        (its first anchor replaces every weight and scale; the folder goes with :meth:`close`)."""
        self._fp8_dir = Path(tempfile.mkdtemp(prefix="rlsync-fp8-"))
        return str(write_fp8_checkpoint(model, self._fp8_dir))

    def fetch_loop(self) -> None:
        """Background thread: download and validate the next update while generation goes on."""
        while not self._stop.is_set():
            self.slot.wait_empty(self._stop)
            if self._stop.is_set():
                return
            since = generation(self.bucket)
            try:
                update = self.subscriber.fetch()
            except (SyncError, BucketError) as exc:
                logger.warning("replica %s: update refused or unavailable: %s", self.replica_id, exc)
                update = None
            if self.subscriber.manifest is not None:
                self.newest_step = self.subscriber.manifest.step
            if update is None:
                wait_for_change(self.bucket, self._stop, self._idle_s, (self.chain.pointer_key,), since)
                continue
            self.slot.put(update)

    def apply_pending(self) -> bool:
        """Apply a downloaded update, pausing generation; returns whether one was applied.

        The fetch thread waits until this returns before it fetches the next
        update, which is validated against the state this apply produces.
        """
        return self.slot.apply(self._apply)

    def _apply(self, update: Update) -> bool:
        t0 = time.perf_counter()
        try:
            self.subscriber.apply(update)
        except SyncError as exc:
            logger.error("replica %s: refused %s %d: %s", self.replica_id, update.kind, update.step, exc)
            return False
        if self._engine_weights is None:  # the engine keeps its own weights: hand it the verified update
            if update.kind == "anchor":
                self.engine.load_state(self.subscriber.state)
            else:
                self.engine.apply_patches(update.patches or {}, self.subscriber.state)
        idle = time.perf_counter() - t0
        if update.kind == "anchor":
            self._rehash_now.set()
        self.syncs.append({
            "step": update.step, "kind": update.kind, "nbytes": update.nbytes, "download_s": update.download_s,
            "decode_s": update.decode_s, "idle_s": idle, "time": time.time(),
        })  # fmt: skip
        del self.syncs[:-500]
        logger.debug("replica %s: applied %s %d, idle %.3fs", self.replica_id, update.kind, update.step, idle)
        self.summary.add(applied=1, anchors=update.kind == "anchor", idle_s=idle)
        self.summary.note(version=update.step)
        return True

    def rehash_loop(self) -> None:
        """Background thread: re-hash the weights in full after every anchor and every ``rehash_every_s``
        seconds (:meth:`~rlsync.protocol.Subscriber.verify_weights`; a mismatch re-bootstraps)."""
        every = self.config.rehash_every_s
        while not self._stop.is_set():
            self._rehash_now.wait(every if every > 0 else None)
            if self._stop.is_set():
                return
            self._rehash_now.clear()
            if self.subscriber.verify_weights() is False:
                logger.error("replica %s: %s", self.replica_id, self.subscriber.stats.last_error)

    # -- tasks --------------------------------------------------------------

    def answer(self, batch: int) -> int:
        """Generate G completions per task of ``batch`` and write them; returns samples written."""
        doc = get_json(self.bucket, task_key(batch), self.refusals)
        self.batches.taken(batch)
        if doc is None:
            return 0
        try:
            tasks = parse_tasks(doc)
        except ValueError as exc:
            self.refusals.add(task_key(batch), str(exc))
            return 0
        prompt_ids = [self.tokenizer(t["prompt"])["input_ids"] for t in tasks]
        plan = plan_batch([len(ids) for ids in prompt_ids], self.budget)
        if plan.dropped or plan.refused:
            self.refusals.add(task_key(batch), plan.refused or f"{len(plan.dropped)} prompts longer than {self.budget.max_prompt_tokens} tokens")
        version = self.policy_version
        assert version is not None
        seed = self._sampling_seed(batch, version)
        t0 = time.perf_counter()
        samples = []
        for chunk_index, chunk in enumerate(plan.chunks):
            sampling = SamplingSettings(
                n=self.config.samples_per_task, max_new_tokens=self.config.max_new_tokens,
                temperature=self.config.temperature, seed=seed + chunk_index,
                adapter=version if self.adapters is not None else None,
            )  # fmt: skip
            groups = self.engine.generate([tasks[i]["prompt"] for i in chunk], sampling)
            samples += self._samples([tasks[i] for i in chunk], [prompt_ids[i] for i in chunk], groups, version)
        elapsed = time.perf_counter() - t0
        self.gen_s += elapsed
        self.batch_gen_s = elapsed if self.batch_gen_s is None else 0.7 * self.batch_gen_s + 0.3 * elapsed
        write_samples(self.bucket, rollout_key(batch, self.replica_id), samples, batch=batch, replica=self.replica_id, version=version)
        self.batches.answered()
        self.summary.add(batches=1, samples=len(samples), tokens=sum(len(s.token_ids) for s in samples), gen_s=elapsed)
        self.completions += len(samples)
        return len(samples)

    def _samples(self, tasks: list[dict], prompt_ids: list[list[int]], groups: list, version: int) -> list[Sample]:
        samples = []
        for task, ids, group in zip(tasks, prompt_ids, groups):
            for c in group:
                samples.append(Sample(str(task["task_id"]), task["prompt"], c.text, ids, c.token_ids, c.logprobs, version))
                self.tokens += len(c.token_ids)
        return samples

    def fresh_enough(self) -> bool:
        """Whether a batch started now at this replica's version would still be trained (see
        :func:`~rlsync.spaces.demand.would_be_stale`); ``True`` without a demand object."""
        demand = read_demand(self.bucket, self.refusals, newest_version=newest_version(self.bucket))
        version = self.policy_version
        if demand is None or version is None or not would_be_stale(demand, version, self.batch_gen_s or 0.0):
            return True
        self.skipped_stale += 1
        self.summary.add(skipped_stale=1)
        return False

    @property
    def policy_version(self) -> int | None:
        """The version samples are generated with: the served adapter's in a LoRA run, else the weights'."""
        if self.adapters is not None:
            return self.adapters.step
        return self.subscriber.step

    def _sampling_seed(self, batch: int, version: int) -> int:
        """Seed of one batch: differs between replicas, so racing replicas add new samples, not copies."""
        replica = int.from_bytes(hashlib.sha256(self.replica_id.encode()).digest()[:4], "little")
        return ((self.config.seed * 1_000_003 + batch) * 7919 + version) ^ replica

    # -- status -------------------------------------------------------------

    def status(self) -> ReplicaStatus:
        """The status object this replica publishes (:func:`rollout_space.status.replica_status`)."""
        return replica_status(self)

    def publish_status(self, force: bool = False) -> None:
        """Write the status object (on a Hub bucket at most every ``status_every_s`` unless `force`)."""
        now = time.monotonic()
        status = self.status()
        progress = (status.applied_step, status.newest_step, status.completions, status.refused)
        if self.meter is not None and not force:
            if now - self._status_at < self.config.status_every_s or progress == self._status_progress:
                return  # on the Hub: at most every status_every_s, and only when something moved
        self._status_at, self._status_progress = now, progress
        try:
            put_json(self.bucket, status_key(self.replica_id), status.to_json())
        except BucketError as exc:
            logger.warning("could not write status: %s", exc)

    # -- lifecycle ----------------------------------------------------------

    def step(self) -> bool:
        """One iteration of the main loop; returns whether it did any work."""
        worked = self.apply_pending()
        self._since = generation(self.bucket)
        if self.adapters is not None:
            worked = self.adapters.apply_pending() or worked
        if self.policy_version is not None:
            batch = self.batches.next_batch()
            if batch is not None and self.fresh_enough():
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
        """Run until :meth:`stop` (fetching in a background thread)."""
        for loop, name in ((self.fetch_loop, "fetch"), (self.rehash_loop, "rehash")):
            thread = SupervisedThread(loop, name=f"{name}-{self.replica_id}", stop=self._stop)
            thread.start()
            self._threads.append(thread)
        if self.adapters is not None:
            adapter_fetcher = SupervisedThread(self.adapters.fetch_loop, args=(self._stop,), name=f"adapters-{self.replica_id}", stop=self._stop)
            adapter_fetcher.start()
            self._threads.append(adapter_fetcher)
        while not self._stop.is_set():
            try:
                worked = self.step()
            except BucketError as exc:
                logger.warning("bucket error, retrying: %s", exc)
                worked = False
            if not worked:
                self._idle()
        self.batches.release()
        self.publish_status(force=True)

    @property
    def _idle_s(self) -> float:
        return self.config.poll_s if generation(self.bucket) is None else IDLE_WAIT_S

    def _idle(self) -> None:
        """Wait for new tasks or weights (a watched bucket: until they appear or an update is downloaded)."""
        deadline = time.monotonic() + self._idle_s
        since = self._since
        while not self._stop.is_set() and self.slot.update is None and (left := deadline - time.monotonic()) > 0:
            prefixes = (TASKS_PREFIX, ROLLOUTS_PREFIX, SCORES_PREFIX)
            if wait_for_change(self.bucket, self._stop, min(left, 1.0), prefixes, since):
                return

    def start(self) -> None:
        """Run in background threads."""
        if self.running:
            return
        self._stop.clear()
        thread = SupervisedThread(self.run, name=f"replica-{self.replica_id}", stop=self._stop, restart=False)
        self._threads = [thread]  # before it starts: run() appends the fetch threads
        thread.start()

    def stop(self) -> None:
        """Stop the loops; the engine stays loaded so :meth:`start` can resume (see :meth:`close`)."""
        self._stop.set()
        self._rehash_now.set()
        self.slot.wake()
        if self.adapters is not None:
            self.adapters.wake()
        for t in self._threads:
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
        return any(t.is_alive() for t in self._threads)


def _auto_engine(device: str) -> str:
    """vLLM on a GPU when it is installed, else transformers."""
    import importlib.util

    return "vllm" if device.startswith("cuda") and importlib.util.find_spec("vllm") is not None else "transformers"


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
