"""Tapered pieces: the first and last pieces of a hop smaller, so a tree's faster hops
wait less for the first piece and for the last one (less pipeline fill)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wasma.transfer import Hop, Planner, TransferPlan, build_preset
from wasma.transfer import algorithms as alg
from wasma.transfer.algorithms import with_chunks
from wasma.transfer.costmodel import HopCost
from wasma.transfer.cpu_executor import CpuExecutor
from wasma.transfer.plan import WEIGHT_UNIT, check_plan, chunk_bounds, taper_weights
from wasma.transfer.torch_executor import TorchDistExecutor, torch_available

SIZE = 1_000_003  # odd, so piece boundaries are uneven


def sizes(bounds: list[tuple[int, int]]) -> list[int]:
    return [hi - lo for lo, hi in bounds]


@given(
    offset=st.integers(0, 1 << 50),
    length=st.integers(0, 1 << 45),
    chunks=st.integers(1, 300),
    taper=st.integers(0, 40),
    ramp=st.floats(1.0, 3.0),
)
def test_tapered_bounds_tile_the_range_exactly(
    offset: int, length: int, chunks: int, taper: int, ramp: float
) -> None:
    bounds = chunk_bounds(offset, length, chunks, taper, ramp)
    assert len(bounds) == chunks
    assert bounds[0][0] == offset and bounds[-1][1] == offset + length
    assert all(isinstance(x, int) for pair in bounds for x in pair)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))  # contiguous
    assert all(lo <= hi for lo, hi in bounds)
    if chunks >= 3 and length >= chunks * WEIGHT_UNIT:
        # Pieces never shrink toward the middle (integer division moves a byte at most).
        half = sizes(bounds)[: (chunks + 1) // 2]
        assert all(a <= b + 1 for a, b in itertools.pairwise(half))


def test_ends_are_smaller_than_the_middle_by_the_ramp() -> None:
    bounds = chunk_bounds(7, 10**9 + 3, 20, taper=4, ramp=1.25)
    piece = sizes(bounds)
    middle = piece[10]
    assert piece[4:16] == pytest.approx([middle] * 12, abs=1)
    for step in range(1, 5):  # each step toward an end is 1.25x smaller
        assert piece[4 - step] == pytest.approx(middle / 1.25**step, rel=1e-4)
        assert piece[15 + step] == pytest.approx(middle / 1.25**step, rel=1e-4)
    assert piece[0] < piece[1] < piece[2] < piece[3] < piece[4]


def test_equal_pieces_without_a_taper() -> None:
    for taper, ramp in ((0, 1.5), (3, 1.0)):
        bounds = chunk_bounds(5, 1000, 7, taper, ramp)
        assert bounds == [(5 + c * 1000 // 7, 5 + (c + 1) * 1000 // 7) for c in range(7)]


def test_taper_weights_are_integers_from_the_quantised_ramp() -> None:
    # 1.25 is 81920 / 65536: each weight is the next inward times 65536 // 81920.
    assert taper_weights(3, 1.25) == [536870, 671088, 838860]
    assert taper_weights(0, 1.25) == []
    # Tapers meeting in the middle: each piece weighs as its nearer end says.
    assert sizes(chunk_bounds(0, 3_000_000, 3, taper=5, ramp=2.0))[1] > 1_000_000


def test_check_plan_rejects_bad_taper_or_ramp(topos: Any) -> None:
    planner = Planner(topos.switch(3))
    plan = planner.plan("n0.gpu0", ["n0.gpu1", "n0.gpu2"], SIZE, algorithms=["chain"])
    plan = replace(plan, hops=tuple(with_chunks(plan.hops, 9)))
    good = replace(plan, hops=tuple(replace(h, taper=3, ramp=1.5) for h in plan.hops))
    check_plan(good)
    for taper, ramp in ((-1, 1.5), (2, 0.9), (2, float("nan")), (2, float("inf")), (True, 1.5)):
        bad = replace(plan, hops=(replace(plan.hops[0], taper=taper, ramp=ramp), *plan.hops[1:]))
        with pytest.raises(ValueError, match="taper"):
            check_plan(bad)
    with pytest.raises(ValueError, match="taper"):
        check_plan(replace(plan, hops=(replace(plan.hops[0], taper=1.5), *plan.hops[1:])))


def check_each_byte_once(plan: TransferPlan) -> None:
    """The pieces every receiver gets tile the whole range once: no byte twice, none
    missing (relays included, as a broadcast sends every device all of it)."""
    pieces: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for hop in plan.hops:
        bounds = hop.chunk_bounds()
        assert bounds[0][0] == hop.offset_bytes
        assert bounds[-1][1] == hop.offset_bytes + hop.num_bytes
        pieces[hop.dst].extend(bounds)
    for dst in plan.dsts:
        got = sorted(pieces[dst])
        assert got[0][0] == 0 and got[-1][1] == plan.bytes, dst
        assert all(a[1] == b[0] for a, b in itertools.pairwise(got)), dst


def test_planner_tapers_a_tree_whose_hops_differ_and_the_executor_delivers(topos: Any) -> None:
    """Across a slow NIC then NVLink inside the far host: the NVLink hop is 24x the NIC,
    so pieces may double per step from the ends, and the plan lands sooner than the
    same hops in equal pieces."""
    topo = topos.two_by_two()
    planner = Planner(topo, max_chunks=8)
    plan = planner.plan("n0.gpu0", ["n1.gpu0", "n1.gpu1"], 4_000_037)
    assert any(h.taper for h in plan.hops) and all(h.ramp == 2.0 for h in plan.hops if h.taper)
    even = [replace(h, taper=0, ramp=1.0) for h in plan.hops]
    best_even = alg.chunks_per_tree(planner.links, even, 8)
    assert plan.predicted_s < planner.predict_s(even)
    assert plan.predicted_s < planner.predict_s(best_even)
    check_plan(plan)
    check_each_byte_once(plan)
    result = CpuExecutor(topo).run(plan, timeout_s=60)
    assert result.verified


@pytest.mark.parametrize(
    ("algorithm", "src", "dsts"),
    [
        ("chain", "n0.gpu0", ["n0.gpu1", "n1.gpu0", "n1.gpu1"]),  # shm + TCP, pipelined
        ("binomial_tree", "n0.gpu0", ["n0.gpu1", "n1.gpu0", "n1.gpu1"]),  # rounds
        ("packed_trees", "n0.gpu0", ["n0.gpu1", "n1.gpu0", "n1.gpu1"]),  # sub-ranges
        ("hierarchical", "n1.gpu1", ["n1.gpu0", "n0.gpu0", "n0.gpu1"]),
        ("flow_trees", "n0.gpu0", ["n0.gpu1", "n1.gpu0", "n1.gpu1"]),  # packed trees, rates
        ("rail_trees", "n0.gpu0", ["n0.gpu1", "n1.gpu0", "n1.gpu1"]),  # lanes, sub-parts
    ],
)
def test_tapered_pieces_deliver_exact_bytes(
    algorithm: str, src: str, dsts: list[str], topos: Any
) -> None:
    """Every hop in 9 tapered pieces, whatever the model would pick: children whose
    pieces do not line up with their parent's (sub-ranges) wait for the right piece."""
    topo = topos.two_by_two()
    planner = Planner(topo, max_chunks=8)
    plan = planner.plan(src, dsts, SIZE, algorithms=[algorithm])
    hops = tuple(replace(h, chunks=9, taper=3, ramp=1.5) for h in plan.hops)
    plan = replace(plan, hops=hops, chunks=9, predicted_s=planner.predict_s(hops))
    check_plan(plan)
    check_each_byte_once(plan)
    with CpuExecutor(topo) as executor:
        assert executor.run(plan, timeout_s=60).verified
        # A tapered piece lost on the way must show: the last piece of one hop dropped.
        lo, _ = plan.hops[-1].chunk_bounds()[-1]
        short = replace(plan.hops[-1], num_bytes=lo - plan.hops[-1].offset_bytes)
        broken = replace(plan, hops=(*plan.hops[:-1], short))
        assert not executor.run(broken, timeout_s=60).verified


