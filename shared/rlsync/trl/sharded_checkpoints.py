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

Sharded checkpoints follow the rules of full ones: given the run's publisher (``chain``), the
upload pins the hash of the checkpoint's files in the pointer, and :func:`restore_sharded`
resumes only from a checkpoint pinned there (at a version the pointer has reached) whose
files hash to the pin; a planted or edited checkpoint is skipped for the next older one and
counted in :attr:`BucketCheckpoints.skipped`.

DCP reads ``.metadata`` with ``pickle.load``, falls back to a rank-local ``__<rank>.metadata``
(also ``pickle.load``) when the global one fails, and reads non-tensor entries (the optimizer's
``param_groups``) with ``torch.load(weights_only=False)``, so a bucket object would run code on
load. Before a folder is handed over, :func:`verify_dcp_folder` parses ``.metadata`` with an
unpickler that resolves only DCP's metadata classes and checks the type of every field DCP
reads (so DCP cannot fail on it and fall back), refuses any file the metadata does not name
(a rank-local metadata file among them), and loads every non-tensor entry with
``torch.load(weights_only=True)``. The checkpoint folder is downloaded once, by rank 0, so the
output directory must be shared by the ranks (as ``resume_from_checkpoint`` is).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import shutil
from pathlib import Path, PurePath
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from ..errors import BucketError, CheckpointError, FormatError, SyncError
from ..layout import checkpoint_folder
from ..protocol import read_manifest
from .checkpoint_checks import TRAINER_STATE_FILE, check_pinned, check_trainer_state
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
    """Parse a DCP ``.metadata`` file without running anything but DCP's own constructors, and check
    the type of every field DCP reads.

    Raises:
        CheckpointError: it names another class, does not parse, or a field has another type.
    """
    try:
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
    except Exception as exc:  # noqa: BLE001 - any parse failure means the checkpoint is unusable
        raise CheckpointError(f"{path.parent.name}/{path.name} does not parse: {exc}") from exc
    problem = _metadata_problem(metadata)
    if problem:
        raise CheckpointError(f"{path.parent.name}/{path.name} is not DCP metadata: {problem}")
    return metadata


def _fields_problem(obj: Any, cls: type, fields: Mapping[str, Callable[[Any], bool]]) -> str | None:
    """Why ``obj`` is not a ``cls`` whose attributes are only ``fields``, each passing its check."""
    if type(obj) is not cls:
        return f"{type(obj).__name__} where {cls.__name__} belongs"
    extra = set(vars(obj)) - fields.keys()
    if extra:
        return f"{cls.__name__} has unknown attributes {sorted(extra)}"
    for name, check in fields.items():
        if not check(getattr(obj, name, None)):
            return f"{cls.__name__}.{name} is {type(getattr(obj, name, None)).__name__}"
    return None


def _is_size(value: Any) -> bool:
    return type(value) is torch.Size


def _optional(kind: type | tuple[type, ...]) -> Callable[[Any], bool]:
    return lambda value: value is None or isinstance(value, kind) and type(value) is not bool


def _is_count(value: Any) -> bool:
    return type(value) is int and value >= 0


