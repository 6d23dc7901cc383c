"""The compiled block operations do what their Python reference does: same results, same
list and dict contents (dict order included), same exceptions; and a simulated replay
gives the same KV event stream and the same records with either."""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wasma.benchmarks.apps import generate
from wasma.benchmarks.sim_replay import SimReplay
from wasma.core.blockops import BlockOps, PythonBlockOps, block_ops
from wasma.core.events import KVEvent
from wasma.core.profile import load_profile
from wasma.scheduler.dispatch import Dispatcher

compiled = pytest.importorskip(
    "wasma.core._blockops", reason="the C extension is not built (no compiler at install)"
)
REFERENCE = PythonBlockOps()

keys = st.integers(min_value=-(2**63), max_value=2**63 - 1) | st.integers(0, 20)
masks = st.integers(min_value=0, max_value=2**70) | st.integers(0, 15)
bits = st.sampled_from([1, 2, 4, 8, 1 << 40, 1 << 69])


def both(call: Callable[[BlockOps, Any], Any], state: Any) -> None:
    """`call` on a copy of `state` with each implementation: same outcome, same state."""
    outcomes = []
    for ops in (REFERENCE, compiled):
        s = copy.deepcopy(state)
        try:
            result: Any = ("ok", call(ops, s))
        except Exception as exc:
            result = ("raised", type(exc))
        observed = [list(x.items()) if isinstance(x, dict) else x for x in s]
        outcomes.append((result, observed))
    assert outcomes[0] == outcomes[1]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-3, 5), min_size=1, max_size=12),
    st.lists(st.integers(-14, 13), max_size=20),
    st.integers(-2, 2),
)
def test_list_operations(lst: list[int], idx: list[int], delta: int) -> None:
    both(lambda ops, s: ops.fill(s[0], s[1], delta), [lst, idx])
    both(lambda ops, s: ops.scatter(s[0], s[1], list(range(len(s[1])))), [lst, idx])
    both(lambda ops, s: ops.scatter(s[0], s[1], [7]), [lst, idx])
    both(lambda ops, s: ops.add_at(s[0], s[1], delta), [lst, idx])
    both(lambda ops, s: ops.release(s[0], s[1]), [lst, idx])
    both(lambda ops, s: ops.release(s[0], tuple(s[1])), [lst, idx])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.none() | st.integers(0, 12), min_size=1, max_size=12),
    st.lists(st.integers(-13, 12), max_size=14),
    st.lists(st.integers(0, 12), max_size=14),
    st.integers(-1, 15),
    st.integers(-1, 15),
)
def test_cache_operations(
    hash_of: list[int | None], blocks: list[int], hashes: list[int], lo: int, hi: int
) -> None:
    # The map from hashes to blocks, some agreeing with `hash_of`, some not.
    cached = {h: b for b, h in enumerate(hash_of) if h is not None and b % 3}
    cached.update({h + 100: h for h in hashes[::2]})
    ref = [1] * len(hash_of)
    both(lambda ops, s: ops.evict(s[0], s[1], s[2], blocks), [ref, hash_of, cached])
    keyed = [h + 100 * (i % 2) for i, h in enumerate(hashes)]
    both(lambda ops, s: ops.register(s[0], s[1], blocks, keyed, lo, hi), [cached, hash_of, blocks])


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(keys, masks, max_size=30),
    st.lists(keys, max_size=30),
    bits,
    st.integers(-1, 40),
)
def test_dict_operations(d: dict[int, int], ks: list[int], bit: int, limit: int) -> None:
    # Keys both present and absent, some listed twice.
    ks = [*list(d)[: len(ks) // 2], *ks]
    for order in (ks, list(reversed(ks)), tuple(ks)):
        both(lambda ops, s, o=order: ops.del_keys(s[0], o), [d])
        both(lambda ops, s, o=order: ops.prefix_get(s[0], o, limit), [d])
        both(lambda ops, s, o=order: ops.prefix_len(s[0], o), [d])
        both(lambda ops, s, o=order: ops.or_bits(s[0], o, bit), [d])
        both(lambda ops, s, o=order: ops.clear_bits(s[0], o, bit), [d])
        both(lambda ops, s, o=order: ops.match_runs(s[0], o), [d])
        # The prefix index's map once trimmed: an OrderedDict, its order kept alike.
        od = OrderedDict(d)
        both(lambda ops, s, o=order: ops.or_bits(s[0], o, bit), [od])
        both(lambda ops, s, o=order: ops.clear_bits(s[0], o, bit), [od])
        both(lambda ops, s, o=order: ops.match_runs(s[0], o), [od])


@settings(max_examples=200, deadline=None)
@given(keys, keys, st.integers(0, 10**6), st.integers(-2, 40), st.integers(1, 64))
def test_hash_run(parent: int, stream: int, start: int, count: int, step: int) -> None:
    both(lambda ops, s: ops.hash_run(parent, stream, start, count, step), [])


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 80), masks | st.integers(-5, -1) | st.booleans(), st.integers(0, 9))
def test_set_bits(size: int, mask: int, value: int) -> None:
    # A bit past the list fails alike, after the same lower bits were set.
    both(lambda ops, s: ops.set_bits(s[0], mask, value), [[-1] * size])


