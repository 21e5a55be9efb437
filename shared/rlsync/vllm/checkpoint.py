"""The checkpoint a vLLM model was loaded from: a local folder or a Hub model id in the local cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["checkpoint_names_of", "local_model_folder"]


def local_model_folder(model: str | os.PathLike, revision: str | None = None) -> Path:
    """The local folder of a model given as a path or a Hub model id (``Qwen/Qwen3-0.6B``).

    vLLM keeps a Hub id in ``model_config.model`` and downloads the snapshot into the Hub cache
    before loading it; this returns that cached snapshot (never downloads).

    Raises:
        FileNotFoundError: Neither a folder nor a model id with a cached snapshot.
    """
    folder = Path(model)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(str(model), revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError) as err:
        raise FileNotFoundError(f"{model!r} is neither a model folder nor a Hub model id in the local cache") from err


def checkpoint_names_of(model_path: str | os.PathLike, revision: str | None = None) -> list[str]:
    """Tensor names of a model's safetensors checkpoint: a local folder, or a Hub model id
    resolved to its snapshot in the local Hub cache (see :func:`local_model_folder`).

    Raises:
        FileNotFoundError: No such folder or cached snapshot, or it has no safetensors checkpoint.
    """
    from safetensors import safe_open

    folder = local_model_folder(model_path, revision)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted(json.loads(index.read_text())["weight_map"])
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors checkpoint in {folder}")
    names: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            names.extend(sf.keys())
    return sorted(names)
