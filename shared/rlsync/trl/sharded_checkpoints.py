"""Checkpoints of a sharded (FSDP2) TRL run in the bucket, in torch.distributed.checkpoint's format.

With ``fsdp_config={"version": 2, "state_dict_type": "SHARDED_STATE_DICT"}`` the
``Trainer`` saves through accelerate with ``torch.distributed.checkpoint`` (DCP):
``checkpoint-<step>/pytorch_model_fsdp_0/`` and ``optimizer_0/`` hold one
``__<rank>_0.distcp`` file per rank plus a ``.metadata`` file, beside the usual
``trainer_state.json``, ``scheduler.pt`` and one ``rng_state_<rank>.pth`` per rank.
No rank gathers anything to save or to resume, and DCP reshards on load.

:class:`ShardedCheckpointCallback` uploads such a folder from every rank (each rank
its own files, rank 0 the shared ones), then rank 0 writes the marker, as
:class:`~rlsync.trl.BucketCheckpoints` does for a single-process run; the files of
a sub-folder are stored as ``<folder>..<name>`` so the marker, retention and download
checks are :class:`BucketCheckpoints`' own. :func:`restore_sharded` downloads the
newest checkpoint that verifies and hands every rank its local path for
``trainer.train(resume_from_checkpoint=...)``.

DCP reads ``.metadata`` with ``pickle.load`` and non-tensor entries (the optimizer's
``param_groups``) with ``torch.load(weights_only=False)``, so a bucket object would run
code on load. Before a folder is handed over, :func:`verify_dcp_folder` parses every
``.metadata`` with an unpickler that resolves only DCP's metadata classes and every
non-tensor entry with ``torch.load(weights_only=True)``; a checkpoint that fails is
skipped for the next older one. The checkpoint folder is downloaded once, by rank 0,
so the output directory must be shared by the ranks (as ``resume_from_checkpoint`` is).
"""

from __future__ import annotations

import io
import json
import logging
import pickle
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ..errors import BucketError, CheckpointError
from ..layout import checkpoint_folder
from .checkpoints import _FILE_NAME, MARKER, SKIPPED_FILES, BucketCheckpoints

logger = logging.getLogger(__name__)

SUBFOLDER_SEP = ".."  # "<sub-folder>..<file>" in the bucket: one level, as DCP writes
DCP_METADATA = ".metadata"
_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}  # fmt: skip


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves DCP's metadata classes, ``torch.Size`` and dtypes only."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a DCP metadata class")


def read_dcp_metadata(path: Path) -> Any:
    """Parse a DCP ``.metadata`` file without running anything but DCP's own constructors.

    Raises:
        CheckpointError: it names another class or does not parse.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as exc:  # noqa: BLE001 - any parse failure means the checkpoint is unusable
        raise CheckpointError(f"{path.parent.name}/{path.name} does not parse: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path.parent.name}/{path.name} is not DCP metadata")
    return metadata


def verify_dcp_folder(folder: Path) -> None:
    """Check a DCP folder before DCP reads it: safe metadata, and every non-tensor entry loads with ``weights_only``.

    Raises:
        CheckpointError: the metadata or an entry does not pass.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(folder / DCP_METADATA)
    for index, info in metadata.storage_data.items():
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue  # tensors: DCP itself loads them with weights_only=True
        path = folder / str(info.relative_path)
        if path.parent != folder or not path.is_file() or getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{folder.name}: entry {index.fqn} names {info.relative_path!r}")
        with path.open("rb") as f:
            f.seek(int(info.offset))
            data = f.read(int(info.length))
        try:
            torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{folder.name}: entry {index.fqn} does not load with weights_only: {exc}") from exc


def _unflatten(folder: Path) -> None:
    """Move ``<sub>..<name>`` files into ``<sub>/<name>`` and verify each DCP sub-folder."""
    subfolders = set()
    for path in sorted(folder.iterdir()):
        if SUBFOLDER_SEP not in path.name.strip("."):
            continue
        sub, name = path.name.split(SUBFOLDER_SEP, 1)
        if not sub or sub.startswith(".") or not name or name in (".", ".."):
            raise CheckpointError(f"{path.name}: not a sub-folder file")
        (folder / sub).mkdir(exist_ok=True)
        path.rename(folder / sub / name)
        subfolders.add(sub)
    for sub in sorted(subfolders):
        verify_dcp_folder(folder / sub)


