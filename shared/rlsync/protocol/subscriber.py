"""The subscriber: a replica's side of the bucket protocol.

A subscriber bootstraps from the newest anchor, then applies the deltas after
it in order. Work is split in two so that a replica can keep generating while
an update downloads:

* :meth:`Subscriber.fetch` downloads, decodes and validates the next update
  (sizes, format, names, shapes, dtypes, indices, anchor hash) without touching
  the state;
* :meth:`Subscriber.apply` applies it (the only step that needs generation
  paused), checks the base and result hashes, and rolls back on any mismatch.

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
from typing import Mapping

import torch

from ..aliases import aliases_from_metadata, with_aliases
from ..bucket import Bucket
from ..errors import ChainError, FormatError, HashMismatchError, ObjectNotFoundError, ObjectTooLargeError, SyncError
from ..files import age_out
from ..format import FORMAT_VERSION, decode_delta, load_anchor
from ..hashing import combine_digests, tensor_digest
from ..layout import POINTER_KEY
from ..limits import MAX_HEADERS_BYTES, MAX_POINTER_BYTES
from ..patch import TensorPatch, gather, scatter_
from .manifest import AnchorEntry, DeltaEntry, FileEntry, Manifest

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
        tensors: The full state (anchors).
        patches: Changed elements per tensor (deltas).
        changed: Changed elements (deltas) or all elements (anchors).
        download_s: Seconds spent downloading.
        decode_s: Seconds spent decoding and validating.
        digests: Per-tensor digests of an anchor's tensors (already verified).
        hash_version: The format version whose state hash the update's hashes are.
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
    changed: int = 0
    download_s: float = 0.0
    decode_s: float = 0.0
    digests: dict[str, bytes] | None = dataclasses.field(default=None, repr=False)
    hash_version: int = FORMAT_VERSION
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


class Subscriber:
    """Follows a bucket and keeps a bit-exact copy of the published state.

    Args:
        bucket: The bucket to follow (read access is enough).
        device: Where the state's tensors live.
        workdir: Scratch folder for anchor downloads (default: a temporary folder); scratch
            folders older than ``SCRATCH_MAX_AGE_S`` there (left by killed processes) are removed.
        max_parallel_downloads: Files of one update downloaded at once.
        expect_metadata: Pointer metadata entries the chain must carry (e.g. an adapter chain's
            base model hash); a chain whose metadata disagrees is refused before any download.
    """

    def __init__(
        self,
        bucket: Bucket,
        *,
        device: str | torch.device = "cpu",
        workdir: str | Path | None = None,
        max_parallel_downloads: int = DEFAULT_MAX_PARALLEL_DOWNLOADS,
        expect_metadata: Mapping[str, str] | None = None,
    ) -> None:
        self.bucket = bucket
        self.expect_metadata = dict(expect_metadata or {})
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
        self._digests: dict[str, bytes] = {}
        self._hash_version = FORMAT_VERSION
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
        a state yet has only the pointer's own bounds.

        Raises:
            FormatError: the pointer promises more bytes than that.
        """
        if not self.state:
            return
        limit = 3 * sum(t.numel() * t.element_size() for t in self.state.values()) + MAX_HEADERS_BYTES
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
        version = self.manifest.format_version if self.manifest else FORMAT_VERSION
        try:
            self._check_size("delta", entry.step, entry.nbytes)
            blobs = list(self._downloads.map(lambda f: self._get(f.key, f.size), entry.files))
        except ObjectNotFoundError as exc:
            raise self._refuse(ChainError(f"delta {entry.step} is missing: {exc}")) from None
        except FormatError as exc:
            raise self._refuse(exc) from None
        t1 = time.perf_counter()
        patches: dict[str, list[TensorPatch]] = {}
        changed = 0
        try:
            if version != self._hash_version:
                raise ChainError(f"delta {entry.step} is format version {version}, the state was hashed as {self._hash_version}")
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
                changed += delta.changed
            merged = {name: _merge_patches(name, parts) for name, parts in patches.items()}
        except SyncError as exc:
            raise self._refuse(exc) from None
        return Update(
            "delta", entry.step, entry.base_step, self.state_hash, entry.state_hash, sum(map(len, blobs)),
            patches=merged, changed=changed, download_s=t1 - t0, decode_s=time.perf_counter() - t1, hash_version=version,
        )  # fmt: skip

    def _fetch_anchor(self, entry: AnchorEntry) -> Update:
        t0 = time.perf_counter()
        version = self.manifest.format_version if self.manifest else FORMAT_VERSION
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
            tensors, metadata = load_anchor(files)
            if metadata.get("step") != str(entry.step) or metadata.get("state_hash") != entry.state_hash:
                raise FormatError(f"anchor {entry.step}: metadata disagrees with the pointer")
            aliases = aliases_from_metadata(metadata, tensors)
            if self.state and not _same_schema(self.state, tensors):
                raise FormatError(f"anchor {entry.step}: tensor names, shapes or dtypes differ from the model")
            tensors = {n: t.to(self.device) for n, t in tensors.items()}
            digests = {n: tensor_digest(t, version=version) for n, t in tensors.items()}
            if combine_digests(digests) != entry.state_hash:
                raise HashMismatchError(f"anchor {entry.step}: content does not match its hash")
        except SyncError as exc:
            self.stats.refused += 1
            self.stats.last_error = str(exc)
            logger.error("refused anchor %d: %s", entry.step, exc)
            raise
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        update = Update(
            "anchor", entry.step, None, None, entry.state_hash, entry.nbytes, tensors=tensors,
            changed=sum(t.numel() for t in tensors.values()), download_s=t1 - t0, decode_s=time.perf_counter() - t1,
            digests=digests, hash_version=version, run_id=self.manifest.run_id if self.manifest else "", aliases=aliases,
        )  # fmt: skip
        return update

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
        """Apply a fetched update to :attr:`state`.

        Raises:
            ChainError: the update does not follow the current state (replayed,
                out of order); nothing changes. If it names the current step but
                another base state, it is also counted as refused and the
                subscriber waits for the next anchor.
            HashMismatchError: the result does not match its promised hash; the
                state is rolled back and the subscriber waits for the next anchor.
        """
        with self._lock:
            self._apply(update)

    def _apply(self, update: Update) -> None:
        t0 = time.perf_counter()
        if update.kind == "anchor":
            assert update.tensors is not None
            self.state = update.tensors
            self.aliases = update.aliases
            assert update.digests is not None
            self._digests = update.digests
            self._hash_version = update.hash_version
            self.run_id = update.run_id
            self._resync = False
            self.stats.anchors_applied += 1
        else:
            self._apply_delta(update)
            self._resync = False
            self.stats.deltas_applied += 1
        self.step = update.step
        self.state_hash = update.state_hash
        self.stats.last_apply_s = time.perf_counter() - t0
        logger.info("applied %s %d (%d bytes)", update.kind, update.step, update.nbytes)

    def _apply_delta(self, update: Update) -> None:
        assert update.patches is not None
        if update.base_step != self.step:  # replayed or out of order: the state is still good
            raise ChainError(f"delta {update.base_step}->{update.step} does not apply to step {self.step}")
        if update.base_hash != self.state_hash:  # same step, another state: a fork, resync from the next anchor
            raise self._refuse(ChainError(f"delta {update.step} is based on another state than step {self.step}"))
        undo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        digests = dict(self._digests)
        try:
            for name, patch in update.patches.items():
                tensor = self.state[name]
                undo.append((tensor, patch.index, gather(tensor, patch.index)))
                patch.apply_(tensor)
                digests[name] = tensor_digest(tensor, version=self._hash_version)
            if combine_digests(digests) != update.state_hash:
                raise HashMismatchError(f"state after delta {update.step} does not match its hash")
        except BaseException as exc:
            for tensor, index, old in reversed(undo):
                scatter_(tensor, index, old)
            if isinstance(exc, SyncError):
                raise self._refuse(exc) from None
            raise
        self._digests = digests

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


def _same_schema(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[n].shape == b[n].shape and a[n].dtype == b[n].dtype for n in a)
