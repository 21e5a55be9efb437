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
itself uses to resume) before the folder is handed over. Given the run's
:class:`~rlsync.protocol.Publisher` (``chain``), each upload pins the checkpoint's
weights hash in the pointer, and retention keeps only pinned checkpoints; given
:class:`~rlsync.trl.checkpoint_checks.CheckpointExpectations`, a restore also checks
the checkpoint against the chain and the model (weights hash, tensors, optimizer and
scheduler state, step). Files stream to disk, each bounded by the marker's size and
``max_file_bytes``. A checkpoint that fails is skipped for the next older one, and counted.

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

from ..bucket import Bucket
from ..errors import BucketError, CheckpointError, FormatError, ObjectNotFoundError, ObjectTooLargeError, SyncError
from ..jsonlimits import loads_bounded
from ..layout import CHECKPOINT_MARKER as MARKER
from ..layout import CHECKPOINTS_PREFIX, checkpoint_folder
from ..limits import MAX_MARKER_BYTES
from ..protocol import Publisher
from .checkpoint_checks import WEIGHTS_FILE, CheckpointExpectations, check_checkpoint, weights_hash

logger = logging.getLogger(__name__)

DEFAULT_MAX_FILE_BYTES = 64 * 1024**3
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
_PICKLED = (".pt", ".pth", ".bin")
#: Written by ``Trainer`` but not read on resume; a full pickle (not loadable with ``weights_only``), so not uploaded.
SKIPPED_FILES = ("training_args.bin",)


class BucketCheckpoints:
    """Trainer-format checkpoints stored in a bucket.

    Args:
        bucket: The run's bucket.
        keep: Complete checkpoints retained (older ones are deleted after each upload).
        prefix: Folder of the checkpoints in the bucket.
        max_file_bytes: Largest checkpoint file accepted on download.
        chain: The run's publisher: uploads pin their weights hash in its pointer, and
            retention keeps only pinned checkpoints.
    """

    def __init__(
        self, bucket: Bucket, keep: int = 2, prefix: str = CHECKPOINTS_PREFIX, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
        chain: Publisher | None = None,
    ) -> None:  # fmt: skip
        if keep < 1:
            raise ValueError("keep at least one checkpoint")
        self.bucket = bucket
        self.keep = keep
        self.prefix = prefix
        self.max_file_bytes = max_file_bytes
        self.chain = chain
        self.skipped = 0  # checkpoints refused by restore()

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
        weights = Path(folder) / WEIGHTS_FILE
        if self.chain is not None and weights.exists():
            try:
                self.chain.pin_checkpoint(step, weights_hash(weights))
            except SyncError as exc:
                logger.warning("checkpoint %d is not pinned in the pointer, so it will not be resumed from: %s", step, exc)
        self._retain(step)
        return target

    def _pinned(self) -> set[int] | None:
        manifest = self.chain.manifest if self.chain is not None else None
        return {p.step for p in manifest.checkpoints} if manifest is not None else None

    def _retain(self, newest: int) -> None:
        """Keep the newest ``keep`` complete checkpoints up to ``newest`` (pinned ones, given a chain);
        delete every other one, so a planted checkpoint of a huge step is not kept forever."""
        pinned = self._pinned()
        candidates = [s for s in self.steps() if s <= newest and (pinned is None or s in pinned)]
        kept = set(candidates[-self.keep :])
        drop = self._all_steps() - kept
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

    def marker(self, step: int, max_file_bytes: int | None = None) -> dict[str, Any]:
        """The validated marker of the checkpoint at ``step``.

        Args:
            step: The checkpoint's step.
            max_file_bytes: A tighter bound than :attr:`max_file_bytes` on every file it names.

        Raises:
            CheckpointError: missing, malformed, not of ``step`` (an integer), or naming bad files or sizes.
        """
        limit = self.max_file_bytes if max_file_bytes is None else min(self.max_file_bytes, max_file_bytes)
        try:
            data = self.bucket.get_limited(f"{checkpoint_folder(step, self.prefix)}/{MARKER}", MAX_MARKER_BYTES)
        except ObjectNotFoundError as exc:
            raise CheckpointError(f"checkpoint {step} has no marker") from exc
        except ObjectTooLargeError as exc:
            raise CheckpointError(f"checkpoint {step}: marker too large: {exc}") from None
        try:
            marker = loads_bounded(data, what=f"checkpoint {step} marker", max_bytes=MAX_MARKER_BYTES)
        except FormatError as exc:
            raise CheckpointError(f"checkpoint {step}: {exc}") from None
        files = marker.get("files") if isinstance(marker, dict) else None
        if not isinstance(files, dict) or type(marker.get("step")) is not int or marker["step"] != step:
            raise CheckpointError(f"checkpoint {step}: marker lacks its files or names another step")
        for name, size in files.items():
            if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name in (".", ".."):
                raise CheckpointError(f"checkpoint {step}: invalid file name {name!r}")
            if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= limit:
                raise CheckpointError(f"checkpoint {step}: {name} has an invalid or too large size {size!r}")
        return marker

    def download(self, step: int, dest: str | Path, expect: CheckpointExpectations | None = None) -> Path:
        """Download and verify the checkpoint at ``step`` into ``dest/checkpoint-<step>``, one file at a
        time straight to disk.

        Args:
            step: The checkpoint's step.
            dest: Local folder.
            expect: What the checkpoint must match (see :func:`check_checkpoint`), which also bounds
                every file by the model's size; ``None``: parsing only.

        Raises:
            CheckpointError: the checkpoint is incomplete, malformed, too large, fails to load or to match.
            BucketError: the bucket failed.
        """
        marker = self.marker(step, expect.max_file_bytes() if expect is not None else None)
        folder = Path(dest) / f"checkpoint-{step}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        for name, size in marker["files"].items():
            path = folder / name
            try:
                self.bucket.get_file_limited(f"{checkpoint_folder(step, self.prefix)}/{name}", path, size)
            except ObjectNotFoundError as exc:
                raise CheckpointError(f"checkpoint {step}: {name} is missing") from exc
            except ObjectTooLargeError as exc:
                raise CheckpointError(f"checkpoint {step}: {name} is larger than the marker says: {exc}") from None
            if path.stat().st_size != size:
                raise CheckpointError(f"checkpoint {step}: {name} has {path.stat().st_size} bytes, the marker says {size}")
        verify_checkpoint_folder(folder)
        if expect is not None:
            check_checkpoint(folder, step, marker, expect)
        return folder

    def restore(self, dest: str | Path, expect: CheckpointExpectations | None = None) -> tuple[int, Path, dict[str, Any]] | None:
        """Download the newest checkpoint that verifies (skipped ones are counted in :attr:`skipped`).

        Args:
            dest: Local folder.
            expect: What a checkpoint must match; also bounds every file by the model's size.

        Returns:
            ``(step, local folder, marker)``, or ``None`` when no usable checkpoint exists.
        """
        for step in reversed(self.steps()):
            try:
                folder = self.download(step, dest, expect)
            except CheckpointError as exc:
                self.skipped += 1
                logger.warning("skipping checkpoint %d: %s", step, exc)
                shutil.rmtree(Path(dest) / f"checkpoint-{step}", ignore_errors=True)
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
