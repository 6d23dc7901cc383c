"""Deadline-aware admission: who is held at the router, and that held work still completes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from wasma.benchmarks.apps import generate
from wasma.benchmarks.sim_replay import SimReplay
from wasma.benchmarks.studies.kv_pressure import pressure_profile
from wasma.core.events import EngineStats
from wasma.core.profile import load_profile
from wasma.scheduler.policy import Placement, PlacementKind, Policy, PolicyContext, RequestInfo
from wasma.scheduler.prefix_index import PrefixIndex
from wasma.scheduler.registry import PolicyRegistry, default_registry
from wasma.scheduler.state import Charge, ClusterState
from wasma.scheduler.workflow import Node, OutputOf, Unique, Workflow
from wasma.scheduler.workflows import WorkflowRegistry

PROF = load_profile("llama3-8b-h100")
NO_HOLDS = {"admission": False, "hopeless_slowdown": 1e9}


def test_held_workflows_still_complete_and_wait_for_capacity() -> None:
    wfs = generate("mapreduce", 30, 50.0, seed=3, profile=PROF)  # far above 2 engines' capacity
    held = SimReplay(wfs, "wasma", 2, PROF)
    run = held.run()
    assert held.held_total > 0
    assert len(run.workflows) == len(wfs)
    assert len(run.requests) == sum(len(w) for w in wfs)
    # A held root counts its wait: its request latency starts when it was first offered.
    free_replay = SimReplay(wfs, "wasma", 2, PROF, params=NO_HOLDS)
    free = free_replay.run()
    assert free_replay.held_total == 0
    assert max(r.first_token_s - r.submit_s for r in run.requests) > max(
        r.first_token_s - r.submit_s for r in free.requests
    )


def test_admission_keeps_more_workflows_on_time_under_overload() -> None:
    wfs = generate("pipeline", 60, 1.0, seed=5, profile=PROF)
    # 3x the rate 2 engines sustain: without admission nearly every workflow is late.
    kw: dict[str, Any] = {"rate_scale": 3.0}
    on = SimReplay(wfs, "wasma", 2, PROF, **kw).run()
    off = SimReplay(wfs, "wasma", 2, PROF, params=NO_HOLDS, **kw).run()
    met_on = sum(w.met for w in on.workflows)
    met_off = sum(w.met for w in off.workflows)
    assert len(on.workflows) == len(off.workflows) == len(wfs)
    assert met_on > met_off


def _ctx(outstanding: int, can_defer: bool = True) -> tuple[PolicyContext, Any, Workflow]:
    state = ClusterState(["e0"], PROF.num_kv_blocks - 1)
    for i in range(outstanding):
        # Requests decoding long contexts: each adds to every step of the engine.
        state.on_dispatch(f"bg{i}", 0, Charge(500, 0, 300))
    ctx = PolicyContext(state, PrefixIndex(["e0"]), WorkflowRegistry(), PROF, can_defer=can_defer)
    # The child's prompt: the root's 200 output tokens and 100 of its own.
    alone = PROF.request_alone_s(4000, 200) + PROF.request_alone_s(300, 200)
    # Deadline 1.5x the critical path alone (generated workflows get 2x).
    wf = Workflow.create(
        "wf",
        "app",
        0.0,
        1.5 * alone,
        [
            Node("root", (), 200, (Unique(4000),)),
            Node("child", ("root",), 200, (OutputOf("root"), Unique(100))),
        ],
    )
    ctx.workflows.register(wf, 0.0)
    return ctx, default_registry().create("wasma", ctx), wf


def _request(wf: Workflow, node: str, now: float = 0.0) -> RequestInfo:
    return RequestInfo(
        f"wf/{node}",
        "wf",
        node,
        "app",
        wf.prompt_tokens(node),
        wf.nodes[node].output_tokens,
        [],
        now,
        deadline_s=wf.arrival_s + wf.deadline_s,
        parents=wf.nodes[node].parents,
    )


def test_a_new_workflow_that_would_miss_is_held_and_one_that_can_make_it_is_not() -> None:
    _ctx_idle, idle, wf = _ctx(outstanding=0)
    assert not idle.place(_request(wf, "root"), 0.0).defer
    _ctx_busy, busy, wf = _ctx(outstanding=120)
    assert busy.place(_request(wf, "root"), 0.0).defer


def test_an_admitted_workflow_is_never_held_while_it_can_make_it() -> None:
    _ctx_busy, busy, wf = _ctx(outstanding=120)
    # Its root ran: the child goes through although the engine is just as busy.
    assert not busy.place(_request(wf, "child"), 0.0).defer


def test_a_hopeless_request_waits_for_a_quiet_engine() -> None:
    _c, busy, wf = _ctx(outstanding=120)
    late = wf.deadline_s + 1.0  # past its deadline: the lowest class
    placed = busy.place(_request(wf, "child", late), late)
    assert placed.defer
    _c, idle, wf = _ctx(outstanding=0)
    assert not idle.place(_request(wf, "child", late), late).defer


def test_no_deferral_without_driver_support() -> None:
    _c, busy, wf = _ctx(outstanding=120, can_defer=False)
    assert not busy.place(_request(wf, "root"), 0.0).defer


class _HoldsEverything(Policy):
    """A policy that always asks to hold: the driver must still finish the run."""

    name = "holds_everything"

    def place(self, req: RequestInfo, now: float) -> Placement:
        return Placement(engine=0, kind=PlacementKind.RECOMPUTE, defer=True)


def test_a_run_finishes_even_if_a_policy_holds_for_an_idle_cluster() -> None:
    reg = PolicyRegistry()
    reg.register(_HoldsEverything.name, _HoldsEverything)
    wfs = generate("mapreduce", 5, 1.0, seed=1, profile=PROF)
    replay = SimReplay(wfs, _HoldsEverything.name, 2, PROF, registry=reg)
    run = replay.run()
    assert replay.held_total > 0
    assert len(run.workflows) == len(wfs)
    assert len(run.requests) == sum(len(w) for w in wfs)


def test_past_its_deadline_without_hopeless_demotion_a_root_is_not_held() -> None:
    _c, busy, wf = _ctx(outstanding=120)
    busy.p["hopeless"] = False
    late = wf.deadline_s + 1.0
    assert not busy.place(_request(wf, "root", late), late).defer


# -- KV-aware admission ----------------------------------------------------------------

CAP = PROF.num_kv_blocks - 1


def _kv_ctx(usages: list[float], params: dict[str, Any] | None = None) -> tuple[Any, ClusterState]:
    """Engines that each run one small request and report `usages` of their KV in use."""
    names = [f"e{i}" for i in range(len(usages))]
    state = ClusterState(names, CAP)
    for slot, usage in enumerate(usages):
        state.on_dispatch(f"bg{slot}", slot, Charge(10, 0, 16))
        state.on_stats(slot, EngineStats(1, 0, usage, CAP))
    ctx = PolicyContext(
        state,
        PrefixIndex(names),
        WorkflowRegistry(),
        PROF,
        params={"admission": False, **(params or {})},
        can_defer=True,
    )
    return default_registry().create("wasma", ctx), state


def _big(rid: str = "r", parents: tuple[str, ...] = ()) -> RequestInfo:
    # 8,000 prompt tokens: 500 blocks, 1.8% of the pool.
    return RequestInfo(rid, rid, "n", "app", 8000, 200, [], 0.0, parents=parents)


def test_kv_admission_holds_a_request_its_engine_has_no_kv_for() -> None:
    full, _ = _kv_ctx([0.95])
    assert full.place(_big(), 0.0).defer
    roomy, _ = _kv_ctx([0.5])
    assert not roomy.place(_big(), 0.0).defer
    off, _ = _kv_ctx([0.95], {"kv_admission": False})
    assert not off.place(_big(), 0.0).defer


def test_kv_admission_lets_an_admitted_workflows_later_nodes_through() -> None:
    full, _ = _kv_ctx([0.95])
    assert not full.place(_big(parents=("root",)), 0.0).defer


def test_kv_admission_counts_prompt_and_output_still_to_come() -> None:
    policy, state = _kv_ctx([0.5])
    # Queued prompts and outputs that will take 45% of the pool on top of the 50% in use.
    state.on_dispatch("queued", 0, Charge(0, int(0.45 * CAP * PROF.block_size), 0))
    assert policy.place(_big(), 0.0).defer


def test_kv_admission_counts_a_shared_prefix_once() -> None:
    policy, state = _kv_ctx([0.3])
    # 100 requests over one long document: charged per request they would fill the pool
    # twice over, but the engine holds the document once and reports 30% in use.
    for i in range(100):
        state.on_dispatch(f"sib{i}", 0, Charge(600, 0, 50))
    assert state.loads[0].active_blocks > 2 * CAP
    assert not policy.place(_big(), 0.0).defer


def test_kv_admission_places_where_there_is_room_rather_than_hold() -> None:
    policy, _ = _kv_ctx([0.95, 0.2])
    placed = policy.place(_big(), 0.0)
    assert placed.engine == 1 and not placed.defer


def test_kv_admission_never_holds_for_an_idle_engine() -> None:
    policy, state = _kv_ctx([0.95])
    state.on_finish("bg0")  # the engine's last request finished; its stats lag
    assert not policy.place(_big(), 0.0).defer


def test_kv_admission_cuts_preemptions_on_a_small_pool_and_completes_everything(
    tmp_path: Path,
) -> None:
    small = load_profile(str(pressure_profile(PROF, 16384, tmp_path)))
    wfs = generate("mapreduce", 40, 1.0, seed=4, profile=PROF)
    kw: dict[str, Any] = {"rate_scale": 2.0}
    on = SimReplay(wfs, "wasma", 2, small, **kw)
    run_on = on.run()
    run_off = SimReplay(wfs, "wasma", 2, small, params={"kv_admission": False}, **kw).run()
    for run in (run_on, run_off):
        assert len(run.workflows) == len(wfs)
        assert len(run.requests) == sum(len(w) for w in wfs)
    pre_on = sum(r.preemptions for r in run_on.requests)
    pre_off = sum(r.preemptions for r in run_off.requests)
    assert pre_off > 0
    assert pre_on < pre_off
    assert on.held_total > 0


# -- admission corrected by the estimates' bias -----------------------------------------


def _first_busy_enough_to_hold() -> int:
    """The fewest background requests on the engine at which a new workflow is held."""
    for n in range(1, 400):
        _c, policy, wf = _ctx(outstanding=n)
        if policy.place(_request(wf, "root"), 0.0).defer:
            return n
    raise AssertionError("never held")


@pytest.mark.parametrize("on", [True, False])
def test_admission_bias_holds_when_requests_have_run_longer_than_estimated(on: bool) -> None:
    n = _first_busy_enough_to_hold() - 1  # just admitted on the estimate as it stands
    ctx, policy, wf = _ctx(outstanding=n)
    policy.p["admission_bias"] = on
    assert not policy.place(_request(wf, "root"), 0.0).defer  # no request finished yet
    for i in range(50):  # recent requests took twice their estimate
        ctx.estimates.placed(f"done{i}", 0.0, 1.0)
        ctx.estimates.finished(f"done{i}", 2.0)
    assert policy.place(_request(wf, "root"), 0.0).defer == on
    # An admitted workflow's later nodes still go through.
    assert not policy.place(_request(wf, "child"), 0.0).defer


def test_admission_bias_never_loosens_admission() -> None:
    n = _first_busy_enough_to_hold()
    ctx, policy, wf = _ctx(outstanding=n)
    policy.p["admission_bias"] = True
    for i in range(50):  # requests ran in half their estimate
        ctx.estimates.placed(f"done{i}", 0.0, 1.0)
        ctx.estimates.finished(f"done{i}", 0.5)
    assert ctx.estimates.ratio < 0.6
    assert policy.place(_request(wf, "root"), 0.0).defer


@pytest.mark.parametrize("app", ["pipeline", "debate"])
def test_admission_bias_keeps_more_workflows_on_time_under_overload(app: str) -> None:
    # The overload of test_admission_keeps_more_workflows_on_time_under_overload: a wave
    # of workflows that each looked feasible when they arrived is partly held back instead
    # of missing together.
    wfs = generate(app, 60, 1.0, seed=5, profile=PROF)
    kw: dict[str, Any] = {"rate_scale": 3.0}
    on = SimReplay(wfs, "wasma", 2, PROF, params={"admission_bias": True}, **kw).run()
    off = SimReplay(wfs, "wasma", 2, PROF, **kw).run()
    assert len(on.workflows) == len(off.workflows) == len(wfs)
    assert sum(w.met for w in on.workflows) > sum(w.met for w in off.workflows)
