"""The flow planner on random clusters: every plan feasible, every byte delivered once,
and large transfers within 1.15x of the max-flow bound."""

from __future__ import annotations

import itertools
import random
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wasma.benchmarks.studies.plan_table import random_cluster
from wasma.transfer import Planner, TopologyBuilder, TransferPlan, build_preset
from wasma.transfer.plan import Hop, check_plan

MIB = 1 << 20


def check_fluid_schedule(planner: Planner, plan: TransferPlan) -> None:
    """Every hop runs from the start at its rate: no link (or device limit) may carry
    more than its capacity at once, and each device gets each byte exactly once. A
    multicast (hops naming one first hop in `multicast`) is one send: its rate counts
    once on each link and device of the union of its paths, and it must fork at a
    device the topology says multicasts, each branch on links of its own."""
    on_link: dict[tuple[str, str], float] = defaultdict(float)
    on_node: dict[str, float] = defaultdict(float)
    groups: dict[int, list[Hop]] = defaultdict(list)
    for index, hop in enumerate(plan.hops):
        assert hop.rate_Bps is not None and hop.rate_Bps > 0 and hop.stage == 0
        groups[index if hop.multicast is None else hop.multicast].append(hop)
    for members in groups.values():
        first = members[0]
        links = {link for hop in members for link in itertools.pairwise(hop.path)}
        nodes = {node for hop in members for node in hop.path[1:-1]}
        for hop in members:
            assert (hop.src, hop.offset_bytes, hop.num_bytes, hop.rate_Bps) == (
                first.src,
                first.offset_bytes,
                first.num_bytes,
                first.rate_Bps,
            )
        if len(members) > 1:
            # Where the paths part, the device must multicast, and past it no two
            # branches (nor a branch and the shared prefix) may use one link.
            at = 0
            while all(len(h.path) > at + 1 for h in members) and (
                len({h.path[at + 1] for h in members}) == 1
            ):
                at += 1
            assert planner.topology.can_multicast(first.path[at]), first.path[at]
            branch_links = [link for h in members for link in itertools.pairwise(h.path[at:])]
            assert len(branch_links) == len(set(branch_links))
            assert not set(branch_links) & set(itertools.pairwise(first.path[: at + 1]))
        for link in links:
            on_link[link] += first.rate_Bps
        for node in nodes:
            on_node[node] += first.rate_Bps
            assert planner.topology.kind_of(node) != "gpu"  # GPUs relay only as endpoints
    for (u, v), rate in on_link.items():
        assert rate <= planner.links.bandwidth(u, v) * (1 + 1e-9), (u, v)
    for node, rate in on_node.items():
        limit = planner.links.throughput(node)
        assert limit is None or rate <= limit * (1 + 1e-9), node
    check_received(plan)


def check_received(plan: TransferPlan) -> None:
    """Each device gets each byte at most once and never one it holds from the start,
    and every receiver gets at least the bytes it wants (relays may hold more, in
    transit)."""
    received: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for hop in plan.hops:
        received[hop.dst].append((hop.offset_bytes, hop.offset_bytes + hop.num_bytes))
    for device, ranges in received.items():
        ranges.sort()
        for lo, hi in ranges:  # nobody is sent bytes it holds from the start
            assert not any(a < hi and lo < b for a, b in plan.holdings(device)), device
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start, f"{device} gets bytes twice"
    for dst in plan.receivers:
        ranges = received[dst]
        wanted = sum(hi - lo for lo, hi in plan.wants(dst))
        assert sum(hi - lo for lo, hi in ranges) >= wanted, f"{dst} misses bytes"


@settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)
@given(
    seed=st.integers(0, 2**32 - 1),
    holders=st.integers(1, 2),
    share=st.floats(0.1, 1.0),
    size=st.sampled_from([64 * MIB, 256 * MIB, 1 << 30]),
)
def test_random_clusters_plans_are_feasible_and_near_the_bound(
    seed: int, holders: int, share: float, size: int
) -> None:
    rng = random.Random(seed)
    topology = random_cluster(rng)
    gpus = topology.gpus()
    rng.shuffle(gpus)
    sources = gpus[: min(holders, len(gpus) - 1)] or gpus[:1]
    rest = gpus[len(sources) :]
    dsts = rest[: max(1, round(share * len(rest)))]
    if not rest:
        return  # one GPU: nothing to move
    planner = Planner(topology)
    flow = planner.plan_from(sources, dsts, size, algorithms=["flow_trees"])
    check_plan(flow)
    check_fluid_schedule(planner, flow)
    assert flow.bound_s is not None
    assert flow.predicted_s >= flow.bound_s * (1 - 1e-9)
    best = planner.plan_from(sources, dsts, size)
    check_plan(best)
    if all(h.rate_Bps is not None and h.stage == 0 for h in best.hops):
        check_fluid_schedule(planner, best)  # a packed pick: rail trees, multicasts
    assert best.bound_s is not None
    assert best.predicted_s >= best.bound_s * (1 - 1e-9), (best.algorithm, best.ratio)
    assert best.ratio is not None and best.ratio <= 1.15, (best.algorithm, best.ratio)
    # The bound is a lower bound at every size, not only where the plans are near it:
    # the same pattern small (a few hops) and mid-sized (pipelined, latency still counts).
    for small in (4 << 10, 256 << 10, 4 * MIB):
        for plan in (
            planner.plan_from(sources, dsts, small),
            planner.plan_from(sources, dsts, small, algorithms=["flow_trees"]),
        ):
            assert plan.bound_s is not None
            assert plan.predicted_s >= plan.bound_s * (1 - 1e-9), (small, plan.algorithm)


def test_bound_takes_each_destinations_rate_with_its_own_latency() -> None:
    """4 MiB from n0.gpu0 to n0.gpu1 (behind a 12.5 GB/s link, 1 us away) and to n1.gpu0
    (25 GB/s, 5 us away): sent straight, the slow one lands at 4 MiB / 12.5 GB/s + 1 us +
    the message cost. The bound once added the slowest rate's time to the farthest
    destination's latency (a random cluster's 4 MiB plan came out at 0.984 of it); a
    lower bound may not exceed what a plan achieves."""
    builder = TopologyBuilder("two hosts, one slow GPU")
    builder.add_device("fabric", "switch")
    for host in ("n0", "n1"):
        cpu = builder.add_device(f"{host}.cpu0", "cpu", host)
        switch = builder.add_device(f"{host}.pcie0", "pcie_switch", host)
        builder.add_link(switch, cpu, 40e9, 0.5e-6, "pcie")
        nic = builder.add_device(f"{host}.nic0", "nic", host)
        builder.add_link(nic, switch, 40e9, 0.5e-6, "pcie")
        builder.add_link(nic, "fabric", 25e9, 1.5e-6, "network")
        builder.add_link(builder.add_device(f"{host}.gpu0", "gpu", host), switch, 40e9, 0.5e-6)
    builder.add_link(builder.add_device("n0.gpu1", "gpu", "n0"), "n0.pcie0", 12.5e9, 0.5e-6)
    planner = Planner(builder.build())
    size = 4 * MIB
    plan = planner.plan("n0.gpu0", ["n0.gpu1", "n1.gpu0"], size)
    slow = size / 12.5e9 + 1e-6 + planner.links.per_message_s
    assert plan.predicted_s == pytest.approx(slow)
    assert plan.bound_s is not None and plan.predicted_s >= plan.bound_s * (1 - 1e-9)
    # The slow GPU's cut is its own link, reached from a GPU over one more: the plan
    # sent straight is at the bound, which no longer adds the far GPU's 5 us.
    assert plan.bound_s == pytest.approx(slow)
    assert plan.bound_s < size / 12.5e9 + 5e-6 + planner.links.per_message_s


