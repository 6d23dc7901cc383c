"""The simulated vLLM BlockPool (engines/sim/kv_cache.py)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wasma.engines.sim.kv_cache import KVCache

INF = float("inf")


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


def test_retained_blocks_go_after_ordinary_ones_latest_next_use_first() -> None:
    """Steps-to-use order: among retained free blocks, those wanted latest are evicted
    first (unsaid = never, first of all), each chain tail first; ordinary blocks go
    before any retained one."""
    kv, sink = cache(8)  # 7 usable blocks
    a, b, c, d = fill(kv, [1, 2]), fill(kv, [3, 4]), fill(kv, [5, 6]), fill(kv, [7])
    kv.retain([1, 2], use_at=3.0)
    kv.retain([3, 4], use_at=1.0)
    kv.retain([5, 6])  # next use unsaid
    for blocks in (a, b, c, d):
        kv.free_blocks(blocks)
    assert kv.free == [d[0]]
    assert kv.free_retained == [c[1], c[0], a[1], a[0], b[1], b[0]]
    kv.allocate(4)
    assert sink.removed == [7, 6, 5, 2]
    assert kv.count_hit([1, 2]) == 1 and kv.count_hit([3, 4]) == 2


def test_retention_reorders_when_the_soonest_use_changes() -> None:
    kv, _sink = cache(8)
    a, b = fill(kv, [1, 2]), fill(kv, [3, 4])
    kv.retain([1, 2], use_at=3.0)
    kv.retain([3, 4], use_at=1.0)
    kv.free_blocks(a)
    kv.free_blocks(b)
    assert kv.free_retained == [a[1], a[0], b[1], b[0]]
    # A second holder wants them sooner: kept longest now. Blocks that move between
    # places in the queue move in chain order, as `retain` of free blocks always has.
    kv.retain([1, 2], use_at=0.5)
    assert kv.free_retained == [b[1], b[0], a[0], a[1]]
    kv.release([1, 2], use_at=0.5)  # back to the first holder's time
    assert kv.free_retained == [a[0], a[1], b[1], b[0]]
    kv.release([3, 4], use_at=1.0)  # no holder left: an ordinary free block again
    assert kv.free_retained == [a[0], a[1]]
    assert kv.free[-2:] == [b[0], b[1]]
    with pytest.raises(ValueError):
        kv.retain([1, 2], use_at=2.0)
        kv.release([1, 2], use_at=9.0)  # not a holder's time


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


# -- against a per-block reference pool ---------------------------------------------------


class RefPool:
    """vLLM's BlockPool rules with one OrderedDict entry per free block: the model the
    run-based free queue must match block for block (ids, order, hashes, events)."""

    def __init__(self, num_blocks: int) -> None:
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        # Retention tier: block -> (-next use, order queued); evicted smallest first.
        self.kept_at: dict[int, tuple[float, int]] = {}
        self.retained: dict[int, list[float]] = {}
        self._seq = 0
        self.events: list[tuple[str, list[int]]] = []

    def longest_hit(self, hashes: list[int], cap: int) -> list[int]:
        out = []
        for h in hashes[:cap]:
            if h not in self.cached:
                break
            out.append(self.cached[h])
        return out

    @property
    def kept(self) -> list[int]:
        return sorted(self.kept_at, key=self.kept_at.__getitem__)

    def _keep(self, b: int) -> None:
        """Queue a free retained block behind those wanted later or as soon."""
        h = self.hash_of[b]
        assert h is not None
        self._seq += 1
        self.kept_at[b] = (-min(self.retained[h]), self._seq)

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                (self.free if b in self.free else self.kept_at).pop(b)
            self.ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        out, evicted = [], []
        for _ in range(n):
            if self.free:
                b, _none = self.free.popitem(last=False)
            else:
                b = self.kept[0]
                del self.kept_at[b]
            h = self.hash_of[b]
            if h is not None:
                self.hash_of[b] = None
                if self.cached.get(h) == b:
                    del self.cached[h]
                    evicted.append(h)
            self.ref[b] = 1
            out.append(b)
        if evicted:
            self.events.append(("removed", evicted))
        return out

    def free_blocks(self, blocks: list[int]) -> None:
        unhashed = []
        for b in reversed(blocks):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                h = self.hash_of[b]
                if h is None:
                    unhashed.append(b)
                elif h in self.retained:
                    self._keep(b)
                else:
                    self.free[b] = None
        for b in reversed(unhashed):
            self.free[b] = None
            self.free.move_to_end(b, last=False)

    def retain(self, hashes: list[int], use_at: float = INF) -> None:
        for h in hashes:
            uses = self.retained.setdefault(h, [])
            sooner = bool(uses) and use_at < min(uses)
            uses.append(use_at)
            b = self.cached.get(h)
            if b is None or self.ref[b]:
                continue
            if b in self.free:
                del self.free[b]
                self._keep(b)
            elif sooner and b in self.kept_at:
                self._keep(b)

    def release(self, hashes: list[int], use_at: float = INF) -> None:
        for h in hashes:
            uses = self.retained.get(h)
            if uses is None:
                continue
            b = self.cached.get(h)
            if len(uses) == 1:
                del self.retained[h]
                if b is not None and b in self.kept_at:
                    del self.kept_at[b]
                    self.free[b] = None
                continue
            soonest = min(uses)
            uses.remove(use_at)
            if min(uses) != soonest and b is not None and b in self.kept_at:
                self._keep(b)

    def cache_blocks(self, blocks: list[int], hashes: list[int], start: int, end: int) -> None:
        pairs = zip(hashes[start:end], blocks[start:end], strict=True)
        fresh = [(h, b) for h, b in pairs if h not in self.cached]
        for h, b in fresh:
            self.hash_of[b] = h
            self.cached[h] = b
        if fresh:
            self.events.append(("stored", [h for h, _ in fresh]))

    def seed_pinned(self, hashes: list[int]) -> list[int]:
        have = self.longest_hit(hashes, len(hashes))
        self.touch(have)
        todo = hashes[len(have) :][: len(self.free) + len(self.kept)]
        blocks = self.allocate(len(todo))
        for b, h in zip(blocks, todo, strict=True):
            self.hash_of[b] = h
            self.cached[h] = b
        if todo:
            self.events.append(("stored", list(todo)))
        return have + blocks


def chain_of(stream: int, branch: int, split: int, length: int) -> list[int]:
    """A block-hash chain that shares its first `split` blocks with its stream's others."""
    return [hash((stream, i)) if i < split else hash((stream, branch, i)) for i in range(length)]


