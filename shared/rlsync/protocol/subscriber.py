"""The subscriber: a replica's side of the bucket protocol.

A subscriber bootstraps from the newest anchor, then applies the deltas after
it in order. Work is split in two so that a replica can keep generating while
an update downloads:

* :meth:`Subscriber.fetch` downloads, decodes and verifies the next update
  without touching the state: sizes, format, names, shapes, dtypes, indices, and
  the state hash. For a delta that is the current hash updated with the changed
  elements (their old bits gathered from the state, their new bits from the delta:
  O(changed), see :mod:`rlsync.hashing`), compared with the hash the trainer
  published; for an anchor, the hash of its tensors in one pass;
* :meth:`Subscriber.apply` writes it (the only step that needs generation
  paused): a delta's scatter of the changed elements, an anchor's copy. Nothing
  else runs in the pause; a scatter that fails half-way is undone from the old
  values of the changed elements.

The state is either the subscriber's own or, with ``weights``, an engine's own
serving tensors, written in place: then a replica keeps no second copy of the
model. Because a delta is checked against the hash the subscriber maintains, not
against a re-hash of the weights, :meth:`Subscriber.verify_weights` re-hashes the
actual weights in full, off the critical path (a replica runs it in the
background); a mismatch (memory corruption, a writer outside the protocol) is
counted, and the subscriber re-bootstraps from the newest anchor.

A sharded trainer's update has one file per rank: the files download
concurrently (at most ``max_parallel_downloads`` at a time) and are validated
and merged in the pointer's order.

On a missing, truncated or corrupt delta, or a hash mismatch, the subscriber
refuses the update, keeps its last good state, and resynchronises from the next
pointer it can verify: an anchor newer than its state, or, once the pointer has
changed since the refusal (e.g. a replayed old pointer was replaced by the genuine
one), a delta based on exactly its state (base and result hashes checked). Applying
a delta twice is refused.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, MutableMapping

import numpy as np
import torch

from ..aliases import aliases_from_metadata, with_aliases
from ..bucket import Bucket
from ..dtypes import bits_to_numpy, int_view, numpy_to_values
from ..errors import ChainError, FormatError, HashMismatchError, ObjectNotFoundError, ObjectTooLargeError, SyncError
from ..files import age_out
from ..format import check_version, decode_delta, load_anchor
from ..hashing import (
    CHUNK_ELEMENTS,
    StateLanes,
    change_lanes,
    changes_lanes,
    schema_of,
    slice_lanes,
    structure_digest,
    zero_lanes,
)
from ..layout import POINTER_KEY
from ..limits import MAX_HEADERS_BYTES, MAX_POINTER_BYTES
from ..patch import TensorPatch, scatter_
from ..read_once import FileMappings, read_once
from .manifest import AnchorEntry, DeltaEntry, FileEntry, Manifest
from .targets import check_anchor, check_tied, same_schema

DEFAULT_MAX_PARALLEL_DOWNLOADS = 8

logger = logging.getLogger(__name__)

SCRATCH_PREFIX = "rlsync-anchor-"
SCRATCH_MAX_AGE_S = 6 * 3600.0  # scratch folders of killed processes are removed after this


@dataclasses.dataclass
class Update:
    """A downloaded, validated update, ready to apply.

    Attributes:
        kind: ``"anchor"`` or ``"delta"``.
        step: The version after applying it.
        base_step: The version it applies to (``None`` for anchors).
        base_hash: Hash of that version (``None`` for anchors).
        state_hash: Hash of the resulting state.
        nbytes: Bytes downloaded.
        tensors: The full state (anchors; read from the downloaded files, copied into the
            state by :meth:`Subscriber.apply`).
        patches: Changed elements per tensor (deltas), on the device of the tensor they patch.
        old: The values those elements have before the delta (the rollback of a failed scatter).
        lanes: The state hash after the update (verified against ``state_hash``).
        changed: Changed elements (deltas) or all elements (anchors).
        download_s: Seconds spent downloading.
        decode_s: Seconds spent decoding and verifying (hash included).
        run_id: The run the update belongs to (the pointer's ``run_id``).
    """

    kind: str
    step: int
    base_step: int | None
    base_hash: str | None
    state_hash: str
    nbytes: int
    tensors: dict[str, torch.Tensor] | None = None
    patches: dict[str, TensorPatch] | None = None
    old: dict[str, torch.Tensor] | None = dataclasses.field(default=None, repr=False)
    lanes: StateLanes | None = dataclasses.field(default=None, repr=False)
    changed: int = 0
    download_s: float = 0.0
    decode_s: float = 0.0
    run_id: str = ""
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class SubscriberStats:
    """Counters a replica reports in its status object."""

    reads: int = 0
    bytes_downloaded: int = 0
    anchors_applied: int = 0
    deltas_applied: int = 0
    refused: int = 0
    last_error: str = ""
    last_apply_s: float = 0.0
    rehashes: int = 0
    rehash_mismatches: int = 0
    last_rehash_s: float = 0.0
    verified_step: int | None = None
    verified_hash: str = ""


@dataclasses.dataclass
class _Cursor:
    """Where a running :meth:`Subscriber.verify_weights` is: its tensor, the elements before
    ``position`` hashed into ``lanes``. A delta applied meanwhile adds its changes below
    ``position`` to ``lanes``, so the pass ends with the tensor's lanes as they are then."""

    name: str
    position: int
    lanes: np.ndarray


class Subscriber:
    """Follows a bucket and keeps a state (its own, or an engine's weights) bit-exact to the published one.

    Args:
        bucket: The bucket to follow (read access is enough).
        device: Where the state's tensors live.
        workdir: Scratch folder for anchor downloads (default: a temporary folder); scratch
            folders older than ``SCRATCH_MAX_AGE_S`` there (left by killed processes) are removed.
        max_parallel_downloads: Files of one update downloaded at once.
        expect_metadata: Pointer metadata entries the chain must carry (e.g. an adapter chain's
            base model hash); a chain whose metadata disagrees is refused before any download.
        weights: Tensors to keep in sync in place, by name: an engine's own serving weights
            (contiguous; tied names may share one storage). Anchors are copied into them and
            deltas scattered into them, so no second copy of the model exists; every anchor
            must name all of them. Default: the subscriber holds a state of its own on ``device``.
        check_values: Called with each tensor an anchor would load and the new values of each
            patch a delta would write (name, 1-D values), after decoding and before anything is
            applied; raising :class:`~rlsync.errors.FormatError` refuses the update (e.g. an FP8
            chain's scales, :func:`rlsync.fp8.check_fp8_values`).
        max_state_bytes: The largest state accepted before the first one (e.g. the serving
            engine's model size); ``None``: no bound but the pointer's own until then. Updates
            are bounded by the state's size from then on.
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        device: str | torch.device = "cpu",
        workdir: str | Path | None = None,
        max_parallel_downloads: int = DEFAULT_MAX_PARALLEL_DOWNLOADS,
        expect_metadata: Mapping[str, str] | None = None,
        weights: MutableMapping[str, torch.Tensor] | None = None,
        check_values: Callable[[str, torch.Tensor], None] | None = None,
        max_state_bytes: int | None = None,
    ) -> None:
        self.bucket = bucket
        self.expect_metadata = dict(expect_metadata or {})
        self.check_values = check_values
        self.max_state_bytes = max_state_bytes
        self.device = torch.device(device)
        self.workdir = Path(workdir) if workdir else None
        #: The published state: each tensor once, under the name the state hash covers.
        self.state: dict[str, torch.Tensor] = {}
        #: Tied names of the state (alias -> name in :attr:`state`), from the last anchor.
        self.aliases: dict[str, str] = {}
        self.step: int | None = None
        self.state_hash: str | None = None
        self.run_id: str | None = None
        self.stats = SubscriberStats()
        self._weights = weights
        self._lanes: StateLanes | None = None  # the hash of the state, per tensor
        self._generation = 0  # anchors applied: a re-hash pass ends when the state is replaced
        self._cursor: _Cursor | None = None
        self._rebootstrap = False  # the weights differ from the verified state: only an anchor helps
        self._downloads = concurrent.futures.ThreadPoolExecutor(max(1, max_parallel_downloads), thread_name_prefix="rlsync-get")
        self._resync = False
        self._announced_run: str | None = None
        self._refused_at: tuple[int, str] | None = None  # the pointer (step, hash) when an update was refused
        self.manifest: Manifest | None = None
        self._lock = threading.RLock()  # fetch validates against the state that apply changes
        self._stats_lock = threading.Lock()
        age_out(self.workdir or tempfile.gettempdir(), max_age_s=SCRATCH_MAX_AGE_S, pattern=f"{SCRATCH_PREFIX}*")

    # -- reading the bucket -------------------------------------------------

    def _get(self, key: str, max_bytes: int) -> bytes:
        try:
            data = self.bucket.get_limited(key, max_bytes)
        except ObjectTooLargeError as exc:
            raise FormatError(str(exc)) from None
        with self._stats_lock:  # the download threads share the counters
            self.stats.reads += 1
            self.stats.bytes_downloaded += len(data)
        return data

    def read_manifest(self) -> Manifest | None:
        """Read the pointer; ``None`` before the first publish."""
        try:
            data = self._get(POINTER_KEY, MAX_POINTER_BYTES)
        except ObjectNotFoundError:
            return None
        self.manifest = Manifest.from_json(data)
        return self.manifest

    @property
    def lanes(self) -> StateLanes | None:
        """The state's hash, per tensor, as the verified updates made it (``None`` before the first anchor)."""
        return self._lanes

    @property
    def model_state(self) -> dict[str, torch.Tensor]:
        """:attr:`state` with the tied names restored, each bound to the tensor it aliases (for
        ``model.load_state_dict``, which wants every name of a tied model)."""
        return with_aliases(self.state, self.aliases)

    @property
    def needs_resync(self) -> bool:
        """True after a refused update, until a verified update (see the module docstring) is applied."""
        return self._resync

    def fetch(self) -> Update | None:
        """Download and validate the next update toward the newest version.

        Returns:
            The update, or ``None`` when up to date (or, after a refused update,
            when no newer anchor exists yet).

        Raises:
            SyncError: the update is missing, truncated, corrupt or does not
                match; the state is untouched and the subscriber will resync
                from the next anchor.
            BucketError: the bucket failed; retry later.
        """
        with self._lock:
            return self._fetch()

    def _fetch(self) -> Update | None:
        manifest = self.read_manifest()
        if manifest is None:
            return None
        wrong = {k: manifest.metadata.get(k) for k, v in self.expect_metadata.items() if manifest.metadata.get(k) != v}
        if wrong:
            raise self._refuse(ChainError(f"the chain's metadata {wrong} differs from this subscriber's {self.expect_metadata}"))
        try:
            check_version(manifest.format_version, "chain")
        except FormatError as exc:
            raise self._refuse(exc) from None
        if self._rebootstrap:  # the weights are not the verified state: only an anchor can repair them
            return self._fetch_anchor(manifest.anchors[-1])
        if manifest.step == self.step:
            if manifest.state_hash == self.state_hash:
                self._resync = False  # the pointer names exactly this state again
            elif not self._resync:  # same step, other state: a fork
                raise self._refuse(ChainError(f"the pointer names step {self.step} with another state than this one"))
            return None
        if self.step is not None and manifest.step < self.step:
            raise self._refuse(ChainError(f"pointer went back from {self.step} to {manifest.step}"))
        run_changed = self.step is not None and manifest.run_id != self.run_id
        if run_changed and self._announced_run != manifest.run_id:  # one line per new run, not per poll
            self._announced_run = manifest.run_id
            logger.warning(
                "the bucket's run changed from %r (version %d) to %r (version %d): re-bootstrapping from its newest anchor",
                self.run_id, self.step, manifest.run_id, manifest.step,
            )  # fmt: skip
        entry = manifest.delta_after(self.step) if self.step is not None and not run_changed else None
        if entry is not None and not self._resync:
            return self._fetch_delta(entry)
        newer = [a for a in manifest.anchors if self.step is None or a.step > self.step]
        if newer:
            return self._fetch_anchor(newer[-1])
        if not self._resync:
            raise self._refuse(ChainError(f"no retained delta or anchor continues step {self.step}"))
        if entry is not None and self._refused_at != (manifest.step, manifest.state_hash):
            return self._fetch_delta(entry)  # a pointer changed since the refusal: verified by its base and result hashes
        return None

    def _check_size(self, kind: str, step: int, nbytes: int) -> None:
        """Refuse, before any download, an update larger than any the model can need: three times
        its bytes (a delta's positions and values, or an anchor) plus headers. A subscriber without
        a state yet takes ``max_state_bytes`` for the model's bytes (without it, only the pointer's
        own bounds hold).

        Raises:
            FormatError: the pointer promises more bytes than that.
        """
        model = self.state or self._weights
        size = sum(t.numel() * t.element_size() for t in model.values()) if model else self.max_state_bytes
        if size is None:
            return
        limit = 3 * size + MAX_HEADERS_BYTES
        if nbytes > limit:
            raise FormatError(f"{kind} {step}: the pointer promised {nbytes:,} bytes, more than the model's {limit:,} bound")

    def _refuse(self, error: SyncError) -> SyncError:
        self._resync = True
        if self.manifest is not None:
            self._refused_at = (self.manifest.step, self.manifest.state_hash)
        self.stats.refused += 1
        self.stats.last_error = str(error)
        logger.error("refused update: %s; keeping step %s until a pointer it can verify", error, self.step)
        return error

    def _fetch_delta(self, entry: DeltaEntry) -> Update:
        t0 = time.perf_counter()
        try:
            self._check_size("delta", entry.step, entry.nbytes)
            blobs = list(self._downloads.map(lambda f: self._get(f.key, f.size), entry.files))
        except ObjectNotFoundError as exc:
            raise self._refuse(ChainError(f"delta {entry.step} is missing: {exc}")) from None
        except FormatError as exc:
            raise self._refuse(exc) from None
        t1 = time.perf_counter()
        patches: dict[str, list[TensorPatch]] = {}
        old_bits: dict[str, list[np.ndarray]] = {}
        changed = 0
        try:
            for file, data in zip(entry.files, blobs):
                if len(data) != file.size:
                    raise FormatError(f"{file.key}: {len(data)} bytes, the pointer promised {file.size} (truncated?)")
                delta = decode_delta(data, self.state)
                if (delta.step, delta.base_step, delta.state_hash) != (entry.step, entry.base_step, entry.state_hash):
                    raise FormatError(f"{file.key}: metadata disagrees with the pointer")
                if delta.base_hash != self.state_hash:
                    raise HashMismatchError(f"delta {entry.step} is based on another state than step {self.step}")
                for name, patch in delta.patches.items():
                    patches.setdefault(name, []).append(patch)
                    old_bits.setdefault(name, []).append(delta.old_bits[name])
                changed += delta.changed
            merged = {name: _merge_patches(name, parts) for name, parts in patches.items()}
            if self.check_values is not None:
                for name, patch in merged.items():
                    self.check_values(name, patch.values)
            old = {name: np.concatenate(parts) if len(parts) > 1 else parts[0] for name, parts in old_bits.items()}
            check_tied(self.state, merged)
            lanes = self._updated_lanes(merged, old)
            if lanes.hexdigest() != entry.state_hash:
                raise HashMismatchError(
                    f"delta {entry.step}: the state it makes from step {self.step} does not match its hash "
                    "(a changed value, position, missing element or another base); refused before applying"
                )
        except SyncError as exc:
            raise self._refuse(exc) from None
        staged = {name: _on_device(patch, self.state[name].device) for name, patch in merged.items()}
        undo = {name: numpy_to_values(old[name], self.state[name].dtype).to(self.state[name].device) for name in merged}
        return Update(
            "delta", entry.step, entry.base_step, self.state_hash, entry.state_hash, sum(map(len, blobs)),
            patches=staged, old=undo, lanes=lanes, changed=changed, download_s=t1 - t0, decode_s=time.perf_counter() - t1,
        )  # fmt: skip

    def _updated_lanes(self, patches: Mapping[str, TensorPatch], old: Mapping[str, np.ndarray]) -> StateLanes:
        """The state hash after ``patches``, from the current one and the changed elements alone."""
        assert self._lanes is not None
        return self._lanes.updated(changes_lanes({
            name: (self.state[name].element_size(), self.state[name].numel(), patch.index.numpy(), old[name], _bits(patch.values))
            for name, patch in patches.items()
        }))  # fmt: skip

    def _fetch_anchor(self, entry: AnchorEntry) -> Update:
        t0 = time.perf_counter()
        try:
            self._check_size("anchor", entry.step, entry.nbytes)
        except FormatError as exc:
            self.stats.refused += 1
            self.stats.last_error = str(exc)
            raise
        folder = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=self.workdir))
        try:
            files = list(self._downloads.map(lambda f: self._get_anchor_file(entry, f, folder), entry.files))
            t1 = time.perf_counter()
            tensors, metadata = load_anchor(files)  # views of the files: apply copies them into the state
            if metadata.get("step") != str(entry.step) or metadata.get("state_hash") != entry.state_hash:
                raise FormatError(f"anchor {entry.step}: metadata disagrees with the pointer")
            aliases = aliases_from_metadata(metadata, tensors)
            check_anchor(entry.step, tensors, self.state, self._weights)
            if self.check_values is not None:
                for name, tensor in tensors.items():
                    self.check_values(name, tensor.reshape(-1))
            lanes = _anchor_lanes(tensors)
            if lanes.hexdigest() != entry.state_hash:
                raise HashMismatchError(f"anchor {entry.step}: content does not match its hash")
        except SyncError as exc:
            self.stats.refused += 1
            self.stats.last_error = str(exc)
            logger.error("refused anchor %d: %s", entry.step, exc)
            raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # the open views keep the data until apply has copied it
        return Update(
            "anchor", entry.step, None, None, entry.state_hash, entry.nbytes, tensors=tensors, lanes=lanes,
            changed=sum(t.numel() for t in tensors.values()), download_s=t1 - t0, decode_s=time.perf_counter() - t1,
            run_id=self.manifest.run_id if self.manifest else "", aliases=aliases,
        )  # fmt: skip

    def _get_anchor_file(self, entry: AnchorEntry, file: FileEntry, folder: Path) -> Path:
        path = folder / file.key.rsplit("/", 1)[-1]
        try:
            self.bucket.get_file_limited(file.key, path, file.size)
        except ObjectNotFoundError as exc:
            raise ChainError(f"anchor {entry.step} is missing a file: {exc}") from None
        except ObjectTooLargeError as exc:
            raise FormatError(str(exc)) from None
        with self._stats_lock:
            self.stats.reads += 1
            self.stats.bytes_downloaded += path.stat().st_size
        if path.stat().st_size != file.size:
            raise FormatError(f"{file.key}: {path.stat().st_size} bytes, the pointer promised {file.size} (truncated?)")
        return path

    # -- applying -----------------------------------------------------------

    def apply(self, update: Update) -> None:
        """Write a fetched (already verified) update into :attr:`state`: the only step that needs
        generation paused.

        Raises:
            ChainError: the update does not follow the current state (replayed, out of order,
                or the state changed since it was fetched); nothing changes. If it names the
                current step but another base state, it is also counted as refused and the
                subscriber waits for the next anchor.
        """
        with self._lock:
            self._apply(update)

    def _apply(self, update: Update) -> None:
        t0 = time.perf_counter()
        if update.kind == "anchor":
            self._apply_anchor(update)
            self.aliases = update.aliases
        else:
            self._apply_delta(update)
            self._resync = False
            self.stats.deltas_applied += 1
        self.step = update.step
        self.state_hash = update.state_hash
        self._lanes = update.lanes
        self.stats.last_apply_s = time.perf_counter() - t0
        logger.info("applied %s %d (%d bytes)", update.kind, update.step, update.nbytes)

    def _apply_anchor(self, update: Update) -> None:
        """Copy an anchor's tensors into the state: the weights given, the state held when it has
        the same schema, else new tensors on ``device`` (never views of the downloaded files, whose
        pages a later scatter would copy one by one)."""
        assert update.tensors is not None
        self._generation += 1
        self._cursor = None
        if self._weights is not None:
            state = {n: self._weights[n] for n in update.tensors}
        elif self.state and same_schema(self.state, update.tensors):
            state = self.state
        else:
            state = {n: torch.empty(t.shape, dtype=t.dtype, device=self.device) for n, t in update.tensors.items()}
        self.step, self.state_hash, self._lanes = None, None, None  # until every tensor is in
        self.state = state
        mappings = FileMappings()
        with torch.no_grad():
            for name, tensor in update.tensors.items():
                target = state[name].view(-1)  # contiguous: the weights or tensors of its own
                for start, part in read_once(tensor, mappings):  # the file's pages leave RSS as they are copied
                    target[start : start + part.numel()].copy_(part)
        update.tensors = None  # drop the views of the files
        self.run_id = update.run_id
        self._resync = False
        self._rebootstrap = False
        self.stats.anchors_applied += 1

    def _apply_delta(self, update: Update) -> None:
        assert update.patches is not None and update.old is not None
        if self._rebootstrap:
            raise ChainError(f"delta {update.step} not applied: the weights are being resynchronised from an anchor")
        if update.base_step != self.step:  # replayed or out of order: the state is still good
            raise ChainError(f"delta {update.base_step}->{update.step} does not apply to step {self.step}")
        if update.base_hash != self.state_hash:  # same step, another state: a fork, resync from the next anchor
            raise self._refuse(ChainError(f"delta {update.step} is based on another state than step {self.step}"))
        touched: list[str] = []  # restoring old values where the scatter did not happen yet is harmless
        try:
            for name, patch in update.patches.items():
                touched.append(name)
                scatter_(self.state[name], patch.index, patch.values)
        except BaseException:
            for name in reversed(touched):
                scatter_(self.state[name], update.patches[name].index, update.old[name])
            raise
        cursor = self._cursor
        if cursor is not None and cursor.name in update.patches:  # a re-hash pass is inside this tensor
            patch, target = update.patches[cursor.name], self.state[cursor.name]
            below = (patch.index < cursor.position).cpu()
            old, new = (_bits(v[below.to(v.device)]) for v in (update.old[cursor.name], patch.values))
            cursor.lanes += change_lanes(cursor.name, target.element_size(), target.numel(), patch.index.cpu()[below].numpy(), old, new)

    # -- checking the weights -------------------------------------------------

    def verify_weights(self) -> bool | None:
        """Re-hash the state (the engine's actual weights) in full and compare it with the state
        hash the updates were verified against. Meant for a background thread: the state is read a
        chunk at a time, so updates are applied meanwhile (each waits for at most one chunk).

        Returns:
            ``True`` when every tensor matches, ``False`` on a mismatch (counted; the subscriber then
            re-bootstraps from the newest anchor), ``None`` when there is no state yet or an anchor
            replaced it during the pass.
        """
        t0 = time.perf_counter()
        with self._lock:
            if self._lanes is None:
                return None
            generation, names = self._generation, sorted(self.state)
        for name in names:
            cursor = _Cursor(name, 0, zero_lanes())
            numel = self.state[name].numel()
            while True:
                with self._lock:
                    if generation != self._generation:
                        return None
                    if cursor.position >= numel:
                        break
                    self._cursor = cursor
                    flat = self.state[name].detach().reshape(-1)
                    end = min(numel, cursor.position + CHUNK_ELEMENTS)
                    cursor.lanes += slice_lanes(name, flat[cursor.position : end], cursor.position, numel)
                    cursor.position = end
            with self._lock:
                self._cursor = None
                if generation != self._generation:
                    return None
                assert self._lanes is not None
                if not np.array_equal(cursor.lanes, self._lanes.tensors[name]):
                    self._weights_differ(name)
                    return False
        with self._lock:
            self.stats.rehashes += 1
            self.stats.last_rehash_s = time.perf_counter() - t0
            self.stats.verified_step, self.stats.verified_hash = self.step, self.state_hash or ""
        return True

    def _weights_differ(self, name: str) -> None:
        self.stats.rehash_mismatches += 1
        self.stats.refused += 1
        self.stats.last_error = f"the weights differ from the verified state of step {self.step} (first in {name!r})"
        self._rebootstrap = self._resync = True
        logger.error("%s: re-bootstrapping from the newest anchor", self.stats.last_error)

    def sync(self, max_updates: int | None = None) -> list[Update]:
        """Fetch and apply updates until up to date.

        Returns:
            The applied updates.
        """
        applied = []
        while max_updates is None or len(applied) < max_updates:
            update = self.fetch()
            if update is None:
                break
            self.apply(update)
            applied.append(update)
        return applied


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


def _on_device(patch: TensorPatch, device: torch.device) -> TensorPatch:
    """``patch`` with its positions and values already on ``device`` (so that the pause only scatters)."""
    if device.type == "cpu":
        return patch
    return TensorPatch(patch.index.to(device), patch.values.to(device), patch.shape)


def _bits(values: torch.Tensor) -> np.ndarray:
    return bits_to_numpy(int_view(values))