@pytest.mark.parametrize(
    ("dsts", "size"),
    [
        ([f"n1.gpu{g}" for g in range(8)], 1 << 30),
        ([f"n{h}.gpu{g}" for h in range(2) for g in range(8)][1:], 1 << 30),
    ],
)
def test_two_node_h200_broadcast_is_at_the_bound(dsts: list[str], size: int) -> None:
    planner = Planner(build_preset("hgx-h200", 2))
    plan = planner.plan("n0.gpu0", dsts, size)
    assert plan.ratio is not None and plan.ratio <= 1.15
    # The cut between the nodes is eight 400G rails, whatever the destinations: the
    # bound is their rate plus a latency floor of microseconds.
    assert 0 < plan.bound_s - size / 400e9 < 20e-6


def test_small_transfers_stay_a_few_hops() -> None:
    planner = Planner(build_preset("hgx-h200", 2))
    dsts = [f"n{h}.gpu{g}" for h in range(2) for g in range(8)][1:]
    plan = planner.plan("n0.gpu0", dsts, 4096)
    depth = {}
    for index, hop in enumerate(plan.hops):
        depth[index] = 1 if hop.after is None else depth[hop.after] + 1
    assert max(depth.values()) <= 3 and plan.chunks <= 2


def test_repeated_pattern_is_a_memo_hit() -> None:
    planner = Planner(build_preset("hgx-h200", 2))
    dsts = [f"n1.gpu{g}" for g in range(8)]
    first = planner.plan("n0.gpu0", dsts, 1 << 30)
    computed = planner.plans_computed
    assert planner.plan("n0.gpu0", dsts, 1 << 30) is first
    assert planner.plans_computed == computed
    planner.mark_link_down("n0.nic0", "leaf0")  # a link change plans afresh
    again = planner.plan("n0.gpu0", dsts, 1 << 30)
    assert again is not first and all(
        ("n0.nic0", "leaf0") not in set(itertools.pairwise(h.path)) for h in again.hops
    )
    assert again.bound_s is not None and first.bound_s is not None
    assert again.bound_s > first.bound_s  # seven rails left


def test_several_holders_raise_the_bound() -> None:
    planner = Planner(build_preset("hgx-h200", 2))
    dsts = [f"n1.gpu{g}" for g in range(4)]
    one = planner.plan("n0.gpu0", dsts, 1 << 30)
    two = planner.plan_from(["n0.gpu0", "n1.gpu7"], dsts, 1 << 30)
    assert two.bound_s is not None and one.bound_s is not None
    assert two.bound_s < one.bound_s and two.predicted_s < one.predicted_s


@pytest.mark.parametrize(
    ("nodes", "dsts", "within"),
    [
        # Tapered pieces bring these from 1.158 and 1.243 (equal pieces) to 1.126, 1.227;
        # 1.135 and 1.236 against the bound that counts latency from the cut on (the plans
        # did not change: the bound is 1.3 us lower, see `packing.bound_from_cuts`).
        (2, [f"n{h}.gpu{g}" for h in range(2) for g in range(8)][1:], 1.145),
        (4, [f"n{h}.gpu{g}" for h in range(4) for g in range(8)][1:], 1.245),
        (1, [f"n0.gpu{g}" for g in range(1, 8)], 1.18),
    ],
)
def test_rail_trees_are_shallow_feasible_and_beat_the_prim_trees(
    nodes: int, dsts: list[str], within: float
) -> None:
    """Scatter to the rail owners, across every rail, all-gather on each host: a fluid
    schedule within every capacity, each byte once, nearer the bound at 64 MiB than the
    Prim-grown flow trees (9-11 levels deep for 15-31 destinations) and a chain."""
    planner = Planner(build_preset("hgx-h100", nodes))
    plan = planner.plan("n0.gpu0", dsts, 64 * MIB, algorithms=["rail_trees"])
    check_plan(plan)
    check_fluid_schedule(planner, plan)
    assert plan.ratio is not None and 1.0 <= plan.ratio <= within
    trees = planner.plan("n0.gpu0", dsts, 64 * MIB, algorithms=["flow_trees", "chain"])
    assert plan.predicted_s < trees.predicted_s
    assert planner.plan("n0.gpu0", dsts, 64 * MIB).predicted_s <= plan.predicted_s
