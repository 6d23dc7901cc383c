"""Live cost calibration: scale factors learned from request timings, bounded, pure."""

from __future__ import annotations

import math

import pytest

from wasma.core.profile import load_profile
from wasma.scheduler.calibration import (
    CalibrationConfig,
    CostCalibrator,
    RequestTiming,
    scaled_profile,
)

PROFILE = load_profile("tiny-cpu")


def _timing(
    cal: CostCalibrator,
    prefill: float,
    decode: float,
    prompt: int = 1024,
    cached: int = 0,
    out: int = 32,
    queued: int = 0,
    batch: int = 2,
    ctx: int = 512,
    seq: float | None = None,
) -> RequestTiming:
    """A request whose durations are what a profile scaled by (prefill, decode[, seq])
    predicts."""
    truth = CostCalibrator(scaled_profile(cal.base, prefill, decode, seq))
    t = RequestTiming(prompt, cached, out, 0.0, 0.0, queued, batch, ctx)
    per_step, per_token = truth._prefill_pred_s(t)
    return RequestTiming(
        prompt, cached, out, per_step + per_token, truth._decode_pred_s(t), queued, batch, ctx
    )


def test_starts_at_the_profile_and_warms_up() -> None:
    cal = CostCalibrator(PROFILE, CalibrationConfig(warmup_requests=3))
    assert cal.scales() == (1.0, 1.0)
    assert cal.profile() == PROFILE
    for _ in range(2):
        assert not cal.observe(_timing(cal, 4.0, 3.0))
    assert cal.scales() == (1.0, 1.0)  # not yet warmed up
    assert cal.observe(_timing(cal, 4.0, 3.0))  # moved well past the republish limit


FIT = CalibrationConfig(min_fit_samples=0)  # lines fitted from the first request on


def test_recovers_separate_prefill_and_decode_factors() -> None:
    cal = CostCalibrator(PROFILE, FIT)
    shapes = [(1024, 0, 0), (1024, 768, 0), (400, 0, 2048), (1800, 1024, 512)]
    for i in range(60):
        prompt, cached, queued = shapes[i % len(shapes)]
        cal.observe(_timing(cal, 6.0, 2.5, prompt=prompt, cached=cached, queued=queued))
    p, d = cal.scales()
    assert d == pytest.approx(2.5, rel=1e-6)
    assert p == pytest.approx(6.0, rel=1e-6)
    prof = cal.profile()
    assert prof.step.per_prefill_token_s == pytest.approx(PROFILE.step.per_prefill_token_s * 6)
    assert prof.step.per_prefill_attn_s == pytest.approx(PROFILE.step.per_prefill_attn_s * 6)
    assert prof.step.base_s == pytest.approx(PROFILE.step.base_s * 2.5)
    assert prof.step.per_decode_seq_s == pytest.approx(PROFILE.step.per_decode_seq_s * 2.5)
    # Only the step model changes: limits and sizes are the engines'.
    assert (prof.block_size, prof.num_kv_blocks, prof.max_num_batched_tokens) == (
        PROFILE.block_size,
        PROFILE.num_kv_blocks,
        PROFILE.max_num_batched_tokens,
    )


def test_scaled_profile_predicts_the_observed_times() -> None:
    cal = CostCalibrator(PROFILE, FIT)
    for _ in range(40):
        cal.observe(_timing(cal, 3.0, 5.0, prompt=900, out=40))
    t = _timing(cal, 3.0, 5.0, prompt=900, out=40)
    fitted = CostCalibrator(cal.profile())
    per_step, per_token = fitted._prefill_pred_s(t)
    assert per_step + per_token == pytest.approx(t.ttft_s, rel=1e-6)
    assert fitted._decode_pred_s(t) == pytest.approx(t.decode_s, rel=1e-6)


