"""Small topologies shared by the transfer tests, as the `topos` fixture."""

from __future__ import annotations

import pytest

from wasma.transfer.topology import Topology, TopologyBuilder


def switch_topology(
    gpus: int,
    bandwidth_Bps: float = 100e9,
    latency_s: float = 1e-6,
    host: str = "n0",
    multicast: bool = False,
) -> Topology:
    """`gpus` GPUs on one switch, identical links (the switch multicasts if asked)."""
    builder = TopologyBuilder(f"switch{gpus}")
    builder.add_device(f"{host}.sw", "nvswitch", host, multicast=multicast)
    for i in range(gpus):
        builder.add_device(f"{host}.gpu{i}", "gpu", host)
        builder.add_link(f"{host}.gpu{i}", f"{host}.sw", bandwidth_Bps, latency_s, "nvlink")
    return builder.build()


def two_by_two() -> Topology:
    """Two hosts of two GPUs: fast switch inside, one slow NIC each between."""
    builder = TopologyBuilder("2x2")
    builder.add_device("fabric", "switch")
    for h in range(2):
        host = f"n{h}"
        builder.add_device(f"{host}.sw", "nvswitch", host)
        builder.add_device(f"{host}.nic0", "nic", host)
        builder.add_link(f"{host}.nic0", f"{host}.sw", 50e9, 0.5e-6, "pcie")
        builder.add_link(f"{host}.nic0", "fabric", 12.5e9, 2e-6, "network")
        for g in range(2):
            builder.add_device(f"{host}.gpu{g}", "gpu", host)
            builder.add_link(f"{host}.gpu{g}", f"{host}.sw", 300e9, 0.7e-6, "nvlink")
    return builder.build()


def two_hosts(gpus: int = 3, multicast: bool = True) -> Topology:
    """Two hosts of `gpus` GPUs on a switch (multicasting unless told not to), each GPU
    with a NIC of its own on one rail switch per GPU index."""
    builder = TopologyBuilder(f"2x{gpus}")
    for g in range(gpus):
        builder.add_device(f"rail{g}", "switch")
    for h in range(2):
        host = f"n{h}"
        builder.add_device(f"{host}.sw", "nvswitch", host, multicast=multicast)
        builder.add_device(f"{host}.pcie", "pcie_switch", host)
        for g in range(gpus):
            gpu = builder.add_device(f"{host}.gpu{g}", "gpu", host)
            builder.add_link(gpu, f"{host}.sw", 300e9, 0.7e-6, "nvlink")
            builder.add_link(gpu, f"{host}.pcie", 50e9, 0.5e-6, "pcie")
            nic = builder.add_device(f"{host}.nic{g}", "nic", host)
            builder.add_link(nic, f"{host}.pcie", 50e9, 0.5e-6, "pcie")
            builder.add_link(nic, f"rail{g}", 25e9, 1.5e-6, "network")
    return builder.build()


def pcie_tree() -> Topology:
    """Four GPUs under two PCIe switches under one root complex."""
    builder = TopologyBuilder("pcie-tree")
    builder.add_device("n0.cpu0", "cpu", "n0")
    for s in range(2):
        builder.add_device(f"n0.pcie{s}", "pcie_switch", "n0")
        builder.add_link(f"n0.pcie{s}", "n0.cpu0", 16e9, 0.5e-6, "pcie")
        for g in range(2):
            name = f"n0.gpu{2 * s + g}"
            builder.add_device(name, "gpu", "n0")
            builder.add_link(name, f"n0.pcie{s}", 24e9, 0.5e-6, "pcie")
    return builder.build()


class Topos:
    """Builders for the small test topologies (a fixture, as tests are imported by path)."""

    switch = staticmethod(switch_topology)
    two_by_two = staticmethod(two_by_two)
    two_hosts = staticmethod(two_hosts)
    pcie_tree = staticmethod(pcie_tree)

    @classmethod
    def named(cls, name: str) -> Topology:
        return {"switch4": lambda: switch_topology(4), "2x2": two_by_two, "pcie": pcie_tree}[name]()


@pytest.fixture
def topos() -> type[Topos]:
    return Topos
