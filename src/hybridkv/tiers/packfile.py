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
against its checksum when read. Tables are parsed and checked as numpy arrays: a store of a
million pages has a million entries to read before it serves them.
"""

from __future__ import annotations

import os
import struct
import zlib

import numpy as np

from hybridkv.tiers import pagefile

ALIGN = 4096
SUFFIX = ".pack"
ENTRY = np.dtype([("group", "<u2"), ("key_len", "u1"), ("key", "u1", (pagefile.MAX_KEY,)),
                  ("offset", "<u8"), ("length", "<u4"), ("checksum", "<u8")])   # 55 B, unpadded
_TRAILER = struct.Struct("<4sHII")                # magic version count table-crc32
MAGIC = b"HKVT"
VERSION = 2


def aligned(nbytes):
    """``nbytes`` rounded up to whole ALIGN blocks: an int, or a numpy array of them."""
    return -(-nbytes // ALIGN) * ALIGN


def make_table(rows: list[tuple[int, bytes, int, int, int]]) -> np.ndarray:
    """A table (an ``ENTRY`` array) from (group, key, offset, length, xxh3) rows."""
    table = np.zeros(len(rows), ENTRY)
    if not rows:
        return table
    groups, keys, offsets, lengths, checksums = zip(*rows, strict=True)
    key_lens = [len(key) for key in keys]
    if max(key_lens) > pagefile.MAX_KEY:
        raise ValueError(f"key of {max(key_lens)} bytes is longer than {pagefile.MAX_KEY}")
    table["group"], table["key_len"], table["offset"] = groups, key_lens, offsets
    table["length"], table["checksum"] = lengths, checksums
    if min(key_lens) == max(key_lens) > 0:  # the usual case: one key size, one copy
        table["key"][:, : key_lens[0]] = np.frombuffer(b"".join(keys), np.uint8).reshape(len(keys), -1)
    else:
        for i, key in enumerate(keys):
            table["key"][i, : len(key)] = np.frombuffer(key, np.uint8)
    return table


def encode(pages: list[tuple[int, bytes, object]]) -> tuple[list, np.ndarray]:
    """The buffers of a pack holding ``pages`` (group, key, payload), in file order, and its
    table."""
    buffers, rows, offset = [], [], 0
    for group, key, payload in pages:
        data = memoryview(payload).cast("B")
        buffers += [data, bytes(aligned(len(data)) - len(data))]
        rows.append((group, key, offset, len(data), pagefile.checksum(data)))
        offset += aligned(len(data))
    table = make_table(rows)
    buffers.append(encode_table(table))
    return buffers, table


def encode_table(table: np.ndarray) -> bytes:
    """The table and trailer that end a pack."""
    body = table.tobytes()
    return body + _TRAILER.pack(MAGIC, VERSION, len(table), zlib.crc32(body))


def table_bytes(count: int) -> int:
    """Bytes of the table and trailer of a pack of ``count`` pages."""
    return count * ENTRY.itemsize + _TRAILER.size


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


def parse_table(tail: bytes, file_bytes: int) -> np.ndarray:
    """The table of a pack from its last ``table_bytes(count)`` bytes, checked: the crc,
    and every payload aligned, after the one before it and before the table."""
    count = parse_trailer(tail)
    want = table_bytes(count)
    if len(tail) < want:
        raise pagefile.CorruptPage("pack table truncated")
    body = tail[len(tail) - want: len(tail) - _TRAILER.size]
    if zlib.crc32(body) != _TRAILER.unpack(tail[-_TRAILER.size:])[3]:
        raise pagefile.CorruptPage("pack table checksum mismatch")
    table = np.frombuffer(body, ENTRY)
    offsets, lengths = table["offset"], table["length"].astype(np.uint64)
    room = np.uint64(file_bytes - want)                # payloads lie in file order, apart
    past = offsets > room
    bad = past | (lengths > np.where(past, 0, room - offsets)) | (offsets % ALIGN != 0)
    bad |= table["key_len"] > pagefile.MAX_KEY
    bad[1:] |= offsets[1:] < offsets[:-1] + lengths[:-1]
    if bad.any():
        raise pagefile.CorruptPage("pack table entry out of range")
    return table


def read_table(fd: int) -> np.ndarray:
    """The checked table of the pack open at ``fd`` (a buffered descriptor)."""
    size = os.fstat(fd).st_size
    tail = os.pread(fd, min(size, 64 * 1024), max(0, size - 64 * 1024))
    want = table_bytes(parse_trailer(tail))
    if want > len(tail):
        if want > size:
            raise pagefile.CorruptPage("pack table longer than the pack")
        tail = os.pread(fd, want, size - want)
    return parse_table(tail, size)
