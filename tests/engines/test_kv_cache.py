"""The simulated vLLM BlockPool (engines/sim/kv_cache.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.sim.kv_cache import KVCache


class Sink:
    def __init__(self) -> None:
        self.stored: list[tuple[list[int], int | None]] = []
        self.removed: list[int] = []

    def on_stored(self, hashes: list[int], parent: int | None) -> None:
        self.stored.append((list(hashes), parent))

    def on_removed(self, hashes: list[int]) -> None:
        self.removed.extend(hashes)


def cache(num_blocks: int = 9, bs: int = 4) -> tuple[KVCache, Sink]:
    sink = Sink()
    return KVCache(num_blocks, bs, on_stored=sink.on_stored, on_removed=sink.on_removed), sink


def fill(kv: KVCache, hashes: list[int]) -> list[int]:
    """Allocate a request's blocks and cache them under `hashes`."""
    blocks = kv.allocate(len(hashes))
    kv.cache_blocks(blocks, hashes, 0, len(hashes))
    return blocks


def test_null_block_and_capacity() -> None:
    kv, _ = cache(9)
    assert kv.num_blocks == 8 and kv.num_free == 8 and kv.usage == 0.0
    blocks = kv.allocate(8)
    assert 0 not in blocks and sorted(blocks) == list(range(1, 9))
    assert kv.usage == 1.0
    with pytest.raises(ValueError):
        KVCache(1, 4)


def test_cache_blocks_emits_stored_with_parent() -> None:
    kv, sink = cache()
    blocks = kv.allocate(3)
    kv.cache_blocks(blocks, [11, 12, 13], 0, 2)
    kv.cache_blocks(blocks, [11, 12, 13], 2, 3)
    kv.cache_blocks(blocks, [11, 12, 13], 3, 3)  # empty range: nothing
    assert sink.stored == [([11, 12], None), ([13], 12)]
    assert kv.count_hit([11, 12, 13, 14]) == 3


def test_duplicate_content_cached_once() -> None:
    kv, sink = cache()
    a = fill(kv, [1, 2])
    b = kv.allocate(2)
    kv.cache_blocks(b, [1, 2], 0, 2)  # the same content computed again
    assert sink.stored == [([1, 2], None)]
    assert kv.longest_hit([1, 2], 2) == a


def test_longest_hit_stops_at_gap_and_cap() -> None:
    kv, _ = cache()
    blocks = fill(kv, [1, 2, 3])
    assert kv.longest_hit([1, 2, 3, 4], 10) == blocks
    assert kv.longest_hit([1, 2, 3], 2) == blocks[:2]
    assert kv.longest_hit([1, 9, 3], 10) == blocks[:1]
    assert kv.longest_hit([9], 10) == []
    assert kv.count_hit([1, 9, 3]) == 1


def test_free_is_tail_first_so_tail_evicted_first() -> None:
    kv, sink = cache(5)  # 4 usable blocks
    fill(kv, [1, 2, 3])
    kv.free_blocks(kv.longest_hit([1, 2, 3], 3))
    assert kv.num_free == 4
    # the never-used block goes first, then the freed ones tail first: 3, 2, 1
    kv.allocate(2)
    assert sink.removed == [3]
    assert kv.count_hit([1, 2, 3]) == 2
    kv.allocate(1)
    assert sink.removed == [3, 2]
    assert kv.count_hit([1, 2, 3]) == 1


def test_lru_across_requests_least_recently_freed_evicted_first() -> None:
    kv, sink = cache(5)
    a = fill(kv, [1, 2])
    b = fill(kv, [7, 8])
    kv.free_blocks(a)  # freed first: older
    kv.free_blocks(b)
    kv.allocate(2)
    assert sink.removed == [2, 1]
    assert kv.count_hit([7, 8]) == 2


def test_touch_removes_from_free_queue_and_protects() -> None:
    kv, sink = cache(5)
    blocks = fill(kv, [1, 2])
    kv.free_blocks(blocks)
    assert kv.num_free == 4
    hit = kv.longest_hit([1, 2], 2)
    kv.touch(hit)
    assert kv.num_free == 2
    assert all(kv.ref[b] == 1 for b in hit)
    kv.allocate(2)  # takes the two uncached blocks; the touched ones are not in the queue
    assert sink.removed == []
    assert kv.count_hit([1, 2]) == 2
    # touching a block in use bumps its count; freeing once leaves it in use
    kv.touch(hit)
    kv.free_blocks(hit)
    assert all(kv.ref[b] == 1 for b in hit) and kv.num_free == 0


def test_evicted_block_loses_hash() -> None:
    kv, sink = cache(3)  # 2 usable
    fill(kv, [1, 2])
    kv.free_blocks(kv.longest_hit([1, 2], 2))
    kv.allocate(2)
    assert sorted(sink.removed) == [1, 2]
    assert kv.count_hit([1]) == 0
    assert all(h is None for h in kv.hash_of)


