"""The pointer ("weights ready") object.

The pointer is a small JSON manifest of every retained version: the anchors
(step, files, sizes, hash) and the deltas (step, base step, file, size, result
hash), plus the newest step and its hash; the keys it names are :mod:`rlsync.layout`'s. Readers never need a listing (which
object stores may serve stale) and never see a pointer to an incomplete file.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping

from ..bucket import validate_key
from ..errors import FormatError, InvalidKeyError
from ..anchor_format import INDEX_FILE, SINGLE_FILE, shard_names
from ..format import FORMAT_NAME, FORMAT_VERSION
from ..jsonlimits import loads_bounded
from ..layout import (
    ANCHOR_FILE,
    DELTA_FILE,
)
from ..limits import MAX_POINTER_BYTES

#: Pointer versions whose layout parses (the same in all): a reader then refuses a chain whose
#: hashes it cannot check (:func:`rlsync.format.check_version`), and a new run can replace it.
POINTER_FORMAT_VERSIONS = (1, 2, FORMAT_VERSION)
MAX_METADATA_ENTRIES = 32
MAX_METADATA_VALUE_CHARS = 4096


@dataclasses.dataclass(frozen=True)
class FileEntry:
    """One object of a published version."""

    key: str
    size: int


@dataclasses.dataclass(frozen=True)
class AnchorEntry:
    """A published anchor."""

    step: int
    state_hash: str
    files: tuple[FileEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclasses.dataclass(frozen=True)
class DeltaEntry:
    """A published delta from ``base_step`` to ``step``.

    A sharded trainer's delta has one file per rank: ``file`` is part 1 and
    ``parts`` the others, in rank order; each is a complete delta file holding
    the changes of one rank's slices in global coordinates.
    """

    step: int
    base_step: int
    state_hash: str
    file: FileEntry
    changed: int = 0
    total: int = 0
    parts: tuple[FileEntry, ...] = ()

    @property
    def files(self) -> tuple[FileEntry, ...]:
        """Every file of the delta, in apply order."""
        return (self.file, *self.parts)

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclasses.dataclass(frozen=True)
class CheckpointPin:
    """The weights hash of a training checkpoint, kept in the pointer so that a restarting trainer
    resumes only from checkpoints this chain's writer saved (see :mod:`rlsync.trl.checkpoints`)."""

    step: int
    weights_hash: str


MAX_CHECKPOINT_PINS = 16


