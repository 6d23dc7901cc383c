"""The one scheduling core (scheduler/dispatch.py), and both drivers on it."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from wasma.benchmarks.apps import generate
from wasma.benchmarks.sim_replay import SimReplay
from wasma.core.profile import load_profile
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.engines.sim_engine import SimEngine
from wasma.scheduler.dispatch import Dispatch, Dispatcher, DispatcherConfig, Finished, HeldQueue
from wasma.scheduler.policy import Placement, PlacementKind, RequestInfo
from wasma.scheduler.workflow import Node, Unique, Workflow

PROFILE = load_profile("llama3-8b-h100")


def _info(rid: str, key: str, node: str, now: float, parents: tuple[str, ...] = ()) -> RequestInfo:
    return RequestInfo(rid, key, node, "app", 100, 10, (), now, math.inf, parents)


def test_held_queue_is_most_urgent_first_then_first_come() -> None:
    q: HeldQueue[str] = HeldQueue()
    for ticket, prio in [("a", 5), ("b", 1), ("c", 5), ("d", 1)]:
        q.push(Placement(0, PlacementKind.RECOMPUTE, priority=prio, defer=True), ticket)
    assert len(q) == 4
    assert [q.pop() for _ in range(5)] == ["b", "d", "a", "c", None]


def test_a_live_workflow_is_opened_counted_and_swept_when_idle() -> None:
    d = Dispatcher(["e0"], PROFILE, DispatcherConfig(policy="least_loaded"))
    wst = d.open_request("w", "chat", 5.0, now=1.0)
    assert (wst.app, wst.deadline_s) == ("chat", 6.0)
    d.open_request("w", "chat", None, now=2.0)
    assert d.busy("w") and d.open_workflows == 1
    d.release("w", 3.0)
    d.release("w", 4.0)
    assert not d.busy("w")
    assert d.sweep_idle(now=5.0, idle_s=60.0) == []  # idle, not long, deadline ahead
    # Past its deadline, but an agent's next turn may still come: not yet settled.
    assert d.sweep_idle(now=6.5, idle_s=60.0, settle_s=3.0) == []
    # Past its deadline with nothing open for `settle_s`: its outcome is settled.
    (closed,) = d.sweep_idle(now=7.5, idle_s=60.0, settle_s=3.0)
    # Ended at its last activity (4.0), within its 6.0 deadline.
    assert (closed.last_s, closed.met) == (4.0, True)
    assert d.open_workflows == 0 and d.ctx.workflows.get("w") is not None
    # Without a deadline, idle for `idle_s` closes it.
    d.open_request("v", "chat", None, now=10.0)
    d.release("v", 11.0)
    assert d.sweep_idle(now=70.0, idle_s=60.0) == []
    assert [c.last_s for c in d.sweep_idle(now=71.5, idle_s=60.0)] == [11.0]


def test_anonymous_requests_leave_nothing_behind() -> None:
    d = Dispatcher(["e0"], PROFILE, DispatcherConfig(policy="least_loaded"))
    d.open_request("~r1", None, None, now=0.0)
    assert d.open_workflows == 0 and "~r1" in d.ctx.workflows.active
    d.release("~r1", 1.0)
    assert "~r1" not in d.ctx.workflows.active


def test_a_registered_dag_reports_its_ready_children_and_its_end() -> None:
    wf = Workflow.create(
        "w",
        "app",
        0.0,
        10.0,
        [Node("a", (), 4, (Unique(64),)), Node("b", ("a",), 4, (Unique(64),))],
    )
    d = Dispatcher(["e0", "e1"], PROFILE, DispatcherConfig(policy="round_robin"))
    d.register(wf, "t/w", now=0.0)
    first = d.place(_info("r-a", "t/w", "a", 0.0), 0.0)
    assert isinstance(first, Dispatch) and not first.held
    d.on_first_token("r-a")
    assert d.finish("r-a", "t/w", "a", 1.0) == Finished(["b"], True, None)
    d.place(_info("r-b", "t/w", "b", 1.0, ("a",)), 1.0)
    done = d.finish("r-b", "t/w", "b", 2.0)
    assert done.ready == [] and done.workflow is not None
    assert done.workflow.finished_s == 2.0


class _Recorder:
    """Records every call a driver makes into its dispatcher, with what came back."""

    CALLS = (
        "on_stats",
        "on_first_token",
        "register",
        "open_request",
        "close_live",
        "release",
        "place",
        "finish",
    )

    def __init__(self, dispatch: Dispatcher) -> None:
        self.log: list[tuple[str, tuple[Any, ...], dict[str, Any], Any]] = []
        for name in self.CALLS:
            setattr(dispatch, name, self._wrap(name, getattr(dispatch, name)))
        # Engines were handed the dispatcher's KV sink when built; it goes on to the
        # router, looked up at each event.
        router = dispatch.router
        router.on_kv_event = self._wrap("on_kv_event", router.on_kv_event)  # type: ignore[method-assign]

    def _wrap(self, name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            self.log.append((name, args, kwargs, out))
            return out

        return call


def _comparable(out: Any) -> Any:
    if isinstance(out, Dispatch):
        return (out.placement, out.release)
    if isinstance(out, Finished):
        return (out.ready, out.registered, None if out.workflow is None else out.workflow.app)
    if hasattr(out, "workflow_id") and hasattr(out, "deadline_s"):
        return (out.workflow_id, out.app, out.arrival_s, out.deadline_s)
    return out


@pytest.mark.parametrize(
    ("app", "policy", "params"),
    [
        ("mapreduce", "wasma", {"transfer": False}),
        ("debate", "prefix_aware", {}),
        ("pipeline", "kv_aware", {}),
    ],
)
def test_the_live_driver_decides_as_the_simulator_on_the_same_events(
    app: str, policy: str, params: dict[str, Any]
) -> None:
    """The simulator's run, call by call, fed to the dispatcher the live router service
    builds: every placement, hold, release and ready child comes out the same."""
    wfs = generate(app, 12, 3.0, 11, PROFILE)
    sim = SimReplay(wfs, policy, 3, PROFILE, params=params)
    recorder = _Recorder(sim.dispatch)
    sim.run()
    assert sum(1 for e in recorder.log if e[0] == "place") >= len(sim.records)
    # The simulator keeps one KV block back, as vLLM does (its null block).
    live_profile = dataclasses.replace(PROFILE, num_kv_blocks=PROFILE.num_kv_blocks - 1)
    engines = [SimEngine(f"e{i}", PROFILE) for i in range(3)]
    service = RouterService(engines, live_profile, RouterConfig(policy=policy, params=params))
    live = service.dispatch
    for name, args, kwargs, out in recorder.log:
        got = getattr(live, name)(*args, **kwargs)
        assert _comparable(got) == _comparable(out), f"{name}{args[:2]} differs"
