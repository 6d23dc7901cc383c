"""Topology discovery on a GPU host from `nvidia-smi topo -m` output.

The matrix says how each pair of GPUs/NICs connects (NV# bonded NVLinks, PIX/PXB behind
PCIe switches, PHB/NODE/SYS through a host bridge or across sockets). From it we rebuild a
graph with the same structure: an NVSwitch when every GPU pair has the same NVLink count
(HGX), direct NVLinks otherwise; PCIe switches grouping PIX/PXB neighbours; one CPU node
per NUMA node.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess

from wasma.transfer.topology import Topology, TopologyBuilder, TopologyError

NVLINK_PER_LINK_Bps = 25e9  # NVLink 3/4, per link per direction
_DEVICE = re.compile(r"^(GPU|NIC)(\d+)$")
_PCIE_SWITCHED = {"PIX", "PXB"}


def parse_nvidia_smi_topo(
    text: str,
    host: str = "n0",
    *,
    nvlink_per_link_Bps: float = NVLINK_PER_LINK_Bps,
    pcie_Bps: float = 24e9,
    nic_Bps: float = 25e9,
    smp_Bps: float = 60e9,
    nvswitch_multicast: bool | None = None,
) -> Topology:
    """Build a one-host topology from `nvidia-smi topo -m` text. `nvswitch_multicast`
    says whether the NVSwitch (where there is one) multicasts; None reads it from the
    bond: 18 NVLinks a GPU is Hopper or later (third-generation NVSwitch, NVLink SHARP),
    12 (A100) and fewer are older switches that do not."""
    header, rows = _matrix(text)
    devices = [d for d in header if _DEVICE.match(d)]
    if not any(d.startswith("GPU") for d in devices):
        raise TopologyError("nvidia-smi topo output lists no GPUs")
    matrix: dict[str, dict[str, str]] = {}
    numa: dict[str, str] = {}
    for row in rows:
        name, cells = row[0], row[1:]
        if name not in devices:
            continue
        if len(cells) < len(devices):
            raise TopologyError(
                f"nvidia-smi topo row {name!r} has {len(cells)} cells, "
                f"expected at least {len(devices)}"
            )
        matrix[name] = dict(zip(devices, cells[: len(devices)], strict=True))
        extra = cells[len(devices) :]
        # Columns after the matrix: CPU Affinity, NUMA Affinity, GPU NUMA ID (GPU rows only).
        if name.startswith("GPU") and len(extra) >= 2 and extra[1].isdigit():
            numa[name] = extra[1]
    missing = [d for d in devices if d not in matrix]
    if missing:
        raise TopologyError(f"nvidia-smi topo output has no row for {', '.join(missing)}")
    gpus = [d for d in devices if d.startswith("GPU")]
    nics = [d for d in devices if d.startswith("NIC")]
    for dev in devices:
        if dev not in numa:
            # A NIC (or a GPU without affinity) shares the socket of any GPU it reaches
            # without crossing the SMP interconnect.
            near = [g for g in gpus if g in numa and matrix[dev][g] not in {"SYS", "X"}]
            numa[dev] = numa[near[0]] if near else "0"

    builder = TopologyBuilder(f"{host}-discovered")
    sockets = sorted(set(numa.values()), key=int)
    for s in sockets:
        builder.add_device(f"{host}.cpu{s}", "cpu", host)
    for a, b in itertools.pairwise(sockets):
        builder.add_link(f"{host}.cpu{a}", f"{host}.cpu{b}", smp_Bps, 0.3e-6, "smp")
    # GPU3 -> n0.gpu3, NIC1 -> n0.nic1: the names the rest of wasma uses.
    names = {d: f"{host}.{d[:3].lower()}{d[3:]}" for d in devices}
    for d in gpus:
        builder.add_device(names[d], "gpu", host)
    for d in nics:
        builder.add_device(names[d], "nic", host)

    # PCIe: PIX/PXB neighbours sit behind a common switch (union-find over the relation).
    parent = {d: d for d in devices}

    def find(d: str) -> str:
        while parent[d] != d:
            parent[d] = parent[parent[d]]
            d = parent[d]
        return d

    for a in devices:
        for b in devices:
            if a < b and matrix[a][b] in _PCIE_SWITCHED:
                parent[find(a)] = find(b)
    groups: dict[str, list[str]] = {}
    for d in devices:
        groups.setdefault(find(d), []).append(d)
    for index, members in enumerate(sorted(groups.values(), key=lambda m: devices.index(m[0]))):
        switch = builder.add_device(f"{host}.pcie{index}", "pcie_switch", host)
        builder.add_link(switch, f"{host}.cpu{numa[members[0]]}", pcie_Bps, 0.5e-6, "pcie")
        for d in members:
            bandwidth = nic_Bps if d.startswith("NIC") else pcie_Bps
            builder.add_link(names[d], switch, bandwidth, 0.5e-6, "pcie")

    nvlinks = {(a, b): _nvlink_count(matrix[a][b]) for a in gpus for b in gpus if a < b}
    counts = set(nvlinks.values())
    if len(gpus) > 2 and len(counts) == 1 and 0 not in counts:
        # Every pair bonded alike: an NVSwitch fabric (HGX). Per GPU bandwidth = its links.
        (count,) = counts
        multicast = count >= 18 if nvswitch_multicast is None else nvswitch_multicast
        builder.add_device(f"{host}.nvswitch", "nvswitch", host, multicast=multicast)
        for g in gpus:
            builder.add_link(
                names[g], f"{host}.nvswitch", count * nvlink_per_link_Bps, 0.7e-6, "nvlink"
            )
    else:
        for (a, b), count in nvlinks.items():
            if count:
                builder.add_link(names[a], names[b], count * nvlink_per_link_Bps, 0.7e-6, "nvlink")
    return builder.build()


def discover_local(host: str = "n0") -> Topology:
    """Run `nvidia-smi topo -m` here and parse it; TopologyError when unavailable."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise TopologyError("nvidia-smi not found: no NVIDIA GPU to discover on this host")
    result = subprocess.run(
        [exe, "topo", "-m"], capture_output=True, text=True, timeout=30, check=False
    )
    if result.returncode != 0:
        raise TopologyError(f"nvidia-smi topo -m failed: {result.stderr.strip()[:200]}")
    return parse_nvidia_smi_topo(result.stdout, host)


def _nvlink_count(cell: str) -> int:
    match = re.fullmatch(r"NV(\d+)", cell)
    return int(match.group(1)) if match else 0


def _matrix(text: str) -> tuple[list[str], list[list[str]]]:
    # Strip ANSI colour codes that nvidia-smi adds on a terminal.
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).rstrip() for line in text.splitlines()]
    # The header is the first line whose tokens start GPU0 followed by another column
    # name; GPU0's own row follows GPU0 with 'X'.
    header_index = next(
        (
            i
            for i, line in enumerate(lines)
            if line.split()[:1] == ["GPU0"] and line.split()[1:2] != ["X"]
        ),
        None,
    )
    if header_index is None:
        raise TopologyError("not nvidia-smi topo -m output: no header row naming GPU0")
    header = lines[header_index].split()
    rows = []
    for line in lines[header_index + 1 :]:
        if not line.strip() or line.lstrip().startswith("Legend"):
            break
        rows.append(line.split())
    return header, rows
