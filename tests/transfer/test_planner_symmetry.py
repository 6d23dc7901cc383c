"""The symmetry memo of `Planner.estimate_s` must price every GPU pair of a preset exactly
as the full per-pair planning does (same floats, not just close ones)."""

from __future__ import annotations

import itertools

import pytest

from wasma.transfer.planner import Planner
from wasma.transfer.presets import load_topology
from wasma.transfer.symmetry import is_automorphism, pair_classes
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


@pytest.mark.parametrize("spec", ["preset:hgx-h100", "preset:pcie-8"])
def test_pairs_of_a_host_class_price_alike_at_every_octave(spec: str) -> None:
    # Within a host, pairs an automorphism maps onto each other share one price (the
    # class's first pair's): every pair, every size octave a KV copy can have, exactly.
    fast = Planner(load_topology(spec))
    reference = Planner(load_topology(spec), by_symmetry=False)
    gpus = fast.topology.gpus()
    for src, dst in itertools.permutations(gpus, 2):
        for octave in range(1, 36):
            size = (1 << (octave - 1)) + (12345 % (1 << (octave - 1)) if octave > 1 else 0)
            assert fast.estimate_s(src, [dst], size) == reference.estimate_s(src, [dst], size), (
                src,
                dst,
                size,
            )
    assert fast.plans_computed * 6 < reference.plans_computed


def test_host_pair_classes_follow_the_wiring() -> None:
    # HGX: a pair under one PCIe switch, on one socket, across sockets. pcie-8's NICs
    # hang off the first switch of each socket, so its switches of a socket differ.
    hgx = Planner(load_topology("preset:hgx-h100:2"))._pair_classes()
    assert sorted(set(hgx.values())) == [("0", "1"), ("0", "2"), ("0", "4")]
    assert hgx[("7", "6")] == ("0", "1") and hgx[("5", "1")] == ("0", "4")
    pcie = Planner(load_topology("preset:pcie-8"))._pair_classes()
    assert len(set(pcie.values())) == 8
    assert pcie[("1", "0")] == ("0", "1") and pcie[("2", "3")] == ("2", "3")


def test_a_declared_relabelling_that_breaks_a_link_is_not_used() -> None:
    topology = load_topology("preset:pcie-8")
    # GPU 0 and GPU 2 sit under different switches: swapping them alone moves links.
    wrong = {"n0.gpu0": "n0.gpu2", "n0.gpu2": "n0.gpu0"}
    assert not is_automorphism(topology, wrong)
    assert all(is_automorphism(topology, m) for m in topology.symmetries)
    topology.symmetries = [wrong]
    classes = pair_classes(topology, "n0", [f"n0.gpu{i}" for i in range(8)])
    assert all(pair == rep for pair, rep in classes.items())