def _metadata_problem(metadata: Any) -> str | None:
    """Why ``metadata`` is not a DCP ``Metadata`` of the types DCP's loader reads, or ``None``."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as dcp

    problem = _fields_problem(metadata, dcp.Metadata, {
        "state_dict_metadata": lambda v: type(v) is dict, "planner_data": lambda v: v is None or type(v) is dict,
        "storage_data": lambda v: type(v) is dict, "storage_meta": lambda v: v is None or type(v) is dcp.StorageMeta,
        "version": _optional(str),
    })  # fmt: skip
    if problem:
        return problem
    if metadata.storage_meta is not None:
        problem = _fields_problem(metadata.storage_meta, dcp.StorageMeta, {
            "checkpoint_id": _optional((str, PurePath)), "save_id": _optional(str), "load_id": _optional(str),
            "modules": lambda v: type(v) is list and all(type(m) is str for m in v),
        })  # fmt: skip
        if problem:
            return problem
    for fqn, path in (metadata.planner_data or {}).items():
        if type(fqn) is not str or type(path) is not tuple or not all(type(p) in (str, int) for p in path):
            return f"planner data of {fqn!r} is not a path"
    properties = {
        "dtype": lambda v: isinstance(v, torch.dtype), "layout": lambda v: isinstance(v, torch.layout),
        "requires_grad": lambda v: type(v) is bool, "memory_format": lambda v: isinstance(v, torch.memory_format),
        "pin_memory": lambda v: type(v) is bool,
    }  # fmt: skip
    for fqn, entry in metadata.state_dict_metadata.items():
        if type(fqn) is not str:
            return f"an entry is named by a {type(fqn).__name__}"
        if type(entry) is dcp.BytesStorageMetadata:
            problem = _fields_problem(entry, dcp.BytesStorageMetadata, {})
        else:
            problem = _fields_problem(entry, dcp.TensorStorageMetadata, {
                "properties": lambda v: _fields_problem(v, dcp.TensorProperties, properties) is None,
                "size": _is_size, "chunks": lambda v: type(v) is list,
            }) or next((p for c in entry.chunks if (p := _chunk_problem(c, entry.size, dcp))), None)  # fmt: skip
        if problem:
            return f"entry {fqn!r}: {problem}"
    for index, info in metadata.storage_data.items():
        problem = _fields_problem(index, dcp.MetadataIndex, {
            "fqn": lambda v: type(v) is str, "offset": lambda v: v is None or _is_size(v), "index": _optional(int),
        }) or _fields_problem(info, filesystem._StorageInfo, {
            "relative_path": lambda v: type(v) is str, "offset": _is_count, "length": _is_count,
            "transform_descriptors": lambda v: v is None,
        })  # fmt: skip
        if problem:
            return f"storage of {getattr(index, 'fqn', index)!r}: {problem}"
        if index.fqn not in metadata.state_dict_metadata:
            return f"storage of {index.fqn!r}, an entry it does not describe"
    return None


def _chunk_problem(chunk: Any, size: torch.Size, dcp: Any) -> str | None:
    problem = _fields_problem(chunk, dcp.ChunkStorageMetadata, {"offsets": _is_size, "sizes": _is_size})
    if problem is None and not len(chunk.offsets) == len(chunk.sizes) == len(size):
        problem = "a chunk of another rank than its tensor"
    return problem


def verify_dcp_folder(folder: Path) -> None:
    """Check a DCP folder before DCP reads it: safe and well-typed metadata, no file it does not name
    (DCP would unpickle a rank-local ``__<rank>.metadata``), and every non-tensor entry loads with
    ``weights_only``.

    Raises:
        CheckpointError: the metadata, a file or an entry does not pass.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = read_dcp_metadata(folder / DCP_METADATA)
    named = {str(info.relative_path) for info in metadata.storage_data.values()}
    for name in named:
        if os.path.basename(name) != name or not (folder / name).is_file():
            raise CheckpointError(f"{folder.name}: the metadata names {name!r}, not a file of the folder")
    unknown = sorted(p.name for p in folder.iterdir() if p.name not in named | {DCP_METADATA})
    if unknown:
        raise CheckpointError(f"{folder.name}: files the metadata does not name: {unknown}")
    for index, info in metadata.storage_data.items():
        path = folder / info.relative_path
        if info.offset + info.length > path.stat().st_size:
            raise CheckpointError(f"{folder.name}: entry {index.fqn} reaches past the end of {info.relative_path}")
        if not isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata):
            continue  # tensors: DCP itself loads them with weights_only=True
        with path.open("rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
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
        """Every rank uploads the files it wrote; once all have, rank 0 writes the marker, pins the
        hash of the files in the pointer (given the checkpoints' ``chain``) and applies retention."""
        rank = dist.get_rank()
        target = checkpoint_folder(step, self.checkpoints.prefix)
        mine: dict[str, tuple[int, bytes]] = {}
        error = None
        try:
            for path in sorted(folder.rglob("*")):
                relative = path.relative_to(folder)
                if not path.is_file() or len(relative.parts) > 2 or path.name in (MARKER, *SKIPPED_FILES):
                    continue
                name = SUBFOLDER_SEP.join(relative.parts)
                if _writer(relative) != rank or not _FILE_NAME.fullmatch(name):
                    continue
                digest = file_digest(path)
                self.checkpoints.bucket.put_file(f"{target}/{name}", path)
                mine[name] = (path.stat().st_size, digest)
        except (BucketError, OSError) as exc:  # reported through the gather: no rank waits on a failed one
            error = f"rank {rank}: {exc}"
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (mine, error))
        errors = [e for _, e in parts if e]
        if errors:
            raise BucketError(f"checkpoint {step} not uploaded (no marker written): {'; '.join(errors)}")
        if rank == 0:
            files = {n: f for part, _ in parts for n, f in part.items()}
            marker = {"step": step, "files": {n: size for n, (size, _) in files.items()}, **(self.info() if self.info else {})}
            self.checkpoints.bucket.put(f"{target}/{MARKER}", json.dumps(marker).encode())  # last: the checkpoint is complete
            self._pin(step, combine_file_digests({n: digest for n, (_, digest) in files.items()}))
            self.checkpoints._retain(step)
        dist.barrier()
        self.last_step = step

    def _pin(self, step: int, files_hash: str) -> None:
        chain = self.checkpoints.chain
        if chain is None:
            logger.warning("sharded checkpoint %d is not pinned (no chain given), so it will not be resumed from", step)
            return
        try:
            chain.pin_checkpoint(step, files_hash)
        except SyncError as exc:
            logger.warning("sharded checkpoint %d is not pinned in the pointer, so it will not be resumed from: %s", step, exc)


