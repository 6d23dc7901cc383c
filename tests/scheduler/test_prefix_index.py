"""The cluster prefix index fed by KV events (scheduler/prefix_index.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.base import AllBlocksCleared, BlockRemoved, BlockStored
from scheduler.prefix_index import PrefixIndex

ENGINES = ["e0", "e1", "e2"]


def stored(e: str, *hs: int) -> BlockStored:
    return BlockStored(e, tuple(hs), None)


def removed(e: str, *hs: int) -> BlockRemoved:
    return BlockRemoved(e, tuple(hs))


def test_match_longest_prefix_per_engine() -> None:
    idx = PrefixIndex(ENGINES)
    idx.apply(stored("e0", 1, 2, 3))
    idx.apply(stored("e1", 1, 2))
    idx.apply(stored("e2", 2, 3))  # no block 0: no usable prefix
    assert idx.match([1, 2, 3, 4]) == [3, 2, 0]
    assert idx.match([1, 9, 3]) == [1, 1, 0]
    assert idx.match([]) == [0, 0, 0]
    assert idx.match([7]) == [0, 0, 0]


def test_match_stops_at_first_gap() -> None:
    idx = PrefixIndex(ENGINES)
    idx.apply(stored("e0", 1, 2, 3, 4))
    idx.apply(removed("e0", 2))
    assert idx.match([1, 2, 3, 4]) == [1, 0, 0]


def test_removed_then_restored() -> None:
    idx = PrefixIndex(ENGINES)
    idx.apply(stored("e1", 5, 6))
    idx.apply(removed("e1", 5, 6))
    assert idx.match([5, 6]) == [0, 0, 0]
    assert len(idx) == 0
    idx.apply(stored("e1", 5, 6))
    assert idx.match([5, 6]) == [0, 2, 0]
    assert idx.holders(5) == [1]


def test_blocks_per_engine_counts_distinct_hashes() -> None:
    idx = PrefixIndex(ENGINES)
    idx.apply(stored("e0", 1, 2))
    idx.apply(stored("e0", 2, 3))  # 2 again: not double counted
    idx.apply(stored("e1", 1))
    idx.apply(removed("e0", 9))  # unknown: ignored
    idx.apply(removed("e2", 1))  # not held by e2: ignored
    assert idx.blocks_per_engine == [3, 1, 0]
    assert idx.holders(1) == [0, 1]
    assert len(idx) == 3


def test_unknown_engine_events_ignored_and_add_engine() -> None:
    idx = PrefixIndex(ENGINES)
    idx.apply(stored("zz", 1, 2))
    assert len(idx) == 0
    idx.add_engine("zz")
    idx.add_engine("zz")  # idempotent
    assert idx.engines == [*ENGINES, "zz"]
    idx.apply(stored("zz", 1, 2))
    assert idx.match([1, 2]) == [0, 0, 0, 2]


def test_all_blocks_cleared_and_remove_engine() -> None:
    idx = PrefixIndex(ENGINES)
    idx.apply(stored("e0", 1, 2))
    idx.apply(stored("e1", 1, 2))
    idx.apply(AllBlocksCleared("e0"))
    assert idx.match([1, 2]) == [0, 2, 0]
    assert idx.blocks_per_engine == [0, 2, 0]
    idx.remove_engine_blocks("e1")
    assert idx.match([1, 2]) == [0, 0, 0]
    assert len(idx) == 0
    idx.remove_engine_blocks("nope")  # no error


def test_bad_cap() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(ENGINES, max_blocks=0)


def test_cap_forgets_old_entries_keeps_new() -> None:
    idx = PrefixIndex(ENGINES, max_blocks=4)
    idx.apply(stored("e0", *range(1, 5)))
    idx.apply(stored("e1", *range(10, 13)))
    assert len(idx) <= 4
    assert idx.match([10, 11, 12]) == [0, 3, 0]  # the newest survive
    assert idx.match([1, 2, 3, 4])[0] < 4
    assert sum(idx.blocks_per_engine) == sum(
        len(idx.holders(h)) for h in [*range(1, 5), *range(10, 13)]
    )


# -- against a brute-force model -------------------------------------------------------

hash_st = st.integers(0, 12)
event_st = st.one_of(
    st.tuples(
        st.just("store"), st.sampled_from(ENGINES), st.lists(hash_st, max_size=6, unique=True)
    ),
    st.tuples(
        st.just("remove"), st.sampled_from(ENGINES), st.lists(hash_st, max_size=6, unique=True)
    ),
    st.tuples(st.just("clear"), st.sampled_from(ENGINES), st.just([])),
)


def brute_match(held: dict[str, set[int]], chain: list[int]) -> list[int]:
    out = []
    for e in ENGINES:
        n = 0
        while n < len(chain) and chain[n] in held[e]:
            n += 1
        out.append(n)
    return out


@settings(max_examples=200, deadline=None, database=None)
@given(
    events=st.lists(event_st, max_size=40),
    queries=st.lists(st.lists(hash_st, max_size=8), min_size=1, max_size=6),
)
def test_matches_brute_force_model(
    events: list[tuple[str, str, list[int]]], queries: list[list[int]]
) -> None:
    idx = PrefixIndex(ENGINES)
    held: dict[str, set[int]] = {e: set() for e in ENGINES}
    for kind, eng, hs in events:
        if kind == "store":
            idx.apply(stored(eng, *hs))
            held[eng].update(hs)
        elif kind == "remove":
            idx.apply(removed(eng, *hs))
            held[eng].difference_update(hs)
        else:
            idx.apply(AllBlocksCleared(eng))
            held[eng].clear()
        assert idx.blocks_per_engine == [len(held[e]) for e in ENGINES]
        assert len(idx) == len(set().union(*held.values()))
    for q in queries:
        assert idx.match(q) == brute_match(held, q)
    for h in range(13):
        assert idx.holders(h) == [i for i, e in enumerate(ENGINES) if h in held[e]]


@settings(max_examples=150, deadline=None, database=None)
@given(
    events=st.lists(event_st, max_size=40),
    cap=st.integers(1, 6),
    query=st.lists(hash_st, max_size=8),
)
def test_capped_index_is_a_consistent_subset(
    events: list[tuple[str, str, list[int]]], cap: int, query: list[int]
) -> None:
    """A capped index may forget, but never invents blocks and stays self-consistent."""
    idx = PrefixIndex(ENGINES, max_blocks=cap)
    held: dict[str, set[int]] = {e: set() for e in ENGINES}
    for kind, eng, hs in events:
        if kind == "store":
            idx.apply(stored(eng, *hs))
            held[eng].update(hs)
        elif kind == "remove":
            idx.apply(removed(eng, *hs))
            held[eng].difference_update(hs)
        else:
            idx.apply(AllBlocksCleared(eng))
            held[eng].clear()
        assert len(idx) <= cap
        per = [0] * len(ENGINES)
        for h in range(13):
            for s in idx.holders(h):
                assert h in held[ENGINES[s]]
                per[s] += 1
        assert idx.blocks_per_engine == per
    got, full = idx.match(query), brute_match(held, query)
    assert all(g <= f for g, f in zip(got, full, strict=True))
