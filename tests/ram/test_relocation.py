"""The pages of an arena move are copied on several threads: every page lands whole in its new
row, no other row changes, and a failed copy is reported, not lost on a thread."""

import numpy as np
import pytest

from hybridkv.ram.regions import SharedRegion
from hybridkv.ram.relocation import Relocator

PAGE = 256 * 1024


@pytest.fixture
def region(tmp_path):
    region = SharedRegion.create(tmp_path / "hybridkv-relocation", 64, PAGE)
    region.array[:] = np.random.default_rng(0).integers(0, 256, region.array.shape, dtype=np.uint8)
    yield region
    region.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_every_moved_page_lands_whole_and_nothing_else_changes(region, threads):
    before = region.array.copy()
    moves = [(region, 40 + i, 2 * i) for i in range(20)]       # down into every other low row
    relocator = Relocator(threads=threads, parallel_bytes=0)
    try:
        relocator.copy(moves)
    finally:
        relocator.close()
    for _, src, dst in moves:
        assert np.array_equal(region.array[dst], before[src])
    untouched = sorted(set(range(64)) - {dst for _, _, dst in moves})
    assert np.array_equal(region.array[untouched], before[untouched])


def test_a_copy_that_fails_on_a_thread_raises_to_the_caller(region):
    relocator = Relocator(threads=3, parallel_bytes=0)
    try:
        with pytest.raises(IndexError):
            relocator.copy([(region, 1, 2), (region, 3, 64)])  # row 64 is past the region
    finally:
        relocator.close()
