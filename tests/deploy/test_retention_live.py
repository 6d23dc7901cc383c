"""The router turns a policy's `retain` into a KV retention lease on the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from deploy.metadata import WorkflowIdentity
from deploy.router_service import RouterService, ServiceRequest
from engines.base import GenerateRequest, TokenChunk
from engines.sim.profile import load_profile
from engines.sim_engine import SimEngine
from scheduler.policy import Placement, PlacementKind, Policy, RequestInfo
from scheduler.registry import PolicyRegistry

PROFILE = load_profile("llama3-8b-h100")


class _RetainsPlanners(Policy):
    """Asks engines to keep the planner's KV (its workers will extend it), nothing else."""

    name = "retains_planners"
    lease: float | None = None  # None: the router's default

    def place(self, req: RequestInfo, now: float) -> Placement:
        keep = req.node_id == "plan"
        return Placement(0, PlacementKind.RECOMPUTE, retain=keep, retain_s=self.lease)


class _SizesLeases(_RetainsPlanners):
    name = "sizes_leases"
    lease = 7.0


class _Recording(SimEngine):
    def __init__(self) -> None:
        super().__init__("s0", PROFILE, speed=100.0)
        self.seen: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self.seen.append(request)
        async for chunk in super().generate(request):
            yield chunk


@pytest.mark.parametrize(("policy", "lease"), [(_RetainsPlanners, 45.0), (_SizesLeases, 7.0)])
async def test_a_retained_placement_asks_the_engine_for_a_lease(
    policy: type[_RetainsPlanners], lease: float
) -> None:
    reg = PolicyRegistry()
    reg.register(policy.name, policy)
    engine = _Recording()
    svc = RouterService([engine], PROFILE, policy=policy.name, registry=reg, retain_lease_s=45.0)
    await svc.start()
    try:
        for node in ("plan", "work"):
            ident = WorkflowIdentity(workflow_id="wf", node_id=node)
            await svc.complete(ServiceRequest(f"r-{node}", [11] * 64, 4, ident))
        assert [(r.request_id, r.retain_s) for r in engine.seen] == [
            ("r-plan", lease),
            ("r-work", 0.0),
        ]
        # The engine keeps the planner's cached blocks in its retention tier.
        assert engine.core.kv.retained
    finally:
        await svc.close()


class _SaysWhenReadersStart(Policy):
    """Retains every node's context, its readers expected 2 s after placement."""

    name = "says_when"

    def place(self, req: RequestInfo, now: float) -> Placement:
        return Placement(0, PlacementKind.RECOMPUTE, retain=True, retain_s=60.0, retain_use_s=2.0)


async def test_a_retention_ends_once_its_readers_started_by_the_next_request_there() -> None:
    """With a registered DAG the router knows who reads the planner's context. Once both
    workers have started, the planner's retention is released with the next request sent
    to that engine, which ends it there; the use time travels with each lease."""
    reg = PolicyRegistry()
    reg.register(_SaysWhenReadersStart.name, _SaysWhenReadersStart)
    engine = _Recording()
    svc = RouterService([engine], PROFILE, policy=_SaysWhenReadersStart.name, registry=reg)
    await svc.start()
    try:
        svc.register_workflow(
            {
                "workflow_id": "wf",
                "nodes": [
                    {"id": "plan", "output_tokens": 4, "prompt": [{"unique": 64}]},
                    {
                        "id": "a",
                        "parents": ["plan"],
                        "output_tokens": 4,
                        "prompt": [{"context": "plan"}, {"unique": 16}],
                    },
                    {
                        "id": "b",
                        "parents": ["plan"],
                        "output_tokens": 4,
                        "prompt": [{"context": "plan"}, {"unique": 16}],
                    },
                ],
            }
        )
        plan = [11] * 64
        for node, prompt in (("plan", plan), ("a", plan + [1] * 16), ("b", plan + [2] * 16)):
            ident = WorkflowIdentity(workflow_id="wf", node_id=node)
            await svc.complete(ServiceRequest(f"r-{node}", prompt, 4, ident))
        assert "r-plan" in engine._kept  # b has started, but nothing was sent since
        await svc.complete(ServiceRequest("r-next", [5] * 32, 4, WorkflowIdentity()))
        seen = {r.request_id: r for r in engine.seen}
        assert seen["r-next"].release == ("r-plan",)
        assert all(seen[r].release == () for r in ("r-plan", "r-a", "r-b"))
        assert seen["r-plan"].retain_use_s == 2.0
        assert "r-plan" not in engine._kept and "r-a" in engine._kept
        text = svc.render_metrics()[0].decode()
        assert 'wasma_retention_leases_total{engine="s0"} 4.0' in text
        assert 'wasma_retention_released_total{engine="s0"} 1.0' in text
    finally:
        await svc.close()


async def test_the_config_lease_reaches_the_router() -> None:
    from deploy.build import EngineSpec, ServiceConfig, build_service

    cfg = ServiceConfig(engines=EngineSpec.parse("sim:1"), retain_lease_s=30.0)
    svc = await build_service(cfg)
    try:
        assert svc.retain_lease_s == 30.0
    finally:
        await svc.close()
