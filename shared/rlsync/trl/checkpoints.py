"""Training checkpoints in the bucket, in the format transformers' ``Trainer`` writes.

A trainer that restarts (a Space rebooted, a process killed) should lose
nothing: the fp32 master weights, the optimizer and scheduler state, the RNG
state and the step counter all live in a ``Trainer`` checkpoint folder
(``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``,
``trainer_state.json``, ...). :class:`BucketCheckpoints` copies such folders
into the bucket under ``checkpoints/<step>/`` and writes ``checkpoints/<step>/COMPLETE.json``
(file names and sizes, the published weight version) last, so a checkpoint cut
short by a crash is never resumed from. Retention keeps the newest ``keep``.

Checkpoint objects are untrusted like every bucket object: names are checked,
sizes must match the marker and stay under a bound, JSON must parse, and every
pickled file must load with ``torch.load(weights_only=True)`` (what ``Trainer``
itself uses to resume) before the folder is handed over; a checkpoint that fails
is skipped for the next older one.

:class:`CheckpointCallback` uploads every checkpoint the ``Trainer`` saves.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from transformers import TrainerCallback
from transformers.trainer_pt_utils import safe_globals

from ..bucket import Bucket, BucketError, ObjectNotFoundError

logger = logging.getLogger(__name__)

CHECKPOINTS_PREFIX = "checkpoints/"
MARKER = "COMPLETE.json"
DEFAULT_MAX_FILE_BYTES = 64 * 1024**3
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_PICKLED = (".pt", ".pth", ".bin")
#: Written by ``Trainer`` but not read on resume; a full pickle (not loadable with ``weights_only``), so not uploaded.
SKIPPED_FILES = ("training_args.bin",)


class CheckpointError(ValueError):
    """A checkpoint in the bucket is incomplete, malformed or too large."""


def checkpoint_folder(step: int, prefix: str = CHECKPOINTS_PREFIX) -> str:
    """The bucket folder of the checkpoint at optimizer step ``step``."""
    return f"{prefix}{step:010d}"


class BucketCheckpoints:
    """Trainer-format checkpoints stored in a bucket.

    Args:
        bucket: The run's bucket.
        keep: Complete checkpoints retained (older ones are deleted after each upload).
        prefix: Folder of the checkpoints in the bucket.
        max_file_bytes: Largest checkpoint file accepted on download.
    """

    def __init__(
        self, bucket: Bucket, keep: int = 2, prefix: str = CHECKPOINTS_PREFIX, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    ) -> None:
        if keep < 1:
            raise ValueError("keep at least one checkpoint")
        self.bucket = bucket
        self.keep = keep
        self.prefix = prefix
        self.max_file_bytes = max_file_bytes

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (with a marker), oldest first."""
        found = []
        for obj in self.bucket.list(self.prefix):
            parts = obj.key[len(self.prefix) :].split("/")
            if len(parts) == 2 and parts[1] == MARKER and parts[0].isdigit():
                found.append(int(parts[0]))
        return sorted(found)

    def upload(self, folder: str | Path, step: int, **info: Any) -> str:
        """Copy a ``Trainer`` checkpoint folder into the bucket, marker last, then apply retention.

        Args:
            folder: The local checkpoint folder (its files; sub-folders are skipped).
            step: The optimizer step it holds.
            **info: Extra JSON fields stored in the marker (e.g. ``published_version``).

        Returns:
            The bucket folder written.
        """
        target = checkpoint_folder(step, self.prefix)
        files = {}
        for path in sorted(Path(folder).iterdir()):
            if not path.is_file() or not _FILE_NAME.fullmatch(path.name) or path.name in (MARKER, *SKIPPED_FILES):
                continue
            self.bucket.put_file(f"{target}/{path.name}", path)
            files[path.name] = path.stat().st_size
        marker = {"step": step, "files": files, **info}
        self.bucket.put(f"{target}/{MARKER}", json.dumps(marker).encode())
        logger.info("checkpoint %d uploaded (%d files, %d bytes)", step, len(files), sum(files.values()))
        self._retain(step)
        return target

    def _retain(self, newest: int) -> None:
        complete = self.steps()
        drop = set(complete[: -self.keep]) | {s for s in self._all_steps() if s < newest and s not in complete}
        keys = [o.key for s in sorted(drop) for o in self.bucket.list(checkpoint_folder(s, self.prefix) + "/")]
        if keys:
            try:
                self.bucket.delete(keys)
            except BucketError as exc:
                logger.warning("checkpoint retention could not delete: %s", exc)

    def _all_steps(self) -> set[int]:
        out = set()
        for obj in self.bucket.list(self.prefix):
            head = obj.key[len(self.prefix) :].split("/")[0]
            if head.isdigit():
                out.add(int(head))
        return out

    def marker(self, step: int) -> dict[str, Any]:
        """The validated marker of the checkpoint at ``step``.

        Raises:
            CheckpointError: missing, malformed, or naming bad files or sizes.
        """
        try:
            data = self.bucket.get(f"{checkpoint_folder(step, self.prefix)}/{MARKER}")
        except ObjectNotFoundError as exc:
            raise CheckpointError(f"checkpoint {step} has no marker") from exc
        if len(data) > 1 << 20:
            raise CheckpointError(f"checkpoint {step}: marker of {len(data)} bytes is too large")
        try:
            marker = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise CheckpointError(f"checkpoint {step}: malformed marker: {exc}") from exc
        files = marker.get("files") if isinstance(marker, dict) else None
        if not isinstance(files, dict) or marker.get("step") != step:
            raise CheckpointError(f"checkpoint {step}: marker lacks its files or names another step")
        for name, size in files.items():
            if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name in (".", ".."):
                raise CheckpointError(f"checkpoint {step}: invalid file name {name!r}")
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= self.max_file_bytes:
                raise CheckpointError(f"checkpoint {step}: {name} has an invalid or too large size {size!r}")
        return marker

    def download(self, step: int, dest: str | Path) -> Path:
        """Download and verify the checkpoint at ``step`` into ``dest/checkpoint-<step>``.

        Raises:
            CheckpointError: the checkpoint is incomplete, malformed or fails to load.
            BucketError: the bucket failed.
        """
        marker = self.marker(step)
        folder = Path(dest) / f"checkpoint-{step}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name, size in marker["files"].items():
            try:
                data = self.bucket.get(f"{checkpoint_folder(step, self.prefix)}/{name}")
            except ObjectNotFoundError as exc:
                raise CheckpointError(f"checkpoint {step}: {name} is missing") from exc
            if len(data) != size:
                raise CheckpointError(f"checkpoint {step}: {name} has {len(data)} bytes, the marker says {size}")
            (folder / name).write_bytes(data)
        verify_checkpoint_folder(folder)
        return folder

    def restore(self, dest: str | Path) -> tuple[int, Path, dict[str, Any]] | None:
        """Download the newest checkpoint that verifies.

        Returns:
            ``(step, local folder, marker)``, or ``None`` when no usable checkpoint exists.
        """
        for step in reversed(self.steps()):
            try:
                folder = self.download(step, dest)
            except CheckpointError as exc:
                logger.warning("skipping checkpoint %d: %s", step, exc)
                continue
            return step, folder, self.marker(step)
        return None