times = st.sampled_from([0.0, 1.0, 2.0, 2.5, float("inf")]) | st.integers(0, 2)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(st.integers(0, 12), st.lists(times, max_size=4), max_size=10),
    st.lists(st.integers(0, 14), max_size=16),
    times,
)
def test_retention_operations(uses: dict[int, list[Any]], hashes: list[int], when: Any) -> None:
    # Use lists are kept sorted; an empty one never occurs but must fail alike.
    retained = {h: sorted(u) for h, u in uses.items()}
    # repr() tells 2 from 2.0: where an int and an equal float were put must agree.
    both(lambda ops, s: (ops.retain_uses(s[0], hashes, when), repr(s[0])), [retained])
    both(lambda ops, s: (ops.release_uses(s[0], hashes, when), repr(s[0])), [retained])

    def round_trip(ops: BlockOps, s: Any) -> Any:
        got = ops.retain_uses(s[0], hashes, when), ops.release_uses(s[0], hashes, when)
        return got, repr(s[0])

    both(round_trip, [retained])


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 2), min_size=1, max_size=10),
    st.lists(st.sampled_from(["plain", "kept", "none"]), min_size=10, max_size=10),
    st.dictionaries(st.integers(0, 12), st.integers(-10, 9), max_size=12),
    st.lists(st.integers(0, 14), max_size=16),
    st.none() | st.sets(st.integers(0, 14), max_size=5),
    st.booleans(),
)
def test_free_cached(
    ref: list[int],
    kinds: list[str],
    cached: dict[int, int],
    hashes: list[int],
    also: set[int] | None,
    kept: bool,
) -> None:
    # Queue runs stand in as lists (ordinary) and tuples (retention tier); a block id
    # past the counts list must fail alike.
    made = {"plain": [0], "kept": (0,), "none": None}
    run_of = [made[k] for k in kinds[: len(ref)]]
    want = tuple if kept else list
    both(
        lambda ops, s: ops.free_cached(s[0], s[1], s[2], hashes, want, tuple, also),
        [cached, ref, run_of],
    )


def test_match_runs_reads_the_running_and() -> None:
    d = {10: 0b111, 11: 0b111, 12: 0b101, 13: 0b001, 14: 0b100}
    for ops in (REFERENCE, compiled):
        # Engine bit 1 ends at depth 2, bit 2 at depth 3, bit 0 holds all four.
        assert ops.match_runs(d, [10, 11, 12, 13, 14]) == [(2, 0b010), (3, 0b100), (4, 0b001)]
        assert ops.match_runs(d, [99, 10]) == []


def test_compiled_writes_an_ordered_dict_through_its_own_order() -> None:
    """The holder operations take the trimmed index's OrderedDict and keep its order (a
    new key last, an update in place, a delete gone from the order too); any other dict
    subclass, and an OrderedDict where a KV map is expected, are refused."""
    od = OrderedDict({1: 1, 2: 3, 3: 1})
    compiled.or_bits(od, [4, 1], 2)
    assert list(od.items()) == [(1, 3), (2, 3), (3, 1), (4, 2)]
    compiled.clear_bits(od, [3, 2], 1)
    assert list(od.items()) == [(1, 3), (2, 2), (4, 2)]
    assert od.popitem(last=False) == (1, 3)  # the linked order is intact
    od.move_to_end(2)
    assert list(od) == [4, 2]
    with pytest.raises(TypeError):
        compiled.or_bits(defaultdict(int, {1: 1}), [1], 2)
    with pytest.raises(TypeError):
        compiled.prefix_get(OrderedDict({1: 1}), [1], 4)


def test_environment_picks_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    assert block_ops() is compiled
    monkeypatch.setenv("WASMA_BLOCKOPS", "python")
    assert isinstance(block_ops(), PythonBlockOps)


def replay(
    monkeypatch: pytest.MonkeyPatch, which: str, app: str, policy: str, kv_blocks: int
) -> tuple[list[KVEvent], Any]:
    """One replay with the given block operations, its KV events as the router got them."""
    monkeypatch.setenv("WASMA_BLOCKOPS", which)
    profile = load_profile("llama3-8b-h100")
    if kv_blocks:
        profile = dataclasses.replace(
            profile, num_kv_blocks=kv_blocks, max_model_len=(kv_blocks - 1) * 16
        )
    events: list[KVEvent] = []
    real = Dispatcher.on_kv_event

    def record(self: Dispatcher, event: KVEvent) -> None:
        events.append(event)
        real(self, event)

    monkeypatch.setattr(Dispatcher, "on_kv_event", record)
    wfs = generate(app, 25, 3.0, seed=5, profile=profile)
    run = SimReplay(wfs, policy, 2 if kv_blocks else 4, profile).run()
    monkeypatch.undo()
    return events, (run.requests, run.workflows, run.engine_steps, run.engine_prefix_hits)


@pytest.mark.parametrize(
    ("app", "policy", "kv_blocks"),
    [
        ("mapreduce", "least_loaded", 0),
        ("debate", "wasma", 0),
        ("pipeline", "prefix_aware", 0),
        ("mapreduce", "wasma", 900),  # evicts, preempts, retains
    ],
)
def test_replay_is_the_same_with_either(
    monkeypatch: pytest.MonkeyPatch, app: str, policy: str, kv_blocks: int
) -> None:
    ev_py, res_py = replay(monkeypatch, "python", app, policy, kv_blocks)
    ev_c, res_c = replay(monkeypatch, "compiled", app, policy, kv_blocks)
    assert len(ev_py) > 100
    assert ev_py == ev_c
    assert res_py == res_c
