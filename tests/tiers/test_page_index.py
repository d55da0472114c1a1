"""The packed-page index: a numpy hash table that must agree with a dict whatever happens,
probed in C (tiers/_page_probe.c) or, where that is not built, in numpy: both run here."""

import random

import numpy as np
import pytest

from hybridkv.tiers import packfile, page_index
from hybridkv.tiers.page_index import PageTable, fingerprints, table_fingerprints

KEYS = [i.to_bytes(16, "big") for i in range(2000)] + [bytes([i]) * (i % 33) for i in range(60)]


def compiled_probe():
    """The C probe, which scripts/setup.sh builds: a test of it fails where it is missing."""
    assert page_index.compiled_probe is not None, "tiers/_page_probe.c is not built: run scripts/setup.sh"
    return page_index.compiled_probe


@pytest.fixture(params=["compiled", "numpy"])
def probe(request, monkeypatch):
    """Each table test runs with the C probe and with the numpy one."""
    if request.param == "numpy":
        monkeypatch.setattr(page_index, "compiled_probe", None)
    else:
        compiled_probe()


@pytest.mark.parametrize("seed", range(3))
def test_the_table_agrees_with_a_dict_through_random_puts_and_removals(seed, probe):
    rng = random.Random(seed)
    table, model = PageTable(16), {}
    for step in range(800):
        batch = rng.sample(KEYS, rng.randint(1, 60))
        fps = fingerprints(batch)
        if rng.random() < 0.55:
            locs = np.array([rng.randrange(1 << 40) for _ in batch], np.int64)
            replace = rng.random() < 0.5
            old, indexed = table.put(fps, locs, replace)
            assert old.tolist() == [model.get(k, -1) for k in batch]
            assert indexed.tolist() == [replace or k not in model for k in batch]
            model.update({k: int(loc) for k, loc in zip(batch, locs, strict=True) if replace or k not in model})
        else:   # a removal happens only where the key is still at the given location
            locs = np.array([model.get(k, 3) if rng.random() < 0.8 else 7 for k in batch], np.int64)
            removed = [k for k, loc in zip(batch, locs, strict=True) if model.get(k) == loc]
            assert table.remove(fps, locs) == len(removed)
            for k in removed:
                del model[k]
        assert table.find(fingerprints(KEYS)).tolist() == [model.get(k, -1) for k in KEYS], step
        assert len(table) == len(model)


def test_of_equal_keys_in_one_batch_the_first_is_indexed_unless_replacing(probe):
    table = PageTable()
    fps = fingerprints([b"a" * 16, b"b" * 16, b"a" * 16])
    old, indexed = table.put(fps, np.array([1, 2, 3]), replace=False)
    assert old.tolist() == [-1, -1, -1] and indexed.tolist() == [True, True, False]
    assert table.find(fps).tolist() == [1, 2, 1] and len(table) == 2


def test_removed_slots_are_reclaimed_and_the_table_shrinks_when_rebuilt(probe):
    table = PageTable()
    fps = fingerprints([i.to_bytes(16, "little") for i in range(50_000)])
    locs = np.arange(50_000, dtype=np.int64)
    table.put(fps, locs, replace=True)
    grown = table.nbytes
    table.remove(fps[:49_900], locs[:49_900])
    assert table.nbytes == grown            # removed slots stay until a rebuild
    for batch in range(60):                 # churn: pages come and go, ~100 stay
        churn = fingerprints([(batch * 1000 + i).to_bytes(16, "big") for i in range(1000)])
        table.put(churn, locs[:1000], replace=True)
        assert table.remove(churn, locs[:1000]) == 1000
    assert table.nbytes < grown / 8 and len(table) == 100
    assert table.find(fps[49_900:]).tolist() == locs[49_900:].tolist()
    assert (table.find(fps[:49_900]) == -1).all()


def test_fingerprints_are_the_key_at_16_bytes_and_a_hash_otherwise():
    assert fingerprints([bytes(range(16))]).tobytes() == bytes(range(16))
    short, padded = fingerprints([b"k"]), fingerprints([b"k\0"])
    assert short.tobytes() != padded.tobytes() and short.tobytes() != b"k".ljust(16, b"\0")
    keys = [bytes(range(16)), b"k", b"k\0", b"x" * 32]
    table = packfile.make_table([(0, k, 0, 1, 0) for k in keys])
    assert table_fingerprints(table["key"], table["key_len"]).tobytes() == fingerprints(keys).tobytes()


def test_both_probes_find_the_same_slots_past_removed_slots_and_for_misses(monkeypatch):
    """20,000 keys with a third of them removed (probes pass removed slots), and 500 misses."""
    compiled_probe()
    table = PageTable(16)
    fps = fingerprints([i.to_bytes(16, "little") for i in range(20_000)])
    table.put(fps, np.arange(20_000, dtype=np.int64), replace=True)
    table.remove(fps[::3], np.arange(0, 20_000, 3, dtype=np.int64))
    asked = np.concatenate([fps, fingerprints([(i + 1 << 64).to_bytes(16, "little") for i in range(500)])])
    compiled = table.find(asked)
    monkeypatch.setattr(page_index, "compiled_probe", None)
    assert table.find(asked).tolist() == compiled.tolist()
    assert (compiled[::3][:6667] == -1).all() and (compiled[20_000:] == -1).all()
    assert (compiled[1:20_000:3] == np.arange(1, 20_000, 3)).all()


def test_the_compiled_probe_refuses_arrays_that_do_not_fit_the_table():
    probe = compiled_probe()
    bits = 4                                       # a table of 16 empty slots
    hi, lo, loc = np.zeros(16, np.uint64), np.zeros(16, np.uint64), np.full(16, -1, np.int64)
    fps = fingerprints([b"a" * 16])
    found = np.empty(1, np.int64)
    probe(hi, lo, loc, fps, found, bits)
    assert found.tolist() == [-1]
    with pytest.raises(ValueError, match="2\\*\\*bits slots"):
        probe(hi, lo, loc, fps, found, bits + 1)
    with pytest.raises(ValueError, match="one per fingerprint"):
        probe(hi, lo, loc, fps, np.empty(2, np.int64), bits)