def test_scales_are_bounded() -> None:
    cfg = CalibrationConfig(min_scale=0.5, max_scale=8.0, warmup_requests=1)
    slow = CostCalibrator(PROFILE, cfg)
    for _ in range(30):
        slow.observe(RequestTiming(1024, 0, 32, ttft_s=60.0, decode_s=90.0))
    assert slow.scales() == (8.0, 8.0)
    fast = CostCalibrator(PROFILE, cfg)
    for _ in range(30):
        fast.observe(RequestTiming(1024, 0, 32, ttft_s=1e-7, decode_s=1e-7))
    assert fast.scales() == (0.5, 0.5)


def test_recent_requests_outweigh_old_ones() -> None:
    cal = CostCalibrator(PROFILE, CalibrationConfig(weight=0.2, min_fit_samples=0))
    for _ in range(50):
        cal.observe(_timing(cal, 2.0, 2.0))
    for _ in range(50):
        cal.observe(_timing(cal, 10.0, 4.0))
    p, d = cal.scales()
    assert p == pytest.approx(10.0, rel=1e-3)
    assert d == pytest.approx(4.0, rel=1e-3)


def test_ignores_unusable_timings() -> None:
    cal = CostCalibrator(PROFILE, CalibrationConfig(warmup_requests=1, min_fit_samples=0))
    for bad in (
        RequestTiming(1024, 0, 32, ttft_s=math.nan, decode_s=0.1),
        RequestTiming(1024, 0, 32, ttft_s=0.1, decode_s=math.inf),
        RequestTiming(1024, 0, 32, ttft_s=-1.0, decode_s=0.1),
        RequestTiming(0, 0, 32, ttft_s=0.1, decode_s=0.1),
    ):
        assert not cal.observe(bad)
    assert cal.samples == 0 and cal.scales() == (1.0, 1.0)
    # A one-token request says nothing about decode; its prefill still counts.
    cal.observe(_timing(cal, 3.0, 1.0, out=1))
    assert cal.decode_samples == 0
    assert cal.scales() == pytest.approx((3.0, 1.0))


def test_republishes_only_on_material_change() -> None:
    cal = CostCalibrator(PROFILE, CalibrationConfig(warmup_requests=1, republish_change=0.15))
    assert cal.observe(_timing(cal, 4.0, 4.0))
    first = cal.publish()
    assert first.step.base_s == pytest.approx(PROFILE.step.base_s * 4.0)
    assert cal.snapshot()["published_step_scale"] == pytest.approx(4.0)
    # Same speed again: nothing to publish.
    assert not any(cal.observe(_timing(cal, 4.0, 4.0)) for _ in range(20))
    # Much slower decode: publish once it has moved by more than 15%.
    flags = [cal.observe(_timing(cal, 4.0, 8.0)) for _ in range(20)]
    assert any(flags)


def test_deterministic() -> None:
    def run() -> tuple[float, float]:
        cal = CostCalibrator(PROFILE)
        for i in range(25):
            cal.observe(_timing(cal, 1.0 + i % 5, 2.0 + i % 3, prompt=300 + 37 * i))
        return cal.scales()

    assert run() == run()


def test_config_is_checked() -> None:
    with pytest.raises(ValueError):
        CalibrationConfig(weight=0.0)
    with pytest.raises(ValueError):
        CalibrationConfig(min_scale=2.0)
    with pytest.raises(ValueError):
        CalibrationConfig(max_scale=0.5)


def test_fixed_per_request_overhead_is_not_charged_to_prefill_tokens() -> None:
    """A remote engine's HTTP and API-server cost is the same for a short prompt and a
    long one: it must come out as overhead, not as slower prefill."""
    cal = CostCalibrator(PROFILE, FIT)
    shapes = [(1800, 0, 0), (1024, 960, 0), (400, 0, 2048), (1500, 256, 512), (600, 0, 0)]
    for i in range(80):
        prompt, cached, queued = shapes[i % len(shapes)]
        t = _timing(cal, 3.0, 2.0, prompt=prompt, cached=cached, queued=queued)
        cal.observe(
            RequestTiming(
                t.prompt_tokens,
                t.cached_tokens,
                t.output_tokens,
                t.ttft_s + 0.08,  # 80 ms of hops on every request
                t.decode_s,
                t.queued_prefill_tokens,
                t.batch,
                t.batch_context_tokens,
            )
        )
    p, d = cal.scales()
    assert d == pytest.approx(2.0, rel=1e-6)
    assert p == pytest.approx(3.0, rel=1e-3)
    assert cal.overhead_s == pytest.approx(0.08, rel=1e-3)
    assert cal.snapshot()["overhead_s"] == pytest.approx(0.08, rel=1e-3)


