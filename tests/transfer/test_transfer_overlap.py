from __future__ import annotations

import random

import pytest

from wasma.transfer import exposed_per_layer_s, exposed_s, layer_transfer_times_s


def test_layerwise_hides_transfer_behind_compute() -> None:
    # 32 layers, transfer 32 ms, compute 64 ms: only the first layer's 1 ms shows.
    assert exposed_s(0.032, 32, 0.064) == pytest.approx(0.001)
    # Without layer-by-layer loading, the whole transfer shows.
    assert exposed_s(0.032, 32, 0.064, layerwise=False) == pytest.approx(0.032)


def test_transfer_slower_than_compute_exposes_the_difference() -> None:
    # Each layer's compute waits for its KV: exposed = T + c - C.
    assert exposed_s(0.100, 10, 0.020) == pytest.approx(0.100 + 0.002 - 0.020)


def test_queue_wait_prefetch_hides_more() -> None:
    assert exposed_s(0.050, 10, 0.010, queue_wait_s=0.030) == pytest.approx(
        0.050 + 0.001 - 0.010 - 0.030
    )
    assert exposed_s(0.050, 10, 0.010, queue_wait_s=1.0) == 0.0
    assert exposed_s(0.050, 10, 0.010, queue_wait_s=0.02, layerwise=False) == pytest.approx(0.03)


def test_closed_form_matches_layer_by_layer_simulation() -> None:
    rng = random.Random(3)
    for _ in range(300):
        layers = rng.randint(1, 80)
        transfer = rng.uniform(0, 0.2)
        compute = rng.uniform(0, 0.2)
        wait = rng.choice([0.0, rng.uniform(0, 0.3)])
        simulated = exposed_per_layer_s(
            [transfer / layers] * layers, [compute / layers] * layers, wait
        )
        assert exposed_s(transfer, layers, compute, wait) == pytest.approx(simulated, abs=1e-12)


def test_per_layer_helpers_and_validation() -> None:
    times = layer_transfer_times_s([10**6] * 4, 1e9, latency_s=1e-5)
    assert times == pytest.approx([1.01e-3] * 4)
    # Uneven layers: a big last layer shows.
    assert exposed_per_layer_s([0.0, 0.0, 0.05], [0.01, 0.01, 0.01]) == pytest.approx(0.03)
    with pytest.raises(ValueError):
        exposed_s(0.1, 0, 0.1)
    with pytest.raises(ValueError):
        exposed_s(-0.1, 3, 0.1)
    with pytest.raises(ValueError):
        exposed_per_layer_s([0.1], [0.1, 0.2])
    with pytest.raises(ValueError):
        layer_transfer_times_s([1], 0.0)
