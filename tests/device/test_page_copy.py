"""The page copier on CPU tensors strided as vLLM lays out its caches: every physical layout,
a kernel split, padded state pages and tensor-parallel slices; both the direct path (CPU) and
the staged one a GPU runs."""

import pytest
import torch

from hybridkv.core.errors import HybridKVError
from hybridkv.device.page_copy import PageCopier, block_bytes, fold_kernel_blocks, slot_rows
from hybridkv.ram.regions import SharedRegion
from hybridkv.tools.gpu_check import LAYOUT_ORDERS, attention_caches, state_caches

BLOCKS = 6
DIMS = dict(layers=2, blocks=BLOCKS, heads=2, tokens=8, width=4, dtype=torch.int32)   # random bits, no NaNs


def views(layout, split=1, seed=0):
    return [fold_kernel_blocks(t, BLOCKS) for t in attention_caches(layout, split=split, seed=seed, **DIMS)]


def expected_page(layer_views, block):
    """Each layer's block in logical [H, N, C] order, layer after layer."""
    return torch.cat([v[block].reshape(-1).contiguous().view(torch.uint8) for v in layer_views])


@pytest.fixture
def region(tmp_path):
    made = []

    def make(page, slots=BLOCKS):
        made.append(SharedRegion.create(tmp_path / f"r{len(made)}", slots, page))
        return made[-1]
    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
def test_save_writes_each_block_in_logical_order_at_its_slot(layout, staged, region):
    src = views(layout)
    r = region(block_bytes(src))
    PageCopier({0: src}, {0: r.page_bytes}, staged=staged).save(0, r, [4, 0, 2], [1, 5, 3]).wait()
    for slot, block in ((4, 1), (0, 5), (2, 3)):
        assert torch.equal(torch.from_numpy(r.array[slot].copy()), expected_page(src, block))
    assert not r.array[[1, 3, 5]].any()          # slots not named stay untouched


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
@pytest.mark.parametrize("layout", list(LAYOUT_ORDERS))
def test_pages_load_into_any_other_layout_bit_identical(layout, staged, region):
    src = views(layout)
    r = region(block_bytes(src))
    PageCopier({0: src}, {0: r.page_bytes}, staged=staged).save(0, r, range(BLOCKS), range(BLOCKS))
    for other in LAYOUT_ORDERS:
        raw = [torch.zeros_like(t) for t in attention_caches(other, **DIMS)]
        dst = [fold_kernel_blocks(t, BLOCKS) for t in raw]
        PageCopier({0: dst}, {0: r.page_bytes}, staged=staged).load(0, r, [2, 5], [0, 4]).wait()
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(d[0], s[2]) and torch.equal(d[4], s[5])
            assert not d[[1, 2, 3, 5]].any()     # blocks not named stay zero


def test_only_consecutive_ascending_slots_are_copied_as_one_slice():
    assert slot_rows([1, 2, 3]) == slice(1, 4) and slot_rows(range(4, 6)) == slice(4, 6)
    assert slot_rows([]) == slice(0, 0)
    for scattered in ([3, 1], [1, 3], [2, 1, 0]):
        assert torch.equal(slot_rows(scattered), torch.tensor(scattered))


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_consecutive_slots_copy_as_one_run_and_land_like_scattered_ones(staged, region):
    """Slots in a row are copied as one slice of the region (the fast path), both ways."""
    src = views("LBHNC")
    r = region(block_bytes(src))
    PageCopier({0: src}, {0: r.page_bytes}, staged=staged).save(0, r, [1, 2, 3], [5, 0, 3]).wait()
    for slot, block in ((1, 5), (2, 0), (3, 3)):
        assert torch.equal(torch.from_numpy(r.array[slot].copy()), expected_page(src, block))
    assert not r.array[[0, 4, 5]].any()
    dst = views("LBHNC", seed=1)
    for t in dst:
        t.zero_()
    PageCopier({0: dst}, {0: r.page_bytes}, staged=staged).load(0, r, [2, 3], [1, 4]).wait()
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[1], s[0]) and torch.equal(d[4], s[3])
        assert not d[[0, 2, 3, 5]].any()


