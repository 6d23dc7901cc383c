"""Transfer bytes and seconds reach /metrics from the engines' own measurements: the
router counts each KV load an engine reports (EngineStats.kv_loads) exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from wasma.core.events import EngineStats
from wasma.core.profile import load_profile
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.engines.sim_engine import SimEngine

PROFILE = load_profile("llama3-8b-h100")


class _Loading(SimEngine):
    """A simulated engine that also reports KV loads from peers, as a vLLM engine
    running the wasma connector does."""

    def __init__(self, name: str) -> None:
        super().__init__(name, PROFILE)
        self.loads: list[tuple[int, int, float]] = []
        self.polls = 0

    async def stats(self) -> EngineStats:
        self.polls += 1
        base = await super().stats()
        return EngineStats(
            base.num_running, base.num_waiting, base.kv_usage, base.num_kv_blocks,
            kv_loads=tuple(self.loads[-3:]),  # a short window, as the real one is bounded
        )  # fmt: skip


def _transfers(svc: RouterService) -> tuple[float, float, float]:
    """(bytes, loads, seconds) as /metrics shows them."""
    text = svc.metrics.render()[0].decode()
    got = {"bytes": 0.0, "count": 0.0, "sum": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "wasma_transfer_bytes_total":
                got["bytes"] = s.value
            elif s.name == "wasma_transfer_seconds_count":
                got["count"] = s.value
            elif s.name == "wasma_transfer_seconds_sum":
                got["sum"] = s.value
    return got["bytes"], got["count"], got["sum"]


async def _until(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < end, "condition not reached"
        await asyncio.sleep(0.02)


async def test_each_kv_load_an_engine_reports_is_counted_once() -> None:
    engine = _Loading("v0")
    svc = RouterService(
        [engine], PROFILE, RouterConfig(policy="least_loaded", stats_interval_s=0.02)
    )
    await svc.start()
    try:
        engine.loads += [(1, 1000, 0.5), (2, 3000, 0.25)]
        await _until(lambda: _transfers(svc)[1] == 2)
        polls = engine.polls
        await _until(lambda: engine.polls >= polls + 3)  # the same loads, polled again
        assert _transfers(svc) == (4000, 2, 0.75)

        # Loads that land between two polls all count.
        engine.loads += [(3, 10, 0.125), (4, 10, 0.125)]
        await _until(lambda: _transfers(svc)[1] == 4)
        assert _transfers(svc) == (4020, 4, 1.0)

        # The engine restarted and numbers its loads from 1 again.
        engine.loads = [(1, 5, 0.125)]
        await _until(lambda: _transfers(svc)[1] == 5)
        polls = engine.polls
        await _until(lambda: engine.polls >= polls + 3)
        assert _transfers(svc) == (4025, 5, 1.125)
    finally:
        await svc.close()