@dataclasses.dataclass(frozen=True)
class Manifest:
    """The pointer object: every retained version, newest last."""

    step: int
    state_hash: str
    anchors: tuple[AnchorEntry, ...]
    deltas: tuple[DeltaEntry, ...]
    run_id: str = ""
    format_version: int = FORMAT_VERSION
    checkpoints: tuple[CheckpointPin, ...] = ()
    #: What the chain's versions apply to, set at its first publish and kept (e.g. an adapter chain's
    #: base model name and hash, see :mod:`rlsync.adapters`); empty for a weights chain.
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def newest_anchor(self) -> AnchorEntry:
        return self.anchors[-1]

    def delta_after(self, step: int) -> DeltaEntry | None:
        """The delta whose base is ``step``, if retained."""
        for d in self.deltas:
            if d.base_step == step:
                return d
        return None

    def deltas_since(self, step: int) -> list[DeltaEntry]:
        """Deltas with a step above ``step``, in order."""
        return [d for d in self.deltas if d.step > step]

    def catchup_bytes(self) -> int:
        """What a newly joining replica downloads: the newest anchor plus the deltas after it."""
        anchor = self.newest_anchor
        return anchor.nbytes + sum(d.nbytes for d in self.deltas_since(anchor.step))

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "run_id": self.run_id,
            "step": self.step,
            "state_hash": self.state_hash,
            "anchors": [dataclasses.asdict(a) for a in self.anchors],
            "deltas": [dataclasses.asdict(d) for d in self.deltas],
        }
        if self.checkpoints:
            doc["checkpoints"] = [dataclasses.asdict(p) for p in self.checkpoints]
        if self.metadata:
            doc["metadata"] = dict(self.metadata)
        return json.dumps(doc, indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        """Parse and check a pointer object.

        Raises:
            FormatError: invalid JSON, unknown version, unsafe keys, inconsistent steps.
        """
        doc = loads_bounded(data, what="pointer object", max_bytes=MAX_POINTER_BYTES)
        try:
            if doc.get("format") != FORMAT_NAME:
                raise FormatError(f"pointer is not an {FORMAT_NAME} pointer")
            version = doc.get("format_version")
            if type(version) is not int or version not in POINTER_FORMAT_VERSIONS:
                raise FormatError(f"unsupported pointer format version {doc.get('format_version')!r}")
            anchors = tuple(
                AnchorEntry(
                    step=_int(a["step"]),
                    state_hash=_str(a["state_hash"]),
                    files=tuple(_file(f) for f in a["files"]),
                )
                for a in doc["anchors"]
            )
            deltas = tuple(
                DeltaEntry(
                    step=_int(d["step"]),
                    base_step=_int(d["base_step"]),
                    state_hash=_str(d["state_hash"]),
                    file=_file(d["file"]),
                    changed=_int(d.get("changed", 0)),
                    total=_int(d.get("total", 0)),
                    parts=tuple(_file(f) for f in d.get("parts", ())),
                )
                for d in doc["deltas"]
            )
            manifest = cls(
                step=_int(doc["step"]),
                state_hash=_str(doc["state_hash"]),
                anchors=anchors,
                deltas=deltas,
                run_id=_str(doc.get("run_id", "")),
                format_version=version,
                checkpoints=tuple(
                    CheckpointPin(_int(p["step"]), _str(p["weights_hash"])) for p in doc.get("checkpoints", ())
                ),
                metadata=_metadata(doc.get("metadata", {})),
            )
        except FormatError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, InvalidKeyError) as exc:
            raise FormatError(f"malformed pointer object: {exc}") from None
        manifest.check()
        return manifest

    def check(self) -> None:
        """Check internal consistency: steps increase, the newest version is described."""
        if not self.anchors:
            raise FormatError("pointer lists no anchor")
        if not all(a.files for a in self.anchors):
            raise FormatError("pointer lists an anchor without files")
        steps = [a.step for a in self.anchors]
        if steps != sorted(set(steps)) or [d.step for d in self.deltas] != sorted({d.step for d in self.deltas}):
            raise FormatError("pointer steps are not strictly increasing")
        for d in self.deltas:
            if d.base_step >= d.step:
                raise FormatError(f"delta {d.step} has base step {d.base_step}")
        newest = max([a.step for a in self.anchors] + [d.step for d in self.deltas])
        if newest != self.step:
            raise FormatError(f"pointer step {self.step} is not its newest version {newest}")
        for a in self.anchors:
            _check_anchor_keys(a)
        for d in self.deltas:
            _check_delta_keys(d)
        pinned = [p.step for p in self.checkpoints]
        if len(pinned) > MAX_CHECKPOINT_PINS or pinned != sorted(set(pinned)):
            raise FormatError(f"pointer pins more than {MAX_CHECKPOINT_PINS} checkpoints, or not in increasing steps")
        keys = [f.key for a in self.anchors for f in a.files] + [f.key for d in self.deltas for f in d.files]
        if len(keys) != len(set(keys)):
            raise FormatError("pointer names one object twice")

    def epochs(self) -> set[int]:
        """The run-lock epochs of the trainers that wrote the retained files."""
        return {key_epoch(f.key) for a in self.anchors for f in a.files} | {
            key_epoch(f.key) for d in self.deltas for f in d.files
        }


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FormatError(f"expected a non-negative integer, got {value!r}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 256:
        raise FormatError(f"expected a short string, got {type(value).__name__}")
    return value


def _metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or len(value) > MAX_METADATA_ENTRIES:
        raise FormatError(f"pointer metadata must be an object of at most {MAX_METADATA_ENTRIES} entries")
    for key, item in value.items():
        _str(key)
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE_CHARS:
            raise FormatError(f"pointer metadata {key!r}: expected a string of at most {MAX_METADATA_VALUE_CHARS} characters")
    return dict(value)


def _file(value: Any) -> FileEntry:
    return FileEntry(key=validate_key(value["key"]), size=_int(value["size"]))


def key_epoch(key: str) -> int:
    """The run-lock epoch in a key this protocol derives (``anchors/<step>-e<epoch>/...``, ``deltas/...``;
    0 for format version 1's keys, which had none).

    Raises:
        FormatError: ``key`` is not such a key.
    """
    match = ANCHOR_FILE.fullmatch(key) or DELTA_FILE.fullmatch(key)
    if match is None:
        raise FormatError(f"{key!r} is not an anchor or delta key")
    return int(match.group(2) or 0)


def _matches(pattern: re.Pattern, step: int, files: tuple[FileEntry, ...], what: str) -> list[re.Match]:
    """Match every file key of one version; all must be derived for ``step`` under one epoch."""
    matches = []
    for f in files:
        match = pattern.fullmatch(f.key)
        if match is None:
            raise FormatError(f"{what} {step}: {f.key!r} is not a key this protocol writes")
        matches.append(match)
    written, epoch = matches[0].group(1), matches[0].group(2)
    canonical = (f"{step:012d}", epoch if epoch is None else f"{int(epoch):04d}")
    if {(m.group(1), m.group(2)) for m in matches} != {(written, epoch)} or (written, epoch) != canonical:
        raise FormatError(f"{what} {step}: files of another step or epoch")
    return matches


def _check_anchor_keys(anchor: AnchorEntry) -> None:
    """Every file of an anchor is under ``anchor_folder(step, epoch)``, named as
    :func:`~rlsync.anchor_format.write_anchor` names them: one ``model.safetensors``, or shards
    ``1..n`` of ``n`` (``n`` at least 2) in order with an optional index last."""
    names = [m.group(3) for m in _matches(ANCHOR_FILE, anchor.step, anchor.files, "anchor")]
    if names == [SINGLE_FILE]:
        return
    shards = names[:-1] if names[-1] == INDEX_FILE else names
    if len(shards) < 2 or shards != shard_names(len(shards)):
        raise FormatError(f"anchor {anchor.step}: its files are not one model file, or shards 1..n of n in order")


def _check_delta_keys(delta: DeltaEntry) -> None:
    """A delta is ``delta_key(step, epoch)``, or parts ``1..n`` of ``n`` in order (``delta_part_key``)."""
    matches = _matches(DELTA_FILE, delta.step, delta.files, "delta")
    count = len(matches)
    parts = [(m.group(3), m.group(4)) for m in matches]
    if parts != [(None, None)] and parts != [(f"{i + 1:05d}", f"{count:05d}") for i in range(count)]:
        raise FormatError(f"delta {delta.step}: its files are not one delta file, or parts 1..n of n in order")
