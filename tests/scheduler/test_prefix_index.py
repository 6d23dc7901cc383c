"""The cluster prefix index fed by KV events (scheduler/prefix_index.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wasma.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from wasma.scheduler.prefix_index import PrefixIndex

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


@settings(max_examples=150, deadline=None, database=None)
@given(events=st.lists(event_st, max_size=40), cap=st.integers(1, 20))
def test_store_and_remove_are_the_events_applied(
    events: list[tuple[str, str, list[int]]], cap: int
) -> None:
    """`store` / `remove` (what the router calls for its in-flight index) leave the index
    as `apply` of the same events does: same entries in the same (eviction) order."""
    by_event = PrefixIndex(ENGINES, max_blocks=cap)
    direct = PrefixIndex(ENGINES, max_blocks=cap)
    for kind, eng, hs in events:
        if kind == "store":
            by_event.apply(stored(eng, *hs))
            direct.store(eng, tuple(hs))
        elif kind == "remove":
            by_event.apply(removed(eng, *hs))
            direct.remove(eng, tuple(hs))
        else:
            by_event.apply(AllBlocksCleared(eng))
            direct.remove_engine_blocks(eng)
        assert list(direct._holders.items()) == list(by_event._holders.items())
        assert direct.blocks_per_engine == by_event.blocks_per_engine
    direct.store("nobody", (1, 2))  # an engine it does not know: ignored, as by `apply`
    direct.remove("nobody", (1,))
    assert list(direct._holders.items()) == list(by_event._holders.items())


def test_match_long_chains_across_lookup_chunks() -> None:
    """`match` looks blocks up in growing chunks; depths on either side of a chunk
    boundary must come out exact."""
    idx = PrefixIndex(ENGINES)
    chain = list(range(1000, 1700))
    idx.apply(stored("e0", *chain[:64]))  # exactly the first chunk
    idx.apply(stored("e1", *chain[:65]))  # one block into the second
    idx.apply(stored("e2", *chain[:500]))
    assert idx.match(chain) == [64, 65, 500]
    assert idx.match(chain[:192]) == [64, 65, 192]
    idx.apply(removed("e2", chain[300]))
    assert idx.match(chain) == [64, 65, 300]
    assert brute_match({e: set() for e in ENGINES}, chain) == [0, 0, 0]


def test_cap_forgets_least_recently_inserted_first() -> None:
    """Past the cap the oldest entries go first; a hash every engine dropped re-enters
    at the newest end (the order a plain dict and an OrderedDict both keep)."""
    idx = PrefixIndex(ENGINES, max_blocks=5)
    idx.apply(stored("e0", 1, 2, 3))
    idx.apply(stored("e1", 4))
    idx.apply(removed("e0", 2))
    idx.apply(stored("e0", 2))  # back, now the newest: order 1, 3, 4, 2
    idx.apply(stored("e1", 1))  # already known: keeps its place
    idx.apply(stored("e1", 5, 6))  # 6 entries: the oldest (1) goes
    assert len(idx) == 5 and idx.holders(1) == []
    assert idx.blocks_per_engine == [2, 3, 0]
    idx.apply(stored("e2", 7))  # then 3
    assert idx.holders(3) == [] and idx.holders(2) == [0] and idx.holders(7) == [2]
    assert idx.blocks_per_engine == [1, 3, 1]


@settings(max_examples=100, deadline=None, database=None)
@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["store", "remove"]),
            st.sampled_from(ENGINES),
            st.integers(0, 300),
            st.integers(0, 300),
        ),
        max_size=25,
    ),
    depth=st.integers(0, 300),
)
def test_long_chain_matches_brute_force_model(
    events: list[tuple[str, str, int, int]], depth: int
) -> None:
    """Stores and evictions of chain slices (as engines send them) on 300-block chains."""
    chain = list(range(5000, 5300))
    idx = PrefixIndex(ENGINES)
    held: dict[str, set[int]] = {e: set() for e in ENGINES}
    for kind, eng, a, b in events:
        hs = chain[min(a, b) : max(a, b)]
        if kind == "store":
            idx.apply(stored(eng, *hs))
            held[eng].update(hs)
        else:
            idx.apply(removed(eng, *hs))
            held[eng].difference_update(hs)
    assert idx.blocks_per_engine == [len(held[e]) for e in ENGINES]
    assert idx.match(chain[:depth]) == brute_match(held, chain[:depth])


@settings(max_examples=150, deadline=None, database=None)
@given(events=st.lists(event_st, max_size=40), cap=st.integers(1, 20))
def test_a_trimmed_index_keeps_the_compiled_operations(
    events: list[tuple[str, str, list[int]]], cap: int
) -> None:
    """Past its cap the index keeps its entries in an OrderedDict (oldest out first) and
    still runs the compiled operations, with what the Python reference gives: the same
    entries in the same order, the same counts, the same matches."""
    from wasma.core.blockops import PythonBlockOps, block_ops

    ops = block_ops()
    if isinstance(ops, PythonBlockOps):
        pytest.skip("the C extension is not built")
    fast = PrefixIndex(ENGINES, max_blocks=cap)
    ref = PrefixIndex(ENGINES, max_blocks=cap, ops=PythonBlockOps())
    for kind, eng, hs in events:
        for idx in (fast, ref):
            if kind == "store":
                idx.apply(stored(eng, *hs))
            elif kind == "remove":
                idx.apply(removed(eng, *hs))
            else:
                idx.apply(AllBlocksCleared(eng))
        assert list(fast._holders.items()) == list(ref._holders.items())
        assert fast.blocks_per_engine == ref.blocks_per_engine
        assert fast.match(hs) == ref.match(hs)
    assert fast._ops is ops  # never swapped for the reference
