"""A link-bandwidth transfer model: the fallback `TransferPricer` when no topology is
given. Engines sit 8 to a node (NVSwitch inside, one 400G NIC per GPU between nodes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol


class TransferPricer(Protocol):
    def estimate_s(self, src: str, dsts: Sequence[str], num_bytes: int) -> float: ...


class LinkBandwidthPricer:
    def __init__(
        self,
        engines: Sequence[str],
        gpus_per_node: int = 8,
        intra_node_bytes_per_s: float = 450e9,  # NVLink 4 per direction, H100 SXM
        inter_node_bytes_per_s: float = 50e9,  # 400 Gb/s NIC
        latency_s: float = 20e-6,
    ) -> None:
        self._node = {name: i // gpus_per_node for i, name in enumerate(engines)}
        self.intra = intra_node_bytes_per_s
        self.inter = inter_node_bytes_per_s
        self.latency_s = latency_s

    def estimate_s(self, src: str, dsts: Sequence[str], num_bytes: int) -> float:
        node = self._node[src]
        cross = any(self._node[d] != node for d in dsts)
        bw = self.inter if cross else self.intra
        # Fan-out to several destinations is pipelined: about one copy plus a hop each.
        return self.latency_s * len(dsts) + num_bytes / bw


class DeviceMappedPricer:
    """Prices engine-to-engine moves with a device-level pricer (the topology planner),
    given which device each engine runs on."""

    def __init__(self, inner: TransferPricer, devices: Mapping[str, str]) -> None:
        self.inner = inner
        self.devices = dict(devices)

    def estimate_s(self, src: str, dsts: Sequence[str], num_bytes: int) -> float:
        dev = self.devices
        if len(dsts) == 1:  # the common case, without a list built for it
            return self.inner.estimate_s(dev[src], (dev[dsts[0]],), num_bytes)
        return self.inner.estimate_s(dev[src], [dev[d] for d in dsts], num_bytes)


def hgx_devices(engines: Sequence[str], gpus_per_node: int = 8) -> dict[str, str]:
    """Engine i on GPU i % 8 of node i // 8, the naming of the topology presets."""
    return {e: f"n{i // gpus_per_node}.gpu{i % gpus_per_node}" for i, e in enumerate(engines)}
