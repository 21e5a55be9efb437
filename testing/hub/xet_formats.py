"""The two binary formats of Xet storage the Hub stand-in reads (:mod:`testing.hub.xet_storage`): the file
records of a shard (which xorb chunks make up a file) and the chunk headers of a xorb (where each chunk's bytes lie).

Both arrive from clients, so both are parsed with every length checked: a malformed one is a :class:`ValueError`.

A shard (xet-core's MDB format, version 2) starts with a 48-byte header (a 32-byte tag, the version, the footer
size), then one record per file: a 48-byte header (file hash, flags, entry count, padding), one 48-byte entry per
term (xorb hash, flags, unpacked byte count, first chunk index, end chunk index), then optional verification entries
(flag bit 31, one per term) and a metadata extension (flag bit 30); a hash of all 0xff bytes ends the list.

A xorb is a run of chunks, each an 8-byte header (version 0, compressed length: 3 bytes, compression scheme,
uncompressed length: 3 bytes, little-endian) and its compressed bytes, then a footer that starts ``XETBLOB``.
"""

from __future__ import annotations

import dataclasses
import struct

#: The tag every shard starts with (``MDB_SHARD_HEADER_TAG`` in xet-core).
SHARD_TAG = b"HFRepoMetaData\x00" + bytes([85, 105, 103, 69, 106, 123, 129, 87, 131, 165, 189, 217, 92, 205, 209,
                                            74, 169])  # fmt: skip
#: Size of a shard's header and of each of its file-section entries.
ENTRY = 48
#: The hash that ends a shard's file section.
BOOKEND = b"\xff" * 32
#: xet-core's largest chunk (``MAX_CHUNK_SIZE``: twice the 64 KiB target).
MAX_CHUNK_BYTES = 128 << 10
#: Compression schemes a chunk header may name (none, LZ4, byte-grouped LZ4).
SCHEMES = (0, 1, 2)
#: How a xorb's footer starts.
FOOTER_IDENT = b"XETBLOB"
_VERIFIED = 1 << 31
_METADATA_EXT = 1 << 30


@dataclasses.dataclass(frozen=True)
class Term:
    """One term of a file: the chunks ``[start, end)`` of xorb ``xorb``, ``length`` bytes once unpacked."""

    xorb: str
    start: int
    end: int
    length: int


@dataclasses.dataclass(frozen=True)
class XorbChunks:
    """Where a xorb's chunks lie: chunk ``i`` is the bytes ``[offsets[i], offsets[i + 1])`` of the xorb (its header
    included) and unpacks to ``sizes[i]`` bytes."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.sizes)


def shard_files(data: bytes) -> dict[str, tuple[Term, ...]]:
    """The files a shard records, by Xet hash, each as its terms in order."""
    if len(data) < ENTRY or data[:32] != SHARD_TAG:
        raise ValueError("not a shard: bad header tag")
    files: dict[str, tuple[Term, ...]] = {}
    pos = ENTRY
    while True:
        if pos + ENTRY > len(data):
            raise ValueError("shard file section is truncated")
        raw = data[pos : pos + 32]
        if raw == BOOKEND:
            return files
        flags, count = struct.unpack_from("<II", data, pos + 32)
        following = count * (2 if flags & _VERIFIED else 1) + (1 if flags & _METADATA_EXT else 0)
        if pos + ENTRY * (1 + following) > len(data):
            raise ValueError("shard file record is truncated")
        terms = []
        for i in range(count):
            at = pos + ENTRY * (1 + i)
            length, start, end = struct.unpack_from("<III", data, at + 36)
            if not start < end:
                raise ValueError(f"shard term with an empty chunk range [{start}, {end})")
            terms.append(Term(hash_hex(data[at : at + 32]), start, end, length))
        files[hash_hex(raw)] = tuple(terms)
        pos += ENTRY * (1 + following)


def xorb_chunks(data: bytes) -> XorbChunks:
    """The chunks of a serialized xorb (its footer, if any, is not a chunk)."""
    offsets, sizes = [0], []
    pos = 0
    while pos < len(data) and data[pos : pos + len(FOOTER_IDENT)] != FOOTER_IDENT:
        if pos + 8 > len(data):
            raise ValueError("xorb chunk header is truncated")
        version, scheme = data[pos], data[pos + 4]
        packed = int.from_bytes(data[pos + 1 : pos + 4], "little")
        size = int.from_bytes(data[pos + 5 : pos + 8], "little")
        if version != 0 or scheme not in SCHEMES or size > MAX_CHUNK_BYTES or packed > 2 * MAX_CHUNK_BYTES:
            raise ValueError(f"bad xorb chunk header at byte {pos}")
        pos += 8 + packed
        if pos > len(data):
            raise ValueError("xorb chunk is truncated")
        offsets.append(pos)
        sizes.append(size)
    if not sizes:
        raise ValueError("xorb without chunks")
    return XorbChunks(tuple(offsets), tuple(sizes))


def hash_hex(raw: bytes) -> str:
    """xet-core's hex form of a 32-byte hash: four little-endian u64 words, each as 16 hex digits."""
    return "".join(f"{word:016x}" for word in struct.unpack("<4Q", raw))
