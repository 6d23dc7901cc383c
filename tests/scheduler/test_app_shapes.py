"""Learning an app's workflow shape from live workflows that arrive without a DAG."""

from __future__ import annotations

from engines.sim.profile import load_profile
from scheduler.app_shapes import AppShapes, role_of
from scheduler.policy import PolicyContext, RequestInfo
from scheduler.prefix_index import PrefixIndex
from scheduler.registry import default_registry
from scheduler.router import Router
from scheduler.state import ClusterState
from scheduler.workflows import WorkflowRegistry


def _ctx() -> PolicyContext:
    names = ["e0", "e1"]
    return PolicyContext(
        state=ClusterState(names, 1000),
        index=PrefixIndex(names),
        workflows=WorkflowRegistry(),
        profile=load_profile("llama3-8b-h100"),
    )


def _run_live_workflow(router: Router, wid: str, t0: float) -> None:
    """plan -> map0, map1 (extending plan's prompt) -> reduce (fresh prompt)."""
    reg = router.ctx.workflows
    reg.ensure(wid, "mr", t0, deadline_s=30.0)
    plan = list(range(1000, 1010))
    reqs = [
        ("plan", plan, (), t0),
        ("map0", [*plan, 7, 8], ("plan",), t0 + 1),
        ("map1", [*plan, 9], ("plan",), t0 + 1),
        ("reduce", [500, 501], ("map0", "map1"), t0 + 3),
    ]
    for node, hashes, parents, t in reqs:
        info = RequestInfo(
            f"{wid}/{node}", wid, node, "mr", len(hashes) * 16, 10, hashes, t, t0 + 30, parents
        )
        router.route(info, t)
        router.on_finish(info.request_id, wid, node, t + 0.5)
    reg.close(wid, t0 + 4)


def test_role_folds_digits() -> None:
    assert role_of("map12") == role_of("map3") == "map#"
    assert role_of("a1.r2") == "a#.r#"


def test_learns_remaining_time_and_context_reuse_from_closed_workflows() -> None:
    ctx = _ctx()
    router = Router(ctx, default_registry().create("wasma", ctx))
    assert ctx.shapes.remaining_s("mr", "plan") is None
    for i in range(5):
        _run_live_workflow(router, f"w{i}", t0=100.0 * i)
    shapes = ctx.shapes
    # plan was submitted at t0 and the workflow closed at t0 + 4.
    assert shapes.remaining_s("mr", "plan") == 4.0
    assert shapes.remaining_s("mr", "map7") == 3.0  # any map node: the role is shared
    assert shapes.context_reused("mr", "plan")  # maps extended its prompt
    assert not shapes.context_reused("mr", "map0")  # reduce did not extend a map's
    assert not shapes.context_reused("mr", "reduce")


def test_wasma_uses_learned_shape_for_priority_and_retention() -> None:
    ctx = _ctx()
    router = Router(ctx, default_registry().create("wasma", ctx))
    for i in range(3):
        _run_live_workflow(router, f"w{i}", t0=100.0 * i)
    reg = ctx.workflows
    reg.ensure("new", "mr", 1000.0, deadline_s=30.0)
    plan = RequestInfo("new/plan", "new", "plan", "mr", 160, 10, list(range(10)), 1000.0, 1030.0)
    placed = router.route(plan, 1000.0)
    assert placed.retain  # learned: maps extend plan's context
    late = RequestInfo("new/reduce", "new", "reduce", "mr", 32, 10, [1, 2], 1029.9, 1030.0)
    hopeless = router.route(late, 1029.9)
    urgent = RequestInfo("new/map0", "new", "map0", "mr", 176, 10, list(range(11)), 1001.0, 1030.0)
    fine = router.route(urgent, 1001.0)
    assert fine.hold_order < hopeless.hold_order  # reduce with 0.1 s left and ~1 s to go


def test_shape_table_is_bounded() -> None:
    shapes = AppShapes(max_roles=3)
    reg = WorkflowRegistry(on_close=shapes.observe)
    for i in range(5):
        st = reg.ensure(f"w{i}", f"app{i}", 0.0)
        st.node("n").submitted_s = 0.0
        reg.close(f"w{i}", 1.0)
    assert len(shapes) == 3