class ShardedCheckpointCallback(TrainerCallback):
    """Uploads each sharded checkpoint the ``Trainer`` saves, from every rank (collective).

    Args:
        checkpoints: Where to upload (every rank needs write access).
        info: Called on rank 0 at each save for extra marker fields.
    """

    def __init__(self, checkpoints: BucketCheckpoints, info: Callable[[], dict[str, Any]] | None = None) -> None:
        self.checkpoints = checkpoints
        self.info = info
        self.last_step: int | None = None

    def on_save(self, args, state, control, **kwargs):
        self.upload(Path(args.output_dir) / f"checkpoint-{state.global_step}", state.global_step)

    def upload(self, folder: Path, step: int) -> None:
        """Every rank uploads the files it wrote; once all have, rank 0 writes the marker (and applies retention)."""
        rank = dist.get_rank()
        target = checkpoint_folder(step, self.checkpoints.prefix)
        mine: dict[str, int] = {}
        error = None
        try:
            for path in sorted(folder.rglob("*")):
                relative = path.relative_to(folder)
                if not path.is_file() or len(relative.parts) > 2 or path.name in (MARKER, *SKIPPED_FILES):
                    continue
                name = SUBFOLDER_SEP.join(relative.parts)
                if _writer(relative) != rank or not _FILE_NAME.fullmatch(name):
                    continue
                self.checkpoints.bucket.put_file(f"{target}/{name}", path)
                mine[name] = path.stat().st_size
        except (BucketError, OSError) as exc:  # reported through the gather: no rank waits on a failed one
            error = f"rank {rank}: {exc}"
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (mine, error))
        errors = [e for _, e in parts if e]
        if errors:
            raise BucketError(f"checkpoint {step} not uploaded (no marker written): {'; '.join(errors)}")
        if rank == 0:
            files = {n: s for part, _ in parts for n, s in part.items()}
            marker = {"step": step, "files": files, **(self.info() if self.info else {})}
            self.checkpoints.bucket.put(f"{target}/{MARKER}", json.dumps(marker).encode())  # last: the checkpoint is complete
            self.checkpoints._retain(step)
        dist.barrier()
        self.last_step = step


def _writer(relative: Path) -> int:
    """The rank that uploads a checkpoint file: the rank in its name (``__<rank>_0.distcp``,
    ``rng_state_<rank>.pth``), else rank 0."""
    stem = relative.name.split(".")[0]
    for prefix in ("__", "rng_state_"):
        digits = stem[len(prefix) :].split("_")[0]
        if stem.startswith(prefix) and digits.isdigit():
            return int(digits)
    return 0


def restore_sharded(checkpoints: BucketCheckpoints, dest: str | Path) -> tuple[int, Path] | None:
    """Download the newest sharded checkpoint that verifies (rank 0) and give every rank its path (collective).

    Args:
        checkpoints: The run's checkpoints.
        dest: A folder every rank can read (e.g. the ``Trainer``'s output directory).

    Returns:
        ``(step, local checkpoint folder)`` for ``resume_from_checkpoint``, or ``None`` when none is usable.

    Raises:
        BucketError: on every rank, when the bucket failed on rank 0.
    """
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = _newest_usable(checkpoints, dest)
        except BucketError as exc:  # every rank raises, none waits on rank 0
            box[0] = ("error", str(exc))
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None and box[0][0] == "error":
        raise BucketError(f"restoring a sharded checkpoint failed on rank 0: {box[0][1]}")
    return None if box[0] is None else (box[0][0], Path(box[0][1]))


def _newest_usable(checkpoints: BucketCheckpoints, dest: str | Path) -> tuple[int, str] | None:
    for step in reversed(checkpoints.steps()):
        try:
            folder = checkpoints.download(step, dest)  # sizes, names, the top-level files
            _unflatten(folder)
        except CheckpointError as exc:
            logger.warning("skipping sharded checkpoint %d: %s", step, exc)
            continue
        return step, str(folder)
    return None
