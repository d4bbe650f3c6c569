"""The paged KV cache: page accounting, both storages, and where writes outside a reservation land.

The storage of separate page tensors (CUDA's) runs its Triton kernels in the interpreter here.
"""
import pytest
import torch

from engine.kv_cache import KVCache
from tests.triton_cpu import require_triton

LAYERS, HEADS, DIM = 2, 2, 4


def cache(separate=False, slots=3, capacity=20, page=4, chunk_pages=1, **kw):
    return KVCache(LAYERS, slots, capacity, HEADS, DIM, torch.float32, "cpu", page_size=page,
                   separate_pages=separate, chunk_pages=chunk_pages, **kw)


@pytest.fixture(params=[False, True], ids=["pool", "separate"])
def separate(request):
    if request.param:
        require_triton()
    return request.param


def test_pages_are_taken_as_reserved_and_reused_after_release(separate):
    c = cache(separate)
    c.reserve([0, 1], [5, 4])                    # 2 pages and 1 page
    assert c.page_counts.tolist() == [2, 1, 0] and c.pages_in_use == 3 and c.pages_held == 3
    assert c.reserved([0, 1, 2]).tolist() == [8, 4, 0]
    c.reserve([0], [3])                          # already covered: nothing new
    assert c.pages_held == 3
    held = set(c.table[0, :2].tolist())
    assert 0 not in held and len(held) == 2     # real pages, never the scratch page (offset 0)
    c.release([0])
    assert c.pages_in_use == 1 and c.pages_free == 2 and c.table[0].eq(0).all()
    c.reserve([2], [8])                          # the freed pages serve the next slot
    assert c.pages_held == 3 and set(c.table[2, :2].tolist()) == held
    c.reserve([1], [100])                        # capped at the capacity: 20 positions, 5 pages
    assert c.page_counts[1] == 5 and c.reserved([1]).tolist() == [20]


def test_fresh_pages_hold_zeros_not_whatever_the_memory_held(separate, monkeypatch):
    """Keys a step has not written yet are read under a mask; a NaN there would pass through
    0 * NaN, so a page the cache takes from the device starts as zeros."""
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    c = cache(separate, chunk_pages=2)
    c.reserve([0, 1], [8, 4])
    k, v = c.read(0, 2, 8)
    assert k.eq(0).all() and v.eq(0).all()


def test_trim_frees_chunks_whose_pages_are_all_free():
    require_triton()
    c = cache(True, chunk_pages=2)
    c.reserve([0, 1, 2], [20, 20, 8])            # 12 pages in 6 chunks (slot 1 starts in slot 0's last)
    before = c.bytes_held()
    c.release([0, 1])
    assert c.pages_free == 10 and c.pages_held == 12
    assert c.trim(keep=3) == 8 * c.page_bytes     # whole chunks only, until at most 3 pages are free
    assert c.pages_free == 2 and c.pages_held == 4 and c.bytes_held() == before - 8 * c.page_bytes
    c.reserve([0], [20])                         # the 2 free pages, then 2 new chunks
    assert c.pages_in_use == 7 and c.pages_free == 1 and c.pages_held == 8
    assert c.trim() == 0                         # no chunk is wholly free
    c.release([0, 2])
    assert c.trim() == 8 * c.page_bytes and c.pages_held == 0


def test_page_budget_raises_out_of_memory_and_keeps_what_was_taken(separate):
    c = cache(separate)
    c.max_pages = 3
    with pytest.raises(torch.OutOfMemoryError):
        c.reserve([0, 1], [8, 8])
    assert c.page_counts.tolist() == [2, 1, 0] and c.table[1, 0] != 0
    c.release([0])
    c.reserve([1], [8])                          # a released page is within the budget again
    assert c.page_counts[1] == 2


def test_storages_hold_the_same_values_and_padding_lands_in_scratch():
    """The same writes through both storages read back the same; positions outside a slot's
    reservation (right padding, past the capacity) change no slot's reserved positions."""
    require_triton()
    g = torch.Generator().manual_seed(0)
    pool, sep = cache(False), cache(True)
    for c in (pool, sep):
        c.reserve([0, 1, 2], [20, 6, 20])
    full = torch.randn(3, 20, HEADS, DIM, generator=g), torch.randn(3, 20, HEADS, DIM, generator=g)
    for c in (pool, sep):
        for layer in range(LAYERS):
            c.write(layer, full[0] + layer, full[1] - layer, torch.zeros(3, dtype=torch.long))
    before = [pool.read(layer, 3, 20) for layer in range(LAYERS)]
    # slot 1 reserved 6 positions (2 pages: 0..7); a padded write of 14 positions from 4 runs past them
    junk = torch.randn(2, 14, HEADS, DIM, generator=g), torch.randn(2, 14, HEADS, DIM, generator=g)
    rows, start = torch.tensor([1, 2]), torch.tensor([4, 17])           # slot 2: 17.. runs past the capacity
    for c in (pool, sep):
        c.write(1, *junk, start, slots=rows)
    for c in (pool, sep):
        for layer in range(LAYERS):
            k, v = c.read(layer, 3, 20)
            want_k, want_v = before[layer][0].clone(), before[layer][1].clone()
            if layer == 1:
                want_k[1, 4:8], want_v[1, 4:8] = junk[0][0, :4], junk[1][0, :4]     # its own reserved pages
                want_k[2, 17:20], want_v[2, 17:20] = junk[0][1, :3], junk[1][1, :3]
            torch.testing.assert_close(k[[0, 2]], want_k[[0, 2]], atol=0, rtol=0)
            torch.testing.assert_close(k[1, :8], want_k[1, :8], atol=0, rtol=0)
            torch.testing.assert_close(v[1, :8], want_v[1, :8], atol=0, rtol=0)
    # gathers of any slots, and of a prefix
    for a, b in zip(pool.read(1, 2, 11, slots=torch.tensor([2, 0])), sep.read(1, 2, 11, slots=torch.tensor([2, 0]))):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_one_pool_grows_keeping_its_pages():
    c = cache(False, slots=4, capacity=64)
    x = torch.randn(1, 64, HEADS, DIM)
    c.reserve([3], [64])                          # 16 pages: the pool doubles 1 -> 32
    c.write(0, x, -x, torch.zeros(1, dtype=torch.long), slots=torch.tensor([3]))
    c.reserve([0, 1, 2], [64, 64, 64])
    k, v = c.read(0, 1, 64, slots=torch.tensor([3]))
    assert torch.equal(k, x) and torch.equal(v, -x) and c.pool.shape[0] >= 65
