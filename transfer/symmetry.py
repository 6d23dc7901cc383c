"""Relabellings of a topology that map it onto itself (automorphisms), and the classes of
GPU pairs on one host that they make alike.

A transfer between two GPUs of one host is the same problem for every pair that an
automorphism maps onto it: two GPUs under one PCIe switch swapped, two switches of one
socket swapped with what hangs off them, the sockets swapped. `Planner.estimate_s` prices
one pair of each class (`pair_classes`) where the topology declares its automorphisms (the
presets do, `Topology.symmetries`). Every declared relabelling is checked against the
links before it is used (`is_automorphism`), so a wrong declaration merges nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

from wasma.transfer.topology import Topology, TopologyError

# A relabelling of devices: device -> its image (devices it leaves alone are absent).
Relabelling = Mapping[str, str]


def is_automorphism(topology: Topology, mapping: Relabelling) -> bool:
    """Whether `mapping` is a permutation of devices that keeps every device's kind and
    maps every link onto a link with the same bandwidth (each way), latency and kind."""
    images = set(mapping.values())
    if len(images) != len(mapping) or images != set(mapping):
        return False  # not a permutation of the devices it moves
    for name, image in mapping.items():
        if name not in topology or image not in topology:
            return False
        if topology.kind_of(name) != topology.kind_of(image):
            return False
    for link in topology.links():
        try:
            moved = topology.link(mapping.get(link.u, link.u), mapping.get(link.v, link.v))
        except TopologyError:
            return False  # mapped onto devices with no link between them
        if (moved.bandwidth_Bps, moved.back_Bps, moved.latency_s, moved.kind) != (
            link.bandwidth_Bps,
            link.back_Bps,
            link.latency_s,
            link.kind,
        ):
            return False
    return True


def pair_classes(
    topology: Topology, host: str, gpus: Sequence[str]
) -> dict[tuple[str, str], tuple[str, str]]:
    """For each ordered pair of distinct `gpus` (all on `host`), the first pair (in the
    order of `gpus`) of its class under the topology's checked automorphisms."""
    assert all(topology.host_of(g) == host for g in gpus)
    checked = [m for m in topology.symmetries if is_automorphism(topology, m)]
    pairs = list(itertools.permutations(gpus, 2))
    on_host = set(gpus)
    rep: dict[tuple[str, str], tuple[str, str]] = {}
    for pair in pairs:
        if pair in rep:
            continue
        # The orbit of `pair`: every pair the checked relabellings reach from it.
        rep[pair] = pair
        todo = [pair]
        while todo:
            a, b = todo.pop()
            for m in checked:
                image = (m.get(a, a), m.get(b, b))
                if image[0] in on_host and image[1] in on_host and image not in rep:
                    rep[image] = pair
                    todo.append(image)
    return rep
