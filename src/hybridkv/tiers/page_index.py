"""Where each packed page lies, in a few dozen bytes a page: a hash table in numpy arrays.

A store of a million packed pages indexed in Python dicts and sets costs ~250 B a page
(a bytes key, a tuple, an int, set and dict slots). Here a page is one slot of three
arrays: its key's 16-byte fingerprint (two uint64) and its location (pack number << 32 |
entry), 24 B at a load of 0.35-0.7. Lookups and inserts take whole batches - a request's
keys, a pack's table, every table of a store at start-up - and run at numpy speed
(open addressing, linear probing, all keys of a batch probing in step). The probe runs in C
where that is built (tiers/_page_probe.c): a lookup then keeps the GIL, so it does not wait
behind the tier's reader threads.

A fingerprint is the key itself when the key has 16 bytes (block keys are 16-byte
blake2b digests); any other key is hashed to 16 bytes with blake2b, so two keys share a
fingerprint only if blake2b collides. Each group has its own table.
"""

from __future__ import annotations

import hashlib

import numpy as np

try:    # the probe in C (tiers/_page_probe.c): a lookup beside busy threads keeps the GIL
    from hybridkv.tiers._page_probe import probe as compiled_probe
except ImportError:     # not built (no C compiler): the numpy probe below
    compiled_probe = None

FINGERPRINT_BYTES = 16
EMPTY = -1                      # a slot never used: a probe for a missing key stops here
REMOVED = -2                    # a slot emptied by a removal: probes continue past it
MAX_LOAD = 0.7                  # used slots (live and removed) per slot before a rebuild
WINDOW = 8                      # slots a probe checks per round (most keys stop in the first)
_STEPS = np.arange(WINDOW)
_MIX = np.uint64(0xC2B2AE3D27D4EB4F)          # folds the fingerprint's first half into the second
_MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)   # Fibonacci hashing: spreads sequential keys


def fingerprints(keys: list[bytes]) -> np.ndarray:
    """The (n, 2) uint64 fingerprints of ``keys``."""
    if keys and set(map(len, keys)) == {FINGERPRINT_BYTES}:
        return np.frombuffer(b"".join(keys), "<u8").reshape(len(keys), 2)
    return np.frombuffer(b"".join(_fingerprint(k) for k in keys), "<u8").reshape(len(keys), 2)


def table_fingerprints(keys: np.ndarray, key_lens: np.ndarray) -> np.ndarray:
    """Fingerprints of a pack table's ``key`` and ``key_len`` columns (keys zero-padded to
    their field): 16-byte keys at numpy speed, others one by one."""
    out = np.ascontiguousarray(keys[:, :FINGERPRINT_BYTES]).view("<u8").copy()
    for i in np.flatnonzero(key_lens != FINGERPRINT_BYTES).tolist():
        out[i] = np.frombuffer(_fingerprint(keys[i, : key_lens[i]].tobytes()), "<u8")
    return out


def _fingerprint(key: bytes) -> bytes:
    if len(key) == FINGERPRINT_BYTES:
        return key
    return hashlib.blake2b(len(key).to_bytes(1, "big") + key, digest_size=FINGERPRINT_BYTES).digest()


