"""Live cost calibration: the policy's step-time model, scaled to what the engines show.

A profile (core/profiles/*.yaml) is fitted once, on an idle engine driven in-process.
Behind an HTTP server on a busy machine the same engine's steps run several times
slower, and not by one factor: per-step costs (scheduling, the API server, sampling) and
per-prefill-token costs stretch differently. A policy pricing a cache hit (prefill
saved) against queueing (load) with the fitted numbers then trades them at the wrong
rate. The calibrator watches finished requests and learns three bounded scale factors:

- `step` and `seq`, from decode: the observed time per decode step is fitted as a line
  on the batch-dependent part of the predicted step (the requests in the batch, their
  KV): its intercept over `base_s` scales the fixed cost of a step, its slope scales
  `per_decode_seq_s` and `per_decode_ctx_token_s` (what one more sequence costs). They
  must not be lumped: on a busy host every step stretches (scheduling, the API server,
  other processes) while batching stays nearly free, and one factor for both would
  make joining a busy engine look far dearer than it is. While the batch barely varies
  both take the ratio of observed to predicted decode time;
- `prefill`: what is left of the observed time to first token once the per-step part
  (scaled by `step` and `seq`) is taken out, against the profile's per-token prefill
  work (the prefill queued ahead of the request plus its own uncached prompt); it scales
  `per_prefill_token_s` and `per_prefill_attn_s`. A remote engine adds a per-request
  cost the profile never saw (HTTP, the API server, process hops) that does not grow
  with the prompt: charged to prefill tokens it would overprice every cache hit. So
  `prefill` is the slope of a weighted least-squares line through (predicted token
  work, observed rest), whose intercept is that fixed overhead (`overhead_s`, reported,
  not priced: every engine pays it alike). While the requests' token work barely varies
  there is no slope to read, and `prefill` falls back to the ratio of the averages.

Averages are exponentially weighted (recent requests count most), scales are clamped
to `[min_scale, max_scale]` and stay at 1 until `warmup_requests` were seen. The line
fits wait for `min_fit_samples` requests; until then all three factors are the ratio of
observed to predicted decode time (the most robust of the signals). The
calibrator is pure: no clock, no I/O; the driver hands it durations it measured. The
simulator never feeds one, so there the profile is exactly the fitted one and runs
stay deterministic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from wasma.core.profile import Profile, StepModel


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    weight: float = 0.05  # EWMA weight of one request (about the last 20 matter)
    min_scale: float = 0.5
    max_scale: float = 20.0
    warmup_requests: int = 8  # scales stay at 1 until this many requests were seen
    # The lines (prefill slope, step vs batching) are read only where their x varies at
    # least this much (coefficient of variation)...
    min_spread: float = 0.2
    # ... and after this many requests: on a few dozen noisy timings from a shared host
    # their slopes swung between the clamps from one run to the next. Until then every
    # factor is the robust one, observed over predicted decode time: the policy keeps
    # the fitted trade-offs and gets the engines' real pace.
    min_fit_samples: int = 64
    # A new profile is published when a scale moved by more than this fraction since
    # the last one: policies may rebuild derived state on each, so not on every request.
    republish_change: float = 0.15

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {self.weight}")
        if not 0 < self.min_scale <= 1 <= self.max_scale:
            raise ValueError("scales must satisfy 0 < min_scale <= 1 <= max_scale")
        if self.warmup_requests < 0 or self.republish_change < 0 or self.min_fit_samples < 0:
            raise ValueError(
                "warmup_requests, republish_change and min_fit_samples must be non-negative"
            )


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """One finished request as its driver saw it, and its engine's load at dispatch."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens the engine served from its prefix cache
    output_tokens: int
    ttft_s: float  # dispatch to first token
    decode_s: float  # first token to last
    queued_prefill_tokens: int = 0  # prefill work already on the engine at dispatch
    batch: int = 1  # requests on the engine while it ran, itself included
    batch_context_tokens: int = 0  # KV tokens of the other requests in that batch
    # Other engines on its host's cores that were busy at dispatch: the profile prices
    # their slowdown separately (`host_contention`), so it is taken out here.
    busy_neighbours: int = 0


@dataclass(slots=True)
class _Ewma:
    value: float = 0.0

    def add(self, x: float, w: float) -> None:
        self.value += w * (x - self.value)


