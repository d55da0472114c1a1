"""Pack files: many small pages in one file, so a restore reads megabytes per request.

A disk serves a 32 KiB read in about the time it serves a 1 MiB one, so one file per small
page caps a restore at a fraction of the disk's bandwidth. A pack holds the pages one write
batch produced, each a self-checking page (``pagefile``) starting on a 4 KiB boundary, and
ends with a table of its pages and a trailer::

    page 0 (header + payload + padding) | page 1 | ... | table | trailer

The table lists (group, key, offset) of every page; the trailer holds the page count, the
table's crc32 and a magic. A pack is written under a temp name and renamed into place, so it
is whole or absent; its pages still verify one by one when read.
"""

from __future__ import annotations

import os
import struct
import zlib

from hybridkv.tiers import pagefile

ALIGN = 4096
SUFFIX = ".pack"
_ENTRY = struct.Struct("<HB32sQ")                 # group keylen key offset
_TRAILER = struct.Struct("<4sHII")                # magic version count table-crc32
MAGIC = b"HKVT"
VERSION = 1
PackEntry = tuple[int, bytes, int]                # (group, key, offset of the page's header)


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def page_span(payload_bytes: int) -> int:
    """Bytes a page takes in a pack, padding included."""
    return aligned(pagefile.HEADER_BYTES + payload_bytes)


def encode(pages: list[tuple[int, bytes, object]]) -> tuple[list, list[PackEntry]]:
    """The buffers of a pack holding ``pages`` (group, key, payload), in file order, and the
    entries of its table."""
    buffers, entries, offset = [], [], 0
    for group, key, payload in pages:
        data = memoryview(payload).cast("B")
        header = pagefile.make_header(group, key, data)
        span = page_span(len(data))
        buffers += [header, data, bytes(span - len(header) - len(data))]
        entries.append((group, key, offset))
        offset += span
    buffers.append(encode_table(entries))
    return buffers, entries


def encode_table(entries: list[PackEntry]) -> bytes:
    """The table and trailer that end a pack holding ``entries``."""
    table = b"".join(_ENTRY.pack(g, len(k), k, o) for g, k, o in entries)
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
    """The entries of a pack from its last ``table_bytes(count)`` bytes, checked."""
    count = parse_trailer(tail)
    want = table_bytes(count)
    if len(tail) < want:
        raise pagefile.CorruptPage("pack table truncated")
    table = tail[len(tail) - want: len(tail) - _TRAILER.size]
    if zlib.crc32(table) != _TRAILER.unpack(tail[-_TRAILER.size:])[3]:
        raise pagefile.CorruptPage("pack table checksum mismatch")
    entries = []
    for group, key_len, key, offset in _ENTRY.iter_unpack(table):
        if offset % ALIGN or offset >= file_bytes - want or key_len > pagefile.MAX_KEY:
            raise pagefile.CorruptPage("pack table entry out of range")
        entries.append((group, key[:key_len], offset))
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
