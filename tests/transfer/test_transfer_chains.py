"""Chains on links of their own (`transfer/chains.py`): where PCIe switches cannot
duplicate, a broadcast at a GPU's out-link rate is a chain; two half-rate chains through
mates halve its depth."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from wasma.transfer import Planner, build_preset
from wasma.transfer.algorithms import with_chunks
from wasma.transfer.chains import mates
from wasma.transfer.cpu_executor import CpuExecutor
from wasma.transfer.plan import check_plan

from .test_transfer_packing import check_fluid_schedule

MIB = 1 << 20


def _all_others(nodes: int) -> list[str]:
    return [f"n{h}.gpu{g}" for h in range(nodes) for g in range(8)][1:]


def test_mates_share_a_pcie_switch() -> None:
    planner = Planner(build_preset("pcie-8", 2))
    pairs = mates(planner.links, ["n0.gpu0", *_all_others(2)])
    assert pairs[0] == ("n0.gpu0", "n0.gpu1")
    assert all(
        b is not None and a[:-1] == b[:-1] and int(a[-1]) // 2 == int(b[-1]) // 2 for a, b in pairs
    )


def test_disjoint_chain_reaches_the_bounds_rate_on_four_pcie_nodes() -> None:
    """The shapes' ring routes each hop alone and shares links (0.52-0.55x of this);
    the packed trees stop at about 21 of the bound's 24 GB/s."""
    planner = Planner(build_preset("pcie-8", 4))
    plan = planner.plan("n0.gpu0", _all_others(4), 1 << 30, algorithms=["disjoint_chain"])
    check_plan(plan)
    check_fluid_schedule(planner, plan)
    assert len(plan.hops) == 31 and all(h.rate_Bps == pytest.approx(24e9) for h in plan.hops)
    ring = planner.plan("n0.gpu0", _all_others(4), 1 << 30, algorithms=["chain"])
    assert plan.predicted_s < 0.6 * ring.predicted_s


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_paired_chains_bring_pcie_broadcasts_near_the_bound(nodes: int) -> None:
    """Four pcie-8 nodes, all 31 others, were 1.416 (64 MiB) and 1.374 (1 GiB) of the
    bound with packed trees; a chain at the full rate is 31 hops deep (1.218 at 64 MiB),
    two chains of pairs 17."""
    planner = Planner(build_preset("pcie-8", nodes))
    dsts = _all_others(nodes)
    for size in (64 * MIB, 1 << 30):
        plan = planner.plan("n0.gpu0", dsts, size)
        assert plan.algorithm == "paired_chains", (size, plan.algorithm)
        check_plan(plan)
        check_fluid_schedule(planner, plan)
        assert all(h.rate_Bps == pytest.approx(12e9) for h in plan.hops)
        assert plan.ratio is not None and 1 - 1e-9 <= plan.ratio <= 1.15, (size, plan.ratio)
        depth: dict[int, int] = {}
        for index, hop in enumerate(plan.hops):
            depth[index] = 1 if hop.after is None else depth[hop.after] + 1
        assert max(depth.values()) <= len(dsts) // 2 + 2


@pytest.mark.parametrize("count", [2, 5, 6])
def test_paired_chains_reach_an_odd_one_out(count: int) -> None:
    """With an odd number of GPUs one has no mate: tree B's chain end sends it B's half."""
    planner = Planner(build_preset("pcie-8"))
    dsts = [f"n0.gpu{g}" for g in range(1, count + 1)]
    plan = planner.plan("n0.gpu0", dsts, 64 * MIB, algorithms=["paired_chains"])
    check_plan(plan)
    check_fluid_schedule(planner, plan)
    assert plan.bound_s is not None and plan.predicted_s >= plan.bound_s * (1 - 1e-9)


@pytest.mark.parametrize("algorithm", ["disjoint_chain", "paired_chains"])
@pytest.mark.parametrize(
    ("name", "src"), [("pcie", "n0.gpu0"), ("pcie", "n0.gpu1"), ("2x2", "n0.gpu0")]
)
def test_chains_run_byte_exactly(algorithm: str, name: str, src: str, topos: Any) -> None:
    topo = topos.named(name)
    dsts = [g for g in topo.gpus() if g != src]
    planner = Planner(topo, max_chunks=8)
    plan = planner.plan(src, dsts, 1_000_003, algorithms=[algorithm])
    # At 1 MB the model wants few pieces; force several to exercise forwarding.
    plan = replace(plan, hops=tuple(with_chunks(plan.hops, 5)), chunks=5)
    check_plan(plan)
    result = CpuExecutor(topo).run(plan, timeout_s=60)
    assert result.verified and len(result.hop_finish_s) == len(plan.hops)