@dataclass(slots=True)
class _Line:
    """An exponentially weighted least-squares line y = a + b x."""

    mass: _Ewma = field(default_factory=_Ewma)  # the EWMA of 1: unbiases the moments
    x: _Ewma = field(default_factory=_Ewma)
    y: _Ewma = field(default_factory=_Ewma)
    xx: _Ewma = field(default_factory=_Ewma)
    xy: _Ewma = field(default_factory=_Ewma)

    def add(self, x: float, y: float, w: float) -> None:
        self.mass.add(1.0, w)
        self.x.add(x, w)
        self.y.add(y, w)
        self.xx.add(x * x, w)
        self.xy.add(x * y, w)

    def fit(self, min_spread: float) -> tuple[float, float] | None:
        """(intercept, slope), or None while x varies too little (coefficient of
        variation under `min_spread`) for a slope to mean anything."""
        m = self.mass.value
        if m <= 0:
            return None
        mx, my = self.x.value / m, self.y.value / m
        var = self.xx.value / m - mx * mx
        if mx <= 0 or var <= (min_spread * mx) ** 2:
            return None
        slope = (self.xy.value / m - mx * my) / var
        return my - slope * mx, slope


@dataclass(frozen=True, slots=True)
class Scales:
    """Factors on the fitted profile's terms."""

    prefill: float = 1.0  # per_prefill_token_s, per_prefill_attn_s
    step: float = 1.0  # base_s: the fixed cost of one engine step
    seq: float = 1.0  # per_decode_seq_s, per_decode_ctx_token_s: one more in the batch


