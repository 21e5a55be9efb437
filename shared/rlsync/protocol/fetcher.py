"""Fetching an update: everything a replica does before the pause, while generation runs.

A delta's files are downloaded (concurrently: a sharded trainer writes one per rank), checked
against the pointer, decoded against the held state, merged in the pointer's order and verified:
the held state's hash updated with the changed elements alone (their old bits gathered from the
state, their new bits from the delta: O(changed), see :mod:`rlsync.hashing`) must equal the hash the
trainer published. Its patches and rollback values are then staged on the state's device, so that
the pause only scatters. An anchor's files are downloaded to a scratch folder, loaded as views of
those files, checked against the model's schema and hashed in one pass.

The fetcher also reads the pointer and bounds every update by the model's size before any download.
Nothing here writes the held state; what to refuse, count and log is the
:class:`~rlsync.protocol.Subscriber`'s.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

from ..aliases import aliases_from_metadata
from ..bucket import Bucket
from ..dtypes import numpy_to_values, tensor_bits
from ..errors import FormatError, HashMismatchError, MissingUpdateError, ObjectNotFoundError, ObjectTooLargeError
from ..files import age_out
from ..anchor_format import load_anchor
from ..delta_format import decode_delta
from ..hashing import StateLanes, changes_lanes, schema_of, slice_lanes, structure_digest, zero_lanes
from ..layout import POINTER_KEY
from ..limits import MAX_HEADERS_BYTES, MAX_POINTER_BYTES
from ..patch import TensorPatch
from ..heap import trim_heap_after
from ..read_once import FileMappings, read_once
from .held import HeldState, SubscriberStats
from .manifest import AnchorEntry, DeltaEntry, FileEntry, Manifest
from .targets import check_anchor, check_tied
from .update import Update

SCRATCH_PREFIX = "rlsync-anchor-"
SCRATCH_MAX_AGE_S = 6 * 3600.0  # scratch folders of killed processes are removed after this


class UpdateFetcher:
    """Downloads, decodes and verifies updates against a held state, without writing it.

    Args:
        bucket: The bucket to read.
        held: The state updates must follow (read only).
        stats: Where reads and downloaded bytes are counted.
        workdir: Scratch folder for anchor downloads (default: a temporary folder); scratch
            folders older than ``SCRATCH_MAX_AGE_S`` there (left by killed processes) are removed.
        max_parallel_downloads: Files of one update downloaded at once.
        weights: An engine's own tensors the state is kept in (every anchor must name all of them).
        check_values: Called with each tensor an anchor would load and the new values of each
            patch a delta would write; raising :class:`~rlsync.errors.FormatError` refuses the update.
        max_state_bytes: The model's size before the first state (see :meth:`check_size`).
    """

    def __init__(
        self,
        bucket: Bucket,
        held: HeldState,
        stats: SubscriberStats,
        *,
        workdir: str | Path | None,
        max_parallel_downloads: int,
        weights: Mapping[str, torch.Tensor] | None,
        check_values: Callable[[str, torch.Tensor], None] | None,
        max_state_bytes: int | None,
    ) -> None:
        self.bucket = bucket
        self.held = held
        self.stats = stats
        self.workdir = Path(workdir) if workdir else None
        self.weights = weights
        self.check_values = check_values
        self.max_state_bytes = max_state_bytes
        self._decoded_bytes = 0  # of the last delta decoded: a trim before the next update (rlsync.heap)
        self._decoded_changed = 0  # its changed elements: the next delta's decoded bytes are estimated from them
        self._downloads = concurrent.futures.ThreadPoolExecutor(max(1, max_parallel_downloads), thread_name_prefix="rlsync-get")
        self._stats_lock = threading.Lock()  # the download threads share the counters
        age_out(self.workdir or tempfile.gettempdir(), max_age_s=SCRATCH_MAX_AGE_S, pattern=f"{SCRATCH_PREFIX}*")

    def read_manifest(self) -> Manifest | None:
        """Read the pointer; ``None`` before the first publish.

        Raises:
            SyncError: the pointer is too large or malformed.
            BucketError: the bucket failed.
        """
        try:
            data = self.get(POINTER_KEY, MAX_POINTER_BYTES)
        except ObjectNotFoundError:
            return None
        return Manifest.from_json(data)

    def get(self, key: str, max_bytes: int) -> bytes:
        """Read one object of at most ``max_bytes`` bytes, counted.

        Raises:
            FormatError: the object is larger.
            BucketError: the bucket failed (``ObjectNotFoundError``: no such object).
        """
        try:
            data = self.bucket.get_limited(key, max_bytes)
        except ObjectTooLargeError as exc:
            raise FormatError(str(exc)) from None
        self._count_read(len(data))
        return data

    def check_size(self, kind: str, step: int, nbytes: int) -> None:
        """Refuse, before any download, an update larger than any the model can need: three times
        its bytes (a delta's positions and values, or an anchor) plus headers. Without a state yet,
        ``max_state_bytes`` stands for the model's bytes (without it, only the pointer's own bounds hold).

        Raises:
            FormatError: the pointer promises more bytes than that.
        """
        model = self.held.state or self.weights
        size = sum(t.numel() * t.element_size() for t in model.values()) if model else self.max_state_bytes
        if size is None:
            return
        limit = 3 * size + MAX_HEADERS_BYTES
        if nbytes > limit:
            raise FormatError(f"{kind} {step}: the pointer promised {nbytes:,} bytes, more than the model's {limit:,} bound")

    def delta(self, entry: DeltaEntry) -> Update:
        """Download, decode and verify the delta ``entry`` against the held state.

        Raises:
            SyncError: the delta is too large for the model (:meth:`check_size`), missing, truncated,
                corrupt, or does not make the published state from the held one.
            BucketError: the bucket failed; retry later.
        """
        # the last update's decoded tensors are freed: their pages go first, unless this one reuses them
        trim_heap_after(self._decoded_bytes, needed_bytes=self._decoded_bytes * entry.changed // max(self._decoded_changed, 1))
        self._decoded_bytes = self._decoded_changed = 0
        t0 = time.perf_counter()
        self.check_size("delta", entry.step, entry.nbytes)
        try:
            blobs = list(self._downloads.map(lambda f: self.get(f.key, f.size), entry.files))
        except ObjectNotFoundError as exc:
            raise MissingUpdateError(f"delta {entry.step} is missing: {exc}") from None
        t1 = time.perf_counter()
        patches, old, changed = self._decode(entry, blobs)
        if self.check_values is not None:
            for name, patch in patches.items():
                self.check_values(name, patch.values)
        check_tied(self.held.state, patches)
        lanes = self._updated_lanes(patches, old)
        if lanes.hexdigest() != entry.state_hash:
            raise HashMismatchError(
                f"delta {entry.step}: the state it makes from step {self.held.step} does not match its hash "
                "(a changed value, position, missing element or another base); refused before applying"
            )
        state = self.held.state
        staged = {name: _on_device(patch, state[name].device) for name, patch in patches.items()}
        undo = {name: numpy_to_values(old[name], state[name].dtype).to(state[name].device) for name in patches}
        self._decoded_bytes = sum(p.index.nbytes + p.values.nbytes + undo[n].nbytes for n, p in patches.items())
        self._decoded_changed = changed
        return Update(
            "delta", entry.step, entry.base_step, self.held.state_hash, entry.state_hash, sum(map(len, blobs)),
            patches=staged, old=undo, lanes=lanes, changed=changed, download_s=t1 - t0, decode_s=time.perf_counter() - t1,
        )  # fmt: skip

    def _decode(
        self, entry: DeltaEntry, blobs: list[bytes]
    ) -> tuple[dict[str, TensorPatch], dict[str, np.ndarray], int]:
        """Decode the files of ``entry`` against the held state (the one place a delta is decoded).

        Returns:
            The patches merged across the files, the old bits of the elements they change, and
            how many they change.
        """
        parts: dict[str, list[TensorPatch]] = {}
        old_bits: dict[str, list[np.ndarray]] = {}
        changed = 0
        for file, data in zip(entry.files, blobs):
            if len(data) != file.size:
                raise FormatError(f"{file.key}: {len(data)} bytes, the pointer promised {file.size} (truncated?)")
            delta = decode_delta(data, self.held.state)
            if (delta.step, delta.base_step, delta.state_hash) != (entry.step, entry.base_step, entry.state_hash):
                raise FormatError(f"{file.key}: metadata disagrees with the pointer")
            if delta.base_hash != self.held.state_hash:
                raise HashMismatchError(f"delta {entry.step} is based on another state than step {self.held.step}")
            for name, patch in delta.patches.items():
                parts.setdefault(name, []).append(patch)
                old_bits.setdefault(name, []).append(delta.old_bits[name])
            changed += delta.changed
        patches = {name: _merge_patches(name, p) for name, p in parts.items()}
        old = {name: np.concatenate(p) if len(p) > 1 else p[0] for name, p in old_bits.items()}
        return patches, old, changed

    def _updated_lanes(self, patches: Mapping[str, TensorPatch], old: Mapping[str, np.ndarray]) -> StateLanes:
        """The state hash after ``patches``, from the held one and the changed elements alone."""
        state, lanes = self.held.state, self.held.lanes
        assert lanes is not None
        return lanes.updated(changes_lanes({
            name: (state[name].element_size(), state[name].numel(), patch.index.numpy(), old[name], tensor_bits(patch.values))
            for name, patch in patches.items()
        }))  # fmt: skip

    def anchor(self, entry: AnchorEntry, run_id: str) -> Update:
        """Download the anchor ``entry`` of the run ``run_id``, check it against the model and hash it.

        Raises:
            SyncError: the anchor is missing a file, truncated, corrupt, of another schema than
                the model, or does not match its hash.
            BucketError: the bucket failed; retry later.
        """
        trim_heap_after(self._decoded_bytes)
        self._decoded_bytes = self._decoded_changed = 0
        t0 = time.perf_counter()
        folder = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=self.workdir))
        try:
            files = list(self._downloads.map(lambda f: self._get_anchor_file(entry, f, folder), entry.files))
            t1 = time.perf_counter()
            tensors, metadata = load_anchor(files)  # views of the files: apply copies them into the state
            if metadata.get("step") != str(entry.step) or metadata.get("state_hash") != entry.state_hash:
                raise FormatError(f"anchor {entry.step}: metadata disagrees with the pointer")
            aliases = aliases_from_metadata(metadata, tensors)
            check_anchor(entry.step, tensors, self.held.state, self.weights)
            if self.check_values is not None:
                for name, tensor in tensors.items():
                    self.check_values(name, tensor.reshape(-1))
            lanes = _anchor_lanes(tensors)
            if lanes.hexdigest() != entry.state_hash:
                raise HashMismatchError(f"anchor {entry.step}: content does not match its hash")
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the open views keep the data until apply has copied it
        return Update(
            "anchor", entry.step, None, None, entry.state_hash, entry.nbytes, tensors=tensors, lanes=lanes,
            changed=sum(t.numel() for t in tensors.values()), download_s=t1 - t0, decode_s=time.perf_counter() - t1,
            run_id=run_id, aliases=aliases,
        )  # fmt: skip

    def _get_anchor_file(self, entry: AnchorEntry, file: FileEntry, folder: Path) -> Path:
        path = folder / file.key.rsplit("/", 1)[-1]
        try:
            self.bucket.get_file_limited(file.key, path, file.size)
        except ObjectNotFoundError as exc:
            raise MissingUpdateError(f"anchor {entry.step} is missing a file: {exc}") from None
        except ObjectTooLargeError as exc:
            raise FormatError(str(exc)) from None
        self._count_read(path.stat().st_size)
        if path.stat().st_size != file.size:
            raise FormatError(f"{file.key}: {path.stat().st_size} bytes, the pointer promised {file.size} (truncated?)")
        return path

    def _count_read(self, nbytes: int) -> None:
        with self._stats_lock:
            self.stats.reads += 1
            self.stats.bytes_downloaded += nbytes


def _merge_patches(name: str, parts: list[TensorPatch]) -> TensorPatch:
    """One patch from the patches of consecutive parts (disjoint, increasing positions).

    Raises:
        FormatError: the parts' positions overlap or are out of order.
    """
    if len(parts) == 1:
        return parts[0]
    for before, after in zip(parts, parts[1:]):
        if int(before.index[-1]) >= int(after.index[0]):
            raise FormatError(f"{name}: delta parts overlap or are out of order")
    return TensorPatch(torch.cat([p.index for p in parts]), torch.cat([p.values for p in parts]), parts[0].shape)


def _on_device(patch: TensorPatch, device: torch.device) -> TensorPatch:
    """``patch`` with its positions and values already on ``device`` (so that the pause only scatters)."""
    if device.type == "cpu":
        return patch
    return TensorPatch(patch.index.to(device), patch.values.to(device), patch.shape)


def _anchor_lanes(tensors: Mapping[str, torch.Tensor]) -> StateLanes:
    """The hash of an anchor's tensors in one pass, a slice at a time: the pages of the downloaded files
    leave RSS as they are hashed (:mod:`rlsync.read_once`), so no second copy of the model stays resident
    (nor the pages that loading mapped: a large folio at the start of each tensor)."""
    mappings, lanes = FileMappings(), {}
    for tensor in tensors.values():
        mappings.release(tensor)
    for name, tensor in tensors.items():
        lanes[name] = zero_lanes()
        for start, part in read_once(tensor, mappings):
            lanes[name] += slice_lanes(name, part, start, tensor.numel())
    return StateLanes(structure_digest(schema_of(tensors)), lanes)