chain_st = st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 10), st.integers(1, 14))
pool_op_st = st.lists(
    st.one_of(
        st.tuples(st.just("req"), chain_st, st.integers(0, 16), st.integers(0, 99)),
        st.tuples(st.just("free"), st.integers(0, 99)),
        # Next use unsaid (INF) or at one of a few times, so that ties occur.
        st.tuples(st.just("retain"), chain_st, st.sampled_from([INF, 1.0, 2.0, 3.0])),
        # Retain what a request holds, as the router does: its blocks go to the tier
        # when freed, so the tier holds blocks wanted at different times.
        st.tuples(st.just("retain_held"), st.integers(0, 99), st.sampled_from([INF, 1.0, 2.0])),
        st.tuples(st.just("release"), st.integers(0, 99)),
        st.tuples(st.just("seed"), chain_st, st.booleans()),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None, database=None)
@given(ops=pool_op_st, num_blocks=st.sampled_from([3, 6, 12, 24]))
def test_matches_per_block_reference_pool(ops: list[tuple[Any, ...]], num_blocks: int) -> None:
    """Every operation leaves the same blocks, order, hashes and events as the reference
    (duplicates, partial tails, retention ordered by next use, transfers and re-cached
    prefixes included)."""
    events: list[tuple[str, list[int]]] = []
    kv = KVCache(
        num_blocks,
        4,
        on_stored=lambda hs, _parent: events.append(("stored", list(hs))),
        on_removed=lambda hs: events.append(("removed", list(hs))),
    )
    ref = RefPool(num_blocks)
    live: list[list[int]] = []
    kept: list[tuple[list[int], float]] = []
    for op in ops:
        if op[0] == "req":
            hashes = chain_of(*op[1])
            cap, split = op[2], op[3]
            hit = kv.longest_hit(hashes, cap)
            assert hit == ref.longest_hit(hashes, cap)
            need = len(hashes) - len(hit)
            ok = kv.can_allocate(need, hit)
            if split % 2:  # the engine's combined check-and-touch
                assert kv.take_hits(list(hit), need) == ok
                if not ok:
                    continue
            else:
                if not ok:
                    continue
                kv.touch(hit)
            ref.touch(hit)
            blocks = hit + kv.allocate(need)
            assert blocks == hit + ref.allocate(need)
            # Cache a prefix in two calls (some blocks may stay unhashed: a partial tail).
            mid = min(split % (len(blocks) + 1), len(blocks))
            kv.cache_blocks(blocks, hashes, 0, mid, len(hit) if mid >= len(hit) else 0)
            ref.cache_blocks(blocks, hashes, 0, mid)
            end = len(blocks) - (split // 50)
            kv.cache_blocks(blocks, hashes, mid, max(end, mid))
            ref.cache_blocks(blocks, hashes, mid, max(end, mid))
            live.append(blocks)
        elif op[0] == "free" and live:
            blocks = live.pop(op[1] % len(live))
            kv.free_blocks(blocks)
            ref.free_blocks(blocks)
        elif op[0] == "retain":
            hashes = chain_of(*op[1])
            kv.retain(hashes, op[2])
            ref.retain(hashes, op[2])
            kept.append((hashes, op[2]))
        elif op[0] == "retain_held" and live:
            blocks = live[op[1] % len(live)]
            hashes = [h for h in map(kv.hash_of.__getitem__, blocks) if h is not None]
            kv.retain(hashes, op[2])
            ref.retain(hashes, op[2])
            kept.append((hashes, op[2]))
        elif op[0] == "release" and kept:
            hashes, use_at = kept.pop(op[1] % len(kept))
            kv.release(hashes, use_at)
            ref.release(hashes, use_at)
        elif op[0] == "seed":
            hashes = chain_of(*op[1])
            held = kv.seed_pinned(hashes)
            assert held == ref.seed_pinned(hashes)
            if op[2]:
                kv.free_blocks(held)  # `seed`: the blocks land free
                ref.free_blocks(held)
            else:
                live.append(held)
        assert kv.ref == ref.ref
        assert kv.hash_of == ref.hash_of
        assert kv.cached == ref.cached
        assert kv.free == list(ref.free)
        assert kv.free_retained == list(ref.kept)
        assert kv.num_free == len(ref.free) + len(ref.kept)
        assert events == ref.events


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_stale_copy_left_by_a_transfer_evicts_nothing(one_at_a_time: bool) -> None:
    """A transfer re-caches a chain whose head was evicted while its tail stayed cached:
    the old tail blocks keep their hashes (and queue place) but no longer own the map
    entries, so evicting them later must not drop the transferred copy."""
    events: list[tuple[str, list[int]]] = []
    kv = KVCache(
        9,
        4,
        on_stored=lambda hs, _p: events.append(("stored", list(hs))),
        on_removed=lambda hs: events.append(("removed", list(hs))),
    )
    ref = RefPool(9)
    for pool in (kv, ref):
        a = pool.allocate(3)
        pool.cache_blocks(a, [11, 12, 13], 0, 3)
        pool.free_blocks(a[:1])  # the head is freed while the tail stays held
        others = pool.allocate(6)  # evicts the head (11) only
        pool.free_blocks(others)
        pinned = pool.seed_pinned([11, 12, 13])  # 12, 13 now map to the new copies
        assert len(pinned) == 3
        pool.free_blocks(a[1:])  # the stale copies join the free queue, hashed
        # Evict both stale copies (decode takes one block at a time): no map entry goes.
        for n in [1] * 5 if one_at_a_time else [5]:
            pool.allocate(n)
        assert pool.longest_hit([11, 12, 13], 3) == pinned
    assert events == ref.events
    assert ("removed", [12]) not in events and ("removed", [13]) not in events
    assert kv.ref == ref.ref and kv.hash_of == ref.hash_of and kv.cached == ref.cached


def test_shared_block_ids_queue_the_same_objects_in_the_same_order() -> None:
    ids = list(range(300))  # most past the small-int cache
    a = KVCache(300, 4, block_ids=ids)
    b = KVCache(300, 4, block_ids=ids)
    own = KVCache(300, 4)
    assert a.free == own.free
    got_a, got_b, got_own = a.allocate(260), b.allocate(260), own.allocate(260)
    assert got_a == got_own
    # The same int objects in both caches (the point of sharing them).
    assert all(x is y for x, y in zip(got_a, got_b, strict=True))
    with pytest.raises(ValueError):
        KVCache(300, 4, block_ids=list(range(299)))
    with pytest.raises(ValueError):
        KVCache(300, 4, block_ids=list(range(1, 301)))
