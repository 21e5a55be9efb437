"""The file sizes recorded in the shards of xet-core's ``local://`` CAS, for the Hub stand-in's batch commits
(:mod:`testing.hub.server`): a commit names a file by its Xet hash, and the stand-in answers with its size."""

from __future__ import annotations

import struct
from pathlib import Path


def xet_file_size(storage: Path, xet_hash: str) -> int | None:
    """The size of the file `xet_hash` according to the shards in the ``local://`` CAS, or None.

    A shard (xet-core's MDB format, version 2) starts with a 48-byte header, then one record per
    file: a 48-byte header (file hash, flags, entry count, padding), 48-byte segment entries whose
    unpacked byte counts add up to the file size, then optional verification entries (flag bit 31,
    one per segment) and a metadata extension (flag bit 30); a hash of all 0xff bytes ends the list.
    """
    for shard in (storage / "xet" / "xorbs" / "shards").glob("*.mdb"):
        data = shard.read_bytes()
        pos = 48
        while pos + 48 <= len(data):
            raw = data[pos : pos + 32]
            if raw == b"\xff" * 32:
                break
            flags, entries = struct.unpack_from("<II", data, pos + 32)
            size = sum(struct.unpack_from("<I", data, pos + 48 + 48 * i + 36)[0] for i in range(entries))
            if _hash_hex(raw) == xet_hash:
                return size
            pos += 48 * (1 + entries * (2 if flags & 1 << 31 else 1) + (1 if flags & 1 << 30 else 0))
    return None


def _hash_hex(raw: bytes) -> str:
    """xet-core's hex form of a 32-byte hash: four little-endian u64 words, each as 16 hex digits."""
    return "".join(f"{word:016x}" for word in struct.unpack("<4Q", raw))
