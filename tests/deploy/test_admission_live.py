"""Deadline-aware admission behind the live router: held requests wait at the router,
are offered again as capacity frees, and always complete."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from wasma.benchmarks.studies.kv_pressure import pressure_profile
from wasma.core.profile import load_profile
from wasma.deploy.metadata import WorkflowIdentity
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.service_types import BadRequest, ServiceRequest
from wasma.engines.sim_engine import SimEngine
from wasma.scheduler.policy import Placement, PlacementKind, Policy, RequestInfo
from wasma.scheduler.registry import PolicyRegistry

PROFILE = load_profile("llama3-8b-h100")


class _HoldsEverything(Policy):
    """Always asks to hold: the router must still run every request to completion."""

    name = "holds_everything"

    def place(self, req: RequestInfo, now: float) -> Placement:
        return Placement(engine=0, kind=PlacementKind.RECOMPUTE, defer=True)


async def _until(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        assert loop.time() < end, "condition not reached"
        await asyncio.sleep(0.005)


async def _background(
    svc: RouterService, n: int, tokens: int, first: int
) -> list[asyncio.Task[Any]]:
    """`n` requests without deadlines, `tokens`-long prompts of token `first + i`, all
    dispatched before this returns."""
    tasks = [
        asyncio.create_task(
            svc.complete(ServiceRequest(f"bg{i}", [first + i] * tokens, 16, WorkflowIdentity()))
        )
        for i in range(n)
    ]
    await _until(lambda: svc.health()["outstanding"] == n)
    return tasks


def _holding_service(speed: float, recheck_s: float, **kw: Any) -> RouterService:
    """One simulated engine behind a router whose policy holds every request."""
    reg = PolicyRegistry()
    reg.register(_HoldsEverything.name, _HoldsEverything)
    return RouterService(
        [SimEngine("s0", PROFILE, speed=speed)],
        PROFILE,
        RouterConfig(policy=_HoldsEverything.name, held_recheck_s=recheck_s, **kw),
        registry=reg,
    )


async def test_held_requests_all_complete_even_if_the_policy_never_lets_go() -> None:
    svc = _holding_service(speed=50.0, recheck_s=0.02)
    await svc.start()
    try:
        reqs = [ServiceRequest(f"r{i}", [7 + i] * 40, 8, WorkflowIdentity()) for i in range(5)]
        results = await asyncio.gather(*(svc.complete(r) for r in reqs))
        assert all(len(r.token_ids) == 8 for r in results)
        # Each was dispatched only when nothing else ran (nothing else would free room).
        assert svc.held_total == 5
        assert svc.completed == 5
        assert svc.health()["held"] == 0
    finally:
        await svc.close()


async def test_a_hopeless_workflow_waits_for_a_quiet_engine_then_completes() -> None:
    # The policy's own hold of hopeless work, behind admission's shedding (off here).
    svc = RouterService(
        [SimEngine("s0", PROFILE, speed=20.0)],
        PROFILE,
        RouterConfig(policy="wasma", held_recheck_s=0.01, shed_past_deadline=False),
    )
    await svc.start()
    try:
        # Background work without deadlines: long prompts queued for prefill.
        background = await _background(svc, 8, 8000, 1000)
        # A workflow whose deadline is already out of reach: it still completes, but
        # only once its engine is quiet enough not to be slowed by more than 2x.
        node = {"parents": [], "output_tokens": 4, "prompt": [{"unique": 64}]}
        svc.register_workflow(
            {"workflow_id": "late", "deadline_s": 1e-6, "nodes": [node | {"id": "a"}]}
        )
        ident = WorkflowIdentity(workflow_id="late", node_id="a")
        late = asyncio.create_task(svc.complete(ServiceRequest("late-a", [3] * 64, 4, ident)))
        await _until(lambda: svc.health()["held"] == 1)
        text, _ = svc.render_metrics()
        assert b"wasma_router_queue_depth 1.0" in text
        # Its id is taken while it waits.
        try:
            await svc.complete(ServiceRequest("late-a", [3] * 64, 4, ident))
        except BadRequest as exc:
            assert "already in flight" in str(exc)
        else:
            raise AssertionError("a duplicate of a held request was accepted")
        result = await late
        assert len(result.token_ids) == 4
        await asyncio.gather(*background)
        assert svc.held_total >= 1 and svc.health()["held"] == 0
    finally:
        await svc.close()


async def test_a_caller_leaving_while_held_leaves_nothing_behind() -> None:
    svc = _holding_service(speed=1.0, recheck_s=0.01)
    await svc.start()
    try:
        # The first runs (forced: the cluster is idle), slowly; the second waits behind it.
        first = asyncio.create_task(
            svc.complete(ServiceRequest("a", [5] * 40, 400, WorkflowIdentity()))
        )
        await _until(lambda: svc.health()["outstanding"] == 1)
        ident = WorkflowIdentity(workflow_id="w", node_id="n")
        second = asyncio.create_task(svc.complete(ServiceRequest("b", [6] * 40, 4, ident)))
        await _until(lambda: svc.health()["held"] == 1)
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        assert svc.health()["held"] == 0
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    finally:
        await svc.close()


async def test_a_request_held_past_max_hold_s_goes_through_while_others_run() -> None:
    svc = _holding_service(speed=1.0, recheck_s=0.01, max_hold_s=0.2)
    await svc.start()
    try:
        # The first runs (forced: the cluster is idle) for far longer than max_hold_s.
        first = asyncio.create_task(
            svc.complete(ServiceRequest("a", [5] * 40, 4000, WorkflowIdentity()))
        )
        await _until(lambda: svc.health()["outstanding"] == 1)
        second = await svc.complete(ServiceRequest("b", [6] * 40, 4, WorkflowIdentity()))
        assert len(second.token_ids) == 4
        assert not first.done()  # it went through beside the first, not after it
        assert svc.held_total == 2 and svc.health()["held"] == 0
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
    finally:
        await svc.close()


def test_max_hold_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_hold_s"):
        _holding_service(speed=1.0, recheck_s=0.01, max_hold_s=0.0)


async def test_a_new_workflow_waits_while_its_engine_kv_is_spoken_for(tmp_path: Path) -> None:
    # A 16k-token KV pool (1,024 blocks): three 4,800-token prompts take 903 of them.
    small = load_profile(str(pressure_profile(PROFILE, 16384, tmp_path)))
    svc = RouterService(
        [SimEngine("s0", small)], small, RouterConfig(policy="wasma", held_recheck_s=0.01)
    )
    await svc.start()
    try:
        background = await _background(svc, 3, 4800, 2000)
        assert svc.health()["held"] == 0
        # One more long prompt would push the engine past 92% of its pool: vLLM would
        # admit it and preempt as the others decode. It waits at the router instead.
        ident = WorkflowIdentity(workflow_id="new", node_id="root")
        new = asyncio.create_task(svc.complete(ServiceRequest("new", [9] * 1000, 8, ident)))
        await _until(lambda: svc.health()["held"] == 1)
        result = await new
        assert len(result.token_ids) == 8
        await asyncio.gather(*background)
        assert svc.held_total == 1 and svc.health()["held"] == 0
    finally:
        await svc.close()


async def test_max_hold_s_from_the_config_file_reaches_the_router(tmp_path: Path) -> None:
    from wasma.deploy.build import EngineSpec, ServiceConfig, build_service
    from wasma.deploy.serve import ConfigError, _reliability, load_config_file

    path = tmp_path / "wasma.yaml"
    path.write_text("reliability:\n  max_hold_s: 12\n")
    kw = _reliability(load_config_file(str(path))["reliability"])
    svc = await build_service(ServiceConfig(engines=EngineSpec.parse("sim:1"), **kw))
    try:
        assert svc.config.max_hold_s == 12.0
    finally:
        await svc.close()
    for bad in ("0", "-1", ".nan"):
        path.write_text(f"reliability:\n  max_hold_s: {bad}\n")
        with pytest.raises(ConfigError, match=r"reliability\.max_hold_s"):
            _reliability(load_config_file(str(path))["reliability"])
