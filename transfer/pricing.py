"""What the scheduler needs from a transfer model: a price in seconds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class TransferPricer(Protocol):
    """Anything that prices moving `num_bytes` from `src` to every device in `dsts`."""

    def estimate_s(self, src: str, dsts: Sequence[str], num_bytes: int) -> float: ...


# The name the issue uses for the same contract.
LinkModel = TransferPricer


class BandwidthPricer:
    """The trivial model: one latency plus bytes over one bandwidth per destination group;
    destinations are fed by a pipelined chain, so each extra one adds only its latency."""

    def __init__(self, bandwidth_Bps: float, latency_s: float = 10e-6) -> None:
        if bandwidth_Bps <= 0 or latency_s < 0:
            raise ValueError("bandwidth must be positive and latency >= 0")
        self.bandwidth_Bps = bandwidth_Bps
        self.latency_s = latency_s

    def estimate_s(self, src: str, dsts: Sequence[str], num_bytes: int) -> float:
        if not dsts or num_bytes == 0:
            return 0.0
        return self.latency_s * len(dsts) + num_bytes / self.bandwidth_Bps
