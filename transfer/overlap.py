"""Computation-communication overlap: how much of a KV transfer a request actually waits.

With layer-by-layer loading (the connector's per-layer hooks), layer i computes while layer
i+1 arrives; while the request still queues, the transfer runs as a prefetch. The policy
should charge only the exposed remainder.
"""

from __future__ import annotations

from collections.abc import Sequence


def exposed_s(
    transfer_s: float,
    layers: int,
    compute_s: float,
    queue_wait_s: float = 0.0,
    *,
    layerwise: bool = True,
) -> float:
    """Seconds a transfer adds to a request's completion beyond its own compute.

    transfer_s: time to move the KV of all layers; layers: layer count (equal shares);
    compute_s: the forward pass over all layers; queue_wait_s: time before compute could
    start anyway (the transfer starts at once, as a prefetch). Without `layerwise`,
    compute waits for the whole KV.

    Layer i arrives at (i+1)x (x = transfer_s/layers) and computes for c = compute_s/layers
    after both it and layer i-1 are done, so compute ends at the latest of q + L c, x + L c
    and L x + c; the exposed time is that end minus q + L c.
    """
    _check(transfer_s=transfer_s, compute_s=compute_s, queue_wait_s=queue_wait_s)
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if not layerwise:
        return max(0.0, transfer_s - queue_wait_s)
    per_layer_transfer = transfer_s / layers
    per_layer_compute = compute_s / layers
    return max(
        0.0,
        per_layer_transfer - queue_wait_s,
        transfer_s + per_layer_compute - compute_s - queue_wait_s,
    )


def exposed_per_layer_s(
    transfer_s: Sequence[float], compute_s: Sequence[float], queue_wait_s: float = 0.0
) -> float:
    """The same for unequal layers: per-layer transfer and compute times, in order.

    Transfers go back to back from t = 0; layer i computes once its KV is in, layer i-1 is
    done, and the queue wait is over."""
    if len(transfer_s) != len(compute_s) or not transfer_s:
        raise ValueError("need one transfer and one compute time per layer (at least one)")
    _check(transfer_s=min(transfer_s), compute_s=min(compute_s), queue_wait_s=queue_wait_s)
    arrived = 0.0
    finished = queue_wait_s
    for move, compute in zip(transfer_s, compute_s, strict=True):
        arrived += move
        finished = max(finished, arrived) + compute
    return max(0.0, finished - (queue_wait_s + sum(compute_s)))


def layer_transfer_times_s(
    layer_bytes: Sequence[int], bandwidth_Bps: float, latency_s: float = 0.0
) -> list[float]:
    """Per-layer transfer times from per-layer KV bytes on one path."""
    if bandwidth_Bps <= 0:
        raise ValueError("bandwidth must be positive")
    return [latency_s + b / bandwidth_Bps for b in layer_bytes]


def _check(**values: float) -> None:
    for name, value in values.items():
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0, got {value!r}")