def test_separates_the_fixed_step_cost_from_the_cost_of_batching() -> None:
    """On a busy host every step costs more (scheduling, the API server, other
    processes) while one more sequence in the batch costs about what it did: the two
    must not be lumped, or joining a busy engine looks far dearer than it is."""
    cal = CostCalibrator(PROFILE, FIT)
    for i in range(120):
        batch = 1 + (i * 7) % 24
        ctx = 300 * (batch - 1)
        t = _timing(cal, 2.0, 6.0, prompt=600 + (i % 5) * 200, batch=batch, ctx=ctx, seq=1.5)
        cal.observe(t)
    c = cal.current()
    assert c.step == pytest.approx(6.0, rel=1e-3)
    assert c.seq == pytest.approx(1.5, rel=1e-3)
    assert c.prefill == pytest.approx(2.0, rel=1e-3)
    prof = cal.profile()
    assert prof.step.base_s == pytest.approx(PROFILE.step.base_s * 6.0, rel=1e-3)
    assert prof.step.per_decode_seq_s == pytest.approx(
        PROFILE.step.per_decode_seq_s * 1.5, rel=1e-3
    )


def test_until_enough_requests_every_factor_is_the_decode_ratio() -> None:
    """A few dozen timings do not pin down slopes: until `min_fit_samples`, the profile
    is scaled uniformly (the policy keeps its fitted trade-offs at the engines' pace)."""
    cfg = CalibrationConfig(min_fit_samples=40)
    cal = CostCalibrator(PROFILE, cfg)
    shapes = [(1024, 0, 0, 1), (1024, 768, 0, 4), (400, 0, 2048, 9), (1800, 1024, 512, 16)]
    for i in range(39):
        prompt, cached, queued, batch = shapes[i % len(shapes)]
        cal.observe(
            _timing(cal, 6.0, 2.5, prompt=prompt, cached=cached, queued=queued, batch=batch)
        )
    c = cal.current()
    assert c.prefill == c.step == c.seq == pytest.approx(2.5, rel=1e-6)
    assert cal.overhead_s == 0.0
    for i in range(39, 80):
        prompt, cached, queued, batch = shapes[i % len(shapes)]
        cal.observe(
            _timing(cal, 6.0, 2.5, prompt=prompt, cached=cached, queued=queued, batch=batch)
        )
    c = cal.current()
    assert c.prefill == pytest.approx(6.0, rel=1e-3)
    assert c.step == pytest.approx(2.5, rel=1e-3) and c.seq == pytest.approx(2.5, rel=1e-3)


def test_busy_host_neighbours_are_not_learned_as_a_slower_engine() -> None:
    """Where the profile prices engines slowing their host neighbours, timings taken
    beside busy neighbours are divided by that slowdown before they are learned: the
    engine's own pace is the same whether its neighbour was busy or not."""
    from dataclasses import replace

    shared = replace(PROFILE, host_contention=0.5)
    cal = CostCalibrator(shared, CalibrationConfig(warmup_requests=0))
    for i in range(40):
        t = _timing(cal, 3.0, 3.0)
        if i % 2:  # beside one busy neighbour: everything 1.5x slower
            t = replace(t, ttft_s=t.ttft_s * 1.5, decode_s=t.decode_s * 1.5, busy_neighbours=1)
        cal.observe(t)
    assert cal.scales() == (pytest.approx(3.0), pytest.approx(3.0))
    assert cal.profile().host_contention == 0.5
