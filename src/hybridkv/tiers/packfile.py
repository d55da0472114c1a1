"""Pack files: many small pages in one file, so a restore reads megabytes per request.

A disk serves a 32 KiB read in about the time it serves a 1 MiB one, so one file per small
page caps a restore at a fraction of the disk's bandwidth. A pack holds the pages one write
batch produced, payloads only, each starting on a 4 KiB boundary, and ends with a table
describing them and a trailer::

    payload 0 (+ padding) | payload 1 | ... | table | trailer

A table entry holds a page's group, key, offset, length and xxh3-64; the trailer the page
count, the table's crc32 and a magic. The table is read once, when a store opens (the index
keeps offsets and checksums), so a read moves payload bytes only: with ``O_DIRECT``, from
the disk straight into the RAM slots, adjacent pages in one request. A pack is written under
a temp name and renamed into place, so it is whole or absent; every page is still checked
against its checksum when read.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import NamedTuple

from hybridkv.tiers import pagefile

ALIGN = 4096
SUFFIX = ".pack"
_ENTRY = struct.Struct("<HB32sQIQ")               # group keylen key offset length xxh3
_TRAILER = struct.Struct("<4sHII")                # magic version count table-crc32
MAGIC = b"HKVT"
VERSION = 2


class PackEntry(NamedTuple):
    group: int
    key: bytes
    offset: int           # of the payload, a multiple of ALIGN
    length: int
    checksum: int         # xxh3-64 of the payload


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def encode(pages: list[tuple[int, bytes, object]]) -> tuple[list, list[PackEntry]]:
    """The buffers of a pack holding ``pages`` (group, key, payload), in file order, and the
    entries of its table."""
    buffers, entries, offset = [], [], 0
    for group, key, payload in pages:
        if len(key) > pagefile.MAX_KEY:
            raise ValueError(f"key of {len(key)} bytes is longer than {pagefile.MAX_KEY}")
        data = memoryview(payload).cast("B")
        buffers += [data, bytes(aligned(len(data)) - len(data))]
        entries.append(PackEntry(group, key, offset, len(data), pagefile.checksum(data)))
        offset += aligned(len(data))
    buffers.append(encode_table(entries))
    return buffers, entries


def encode_table(entries: list[PackEntry]) -> bytes:
    """The table and trailer that end a pack holding ``entries``."""
    table = b"".join(_ENTRY.pack(e.group, len(e.key), e.key, e.offset, e.length, e.checksum) for e in entries)
    return table + _TRAILER.pack(MAGIC, VERSION, len(entries), zlib.crc32(table))


def table_bytes(count: int) -> int:
    """Bytes of the table and trailer of a pack of ``count`` pages."""
    return count * _ENTRY.size + _TRAILER.size


def parse_trailer(tail: bytes) -> int:
    """The page count from the last bytes of a pack; CorruptPage if they are not a trailer."""
    if len(tail) < _TRAILER.size:
        raise pagefile.CorruptPage("pack shorter than its trailer")
    magic, version, count, _ = _TRAILER.unpack(tail[-_TRAILER.size:])
    if magic != MAGIC:
        raise pagefile.CorruptPage("not a pack (bad trailer magic)")
    if version != VERSION:
        raise pagefile.CorruptPage(f"pack format version {version}, expected {VERSION}")
    return count


def parse_table(tail: bytes, file_bytes: int) -> list[PackEntry]:
    """The entries of a pack from its last ``table_bytes(count)`` bytes, checked: the crc,
    and every payload aligned, after the one before it and before the table."""
    count = parse_trailer(tail)
    want = table_bytes(count)
    if len(tail) < want:
        raise pagefile.CorruptPage("pack table truncated")
    table = tail[len(tail) - want: len(tail) - _TRAILER.size]
    if zlib.crc32(table) != _TRAILER.unpack(tail[-_TRAILER.size:])[3]:
        raise pagefile.CorruptPage("pack table checksum mismatch")
    free, payloads_end = 0, file_bytes - want      # payloads lie in file order, apart
    entries = []
    for group, key_len, key, offset, length, checksum in _ENTRY.iter_unpack(table):
        if offset % ALIGN or offset < free or offset + length > payloads_end or key_len > pagefile.MAX_KEY:
            raise pagefile.CorruptPage("pack table entry out of range")
        free = offset + length
        entries.append(PackEntry(group, key[:key_len], offset, length, checksum))
    return entries


def read_table(fd: int) -> list[PackEntry]:
    """The checked table of the pack open at ``fd`` (a buffered descriptor)."""
    size = os.fstat(fd).st_size
    tail = os.pread(fd, min(size, 64 * 1024), max(0, size - 64 * 1024))
    want = table_bytes(parse_trailer(tail))
    if want > len(tail):
        if want > size:
            raise pagefile.CorruptPage("pack table longer than the pack")
        tail = os.pread(fd, want, size - want)
    return parse_table(tail, size)