class CostCalibrator:
    """Learns how much slower (or faster) the engines run than `base` says."""

    def __init__(self, base: Profile, config: CalibrationConfig | None = None) -> None:
        self.base = base
        self.cfg = config or CalibrationConfig()
        self.samples = 0
        self.decode_samples = 0
        # Decode: time per step against the batch-dependent part of the predicted step
        # (intercept: the fixed per-step cost; slope: the marginal cost of batching).
        # Ratios of averages stand in while the batch barely varies.
        self._d_obs = _Ewma()
        self._d_pred = _Ewma()
        self._decode = _Line()
        # Prefill: TTFT less its per-step part against the predicted per-token work.
        self._p_obs = _Ewma()
        self._p_fixed = _Ewma()  # per-step part of the predicted prefill phase (s)
        self._p_batch = _Ewma()
        self._p_tok = _Ewma()
        self._prefill = _Line()
        self._published = Scales()

    # -- predictions under the fitted profile -------------------------------------------
    def _decode_parts(self, t: RequestTiming) -> tuple[int, float]:
        """(decode steps, batch-dependent part of one predicted step)."""
        st = self.base.step
        steps = t.output_tokens - 1  # the first token comes out of the prefill step
        ctx = t.batch_context_tokens + t.prompt_tokens + steps / 2
        return steps, st.per_decode_seq_s * max(t.batch, 1) + st.per_decode_ctx_token_s * ctx

    def _decode_pred_s(self, t: RequestTiming) -> float:
        steps, per_seq = self._decode_parts(t)
        return steps * (self.base.step.base_s + per_seq)

    def _prefill_parts(self, t: RequestTiming) -> tuple[float, float, float]:
        """(fixed per-step part, batch part, per-token part) of the predicted TTFT."""
        st = self.base.step
        uncached = max(t.prompt_tokens - t.cached_tokens, 0)
        tokens = max(t.queued_prefill_tokens, 0) + uncached
        chunks = max(1, math.ceil(tokens / self.base.max_num_batched_tokens))
        others = max(t.batch - 1, 0)
        fixed = chunks * st.base_s
        batch = chunks * (
            st.per_decode_seq_s * others + st.per_decode_ctx_token_s * t.batch_context_tokens
        )
        per_token = st.per_prefill_token_s * tokens + st.per_prefill_attn_s * uncached * (
            t.prompt_tokens
        )
        return fixed, batch, per_token

    def _prefill_pred_s(self, t: RequestTiming) -> tuple[float, float]:
        """(per-step part, per-token part) of the predicted time to first token."""
        fixed, batch, per_token = self._prefill_parts(t)
        return fixed + batch, per_token

    # -- learning ------------------------------------------------------------------------
    def observe(self, t: RequestTiming) -> bool:
        """Take one finished request; True when the scales moved enough that the driver
        should `publish()` a new profile."""
        if not (math.isfinite(t.ttft_s) and math.isfinite(t.decode_s)):
            return False
        if t.ttft_s < 0 or t.decode_s < 0 or t.prompt_tokens <= 0:
            return False
        if t.busy_neighbours > 0 and self.base.host_contention > 0:
            slowed = 1.0 + self.base.host_contention * t.busy_neighbours
            t = replace(t, ttft_s=t.ttft_s / slowed, decode_s=t.decode_s / slowed)
        w = self.cfg.weight
        self.samples += 1
        if t.output_tokens > 1:
            self.decode_samples += 1
            steps, per_seq = self._decode_parts(t)
            self._d_obs.add(t.decode_s, w)
            self._d_pred.add(self._decode_pred_s(t), w)
            self._decode.add(per_seq, t.decode_s / steps, w)
        fixed, batch, per_token = self._prefill_parts(t)
        self._p_obs.add(t.ttft_s, w)
        self._p_fixed.add(fixed, w)
        self._p_batch.add(batch, w)
        self._p_tok.add(per_token, w)
        d = self._decode_scales()
        self._prefill.add(per_token, t.ttft_s - d.step * fixed - d.seq * batch, w)
        if self.samples < self.cfg.warmup_requests:
            return False
        now, then = self.current(), self._published
        limit = math.log1p(self.cfg.republish_change)
        return any(
            abs(math.log(a / b)) > limit
            for a, b in (
                (now.prefill, then.prefill),
                (now.step, then.step),
                (now.seq, then.seq),
            )
        )

    def _clamp(self, x: float) -> float:
        if not math.isfinite(x):
            return 1.0
        return min(max(x, self.cfg.min_scale), self.cfg.max_scale)

    def _fits(self) -> bool:
        return self.samples >= self.cfg.min_fit_samples

    def _decode_ratio(self) -> float:
        if not self.decode_samples or self._d_pred.value <= 0:
            return 1.0
        return self._clamp(self._d_obs.value / self._d_pred.value)

    def _decode_scales(self) -> Scales:
        """The decode part of the scales (prefill left at 1)."""
        if not self.decode_samples or self._d_pred.value <= 0:
            return Scales()
        line = self._decode.fit(self.cfg.min_spread) if self._fits() else None
        if line is not None:
            intercept, slope = line
            return Scales(1.0, self._clamp(intercept / self.base.step.base_s), self._clamp(slope))
        ratio = self._decode_ratio()
        return Scales(1.0, ratio, ratio)

    def _prefill_fit(self, d: Scales) -> tuple[float, float]:
        """(fixed overhead s, prefill scale before clamping)."""
        line = self._prefill.fit(self.cfg.min_spread)
        if line is not None:
            return line
        if self._p_tok.value <= 0:
            return 0.0, 1.0
        # No spread to fit a line through: all of the rest is the tokens'.
        left = self._p_obs.value - d.step * self._p_fixed.value - d.seq * self._p_batch.value
        return 0.0, left / self._p_tok.value

    def current(self) -> Scales:
        """The learned factors; all 1 until warmed up, all the decode ratio until the
        lines may be fitted."""
        if self.samples < self.cfg.warmup_requests:
            return Scales()
        if not self._fits():
            r = self._decode_ratio()
            return Scales(r, r, r)
        d = self._decode_scales()
        _, slope = self._prefill_fit(d)
        return Scales(self._clamp(slope), d.step, d.seq)

    def scales(self) -> tuple[float, float]:
        """(prefill, decode) factors, decode being observed over predicted decode time
        as a whole (what the per-step and per-sequence factors add up to)."""
        if self.samples < self.cfg.warmup_requests:
            return 1.0, 1.0
        return self.current().prefill, self._decode_ratio()

    @property
    def prefill_scale(self) -> float:
        return self.current().prefill

    @property
    def decode_scale(self) -> float:
        return self.scales()[1]

    @property
    def overhead_s(self) -> float:
        """The fixed per-request part of the time to first token (≥ 0), once fitted."""
        if not self._fits() or self.samples < self.cfg.warmup_requests:
            return 0.0
        return max(self._prefill_fit(self._decode_scales())[0], 0.0)

    def profile(self) -> Profile:
        """`base` with its step model scaled by the current factors."""
        c = self.current()
        return scaled_profile(self.base, c.prefill, c.step, c.seq)

    def publish(self) -> Profile:
        """The current scaled profile, remembered as the one the policy now uses."""
        self._published = self.current()
        return self.profile()

    def snapshot(self) -> dict[str, float | int]:
        p, d = self.scales()
        c = self.current()
        return {
            "samples": self.samples,
            "prefill_scale": round(p, 4),
            "decode_scale": round(d, 4),
            "step_scale": round(c.step, 4),
            "seq_scale": round(c.seq, 4),
            "overhead_s": round(self.overhead_s, 6),
            "published_prefill_scale": round(self._published.prefill, 4),
            "published_step_scale": round(self._published.step, 4),
            "published_seq_scale": round(self._published.seq, 4),
        }


def scaled_profile(
    base: Profile, prefill: float, decode: float, decode_seq: float | None = None
) -> Profile:
    """`base` with per-prefill-token terms times `prefill`, the fixed per-step cost times
    `decode` and the per-sequence terms times `decode_seq` (`decode` when None);
    everything else (limits, block size, KV size) unchanged."""
    st = base.step
    seq = decode if decode_seq is None else decode_seq
    step = StepModel(
        base_s=st.base_s * decode,
        per_prefill_token_s=st.per_prefill_token_s * prefill,
        per_decode_seq_s=st.per_decode_seq_s * seq,
        per_decode_ctx_token_s=st.per_decode_ctx_token_s * seq,
        per_prefill_attn_s=st.per_prefill_attn_s * prefill,
    )
    return replace(base, step=step)
