"""The transfer bench's calibration: what the planner's CPU model is fitted with."""

from __future__ import annotations

import pytest

from wasma.benchmarks.studies.transfer_bench import MIB, P2P_CONFIGS, Samples, fit, with_memory


def synthetic(start: float, alpha: float, beta: float) -> dict[tuple[int, int], Samples]:
    return {
        (mib, k): Samples([start + k * alpha + mib * MIB / beta, 9.0]) for mib, k in P2P_CONFIGS
    }


def test_fit_recovers_the_model() -> None:
    cal = fit(synthetic(300e-6, 5e-6, 10e9))
    assert cal.start_s == pytest.approx(300e-6, rel=1e-6)
    assert cal.alpha_s == pytest.approx(5e-6, rel=1e-6)
    assert cal.beta_Bps == pytest.approx(10e9, rel=1e-6)


def test_fit_keeps_start_up_non_negative() -> None:
    # Small copies from cache: faster per byte than large ones, which would put the
    # intercept below zero; the fit pins it at zero and refits the bandwidth.
    samples = synthetic(0.0, 2e-6, 10e9)
    for k in (1, 64):
        samples[4, k] = Samples([samples[4, k].best * 0.5])
    cal = fit(samples)
    assert cal.start_s == 0.0
    assert cal.alpha_s == pytest.approx(2e-6, rel=0.05)
    assert 9e9 < cal.beta_Bps < 11e9


def test_host_capacity_from_fan_outs() -> None:
    cal = fit(synthetic(0.0, 1e-6, 10e9))
    size = 64 * MIB
    # Two copies at once take 1.5x as long as one: the host moves 4/3 of one copy's rate.
    fans = {2: Samples([1e-6 + 1.5 * size / 10e9]), 3: Samples([1e-6 + 2.4 * size / 10e9])}
    assert with_memory(cal, fans, size).memory_Bps == pytest.approx(2 / 1.5 * 10e9, rel=1e-6)
