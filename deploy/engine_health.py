"""Engine health for the live router: polling, stall checks and a circuit breaker.

A background task polls every engine's health and load; a failed check, a request that
stalls or an engine fault takes the engine out of rotation (its prefixes leave the index,
its requests move), and a health check after the breaker's cool-down brings it back.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from wasma.deploy.live_request import LiveRequest, expire
from wasma.deploy.metrics import WasmaMetrics
from wasma.deploy.router_config import RouterConfig
from wasma.engines.base import EngineClient
from wasma.scheduler.dispatch import Dispatcher

log = logging.getLogger(__name__)


class EngineHealth:
    """Which engines are in rotation, and why not."""

    def __init__(
        self,
        engines: Sequence[EngineClient],
        dispatch: Dispatcher,
        metrics: WasmaMetrics,
        config: RouterConfig,
        live: Mapping[str, LiveRequest],
        now: Callable[[], float],
    ) -> None:
        self.engines = engines
        self.dispatch = dispatch
        self.metrics = metrics
        self.config = config
        self._live = live  # the service's requests in flight, by id (read only)
        self.now = now
        # An engine's last chunk, for any request: a request waiting while its engine
        # makes progress for others is slow, not stalled.
        self.progress = [0.0] * len(engines)
        # Circuit breaker per engine: consecutive failures of the engine's own making
        # keep it out of rotation for base * 2^(n-1) seconds (capped), even when its
        # health check says ok; a request it serves to the end closes the breaker.
        self._fails = [0] * len(engines)
        self._open_until = [0.0] * len(engines)
        self.engine_faults = 0
        # The last KV load (EngineStats.kv_loads) counted into the metrics, per engine.
        self._kv_loads_seen: dict[str, int] = {}
        self._preemptions_seen: dict[str, int] = {}

    async def refresh(self) -> None:
        """One health and stats check of every engine, all at once."""
        state = self.dispatch.ctx.state
        timeout = self.config.health_timeout_s

        async def one(slot: int, engine: EngineClient) -> None:
            try:
                ok = await asyncio.wait_for(engine.healthy(), timeout=timeout)
                stats = await asyncio.wait_for(engine.stats(), timeout=timeout) if ok else None
            except Exception as exc:  # an engine's failure must not stop the poller
                log.warning("engine %s: health/stats failed: %r", engine.name, exc)
                ok, stats = False, None
            if not ok:
                # Dead or hung: pull its requests off now rather than at their timeouts.
                self.mark_down(slot, "health check failed")
            elif not state.loads[slot].healthy and self.now() >= self._open_until[slot]:
                log.info("engine %s is back", engine.name)
                state.set_healthy(slot, True)
                self.metrics.set_engine_up(engine.name, True)
            if stats is not None:
                kv = stats.kv_usage
                # An engine's own report, possibly NaN or out of range over HTTP: the
                # policy and the gauge take a fraction in [0, 1].
                kv = min(max(kv, 0.0), 1.0) if math.isfinite(kv) else 0.0
                if kv != stats.kv_usage:
                    stats = replace(stats, kv_usage=kv)
                self.dispatch.on_stats(slot, stats)
                self._observe_kv_loads(engine.name, stats.kv_loads)
                seen = self._preemptions_seen.get(engine.name, 0)
                # A restarted engine counts from 0 again: take its count as new.
                fresh = (
                    stats.num_preemptions - seen
                    if stats.num_preemptions >= seen
                    else stats.num_preemptions
                )
                self.metrics.observe_preemptions(engine.name, fresh)
                self._preemptions_seen[engine.name] = stats.num_preemptions
            load = state.loads[slot]
            self.metrics.set_engine(
                engine.name,
                outstanding=load.outstanding,
                running=None if stats is None else stats.num_running,
                waiting=None if stats is None else stats.num_waiting,
                kv_usage=None if stats is None else stats.kv_usage,
            )

        await asyncio.gather(*(one(i, e) for i, e in enumerate(self.engines)))

    def _observe_kv_loads(self, engine: str, loads: tuple[tuple[int, int, float], ...]) -> None:
        """Count the engine's KV loads from peers not counted yet (transfer bytes and
        seconds, as its connector measured them)."""
        seen = self._kv_loads_seen.get(engine, 0)
        if loads and loads[-1][0] < seen:
            seen = 0  # a new engine process numbers its loads from 1 again
        for seq, nbytes, seconds in loads:
            if seq > seen:
                self.metrics.observe_transfer(nbytes, seconds)
                seen = seq
        self._kv_loads_seen[engine] = seen

    async def poll(self) -> None:
        """The poller: stall checks and health checks every `stats_interval_s`."""
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            try:
                self.check_stalls()
                await self.refresh()
            except Exception:
                # The poller is what finds stalled requests and brings engines back: one
                # bad report must not end it for the life of the service.
                log.exception("engine poll failed; polling goes on")

    def check_stalls(self) -> None:
        now = self.now()
        limit = self.config.request_timeout_s
        for live in list(self._live.values()):
            if live.waiting is None:
                continue
            waited = now - live.last_s
            quiet = now - max(live.last_s, self.progress[live.slot])
            if quiet > limit or waited > 5 * limit:
                if self.dispatch.ctx.state.loads[live.slot].healthy:
                    self.engine_failed(live.slot, f"no output for {waited:.1f} s")
                expire(live)

    def engine_failed(self, slot: int, exc: BaseException | str) -> None:
        """A request failed by the engine's fault: count it on the breaker."""
        self.engine_faults += 1
        self.metrics.observe_engine_fault(self.engines[slot].name)
        if not self.dispatch.ctx.state.loads[slot].healthy:
            # Already out: the other requests it held fail with it, one outage not many.
            log.info("engine %s failed a request while out: %r", self.engines[slot].name, exc)
            return
        self._fails[slot] += 1
        cfg = self.config
        backoff = cfg.breaker_base_s * 2 ** min(self._fails[slot] - 1, 16)
        self._open_until[slot] = self.now() + min(backoff, cfg.breaker_max_s)
        log.warning("engine %s failed a request: %r", self.engines[slot].name, exc)
        self.mark_down(slot, str(exc))

    def mark_down(self, slot: int, why: str) -> None:
        """Out of rotation until a health check after the breaker's cool-down says it is
        back; its cache is unreachable (or gone), so its prefixes leave the index."""
        ctx = self.dispatch.ctx
        name = self.engines[slot].name
        if ctx.state.loads[slot].healthy:
            log.warning("engine %s out of rotation: %s", name, why)
            ctx.state.set_healthy(slot, False)
            ctx.index.remove_engine_blocks(name)
            self.metrics.set_engine_up(name, False)
            self.metrics.forget_engine_reports(name)
            self.dispatch.router.retention.engine_lost(slot)
        self._open_until[slot] = max(
            self._open_until[slot], self.now() + self.config.breaker_base_s
        )
        for live in self._live.values():
            if live.slot == slot:
                expire(live)

    def engine_ok(self, slot: int) -> None:
        """A request served to the end: the breaker closes."""
        self._fails[slot] = 0