def test_a_kernel_split_folds_to_the_same_page_as_whole_blocks(region):
    whole, split = views("LBNHC", seed=3), None
    raw = attention_caches("LBNHC", split=2, **DIMS)
    assert raw[0].shape == (BLOCKS * 2, 2, 4, 4)              # vLLM's kernel-block view
    split = [fold_kernel_blocks(t, BLOCKS) for t in raw]
    for w, s in zip(whole, split, strict=True):               # the same tokens, split in two
        s.copy_(w.reshape(s.shape))
    r = region(block_bytes(whole))
    PageCopier({0: split}, {0: r.page_bytes}).save(0, r, [0], [2])
    assert torch.equal(torch.from_numpy(r.array[0].copy()), expected_page(whole, 2))
    back = [torch.zeros_like(t) for t in raw]
    PageCopier({0: [fold_kernel_blocks(t, BLOCKS) for t in back]}, {0: r.page_bytes}).load(0, r, [0], [5])
    assert torch.equal(back[1][10:12], raw[1][4:6])           # kernel blocks 2b, 2b+1


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_padded_state_pages_copy_the_real_bytes_only(staged, region):
    real, padded = 40, 64
    src = state_caches(3, BLOCKS, real, padded)
    r = region(3 * real)
    PageCopier({1: src}, {1: r.page_bytes}, staged=staged).save(1, r, [3], [2])
    assert torch.equal(torch.from_numpy(r.array[3].copy()), torch.cat([s[2].reshape(-1).view(torch.uint8) for s in src]))
    dst = state_caches(3, BLOCKS, real, padded, seed=9)
    storage = torch.as_strided(dst[0], (3 * BLOCKS * padded,), (1,), 0)
    before = storage.clone()
    PageCopier({1: dst}, {1: r.page_bytes}, staged=staged).load(1, r, [3], [4])
    changed = (storage != before).nonzero().flatten()
    assert len(changed) and all(int(p) % padded < real for p in changed)     # never the padding
    assert all(torch.equal(s[2], d[4]) for s, d in zip(src, dst, strict=True))


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_tensor_parallel_ranks_own_one_slice_each(staged, region):
    ranks = [views("LBHNC", seed=10 + r) for r in range(2)]
    width = block_bytes(ranks[0])
    r = region(2 * width)
    for rank, src in enumerate(ranks):
        PageCopier({0: src}, {0: 2 * width}, rank, 2, staged=staged).save(0, r, [1], [3])
    for rank, src in enumerate(ranks):               # rank-major: rank r's bytes at r * width
        assert torch.equal(torch.from_numpy(r.array[1, rank * width:(rank + 1) * width].copy()), expected_page(src, 3))
        dst = [torch.zeros_like(v) for v in src]
        PageCopier({0: dst}, {0: 2 * width}, rank, 2, staged=staged).load(0, r, [1], [0])
        assert all(torch.equal(d[0], s[3]) for s, d in zip(src, dst, strict=True))


def test_staging_smaller_than_a_batch_moves_it_in_chunks(region):
    src = views("BLNHC")
    r = region(block_bytes(src))
    copier = PageCopier({0: src}, {0: r.page_bytes}, staged=True, save_staging_bytes=1, load_staging_bytes=1)   # one page at a time
    copier.save(0, r, list(range(BLOCKS)), list(range(BLOCKS)))
    dst = [torch.zeros_like(v) for v in src]
    PageCopier({0: dst}, {0: r.page_bytes}, staged=True, save_staging_bytes=1, load_staging_bytes=1).load(0, r, list(range(BLOCKS)), list(range(BLOCKS)))
    assert all(torch.equal(s, d) for s, d in zip(src, dst, strict=True))