def test_tapered_chain_gets_pieces_of_the_tapered_sizes() -> None:
    """The pieces a tapered hop moves are its chunk bounds: uneven, ends smallest."""
    hop = Hop("a", "b", ("a", "b"), 0, 1 << 30, 12, taper=3, ramp=2.0)
    piece = sizes(hop.chunk_bounds())
    assert piece[0] * 8 == pytest.approx(piece[6], rel=1e-5)
    assert sum(piece) == 1 << 30


@pytest.mark.skipif(not torch_available("gloo"), reason="no torch gloo backend")
def test_gloo_runs_a_tapered_plan() -> None:
    planner = Planner(build_preset("hgx-h100", 2))
    plan = planner.plan("n0.gpu0", ["n0.gpu1", "n1.gpu0", "n1.gpu1"], 300_001, algorithms=["chain"])
    hops = tuple(replace(h, chunks=7, taper=2, ramp=1.5) for h in plan.hops)
    plan = replace(plan, hops=hops, chunks=7)
    result = TorchDistExecutor("gloo").run(plan, timeout_s=240)
    assert result.verified and len(result.hop_finish_s) == len(plan.hops)


def test_equal_rate_trees_keep_equal_pieces() -> None:
    """All hops of a tree at one rate: tapering cannot shorten its fill (the longest path
    crosses the others on the largest piece either way), so the planner leaves it."""
    planner = Planner(build_preset("hgx-h100", 1))
    plan = planner.plan("n0.gpu0", [f"n0.gpu{g}" for g in range(1, 8)], 64 << 20)
    costs = planner.links.hop_costs(list(plan.hops))
    for members in alg.trees_of(plan.hops).values():
        rates = {round(costs[i].bandwidth_Bps) for i in members}
        if len(rates) == 1:
            assert not any(plan.hops[i].taper for i in members)


def test_fast_slow_fast_tree_ramps_at_the_rate_ratio() -> None:
    """A tree whose first and last hops are 1.25x its middle one: pieces may grow by
    1.25 per step (the faster hop then clears a piece as the slow one clears the one
    before), and the closed form says it gains."""
    hops = [
        Hop("a", "b", ("a", "b"), 0, 64 << 20, 32, None, 0, 50e9),
        Hop("b", "c", ("b", "c"), 0, 64 << 20, 32, 0, 0, 40e9),
        Hop("c", "d", ("c", "d"), 0, 64 << 20, 32, 1, 0, 50e9),
    ]
    costs = [HopCost(0.3e-6, 5e-6, h.rate_Bps or 0.0, ()) for h in hops]
    shape = alg.tree_taper(hops, costs, [0, 1, 2])
    assert shape is not None
    taper, ramp, chunks, gain = shape
    assert ramp == 1.25 and taper >= 1 and 2 * taper + 1 <= chunks <= 32 and gain > 0
    assert alg.tree_taper(hops[:1], costs[:1], [0]) is None  # one hop: nothing to fill
    level = [HopCost(0.3e-6, 5e-6, 40e9, ()) for _ in hops]
    assert alg.tree_taper(hops, level, [0, 1, 2]) is None  # one rate: nothing to gain