class PageTable:
    """Fingerprint -> location (a non-negative int64) for one group's packed pages."""

    def __init__(self, capacity: int = 1024):
        self._allocate(capacity)
        self.live = 0

    def _allocate(self, capacity: int) -> None:
        bits = max(4, (capacity - 1).bit_length())
        self._bits = bits
        self._shift = np.uint64(64 - bits)
        self._mask = (1 << bits) - 1
        self._hi = np.zeros(1 << bits, np.uint64)
        self._lo = np.zeros(1 << bits, np.uint64)
        self._loc = np.full(1 << bits, EMPTY, np.int64)
        self._used = 0                              # live and removed slots

    def __len__(self) -> int:
        return self.live

    @property
    def nbytes(self) -> int:
        return self._hi.nbytes + self._lo.nbytes + self._loc.nbytes

    def _home(self, fps: np.ndarray) -> np.ndarray:
        """Each fingerprint's first slot, from both halves: keys that differ in either half
        only (counters, say) still spread over the table."""
        return ((((fps[:, 0] * _MIX) ^ fps[:, 1]) * _MULTIPLIER) >> self._shift).astype(np.intp)

    def _window(self, fps: np.ndarray, slots: np.ndarray, pending: np.ndarray, width: int):
        """For each pending key, the ``width`` slots from its current one: the first that
        stops a probe (the key itself, or a never-used slot), and what stopped it."""
        at = (slots[pending, None] + _STEPS[:width]) & self._mask
        loc = self._loc[at]
        same = (loc >= 0) & (self._hi[at] == fps[pending, 0, None]) & (self._lo[at] == fps[pending, 1, None])
        stops = same | (loc == EMPTY)
        first = stops.argmax(axis=1)
        rows = np.arange(len(pending))
        stopped = stops[rows, first]
        return at[rows, first], stopped & same[rows, first], stopped & ~same[rows, first]

    def _probe(self, fps: np.ndarray) -> np.ndarray:
        """The slot holding each fingerprint, or -1."""
        if compiled_probe is not None:
            found = np.empty(len(fps), np.int64)
            compiled_probe(self._hi, self._lo, self._loc, np.ascontiguousarray(fps, np.uint64), found, self._bits)
            return found
        slots, found = self._home(fps), np.full(len(fps), -1, np.intp)
        pending = np.arange(len(fps))
        width = 1                   # most keys stop at their home slot
        while len(pending):
            at, same, empty = self._window(fps, slots, pending, width)
            found[pending[same]] = at[same]
            pending = pending[~(same | empty)]
            slots[pending] += width
            width = WINDOW
        return found

    def entries(self) -> tuple[np.ndarray, np.ndarray]:
        """Every live entry: fingerprints (n x 2) and locations (consistency checks)."""
        live = self._loc >= 0
        return np.stack([self._hi[live], self._lo[live]], axis=1), self._loc[live]

    def find(self, fps: np.ndarray) -> np.ndarray:
        """The location of each fingerprint, or -1."""
        slots = self._probe(fps)
        return np.where(slots >= 0, self._loc[slots], -1)

    def put(self, fps: np.ndarray, locs: np.ndarray, replace: bool) -> tuple[np.ndarray, np.ndarray]:
        """Index fingerprints (distinct, unless ``replace`` is False) at ``locs``. Returns
        each one's previous location (-1 where it was new) and whether it is indexed at its
        ``locs`` now: ``replace=False`` keeps what is indexed already, and of equal
        fingerprints in the batch the first."""
        slots = self._probe(fps)
        held = slots >= 0
        old = np.where(held, self._loc[slots], -1)
        if replace:
            self._loc[slots[held]] = locs[held]
        new = np.flatnonzero(~held)
        if self._used + len(new) > MAX_LOAD * len(self._loc):
            self._rebuild(len(new))
        indexed = held if replace else np.zeros(len(fps), bool)
        indexed[new[self._insert(fps[new], locs[new])]] = True
        return old, indexed

    def remove(self, fps: np.ndarray, locs: np.ndarray) -> int:
        """Unindex each fingerprint still at its given location; returns how many were."""
        slots = self._probe(fps)
        slots = slots[(slots >= 0) & (self._loc[np.maximum(slots, 0)] == locs)]
        self._loc[slots] = REMOVED
        self.live -= len(slots)
        return len(slots)

    def _insert(self, fps: np.ndarray, locs: np.ndarray) -> np.ndarray:
        """Insert fingerprints the table lacks; of equal ones, the first. Returns the
        positions inserted."""
        slots, inserted = self._home(fps), []
        pending = np.arange(len(fps))
        width = 1
        while len(pending):
            at, same, empty = self._window(fps, slots, pending, width)
            # of several keys stopping at one free slot, the first takes it; an equal one
            # finds itself there next round (a duplicate), a different one probes on
            won_at, first = np.unique(at[empty], return_index=True)
            winners = np.flatnonzero(empty)[first]
            rows = pending[winners]
            inserted.append(rows)
            self._hi[won_at], self._lo[won_at], self._loc[won_at] = fps[rows, 0], fps[rows, 1], locs[rows]
            self._used += len(winners)
            self.live += len(winners)
            same[winners] = True
            slots[pending[~(same | empty)]] += width
            pending = pending[~same]
            width = WINDOW
        return np.concatenate(inserted) if inserted else np.zeros(0, np.intp)

    def _rebuild(self, adding: int) -> None:
        """Drop removed slots; size the table so the live pages and ``adding`` more fill at
        most half of it (it grows, and shrinks after many removals)."""
        keep = self._loc >= 0
        hi, lo, loc = self._hi[keep], self._lo[keep], self._loc[keep]
        capacity = 16
        while (len(loc) + adding) > capacity // 2:
            capacity *= 2
        self._allocate(capacity)
        self.live = 0
        self._insert(np.stack([hi, lo], axis=1), loc)
