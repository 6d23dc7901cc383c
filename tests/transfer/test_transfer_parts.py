"""Gather and scatter: distinct parts, planned as one flow at the max-flow bound, run
byte-exactly by the executors."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wasma.benchmarks.studies.plan_table import random_cluster
from wasma.transfer import Planner, build_preset
from wasma.transfer.algorithms import with_chunks
from wasma.transfer.cpu_executor import CpuExecutor
from wasma.transfer.flows import DemandFlow, gather_demands, scatter_demands
from wasma.transfer.plan import Span, check_plan, even_spans
from wasma.transfer.topology import TopologyBuilder, TopologyError
from wasma.transfer.torch_executor import TorchDistExecutor, torch_available

from .test_transfer_packing import check_fluid_schedule, check_received

MIB = 1 << 20
SIZE = 1_000_003  # odd, so part and piece boundaries are uneven


def test_demands_cut_the_bytes_at_every_holders_edges() -> None:
    held = [Span("a", 0, 60), Span("b", 40, 60), Span("c", 0, 20)]
    demands = gather_demands(held, "c", 100)
    # c has [0, 20); [20, 40) only a has, [40, 60) a or b, [60, 100) only b.
    assert [(d.senders, d.offset_bytes, d.num_bytes) for d in demands] == [
        (("a",), 20, 20),
        (("a", "b"), 40, 20),
        (("b",), 60, 40),
    ]
    assert [d.dst for d in scatter_demands("s", even_spans(["x", "y"], 7))] == ["x", "y"]


def test_mixed_senders_and_receivers_are_refused() -> None:
    planner = Planner(build_preset("hgx-h200", 1))
    network = planner._flow_network()
    from wasma.transfer.flows import Demand

    mixed = [Demand(("n0.gpu0",), "n0.gpu1", 0, 10), Demand(("n0.gpu2",), "n0.gpu3", 10, 10)]
    with pytest.raises(ValueError, match="several senders to several destinations"):
        DemandFlow(network, mixed)


def test_scatter_on_one_node_reaches_the_bound_and_uses_every_link() -> None:
    planner = Planner(build_preset("hgx-h200", 1))
    dsts = [f"n0.gpu{g}" for g in range(1, 8)]
    plan = planner.plan_scatter("n0.gpu0", even_spans(dsts, 1 << 30), 1 << 30)
    check_plan(plan)
    check_received(plan)
    assert plan.pattern == "scatter" and plan.ratio is not None and plan.ratio <= 1.01
    assert {w.device for w in plan.wanted} == set(dsts)
    # Bytes leave through NVLink and the PCIe tree at once (the bound counts both).
    first = {h.path[1] for h in plan.hops if h.after is None}
    assert len(first) >= 2


@pytest.mark.parametrize("size", [1 << 30, 64 * MIB])
def test_two_node_gather_uses_every_rail(size: int) -> None:
    planner = Planner(build_preset("hgx-h200", 2))
    holders = [f"n1.gpu{g}" for g in range(8)]
    plan = planner.plan_gather(even_spans(holders, size), "n0.gpu0", size)
    check_plan(plan)
    check_received(plan)
    check_fluid_schedule(planner, plan)
    assert plan.pattern == "gather" and plan.ratio is not None and plan.ratio <= 1.15
    rails = {n for h in plan.hops for n in h.path if n.startswith("n1.nic")}
    assert len(rails) == 8
    # The inter-node cut is eight 400G rails: the bound is their rate and a floor.
    assert plan.bound_s is not None and 0 < plan.bound_s - size / 400e9 < 20e-6


def test_a_part_held_twice_comes_from_either_holder() -> None:
    # A wide destination behind one switch, two narrow holders of the same bytes: each
    # sends a share, so the gather beats either holder alone.
    builder = TopologyBuilder("wide")
    builder.add_device("n0.sw", "nvswitch", "n0")
    for g, speed in enumerate((300e9, 100e9, 100e9)):
        builder.add_device(f"n0.gpu{g}", "gpu", "n0")
        builder.add_link(f"n0.gpu{g}", "n0.sw", speed, 1e-6, "nvlink")
    planner = Planner(builder.build())
    size = 256 * MIB
    both = planner.plan_gather(
        [Span("n0.gpu1", 0, size), Span("n0.gpu2", 0, size)], "n0.gpu0", size
    )
    near = planner.plan_gather([Span("n0.gpu1", 0, size)], "n0.gpu0", size)
    check_plan(both)
    check_received(both)
    assert {h.src for h in both.hops if h.after is None} == {"n0.gpu1", "n0.gpu2"}
    assert both.bound_s is not None and near.bound_s is not None
    assert both.bound_s < 0.51 * near.bound_s + 10e-6 and both.ratio is not None
    assert both.ratio <= 1.05


def test_what_the_destination_holds_is_not_sent() -> None:
    planner = Planner(build_preset("hgx-h200", 1))
    plan = planner.plan_gather([Span("n0.gpu0", 0, 600), Span("n0.gpu1", 0, 1000)], "n0.gpu0", 1000)
    check_plan(plan)
    assert all(h.offset_bytes >= 600 for h in plan.hops)
    assert sum(h.num_bytes for h in plan.hops if h.dst == "n0.gpu0") == 400
    nothing = planner.plan_gather([Span("n0.gpu0", 0, 1000)], "n0.gpu0", 1000)
    assert nothing.hops == () and nothing.predicted_s == 0.0


def test_bad_parts_are_refused_readably() -> None:
    planner = Planner(build_preset("hgx-h200", 1))
    with pytest.raises(ValueError, match="overlap"):
        planner.plan_scatter("n0.gpu0", [Span("n0.gpu1", 0, 10), Span("n0.gpu2", 5, 10)], 20)
    with pytest.raises(ValueError, match="no device holds bytes"):
        planner.plan_gather([Span("n0.gpu1", 0, 10)], "n0.gpu0", 20)
    with pytest.raises(ValueError, match="not within"):
        planner.plan_scatter("n0.gpu0", [Span("n0.gpu1", 0, 30)], 20)
    with pytest.raises(TopologyError):
        planner.plan_scatter("n0.gpu0", [Span("n9.gpu1", 0, 10)], 10)


def test_parts_plans_are_memo_hits() -> None:
    planner = Planner(build_preset("hgx-h200", 2))
    spans = even_spans([f"n1.gpu{g}" for g in range(8)], 1 << 30)
    first = planner.plan_scatter("n0.gpu0", spans, 1 << 30)
    computed = planner.plans_computed
    assert planner.plan_scatter("n0.gpu0", spans, 1 << 30) is first
    assert planner.plans_computed == computed


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    seed=st.integers(0, 2**32 - 1),
    gather=st.booleans(),
    share=st.floats(0.1, 1.0),
    size=st.sampled_from([64 * MIB, 256 * MIB, 1 << 30]),
)
def test_random_clusters_parts_are_feasible_and_near_the_bound(
    seed: int, gather: bool, share: float, size: int
) -> None:
    rng = random.Random(seed)
    topology = random_cluster(rng)
    gpus = topology.gpus()
    if len(gpus) < 2:
        return
    rng.shuffle(gpus)
    one, rest = gpus[0], gpus[1:]
    others = rest[: max(1, round(share * len(rest)))]
    cuts = sorted(rng.sample(range(1, size), len(others) - 1)) if len(others) > 1 else []
    bounds = [0, *cuts, size]
    spans = [Span(d, lo, hi - lo) for d, lo, hi in zip(others, bounds, bounds[1:], strict=False)]
    planner = Planner(topology)
    plan = (
        planner.plan_gather(spans, one, size) if gather else planner.plan_scatter(one, spans, size)
    )
    check_plan(plan)
    check_received(plan)
    if plan.algorithm == "flow_paths":
        check_fluid_schedule(planner, plan)
    assert plan.bound_s is not None
    assert plan.predicted_s >= plan.bound_s * (1 - 1e-9)
    assert plan.ratio is not None and plan.ratio <= 1.15, (plan.algorithm, plan.ratio)


@pytest.mark.parametrize("gather", [False, True])
def test_cpu_executor_moves_parts_exactly(gather: bool, topos: Any) -> None:
    topo = topos.two_by_two()
    planner = Planner(topo, max_chunks=8)
    others = ["n0.gpu1", "n1.gpu0", "n1.gpu1"]
    spans = even_spans(others, SIZE)
    plan = (
        planner.plan_gather(spans, "n0.gpu0", SIZE)
        if gather
        else planner.plan_scatter("n0.gpu0", spans, SIZE)
    )
    check_plan(plan)
    plan = replace(plan, hops=tuple(with_chunks(plan.hops, 5)), chunks=5)
    with CpuExecutor(topo) as executor:
        result = executor.run(plan, timeout_s=60)
        assert result.verified and len(result.hop_finish_s) == len(plan.hops)
        # Dropping the last hop leaves a receiver short: verification must say so.
        short = replace(plan, hops=plan.hops[:-1])
        assert not executor.run(short, timeout_s=60).verified


@pytest.mark.skipif(not torch_available("gloo"), reason="no torch gloo backend")
def test_gloo_moves_a_scatter_and_a_gather() -> None:
    planner = Planner(build_preset("hgx-h100", 1))
    others = ["n0.gpu1", "n0.gpu2", "n0.gpu3"]
    for plan in (
        planner.plan_scatter("n0.gpu0", even_spans(others, 300_001), 300_001),
        planner.plan_gather(even_spans(others, 300_001), "n0.gpu0", 300_001),
    ):
        plan = replace(plan, hops=tuple(with_chunks(plan.hops, 3)), chunks=3)
        result = TorchDistExecutor("gloo").run(plan, timeout_s=240)
        assert result.verified, plan.pattern