def test_can_allocate_accounts_for_evictable_hits() -> None:
    kv, _ = cache(5)  # 4 usable
    blocks = fill(kv, [1, 2])
    kv.free_blocks(blocks)  # 4 free, 2 of them hold the hit
    hit = kv.longest_hit([1, 2, 3], 3)
    assert len(hit) == 2
    assert kv.can_allocate(2, hit)  # 4 free - 2 hits that will be touched
    assert not kv.can_allocate(3, hit)
    assert kv.can_allocate(4, [])
    # hits in use by another request do not reduce the free pool
    kv.touch(hit)
    assert kv.can_allocate(2, hit) and not kv.can_allocate(3, hit)


def test_seed_installs_prefix_as_free_cached_blocks() -> None:
    kv, sink = cache(9)
    assert kv.seed([5, 6, 7]) == 3
    assert sink.stored == [([5, 6, 7], None)]
    assert kv.count_hit([5, 6, 7]) == 3
    assert kv.num_free == 8  # cached but not held
    assert all(kv.ref[b] == 0 for b in kv.longest_hit([5, 6, 7], 3))
    # extending a prefix already here only stores the missing tail
    assert kv.seed([5, 6, 7, 8]) == 4
    assert sink.stored[-1] == ([8], 7)


def test_seed_is_limited_by_free_blocks() -> None:
    kv, _ = cache(5)
    held = kv.allocate(3)
    assert kv.seed([1, 2, 3]) == 1
    assert kv.count_hit([1, 2, 3]) == 1
    kv.free_blocks(held)


def test_seed_does_not_evict_the_prefix_it_extends() -> None:
    kv, _ = cache(5)  # 4 usable
    blocks = fill(kv, [11])
    kv.free_blocks(blocks)  # block of 11 is free (at the MRU end)
    got = kv.seed([11, 12, 13, 14, 15])
    assert got == kv.count_hit([11, 12, 13, 14, 15])


def test_reset_drops_cached_hashes() -> None:
    kv, _ = cache()
    kv.free_blocks(fill(kv, [1, 2]))
    kv.reset()
    assert kv.count_hit([1, 2]) == 0
    assert kv.num_free == 8


# -- invariants under random use -------------------------------------------------------

op_st = st.lists(
    st.one_of(
        st.tuples(st.just("req"), st.integers(0, 3), st.integers(1, 4)),
        st.tuples(st.just("free"), st.integers(0, 10), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None, database=None)
@given(ops=op_st)
def test_pool_invariants(ops: list[tuple[str, int, int]]) -> None:
    """Ref counts, free queue and hash map stay consistent; events mirror the hash map."""
    sink = Sink()
    present: set[int] = set()

    def stored(hs: list[int], parent: int | None) -> None:
        assert not present & set(hs)
        present.update(hs)

    def removed(hs: list[int]) -> None:
        assert set(hs) <= present
        present.difference_update(hs)

    kv = KVCache(7, 2, on_stored=stored, on_removed=removed)
    live: list[list[int]] = []
    for kind, a, b in ops:
        if kind == "req":
            # a request over the prefix chain a*100 + (0..b-1): take hits, allocate the rest
            hashes = [a * 100 + i for i in range(b)]
            hit = kv.longest_hit(hashes, len(hashes))
            need = len(hashes) - len(hit)
            if not kv.can_allocate(need, hit):
                continue
            free_before = kv.num_free
            evictable = sum(1 for blk in hit if kv.ref[blk] == 0)
            kv.touch(hit)
            blocks = hit + kv.allocate(need)
            kv.cache_blocks(blocks, hashes, len(hit), len(hashes))
            assert kv.num_free == free_before - evictable - need
            live.append(blocks)
        elif live:
            kv.free_blocks(live.pop(a % len(live)))
        # invariants
        held = [0] * len(kv.ref)
        for blocks in live:
            for blk in blocks:
                held[blk] += 1
        assert kv.ref == held
        assert set(kv.free) == {blk for blk in range(1, len(kv.ref)) if held[blk] == 0}
        assert 0 not in kv.free
        assert set(kv.cached) == present
        for h, blk in kv.cached.items():
            assert kv.hash_of[blk] == h
    assert sink.stored == []


def test_freed_blocks_without_content_are_reused_before_cached_ones() -> None:
    """vLLM puts freed unhashed blocks (a partial tail) at the front of the free queue, so
    the next allocation takes them and no cached prefix is evicted."""
    kv, sink = cache(4)  # 3 usable
    blocks = kv.allocate(3)
    kv.cache_blocks(blocks, [11, 12], 0, 2)  # the third block is a partial tail
    kv.free_blocks(blocks)
    again = kv.allocate(1)
    assert again == [blocks[2]]
    assert sink.removed == [] and kv.count_hit([11, 12]) == 2
