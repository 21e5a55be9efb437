"""The Hub stand-in's Xet storage: xorbs and shards as plain files in one folder, owned by the stand-in's process
alone (the clients reach it over HTTP: :mod:`testing.hub.cas`), so any number of processes may share it.

A xorb is kept as uploaded (``xorbs/<hash>``), a shard too (``shards/<sha256>.mdb``); an index in memory maps each
xorb to its chunks' byte offsets and each file to its terms (:mod:`testing.hub.xet_formats`), from which a
reconstruction is computed as xet-core's CAS computes it: the terms trimmed to the chunks a byte range needs, with
the byte range of the xorb that holds them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import threading
from pathlib import Path
from typing import Iterator

from testing.hub.xet_formats import Term, XorbChunks, shard_files, xorb_chunks


class RangeNotSatisfiable(ValueError):
    """A byte range that starts at or past the end of the file (HTTP 416)."""


@dataclasses.dataclass(frozen=True)
class Span:
    """Chunks ``[start, end)`` of a xorb and the bytes ``[first_byte, last_byte]`` of the xorb that hold them."""

    start: int
    end: int
    first_byte: int
    last_byte: int


@dataclasses.dataclass(frozen=True)
class Reconstruction:
    """How to rebuild (part of) a file: its terms in order, how many bytes of the first to skip, and per xorb the
    spans to fetch, one per run of overlapping or adjacent terms (as the Hub merges them: hf_xet fetches each span
    once and takes every term that starts where a span starts from it)."""

    offset: int
    terms: tuple[Term, ...]
    fetch: dict[str, tuple[Span, ...]]


class XetStorage:
    """Xorbs, shards and their index under ``root`` (thread-safe).

    Args:
        root: The folder of this storage (created).
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        for folder in ("xorbs", "shards"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._xorbs: dict[str, XorbChunks] = {}
        self._files: dict[str, tuple[Term, ...]] = {}

    def put_xorb(self, xorb_hash: str, data: bytes) -> bool:
        """Store a serialized xorb; whether it was new. A malformed one is a :class:`ValueError`."""
        chunks = xorb_chunks(data)
        path = self.root / "xorbs" / xorb_hash
        with _staged(path, data) as staged, self._lock:
            if xorb_hash in self._xorbs:
                return False  # the first upload of a hash stays (its offsets are the ones indexed)
            os.replace(staged, path)  # whole, and indexed at once: a shard naming it may come next
            self._xorbs[xorb_hash] = chunks
            return True

    def put_shard(self, data: bytes) -> bool:
        """Store a shard and index its files; whether it was new. A malformed shard, or one whose terms name
        xorbs, chunks or lengths this storage does not hold, is a :class:`ValueError`."""
        files = shard_files(data)
        path = self.root / "shards" / f"{hashlib.sha256(data).hexdigest()}.mdb"
        with _staged(path, data) as staged, self._lock:
            for file_hash, terms in files.items():
                for term in terms:
                    self._check(file_hash, term)
            new = not path.exists()
            os.replace(staged, path)
            self._files.update(files)
            return new

    def file_size(self, file_hash: str) -> int | None:
        """The size of file `file_hash`, or None when no shard records it."""
        with self._lock:
            terms = self._files.get(file_hash)
        return None if terms is None else sum(t.length for t in terms)

    def reconstruction(self, file_hash: str, start: int = 0, end: int | None = None) -> Reconstruction | None:
        """The pieces of file `file_hash` that hold its bytes ``[start, end)`` (all of them by default), or None for an
        unknown file; :class:`RangeNotSatisfiable` when `start` is not within the file."""
        with self._lock:
            terms = self._files.get(file_hash)
            if terms is None:
                return None
            size = sum(t.length for t in terms)
            end = size if end is None else min(end, size)
            if start >= size:
                if start == 0:  # an empty file: nothing to fetch
                    return Reconstruction(0, (), {})
                raise RangeNotSatisfiable(f"range starts at {start}, the file has {size} bytes")
            needed, offset, pos = [], 0, 0
            for term in terms:
                if pos >= end:
                    break
                if pos + term.length > start:
                    trimmed, at = self._trim(term, pos, start, end)
                    offset = offset if needed else start - at
                    needed.append(trimmed)
                pos += term.length
            return Reconstruction(offset, tuple(needed), self._spans(needed))

    def read(self, xorb_hash: str, first: int = 0, last: int | None = None) -> bytes | None:
        """Bytes ``[first, last]`` of xorb `xorb_hash` (to its end: `last` None or past it), or None for an unknown
        xorb; :class:`RangeNotSatisfiable` when `first` is not within it."""
        with self._lock:
            if xorb_hash not in self._xorbs:
                return None
        with open(self.root / "xorbs" / xorb_hash, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if first >= size:
                raise RangeNotSatisfiable(f"range starts at {first}, the xorb has {size} bytes")
            f.seek(first)
            return f.read(min(size - 1, size if last is None else last) + 1 - first)

    def _check(self, file_hash: str, term: Term) -> None:
        chunks = self._xorbs.get(term.xorb)
        if chunks is None:
            raise ValueError(f"file {file_hash} names xorb {term.xorb}, which was not uploaded")
        if term.end > len(chunks) or sum(chunks.sizes[term.start : term.end]) != term.length:
            raise ValueError(f"file {file_hash} names chunks [{term.start}, {term.end}) of xorb {term.xorb} "
                             f"({len(chunks)} chunks) with a length that does not match them")  # fmt: skip

    def _trim(self, term: Term, pos: int, start: int, end: int) -> tuple[Term, int]:
        """`term` (whose bytes start at `pos` in the file) cut to the chunks that hold bytes ``[start, end)``, and where
        in the file its first chunk starts."""
        sizes = self._xorbs[term.xorb].sizes
        first, last, at, stop = term.start, term.end, pos, pos + term.length
        while at + sizes[first] <= start:
            at += sizes[first]
            first += 1
        while stop - sizes[last - 1] >= end:
            stop -= sizes[last - 1]
            last -= 1
        return Term(term.xorb, first, last, stop - at), at

    def _spans(self, terms: list[Term]) -> dict[str, tuple[Span, ...]]:
        """Per xorb, the chunk ranges of `terms` merged where they overlap or touch, with their bytes."""
        runs: dict[str, list[list[int]]] = {}
        for term in sorted(terms, key=lambda t: (t.xorb, t.start)):
            merged = runs.setdefault(term.xorb, [])
            if merged and term.start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], term.end)
            else:
                merged.append([term.start, term.end])
        offsets = {xorb: self._xorbs[xorb].offsets for xorb in runs}
        return {xorb: tuple(Span(a, b, offsets[xorb][a], offsets[xorb][b] - 1) for a, b in merged)
                for xorb, merged in runs.items()}  # fmt: skip


@contextlib.contextmanager
def _staged(path: Path, data: bytes) -> Iterator[Path]:
    """`data` written next to `path` under a name of its own (moved into place by the caller, or removed)."""
    staged = path.with_name(f".{path.name}.{threading.get_ident()}.part")
    staged.write_bytes(data)
    try:
        yield staged
    finally:
        staged.unlink(missing_ok=True)
