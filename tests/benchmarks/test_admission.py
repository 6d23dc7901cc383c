"""Deadline-aware admission in the simulator: held requests are completed, never lost."""

from __future__ import annotations

from benchmarks.apps import generate
from benchmarks.sim_replay import SimReplay
from engines.sim.profile import load_profile


def test_held_workflows_still_complete_and_wait_for_capacity() -> None:
    prof = load_profile("llama3-8b-h100")
    wfs = generate("mapreduce", 30, 50.0, seed=3, profile=prof)  # far above 2 engines' capacity
    held = SimReplay(wfs, "wasma", 2, prof, params={"admission_batch": 4})
    run = held.run()
    assert held.held_total > 0
    assert len(run.workflows) == len(wfs)
    assert len(run.requests) == sum(len(w) for w in wfs)
    # A held root counts its wait: its request latency starts when it was first offered.
    free = SimReplay(wfs, "wasma", 2, prof, params={"admission_batch": 10**9}).run()
    assert max(r.first_token_s - r.submit_s for r in run.requests) > max(
        r.first_token_s - r.submit_s for r in free.requests
    )


def test_no_deferral_without_driver_support() -> None:
    from scheduler.policy import PolicyContext, RequestInfo
    from scheduler.prefix_index import PrefixIndex
    from scheduler.registry import default_registry
    from scheduler.state import Charge, ClusterState
    from scheduler.workflows import WorkflowRegistry

    prof = load_profile("llama3-8b-h100")
    state = ClusterState(["e0"], 1000)
    for i in range(10):
        state.on_dispatch(f"bg{i}", 0, Charge(1, 1, 1))
    ctx = PolicyContext(state, PrefixIndex(["e0"]), WorkflowRegistry(), prof, params={})
    wasma = default_registry().create("wasma", ctx)
    req = RequestInfo("r", "w", "root", "app", 64, 8, [1, 2, 3, 4], 0.0)
    assert not wasma.place(req, 0.0).defer  # a live driver that cannot hold gets a placement
    ctx.can_defer = True
    wasma.p["admission_batch"] = 5
    assert wasma.place(req, 0.0).defer