def file_digest(path: Path) -> bytes:
    """SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.digest()


def combine_file_digests(digests: Mapping[str, bytes]) -> str:
    """Hex SHA-256 over ``(name, file digest)`` pairs in name order, each name length-prefixed."""
    h = hashlib.sha256()
    for name in sorted(digests):
        encoded = name.encode()
        h.update(len(encoded).to_bytes(8, "little"))
        h.update(encoded)
        h.update(digests[name])
    return h.hexdigest()


def files_hash(folder: Path) -> str:
    """The hash a sharded checkpoint is pinned by: its files (under their bucket names) and their bytes."""
    return combine_file_digests({p.name: file_digest(p) for p in folder.iterdir() if p.is_file()})


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

    A checkpoint is used only if the pointer pins it (see :class:`ShardedCheckpointCallback`) at a
    version the pointer has reached, its files hash to the pin, and every file passes
    :func:`verify_dcp_folder`; one that fails is skipped for the next older one and counted in
    ``checkpoints.skipped``.

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
    try:
        manifest = read_manifest(checkpoints.bucket)
    except FormatError as exc:
        logger.warning("the pointer is unreadable, so no sharded checkpoint is pinned: %s", exc)
        manifest = None
    pins = {p.step: p.weights_hash for p in manifest.checkpoints} if manifest is not None else {}
    for step in reversed(checkpoints.steps()):
        try:
            check_pinned(step, checkpoints.marker(step), pins, manifest.step if manifest is not None else -1)
            folder = checkpoints.download(step, dest)  # sizes, names, the top-level files
            if files_hash(folder) != pins[step]:
                raise CheckpointError(f"checkpoint {step}: its files do not hash to the hash pinned in the pointer")
            check_trainer_state(folder / TRAINER_STATE_FILE, step)
            _unflatten(folder)
        except CheckpointError as exc:
            checkpoints.skipped += 1
            logger.warning("skipping sharded checkpoint %d: %s", step, exc)
            shutil.rmtree(Path(dest) / f"checkpoint-{step}", ignore_errors=True)
            continue
        return step, str(folder)
    return None
