"""The symmetry memo of `Planner.estimate_s` must price every GPU pair of a preset exactly
as the full per-pair planning does (same floats, not just close ones)."""

from __future__ import annotations

import itertools

import pytest

from wasma.transfer.planner import Planner
from wasma.transfer.presets import load_topology
from wasma.transfer.topology import Topology

SIZES = (4096, 700 << 20)


@pytest.mark.parametrize("spec", ["preset:hgx-h100:3", "preset:pcie-8:2", "preset:hgx-h200:2"])
def test_symmetric_prices_equal_per_pair_prices(spec: str) -> None:
    fast = Planner(load_topology(spec))
    reference = Planner(load_topology(spec), by_symmetry=False)
    assert fast.by_symmetry and not reference.by_symmetry
    gpus = fast.topology.gpus()
    for src, dst in itertools.permutations(gpus, 2):
        for size in SIZES:
            assert fast.estimate_s(src, [dst], size) == reference.estimate_s(src, [dst], size), (
                src,
                dst,
                size,
            )
    # The memo did its job: far fewer plans than the reference built.
    assert fast.plans_computed < reference.plans_computed


def test_symmetry_off_after_a_link_changes() -> None:
    planner = Planner(load_topology("preset:hgx-h100:2"))
    planner.estimate_s("n0.gpu0", ["n1.gpu0"], 1 << 20)
    planner.links.set_bandwidth("n1.gpu0", "n1.pcie0", 1e9)
    reference = Planner(load_topology("preset:hgx-h100:2"), by_symmetry=False)
    reference.links.set_bandwidth("n1.gpu0", "n1.pcie0", 1e9)
    for src, dst in [("n0.gpu0", "n1.gpu0"), ("n1.gpu0", "n0.gpu0"), ("n0.gpu1", "n1.gpu1")]:
        assert planner.estimate_s(src, [dst], 1 << 20) == reference.estimate_s(src, [dst], 1 << 20)


def test_topology_from_a_file_has_no_symmetry() -> None:
    topology = load_topology("preset:hgx-h100:2")
    assert not Planner(Topology.from_dict(topology.to_dict())).by_symmetry


def test_prices_survive_a_reservation_released() -> None:
    planner = Planner(load_topology("preset:hgx-h100:2"))
    idle = planner.links.state
    assert planner.links.as_built
    first = planner.estimate_s("n0.gpu0", ["n1.gpu3"], 5 << 20)
    built = planner.plans_computed
    plan = planner.plan("n0.gpu1", "n1.gpu1", 1 << 20)
    planner.reserve(plan)
    assert planner.links.state != idle and not planner.links.as_built
    planner.release(plan)
    # The table is as it was: the same key, the memo kept, no plan rebuilt.
    assert planner.links.state == idle and planner.links.as_built
    built = planner.plans_computed
    assert planner.estimate_s("n0.gpu0", ["n1.gpu3"], 5 << 20) == first
    assert planner.plans_computed == built


def test_a_learned_speed_is_a_new_state_even_when_set_back() -> None:
    planner = Planner(load_topology("preset:hgx-h100:2"))
    idle = planner.links.state
    bandwidth = planner.links.bandwidth("n1.gpu0", "n1.pcie0")
    planner.links.set_bandwidth("n1.gpu0", "n1.pcie0", bandwidth)
    # Learned speeds are not compared link by link: any update is a new state.
    assert planner.links.state != idle and not planner.links.as_built
