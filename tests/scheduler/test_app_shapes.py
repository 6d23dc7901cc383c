"""Learning an app's workflow shape from live workflows that arrive without a DAG."""

from __future__ import annotations

import pytest

from wasma.core.profile import load_profile
from wasma.scheduler.app_shapes import AppShapes, role_of
from wasma.scheduler.policy import PolicyContext, RequestInfo
from wasma.scheduler.prefix_index import PrefixIndex
from wasma.scheduler.registry import default_registry
from wasma.scheduler.router import Router
from wasma.scheduler.state import ClusterState
from wasma.scheduler.workflows import WorkflowRegistry


def _ctx() -> PolicyContext:
    names = ["e0", "e1"]
    return PolicyContext(
        state=ClusterState(names, 1000),
        index=PrefixIndex(names),
        workflows=WorkflowRegistry(),
        profile=load_profile("llama3-8b-h100"),
    )


_REQS = [  # node, prompt blocks, parents, submitted (s after the workflow's start)
    ("plan", list(range(1000, 1010)), (), 0.0),
    ("map0", [*range(1000, 1010), 7, 8], ("plan",), 1.0),
    ("map1", [*range(1000, 1010), 9], ("plan",), 1.0),
    ("reduce", [500, 501], ("map0", "map1"), 3.0),
]


def _run_live_workflow(
    router: Router, wid: str, t0: float, stretch: float = 1.0, name_parents: bool = True
) -> None:
    """plan -> map0, map1 (extending plan's prompt) -> reduce (fresh prompt); every time
    `stretch` times longer, as under load."""
    reg = router.ctx.workflows
    reg.ensure(wid, "mr", t0, deadline_s=30.0)
    for node, hashes, parents, at in _REQS:
        t = t0 + at * stretch
        info = RequestInfo(
            f"{wid}/{node}",
            wid,
            node,
            "mr",
            len(hashes) * 16,
            10,
            hashes,
            t,
            t0 + 30,
            parents if name_parents else (),
        )
        router.route(info, t)
        router.on_finish(info.request_id, wid, node, t + 0.5 * stretch)
    reg.close(wid, t0 + 4 * stretch)


def _alone(ctx: PolicyContext, node: str) -> float:
    blocks = next(h for n, h, _p, _t in _REQS if n == node)
    return ctx.profile.request_alone_s(len(blocks) * 16, 10)


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
    # The longest chain of requests after each node, each at its time on an idle engine:
    # the unit wasma costs a registered DAG in.
    reduce = _alone(ctx, "reduce")
    longest_map = max(_alone(ctx, "map0"), _alone(ctx, "map1"))
    assert shapes.remaining_s("mr", "plan") == pytest.approx(
        _alone(ctx, "plan") + longest_map + reduce
    )
    # Any map node: the role is shared (its estimate mixes map0's and map1's).
    map_rem = shapes.remaining_s("mr", "map7")
    assert map_rem is not None
    assert _alone(ctx, "map1") + reduce <= map_rem <= _alone(ctx, "map0") + reduce
    assert shapes.remaining_s("mr", "reduce") == pytest.approx(reduce)
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
    # reduce, 0.01 s before the deadline with ~0.06 s of work (alone) to go: hopeless.
    late = RequestInfo("new/reduce", "new", "reduce", "mr", 32, 10, [1, 2], 1029.99, 1030.0)
    hopeless = router.route(late, 1029.99)
    urgent = RequestInfo("new/map0", "new", "map0", "mr", 176, 10, list(range(11)), 1001.0, 1030.0)
    fine = router.route(urgent, 1001.0)
    assert fine.hold_order < hopeless.hold_order


def test_what_is_learned_under_load_does_not_count_the_load_twice() -> None:
    """Workflows that ran 40x slower than alone (a loaded cluster) teach the same remaining
    path as quick ones. Learning their run time instead (40 s after the plan, past the
    30 s deadline) made the next workflow hopeless at its first request, on a cluster
    with room for it."""
    slow, quick = _ctx(), _ctx()
    slow_router = Router(slow, default_registry().create("wasma", slow))
    quick_router = Router(quick, default_registry().create("wasma", quick))
    for i in range(3):
        _run_live_workflow(slow_router, f"w{i}", t0=1000.0 * i, stretch=40.0)
        _run_live_workflow(quick_router, f"w{i}", t0=1000.0 * i)
    for node in ("plan", "map0", "reduce"):
        assert slow.shapes.remaining_s("mr", node) == pytest.approx(
            quick.shapes.remaining_s("mr", node)
        )
    slow.workflows.ensure("new", "mr", 5000.0, deadline_s=30.0)
    plan = RequestInfo("new/plan", "new", "plan", "mr", 160, 10, list(range(10)), 5000.0, 5030.0)
    late = RequestInfo("new/reduce", "new", "reduce", "mr", 32, 10, [1, 2], 5029.99, 5030.0)
    placed = slow_router.route(plan, 5000.0)
    assert not placed.defer
    hopeless = slow_router.route(late, 5029.99)  # 0.01 s left, ~0.06 s of work
    assert placed.hold_order < hopeless.hold_order


def test_without_parents_the_run_time_is_scaled_by_the_slowdown_seen() -> None:
    """Requests that name no parents leave no path to follow: the time the workflow ran
    after a node, divided by how much slower than alone its requests ran."""
    ctx = _ctx()
    router = Router(ctx, default_registry().create("wasma", ctx))
    _run_live_workflow(router, "w0", t0=0.0, stretch=40.0, name_parents=False)
    ran = 4 * 0.5 * 40.0  # four requests, 20 s each
    alone = sum(_alone(ctx, n) for n, *_ in _REQS)
    assert ctx.shapes.remaining_s("mr", "plan") == pytest.approx(4 * 40.0 * alone / ran)
    assert ctx.shapes.remaining_s("mr", "reduce") == pytest.approx(1 * 40.0 * alone / ran)


def test_shape_table_is_bounded() -> None:
    shapes = AppShapes(max_roles=3)
    reg = WorkflowRegistry(on_close=shapes.observe)
    for i in range(5):
        st = reg.ensure(f"w{i}", f"app{i}", 0.0)
        st.node("n").submitted_s = 0.0
        reg.close(f"w{i}", 1.0)
    assert len(shapes) == 3
