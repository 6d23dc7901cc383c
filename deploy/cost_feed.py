"""Live cost calibration: finished requests rescale the policy's step-time model.

The profile was fitted in-process on an idle engine; real engines behind HTTP on a busy
host run slower, by factors `scheduler.calibration.CostCalibrator` learns from finished
requests. This feeds it: each request's engine load when it was placed, and its timings
when it finished; a moved estimate reaches the dispatcher as a new profile.
"""

from __future__ import annotations

import logging

from wasma.core.profile import Profile
from wasma.deploy.live_request import LiveRequest
from wasma.scheduler.calibration import CalibrationConfig, CostCalibrator, RequestTiming
from wasma.scheduler.dispatch import Dispatcher
from wasma.scheduler.policy import Placement

log = logging.getLogger(__name__)


class CostFeed:
    def __init__(self, dispatch: Dispatcher, fitted: Profile, all_simulated: bool) -> None:
        self.dispatch = dispatch
        self.fitted = fitted
        # Simulated engines follow the profile by construction (and their tests expect
        # exact placements): calibration is off for them unless asked for.
        self.all_simulated = all_simulated
        self.calibrator: CostCalibrator | None = None
        self.recalibrations = 0

    def set_calibration(self, calibration: CalibrationConfig | bool | None) -> None:
        """None: on unless every engine is simulated. Turning it off puts the fitted
        profile back."""
        if calibration is None:
            calibration = not self.all_simulated
        if calibration is True:
            calibration = CalibrationConfig()
        self.calibrator = (
            CostCalibrator(self.fitted, calibration)
            if isinstance(calibration, CalibrationConfig)
            else None
        )
        if self.dispatch.ctx.profile != self.fitted:
            self.set_profile(self.fitted)  # a new calibrator starts from it

    def set_profile(self, profile: Profile) -> None:
        """Give the policy a new cost model (same block size and limits)."""
        self.dispatch.set_profile(profile)
        self.recalibrations += 1
        if self.calibrator is not None:
            c = self.calibrator.current()
            log.info(
                "cost model recalibrated: prefill x%.2f, step x%.2f, batching x%.2f",
                c.prefill,
                c.step,
                c.seq,
            )

    def at_dispatch(self, live: LiveRequest, placement: Placement) -> None:
        """Note the engine's load as `live` is placed, excluding itself (prefill tokens
        queued ahead, requests, KV tokens): what its timings are compared against."""
        if self.calibrator is None or live.info is None:
            return
        info, state = live.info, self.dispatch.ctx.state
        loads = state.loads
        load = loads[placement.engine]
        bs = self.dispatch.ctx.block_size
        own_prefill = max(info.prompt_tokens - placement.hit_blocks * bs, 0)
        own_blocks = -(-(info.prompt_tokens + info.max_tokens) // bs)
        live.load_at_dispatch = (
            max(load.pending_prefill_tokens - own_prefill, 0),
            max(load.outstanding - 1, 0),
            max(load.active_blocks - own_blocks, 0) * bs,
        )
        live.busy_neighbours = sum(
            1 for j in state.host_neighbours()[placement.engine] if loads[j].outstanding > 0
        )

    def observe(self, live: LiveRequest, now: float) -> None:
        """A request served start to finish by one engine; swap in a rescaled profile
        when the engines' speed moved."""
        cal = self.calibrator
        if cal is None or live.first_s is None or live.failovers:
            return
        if live.raw_sent and live.n_out == 0:
            return  # a passed-through stream without usage: its output length is unknown
        queued, others, ctx_tokens = live.load_at_dispatch
        prompt = len(live.req.prompt_token_ids)
        timing = RequestTiming(
            prompt_tokens=prompt,
            cached_tokens=min(live.cached, prompt),
            output_tokens=live.n_out,
            ttft_s=live.first_s - live.start_s,
            decode_s=now - live.first_s,
            queued_prefill_tokens=queued,
            batch=others + 1,
            batch_context_tokens=ctx_tokens,
            busy_neighbours=live.busy_neighbours,
        )
        if cal.observe(timing):
            self.set_profile(cal.publish())
