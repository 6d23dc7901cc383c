"""Admission sheds by deadline and sizes its limit from the engines (deadline_shedding.py)."""

from __future__ import annotations

import asyncio
import math

import pytest

from wasma.core.profile import load_profile
from wasma.deploy.deadline_shedding import SLOTS_PER_SEQUENCE, deadline_refusal, default_limit
from wasma.deploy.metadata import WorkflowIdentity
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.service_types import ServiceRequest, Unavailable
from wasma.engines.sim_engine import SimEngine
from wasma.scheduler.state import EngineLoad

PROFILE = load_profile("tiny-cpu")


def test_the_default_limit_follows_the_cluster_not_a_constant() -> None:
    two = RouterService([SimEngine(f"s{i}", PROFILE) for i in range(2)], PROFILE)
    eight = RouterService([SimEngine(f"s{i}", PROFILE) for i in range(8)], PROFILE)
    assert two.admission.max_outstanding == 2 * PROFILE.max_num_seqs * SLOTS_PER_SEQUENCE
    assert eight.admission.max_outstanding == 4 * two.admission.max_outstanding != 8192
    assert (
        RouterService(
            [SimEngine("s0", PROFILE)], PROFILE, RouterConfig(max_outstanding=5)
        ).admission.max_outstanding
        == 5
    )
    assert default_limit(3, PROFILE) == 3 * PROFILE.max_num_seqs * SLOTS_PER_SEQUENCE


def test_no_deadline_is_never_shed_and_an_idle_reachable_one_is_admitted() -> None:
    loads = [EngineLoad("s0")]
    assert deadline_refusal(0.0, math.inf, loads, PROFILE, 10**6, 10**4) is None
    alone = PROFILE.request_alone_s(100, 10)
    assert deadline_refusal(0.0, alone * 1.01, loads, PROFILE, 100, 10) is None
    late = deadline_refusal(0.0, alone * 0.5, loads, PROFILE, 100, 10)
    assert late is not None and late.retry_after_s >= 1.0 and "deadline" in late.message


def test_queued_prefill_ahead_counts_and_the_least_loaded_engine_decides() -> None:
    alone = PROFILE.request_alone_s(100, 10)
    busy = EngineLoad("s0", pending_prefill_tokens=10**6)
    assert deadline_refusal(0.0, alone * 2, [busy], PROFILE, 100, 10) is not None
    assert deadline_refusal(0.0, alone * 2, [busy, EngineLoad("s1")], PROFILE, 100, 10) is None
    down = EngineLoad("s1", healthy=False)
    assert deadline_refusal(0.0, alone * 2, [busy, down], PROFILE, 100, 10) is not None


async def test_a_burst_past_its_deadline_is_shed_with_retry_after_not_left_waiting() -> None:
    # One engine, 40 requests of one workflow with a 0.2 s deadline (a request alone
    # takes 0.02 s): the first are admitted; once the prefill queued ahead puts the
    # finish past the deadline, the rest get a 503 with Retry-After at once (before:
    # all were accepted and waited).
    svc = RouterService([SimEngine("s0", PROFILE)], PROFILE, RouterConfig(policy="least_loaded"))
    await svc.start()
    try:
        ident = WorkflowIdentity(workflow_id="burst", deadline_s=0.2)
        results: list[object] = []

        async def one(i: int) -> None:
            node = WorkflowIdentity(workflow_id="burst", node_id=f"n{i}", deadline_s=0.2)
            try:
                await svc.complete(ServiceRequest(f"r{i}", [20 + i] * 1500, 4, node))
                results.append("ok")
            except Unavailable as exc:
                results.append(exc)

        tasks = [asyncio.create_task(one(i)) for i in range(40)]
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        shed = [r for r in results if isinstance(r, Unavailable)]
        assert shed and "deadline" in shed[0].message
        assert all(r.retry_after_s and r.retry_after_s >= 1.0 for r in shed)
        assert "ok" in results
        text, _ = svc.render_metrics()
        assert f"wasma_admission_rejected_total {float(len(shed))}".encode() in text
        assert ident.workflow_id == "burst"
    finally:
        await svc.close()


@pytest.mark.parametrize("shed", [True, False])
async def test_shedding_can_be_turned_off(shed: bool) -> None:
    cfg = RouterConfig(policy="least_loaded", shed_past_deadline=shed)
    svc = RouterService([SimEngine("s0", PROFILE, speed=50.0)], PROFILE, cfg)
    await svc.start()
    try:
        ident = WorkflowIdentity(workflow_id="w", deadline_s=1e-6)
        req = ServiceRequest("r", [20] * 64, 4, ident)
        if shed:
            with pytest.raises(Unavailable):
                await svc.complete(req)
        else:
            assert len((await svc.complete(req)).token_ids) == 4
    finally:
        await svc.close()
