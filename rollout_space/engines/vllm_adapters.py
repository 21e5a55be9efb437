"""LoRA adapter versions served by a :class:`~.vllm_engine.VllmEngine`: each verified version written to a folder of
its own (peft's layout), read back and hashed, and added to vLLM as a ``LoRARequest`` with a new id per version
(``version + 1``, so vLLM's prefix cache never mixes two versions)."""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Mapping

import torch
from rlsync.adapters import ADAPTER_WEIGHTS_FILE, AdapterChain, write_adapter_folder
from rlsync.hashing import state_hash


class VllmAdapters:
    """The adapter versions loaded into one ``vllm.LLM``, by version.

    Args:
        llm: The engine's ``vllm.LLM``.
        lock: The engine's lock (adding or removing an adapter waits for the running ``generate``).
        max_loras: LoRA adapter versions served at once (0: the engine was started without LoRA).
        spool_dir: Where the adapters' folders go (default: the system temporary folder).
    """

    def __init__(self, llm: Any, lock: threading.RLock, max_loras: int, spool_dir: str | None) -> None:
        self.llm = llm
        self.lock = lock
        self.max_loras = max_loras
        self.spool_dir = spool_dir
        self.requests: dict[int, Any] = {}  # version -> LoRARequest
        self.folder: Path | None = None

    def add(self, version: int, tensors: Mapping[str, torch.Tensor], chain: AdapterChain) -> str:
        """Add adapter version ``version``; returns the hash of the adapter file vLLM loads, read back from disk.

        Raises:
            RuntimeError: the engine was started without LoRA (``max_loras=0``), or vLLM refused the adapter.
        """
        from safetensors.torch import load_file
        from vllm.lora.request import LoRARequest

        if not self.max_loras:
            raise RuntimeError("this vLLM engine was started without LoRA (give max_loras > 0)")
        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix="rlsync-adapters-", dir=self.spool_dir))
        folder = write_adapter_folder(self.folder / f"v{version}", tensors, chain)
        served = state_hash(load_file(folder / ADAPTER_WEIGHTS_FILE))
        request = LoRARequest(f"v{version}", version + 1, str(folder))
        with self.lock:
            added = False
            try:
                added = self.llm.llm_engine.add_lora(request)
            except Exception as exc:  # noqa: BLE001 - vLLM's engine core reports a worker's refusal as a bare Exception
                raise RuntimeError(f"vLLM refused adapter {version}: {exc}") from exc
            finally:  # refused or raised: nothing of it stays
                if not added:
                    shutil.rmtree(folder, ignore_errors=True)
            if not added:
                raise RuntimeError(f"vLLM refused adapter {version}")
            self.requests[version] = request
        return served

    def drop(self, version: int) -> None:
        """Remove adapter version ``version`` from vLLM and delete its folder."""
        with self.lock:
            request = self.requests.pop(version, None)
            if request is None:
                return
            self.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def request(self, version: int | None) -> Any:
        """The ``LoRARequest`` of a loaded version (``None`` for none); the caller holds the lock.

        Raises:
            KeyError: ``version`` is not loaded.
        """
        if version is not None and version not in self.requests:
            raise KeyError(f"adapter {version} is not loaded")
        return None if version is None else self.requests[version]

    def close(self) -> None:
        """Delete the adapters' folders."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
