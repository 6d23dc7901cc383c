"""The router turns a policy's `retain` into a KV retention lease on the engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from wasma.core.profile import load_profile
from wasma.deploy.metadata import WorkflowIdentity
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.service_types import ServiceRequest
from wasma.engines.base import GenerateRequest, TokenChunk
from wasma.engines.sim_engine import SimEngine
from wasma.scheduler.policy import Placement, PlacementKind, Policy, RequestInfo
from wasma.scheduler.registry import PolicyRegistry

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
    def __init__(self, name: str = "s0") -> None:
        super().__init__(name, PROFILE, speed=100.0)
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
    svc = RouterService(
        [engine], PROFILE, RouterConfig(policy=policy.name, retain_lease_s=45.0), registry=reg
    )
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
    svc = RouterService(
        [engine], PROFILE, RouterConfig(policy=_SaysWhenReadersStart.name), registry=reg
    )
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


_PLAN_AND_READERS = {
    "workflow_id": "wf",
    "nodes": [
        {"id": "plan", "output_tokens": 200, "prompt": [{"unique": 64}]},
        {
            "id": "a",
            "parents": ["plan"],
            "output_tokens": 4,
            "prompt": [{"context": "plan"}, {"unique": 16}],
        },
    ],
}


class _RetainsOnFirstHealthy(Policy):
    name = "first_healthy"

    def place(self, req: RequestInfo, now: float) -> Placement:
        slot = self.healthy_slots()[0]
        return Placement(
            slot, PlacementKind.RECOMPUTE, retain=True, retain_s=60.0, retain_use_s=1.0
        )


async def test_a_retention_moved_by_a_failover_is_released_by_the_routers_id() -> None:
    """The engine dies mid-stream; the planner goes on on the other engine under a new
    engine-level id (`r-plan~1`). Its retention there is still the router's `r-plan`, so
    the release the router sends once the reader started ends it, not only its lease."""
    reg = PolicyRegistry()
    reg.register(_RetainsOnFirstHealthy.name, _RetainsOnFirstHealthy)
    first, second = _Recording("s0"), _Recording("s1")
    svc = RouterService(
        [first, second], PROFILE, RouterConfig(policy=_RetainsOnFirstHealthy.name), registry=reg
    )
    await svc.start()
    try:
        svc.register_workflow(_PLAN_AND_READERS)
        plan = [11] * 64
        stream = await svc.open(ServiceRequest("r-plan", plan, 200, WorkflowIdentity("wf", "plan")))
        out = list((await stream.__anext__()).token_ids)
        first.kill()
        async for chunk in stream:
            out.extend(chunk.token_ids)
        await stream.aclose()
        assert len(out) == 200 and stream.resumed == 1
        (moved,) = second.seen
        assert moved.request_id == "r-plan~1" and moved.retain_key == "r-plan"
        assert moved.retention_args()["wasma_retain_key"] == "r-plan"
        assert set(second._kept) == {"r-plan"}
        reader = ServiceRequest("r-a", plan + [1] * 16, 4, WorkflowIdentity("wf", "a"))
        await svc.complete(reader)
        await svc.complete(ServiceRequest("r-next", [5] * 32, 4, WorkflowIdentity()))
        assert second.seen[-1].release == ("r-plan",)
        assert "r-plan" not in second._kept  # ended by the release
    finally:
        await svc.close()


async def test_the_config_lease_reaches_the_router() -> None:
    from wasma.deploy.build import EngineSpec, ServiceConfig, build_service

    cfg = ServiceConfig(engines=EngineSpec.parse("sim:1"), retain_lease_s=30.0)
    svc = await build_service(cfg)
    try:
        assert svc.config.retain_lease_s == 30.0
    finally:
        await svc.close()
