"""The pages of an arena move are copied on several threads: every page lands whole in its new
row, no other row changes, a failed copy is reported, not lost on a thread, and a forked child
copies with threads of its own."""

import os
import signal

import numpy as np
import pytest

from hybridkv.ram import relocation
from hybridkv.ram.regions import SharedRegion
from hybridkv.ram.relocation import copy_moves

PAGE = 256 * 1024


@pytest.fixture
def region(tmp_path):
    region = SharedRegion.create(tmp_path / "hybridkv-relocation", 64, PAGE)
    region.array[:] = np.random.default_rng(0).integers(0, 256, region.array.shape, dtype=np.uint8)
    yield region
    region.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_every_moved_page_lands_whole_and_nothing_else_changes(region, monkeypatch, threads):
    monkeypatch.setattr(relocation, "THREADS", threads)
    before = region.array.copy()
    moves = [(region, 40 + i, 2 * i) for i in range(20)]       # down into every other low row
    copy_moves(moves, parallel_bytes=0)
    for _, src, dst in moves:
        assert np.array_equal(region.array[dst], before[src])
    untouched = sorted(set(range(64)) - {dst for _, _, dst in moves})
    assert np.array_equal(region.array[untouched], before[untouched])


def test_a_copy_that_fails_on_a_thread_raises_to_the_caller(region, monkeypatch):
    monkeypatch.setattr(relocation, "THREADS", 3)
    with pytest.raises(IndexError):
        copy_moves([(region, 1, 2), (region, 3, 64)], parallel_bytes=0)   # row 64 is past the region


def test_a_forked_child_copies_with_threads_of_its_own(region, monkeypatch):
    monkeypatch.setattr(relocation, "THREADS", 2)
    before = region.array.copy()
    copy_moves([(region, 40, 0), (region, 41, 1)], parallel_bytes=0)   # the parent's threads exist now
    pid = os.fork()
    if pid == 0:                                              # the child inherits none of them
        signal.alarm(20)
        code = 1
        try:
            copy_moves([(region, 42, 2), (region, 43, 3)], parallel_bytes=0)
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert np.array_equal(region.array[2], before[42]) and np.array_equal(region.array[3], before[43])