def verify_checkpoint_folder(folder: Path) -> None:
    """Check that every file of a checkpoint folder parses: JSON, safetensors headers, and
    pickles under ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: a file does not parse.
    """
    for path in folder.iterdir():
        try:
            if path.suffix == ".json":
                json.loads(path.read_text())
            elif path.suffix == ".safetensors":
                with safe_open(str(path), "pt") as f:
                    list(f.keys())
            elif path.suffix in _PICKLED:
                with safe_globals():
                    torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # noqa: BLE001 - any parse failure means the checkpoint is unusable
            raise CheckpointError(f"{path.name} does not load: {exc}") from exc


class CheckpointCallback(TrainerCallback):
    """Uploads each checkpoint the ``Trainer`` saves to the bucket.

    Args:
        checkpoints: Where to upload.
        info: Called at each save for extra marker fields (e.g. the published weight version).
    """

    def __init__(self, checkpoints: BucketCheckpoints, info: Callable[[], dict[str, Any]] | None = None) -> None:
        self.checkpoints = checkpoints
        self.info = info
        self.last_step: int | None = None

    def upload(self, output_dir: str | Path, step: int) -> None:
        """Upload ``output_dir/checkpoint-<step>``, then delete the local copy."""
        folder = Path(output_dir) / f"checkpoint-{step}"
        self.checkpoints.upload(folder, step, **(self.info() if self.info else {}))
        self.last_step = step
        shutil.rmtree(folder, ignore_errors=True)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self.upload(args.output_dir, state.global_step)