def test_the_load_staging_buffer_is_taken_when_the_copier_starts_and_never_grows(region):
    """A load the next forward reads must not fail on device memory mid-serving: the staged
    copier holds its load buffer from the start, at the size its largest load moves."""
    src = views("BLNHC")
    width = block_bytes(src)
    r = region(width)
    PageCopier({0: src}, {0: r.page_bytes}, staged=True).save(0, r, list(range(BLOCKS)), list(range(BLOCKS)))
    dst = [torch.zeros_like(v) for v in src]
    narrow = [torch.zeros_like(v[..., :1]) for v in src]         # a second group, 1/C as wide
    w2 = block_bytes(narrow)
    budget = 3 * width + 2 * w2                                  # the narrow group's load uses more of it
    copier = PageCopier({0: dst, 1: narrow}, {0: r.page_bytes, 1: w2}, staged=True, load_staging_bytes=budget)
    reserved = max(budget // width * width, budget // w2 * w2)
    assert reserved > 3 * width and copier.load_staging_reserved == reserved
    copier.load(0, r, list(range(BLOCKS)), list(range(BLOCKS)))
    assert copier.load_staging_reserved == reserved and all(torch.equal(s, d) for s, d in zip(src, dst, strict=True))
    assert PageCopier({0: dst}, {0: r.page_bytes}, staged=False).load_staging_reserved == 0


def test_mismatched_pages_are_refused_with_both_figures(region):
    src = views("LBHNC")
    width = block_bytes(src)
    with pytest.raises(HybridKVError, match=f"rank 1 holds {width} B per block, which is not 1/2 of the {width + 1} B"):
        PageCopier({0: src}, {0: width + 1}, rank=1, ranks=2)
    copier = PageCopier({0: src}, {0: width})
    with pytest.raises(HybridKVError, match=f"region of group 0 has {width + 8} B pages but the engine's page is {width} B"):
        copier.save(0, region(width + 8), [0], [0])
    with pytest.raises(HybridKVError, match="neither 6 blocks nor a whole number of kernel blocks"):
        fold_kernel_blocks(torch.zeros(7, 2, 4, 4), BLOCKS)


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_layers_whose_bytes_do_not_line_up_with_their_dtype_round_trip(staged, region):
    """A 3-byte int8 layer before an int32 one puts the int32 bytes at an odd offset of the
    page: they cannot be seen in place as int32 and go through a buffer, same bytes."""
    odd = torch.randint(-100, 100, (BLOCKS, 1, 1, 3), dtype=torch.int8)
    wide = torch.randint(-1000, 1000, (BLOCKS, 2, 5), dtype=torch.int32)
    r = region(block_bytes([odd, wide]))
    PageCopier({0: [odd, wide]}, {0: r.page_bytes}, staged=staged).save(0, r, [2, 3], [4, 1])
    assert torch.equal(torch.from_numpy(r.array[2].copy()), expected_page([odd, wide], 4))
    back = [torch.zeros_like(odd), torch.zeros_like(wide)]
    PageCopier({0: back}, {0: r.page_bytes}, staged=staged).load(0, r, [2, 3], [0, 5])
    assert torch.equal(back[0][0], odd[4]) and torch.equal(back[1][5], wide[1])
    assert not back[1][[1, 2, 3, 4]].any()


def test_a_new_region_of_a_group_is_copied_into_not_the_one_before(region):
    """The copier keeps a view of each group's region; a re-planned region replaces it."""
    src = views("LBHNC")
    copier = PageCopier({0: src}, {0: block_bytes(src)})
    old, new = region(block_bytes(src)), region(block_bytes(src))
    copier.save(0, old, [0], [1])
    copier.save(0, new, [0], [2])
    assert torch.equal(torch.from_numpy(new.array[0].copy()), expected_page(src, 2))
    assert torch.equal(torch.from_numpy(old.array[0].copy()), expected_page(src, 1))


@pytest.mark.parametrize("slots", [[2, 3], [4, 5, 6]], ids=["fewer-slots", "past-the-end"])
def test_a_save_whose_slots_do_not_match_its_blocks_fails_and_spares_the_other_rank(slots, region):
    """index_select would resize a mismatched destination and write wherever that lands."""
    src = views("LBHNC")
    width = block_bytes(src)
    r = region(2 * width)
    with pytest.raises(RuntimeError):
        PageCopier({0: src}, {0: 2 * width}, 0, 2).save(0, r, slots, [1, 2, 3])
    assert not r.array[:, width:].any()          # rank 1's columns untouched

