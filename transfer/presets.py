"""Built-in cluster shapes, addressed as `preset:NAME[:NODES]` on the command line.

Figures are per direction and what transfers achieve, not marketing peaks:
- HGX H100/H200: 8 GPUs on NVSwitch (NVLink 4, 18 links x 25 GB/s = 450 GB/s each way);
  per pair of GPUs a PCIe Gen5 switch that also holds two 400G NICs (GPUDirect RDMA,
  one NIC per GPU); two CPU sockets. H200 differs from H100 in HBM, not in fabric. Their
  third-generation NVSwitch multicasts (NVLink SHARP: a GPU writes a piece once into the
  switch, which delivers it to every GPU of the group; NCCL's NVLS algorithms).
- pcie-8: 8 GPUs without NVLink, two per PCIe Gen4 switch (~24 GB/s), two sockets joined
  by UPI, one 200G NIC per socket.
- Between nodes, a rail-optimised two-level fat tree: NIC i of every node plugs into leaf
  switch i (rail i), leaves connect to spines with full bisection bandwidth.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

from wasma.transfer.topology import Topology, TopologyBuilder, TopologyError


@dataclass(frozen=True)
class NodeShape:
    gpus: int
    nvlink_Bps: float | None  # GPU <-> NVSwitch; None: no NVLink
    pcie_Bps: float  # GPU/NIC <-> PCIe switch
    pcie_switches: int
    nics: int
    nic_Bps: float
    smp_Bps: float  # socket <-> socket
    sockets: int = 2


NVLINK4_Bps = 450e9
PCIE5_Bps = 55e9  # x16 Gen5 after protocol overhead
PCIE4_Bps = 24e9
NIC_400G_Bps = 50e9
NIC_200G_Bps = 25e9
UPI_Bps = 60e9

NVLINK_LATENCY_S = 0.7e-6
PCIE_LATENCY_S = 0.5e-6
NETWORK_LATENCY_S = 1.5e-6  # per cable and switch hop, RDMA
SMP_LATENCY_S = 0.3e-6
SPINES = 4

SHAPES: dict[str, NodeShape] = {
    "hgx-h100": NodeShape(8, NVLINK4_Bps, PCIE5_Bps, 4, 8, NIC_400G_Bps, UPI_Bps),
    "hgx-h200": NodeShape(8, NVLINK4_Bps, PCIE5_Bps, 4, 8, NIC_400G_Bps, UPI_Bps),
    "pcie-8": NodeShape(8, None, PCIE4_Bps, 4, 2, NIC_200G_Bps, UPI_Bps),
}


def build_preset(name: str, nodes: int = 1) -> Topology:
    if name not in SHAPES:
        raise TopologyError(f"unknown preset {name!r} (known: {', '.join(sorted(SHAPES))})")
    if nodes < 1:
        raise TopologyError(f"preset {name}: node count must be >= 1, got {nodes}")
    shape = SHAPES[name]
    builder = TopologyBuilder(f"{name}x{nodes}" if nodes > 1 else name)
    for node in range(nodes):
        _add_node(builder, f"n{node}", shape)
    if nodes > 1:
        _add_fat_tree(builder, nodes, shape)
    topology = builder.build()
    topology.hosts_alike = True
    topology.symmetries = _symmetries(shape, nodes)
    return topology


def _symmetries(shape: NodeShape, nodes: int) -> list[dict[str, str]]:
    """Swaps that map a preset onto itself, made on every host at once: two GPUs under
    one PCIe switch; two switches of one socket, with their GPUs and NICs; two sockets,
    with their switches. NICs that trade places trade rails (leaf switches) too. Shapes
    where such a swap does not pair devices one to one give none for it."""
    p, g, n, s = shape.pcie_switches, shape.gpus, shape.nics, shape.sockets
    gpus_of = [[i for i in range(g) if i * p // g == k] for k in range(p)]
    nics_of = [[i for i in range(n) if i * p // n == k] for k in range(p)]
    switches_of = [[k for k in range(p) if k * s // p == c] for c in range(s)]

    def block(a: int, b: int) -> list[tuple[str, str]] | None:
        if len(gpus_of[a]) != len(gpus_of[b]) or len(nics_of[a]) != len(nics_of[b]):
            return None
        return [
            (f"pcie{a}", f"pcie{b}"),
            *((f"gpu{x}", f"gpu{y}") for x, y in zip(gpus_of[a], gpus_of[b], strict=True)),
            *((f"nic{x}", f"nic{y}") for x, y in zip(nics_of[a], nics_of[b], strict=True)),
        ]

    swaps: list[list[tuple[str, str]]] = []
    for on_switch in gpus_of:
        swaps.extend([(f"gpu{x}", f"gpu{y}")] for x, y in itertools.pairwise(on_switch))
    for on_socket in switches_of:
        for a, b in itertools.pairwise(on_socket):
            pairs = block(a, b)
            if pairs is not None:
                swaps.append(pairs)
    for c, d in itertools.pairwise(range(s)):
        if len(switches_of[c]) != len(switches_of[d]):
            continue
        pairs = [(f"cpu{c}", f"cpu{d}")]
        for a, b in zip(switches_of[c], switches_of[d], strict=True):
            more = block(a, b)
            if more is None:
                break
            pairs.extend(more)
        else:
            swaps.append(pairs)
    out = []
    for pairs in swaps:
        mapping: dict[str, str] = {}
        for x, y in pairs:
            for host in range(nodes):
                mapping[f"n{host}.{x}"], mapping[f"n{host}.{y}"] = f"n{host}.{y}", f"n{host}.{x}"
            if nodes > 1 and x.startswith("nic"):
                rail_x, rail_y = f"leaf{x[3:]}", f"leaf{y[3:]}"
                mapping[rail_x], mapping[rail_y] = rail_y, rail_x
        out.append(mapping)
    return out


def _add_node(builder: TopologyBuilder, host: str, shape: NodeShape) -> None:
    sockets = [builder.add_device(f"{host}.cpu{s}", "cpu", host) for s in range(shape.sockets)]
    for a, b in itertools.pairwise(sockets):
        builder.add_link(a, b, shape.smp_Bps, SMP_LATENCY_S, "smp")
    switches = []
    for p in range(shape.pcie_switches):
        switch = builder.add_device(f"{host}.pcie{p}", "pcie_switch", host)
        # Switches are spread evenly over sockets, first half on socket 0.
        socket = sockets[p * shape.sockets // shape.pcie_switches]
        builder.add_link(switch, socket, shape.pcie_Bps, PCIE_LATENCY_S, "pcie")
        switches.append(switch)
    nvswitch = None
    if shape.nvlink_Bps is not None:
        # Third-generation NVSwitch (HGX H100/H200) multicasts (NVLink SHARP, NCCL's NVLS).
        nvswitch = builder.add_device(f"{host}.nvswitch", "nvswitch", host, multicast=True)
    for g in range(shape.gpus):
        gpu = builder.add_device(f"{host}.gpu{g}", "gpu", host)
        builder.add_link(
            gpu,
            switches[g * shape.pcie_switches // shape.gpus],
            shape.pcie_Bps,
            PCIE_LATENCY_S,
            "pcie",
        )
        if nvswitch is not None and shape.nvlink_Bps is not None:
            builder.add_link(gpu, nvswitch, shape.nvlink_Bps, NVLINK_LATENCY_S, "nvlink")
    for n in range(shape.nics):
        nic = builder.add_device(f"{host}.nic{n}", "nic", host)
        builder.add_link(
            nic,
            switches[n * shape.pcie_switches // shape.nics],
            shape.pcie_Bps,
            PCIE_LATENCY_S,
            "pcie",
        )


def _add_fat_tree(builder: TopologyBuilder, nodes: int, shape: NodeShape) -> None:
    leaves = [builder.add_device(f"leaf{r}", "switch") for r in range(shape.nics)]
    spines = [builder.add_device(f"spine{s}", "switch") for s in range(SPINES)]
    for rail, leaf in enumerate(leaves):
        for node in range(nodes):
            builder.add_link(
                f"n{node}.nic{rail}", leaf, shape.nic_Bps, NETWORK_LATENCY_S, "network"
            )
        # Full bisection: a leaf's uplinks together match its downlinks.
        for spine in spines:
            builder.add_link(
                leaf, spine, shape.nic_Bps * nodes / SPINES, NETWORK_LATENCY_S, "network"
            )


def build_cpu_cluster(
    hosts: int = 1,
    workers_per_host: int = 4,
    *,
    copy_Bps: float = 5e9,
    cores: float = 2,
    tcp_Bps: float = 2e9,
    tcp_latency_s: float = 20e-6,
    copy_latency_s: float = 0.0,
    memory_Bps: float | None = None,
) -> Topology:
    """Worker processes as devices (named like GPUs, `n0.gpu0`...), for the CPU executor.

    A hop inside a host is one memcpy done by the receiving process: a worker takes in
    `copy_Bps` (one copy running alone; its link's CPU -> worker direction), while readers
    of its buffer are only bounded by the host. The host's CPU node caps all concurrent
    copies together, shared evenly among them, at the smaller of two limits: `cores` x
    `copy_Bps`, since a copy occupies a core, and `memory_Bps`, the copy rate the host's
    memory sustains summed over concurrent copies (each reads and writes every byte
    through the same memory controllers, so two copies at once rarely run twice as fast
    as one; None: no limit beyond the cores). Hosts talk over TCP through a LAN switch at
    `tcp_Bps`."""
    if hosts < 1 or workers_per_host < 1 or not cores > 0:
        raise TopologyError("hosts and workers_per_host must be >= 1, cores > 0")
    if memory_Bps is not None and not memory_Bps > 0:
        raise TopologyError("memory_Bps must be > 0")
    host_Bps = cores * copy_Bps if memory_Bps is None else min(cores * copy_Bps, memory_Bps)
    builder = TopologyBuilder(f"cpu-{hosts}x{workers_per_host}")
    if hosts > 1:
        builder.add_device("lan", "switch")
    for h in range(hosts):
        host = f"n{h}"
        cpu = builder.add_device(f"{host}.cpu0", "cpu", host, throughput_Bps=host_Bps)
        for w in range(workers_per_host):
            worker = builder.add_device(f"{host}.gpu{w}", "gpu", host)
            builder.add_link(
                worker, cpu, host_Bps, copy_latency_s, "memory", bandwidth_back_Bps=copy_Bps
            )
        if hosts > 1:
            nic = builder.add_device(f"{host}.nic0", "nic", host)
            builder.add_link(nic, cpu, copy_Bps, 0.0, "pcie")
            builder.add_link(nic, "lan", tcp_Bps, tcp_latency_s / 2, "network")
    return builder.build()


def load_topology(spec: str) -> Topology:
    """`preset:NAME[:NODES]` or a YAML file path."""
    if spec.startswith("preset:"):
        parts = spec.split(":")
        if len(parts) not in (2, 3) or not parts[1]:
            raise TopologyError(f"bad preset {spec!r}: expected preset:NAME[:NODES]")
        nodes = 1
        if len(parts) == 3:
            try:
                nodes = int(parts[2])
            except ValueError:
                raise TopologyError(
                    f"bad preset {spec!r}: node count {parts[2]!r} is not an integer"
                ) from None
        return build_preset(parts[1], nodes)
    path = Path(spec)
    if not path.exists():
        raise TopologyError(
            f"topology {spec!r} is neither a preset (preset:{'|'.join(sorted(SHAPES))}[:NODES]) "
            "nor an existing file"
        )
    return Topology.from_yaml(path)
