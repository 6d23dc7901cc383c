"""The simulated replay driver and the results summary (benchmarks/sim_replay.py,
benchmarks/metrics.py)."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest

from wasma.benchmarks.apps import generate
from wasma.benchmarks.metrics import percentile, summarize
from wasma.benchmarks.sim_replay import RunResult, SimReplay
from wasma.core.profile import Profile, load_profile
from wasma.scheduler.registry import PolicyRegistry
from wasma.scheduler.workflow import ContextOf, Node, Shared, Unique, Workflow, WorkflowError

PROFILE = load_profile("llama3-8b-h100")
POLICIES = ["round_robin", "least_loaded", "prefix_aware", "kv_aware", "session", "wasma"]
APPS = ["pipeline", "mapreduce", "debate"]


@cache
def trace(app: str, n: int = 6, rate: float = 2.0, seed: int = 5) -> tuple[Workflow, ...]:
    return tuple(generate(app, n, rate, seed, PROFILE))


def small_kv(num_kv_blocks: int) -> Profile:
    return dataclasses.replace(
        PROFILE, num_kv_blocks=num_kv_blocks, max_model_len=(num_kv_blocks - 1) * 16
    )


def records(run: RunResult) -> list[tuple[object, ...]]:
    return sorted(
        (
            r.workflow_id,
            r.node_id,
            r.engine,
            r.kind,
            r.submit_s,
            r.first_token_s,
            r.finish_s,
            r.cached_tokens,
            r.prefill_tokens_computed,
            r.preemptions,
            r.transferred_bytes,
        )
        for r in run.requests
    )


@pytest.mark.parametrize("app", APPS)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_workflow_completes_respecting_the_dag(app: str, policy: str) -> None:
    wfs = trace(app)
    run = SimReplay(wfs, policy, 3, PROFILE).run()
    assert len(run.workflows) == len(wfs)
    assert len(run.requests) == sum(len(w) for w in wfs)
    by_node = {(r.workflow_id, r.node_id): r for r in run.requests}
    assert len(by_node) == len(run.requests)
    for w in wfs:
        rec = next(x for x in run.workflows if x.workflow_id == w.workflow_id)
        assert rec.arrival_s == w.arrival_s and rec.deadline_s == w.deadline_s
        last = 0.0
        for n, node in w.nodes.items():
            r = by_node[(w.workflow_id, n)]
            assert r.submit_s <= r.first_token_s <= r.finish_s
            assert r.output_tokens == node.output_tokens
            assert r.prompt_tokens == w.prompt_tokens(n)
            assert 0 <= r.cached_tokens < r.prompt_tokens
            assert 0 <= r.engine < 3
            for p in node.parents:
                assert r.submit_s >= by_node[(w.workflow_id, p)].finish_s
            if not node.parents:
                assert r.submit_s == w.arrival_s
            last = max(last, r.finish_s)
        assert rec.finish_s == last


@pytest.mark.parametrize("policy", POLICIES)
def test_runs_are_deterministic(policy: str) -> None:
    a = SimReplay(trace("mapreduce"), policy, 3, PROFILE).run()
    b = SimReplay(trace("mapreduce"), policy, 3, PROFILE).run()
    assert records(a) == records(b)
    assert [dataclasses.astuple(w) for w in a.workflows] == [
        dataclasses.astuple(w) for w in b.workflows
    ]


@pytest.mark.parametrize("app", APPS)
def test_without_registered_dags_the_router_sees_requests_and_learns_shapes(app: str) -> None:
    wfs = trace(app, n=10)
    replay = SimReplay(wfs, "wasma", 3, PROFILE, register_dags=False)
    run = replay.run()
    assert len(run.workflows) == len(wfs)
    assert len(run.requests) == sum(len(w) for w in wfs)
    by_node = {(r.workflow_id, r.node_id): r for r in run.requests}
    for w in wfs:
        for n, node in w.nodes.items():
            for p in node.parents:  # the driver still runs a child after its parents
                assert by_node[(w.workflow_id, n)].submit_s >= by_node[(w.workflow_id, p)].finish_s
    registry = replay.ctx.workflows
    assert not registry.active
    closed = [registry.get(w.workflow_id) for w in wfs]
    assert all(st is not None and st.workflow is None for st in closed)  # never a DAG
    # Each workflow kept the deadline its requests carried, from its first request.
    for w, st in zip(wfs, closed, strict=True):
        assert st is not None and st.deadline_s == pytest.approx(w.arrival_s + w.deadline_s)
    roots = {n for w in wfs for n in w.roots()}
    assert all(replay.ctx.shapes.remaining_s(app, n) is not None for n in roots)
    # A policy that never reads the DAG places every request the same either way.
    plain = SimReplay(wfs, "least_loaded", 3, PROFILE).run()
    blind = SimReplay(wfs, "least_loaded", 3, PROFILE, register_dags=False).run()
    assert records(plain) == records(blind)


def test_rate_scale_compresses_arrivals() -> None:
    wfs = trace("debate")
    run = SimReplay(wfs, "least_loaded", 2, PROFILE, rate_scale=2.0).run()
    arrivals = {w.workflow_id: w.arrival_s for w in run.workflows}
    for w in wfs:
        assert arrivals[w.workflow_id] == pytest.approx(w.arrival_s / 2.0)
    assert run.rate_scale == 2.0


def test_prefix_reuse_happens_for_shared_prompts() -> None:
    """mapreduce workers share a document: some prompt tokens must come from cache."""
    run = SimReplay(trace("mapreduce"), "kv_aware", 2, PROFILE).run()
    assert sum(r.cached_tokens for r in run.requests) > 0
    assert run.engine_prefix_hits > 0 and run.engine_prefix_queries >= run.engine_prefix_hits


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="engine"):
        SimReplay(trace("debate"), "wasma", 0, PROFILE)
    with pytest.raises(ValueError, match="rate_scale"):
        SimReplay(trace("debate"), "wasma", 2, PROFILE, rate_scale=0.0)
    with pytest.raises(ValueError, match="policy"):
        SimReplay(trace("debate"), "nope", 2, PROFILE)


def test_request_too_long_for_the_model_is_an_error() -> None:
    wf = Workflow.create("big", "x", 0.0, 10.0, [Node("a", (), 10, (Unique(200_000),))])
    with pytest.raises(ValueError, match=r"big/a.*max_model_len"):
        SimReplay([wf], "round_robin", 1, PROFILE).run()


# -- fast-forward (macro steps) against step-by-step -----------------------------------


def assert_same_times(a: RunResult, b: RunResult) -> None:
    ra, rb = records(a), records(b)
    assert len(ra) == len(rb)
    for x, y in zip(ra, rb, strict=True):
        assert x[:4] == y[:4]  # same workflow, node, engine, placement kind
        assert x[4:7] == pytest.approx(y[4:7], abs=1e-9)
        assert x[7:] == y[7:]


@pytest.mark.parametrize("policy", POLICIES)
def test_fast_forward_equals_step_by_step(policy: str) -> None:
    wfs = trace("mapreduce", 10, 3.0, 9)
    fast = SimReplay(wfs, policy, 3, PROFILE, fast_forward=True).run()
    slow = SimReplay(wfs, policy, 3, PROFILE, fast_forward=False).run()
    assert_same_times(fast, slow)
    assert fast.engine_steps < slow.engine_steps


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
def test_fast_forward_equals_step_by_step_under_kv_pressure(policy: str) -> None:
    """With KV-blind policies, preemption and eviction inside engines match exactly."""
    prof = small_kv(800)
    wfs = tuple(generate("debate", 12, 3.0, 2, prof))
    fast = SimReplay(wfs, policy, 2, prof, fast_forward=True).run()
    slow = SimReplay(wfs, policy, 2, prof, fast_forward=False).run()
    assert sum(r.preemptions for r in slow.requests) > 0
    assert_same_times(fast, slow)


# -- summary ---------------------------------------------------------------------------


def test_summary_has_every_results_field(result_fields: dict[str, type]) -> None:
    run = SimReplay(trace("pipeline"), "wasma", 2, PROFILE).run()
    row = summarize(run, "pipeline.jsonl", PROFILE.kv_bytes_per_token)
    missing = set(result_fields) - set(row)
    assert not missing
    for key, typ in result_fields.items():
        assert isinstance(row[key], typ), (key, row[key])
    assert row["trace"] == "pipeline.jsonl" and row["policy"] == "wasma"
    assert row["engines"] == 2 and row["profile"] == PROFILE.name
    assert row["workflows"] == 6 and row["requests"] == len(run.requests)


def test_summary_values_follow_the_definitions() -> None:
    run = SimReplay(trace("mapreduce"), "least_loaded", 2, PROFILE, rate_scale=1.5).run()
    row = summarize(run, "t.jsonl")
    wfs, reqs = run.workflows, run.requests
    duration = max(w.finish_s for w in wfs) - min(w.arrival_s for w in wfs)
    met = [w for w in wfs if w.finish_s - w.arrival_s <= w.deadline_s]
    assert row["duration_s"] == pytest.approx(duration, abs=1e-6)
    assert row["goodput_wf_per_s"] == pytest.approx(len(met) / duration, rel=1e-6)
    assert row["deadline_attainment"] == pytest.approx(len(met) / len(wfs))
    lat = [w.finish_s - w.arrival_s for w in wfs]
    assert row["p50_workflow_s"] <= row["p95_workflow_s"] <= row["p99_workflow_s"] <= max(lat)
    assert row["p99_workflow_s"] >= min(lat)
    prompt = sum(r.prompt_tokens for r in reqs)
    assert row["prefix_hit_ratio"] == pytest.approx(sum(r.cached_tokens for r in reqs) / prompt)
    assert 0 <= row["prefix_hit_ratio"] < 1
    assert row["p95_ttft_s"] <= row["p95_request_s"]
    assert row["rate_scale"] == 1.5
    assert row["decision_p99_us"] > 0


def test_percentile() -> None:
    assert percentile([], 95) == 0.0
    assert percentile([3.0], 50) == 3.0
    assert percentile(list(range(101)), 95) == pytest.approx(95.0)


def test_summary_of_an_empty_run(result_fields: dict[str, type]) -> None:
    run = RunResult("p", 1, "x", 1.0, [], [], [], 0.0, 0)
    row = summarize(run, "t")
    assert set(result_fields) <= set(row)
    assert row["goodput_wf_per_s"] == 0.0 and row["deadline_attainment"] == 0.0


@pytest.mark.parametrize(
    ("policy_lease", "default_lease", "kept_at_end"),
    [(None, 10.0, False), (None, 1000.0, True), (5.0, 1000.0, False), (500.0, 10.0, True)],
)
def test_retention_lasts_the_lease_after_the_request_finishes(
    policy_lease: float | None, default_lease: float, kept_at_end: bool
) -> None:
    """As the live router's lease to vLLM (`retain_by_use=False`): the planner's KV (its
    worker extends it) is retained from placement until the lease after it finishes: the
    policy's, or else the driver's default."""
    from wasma.scheduler.policy import Placement, PlacementKind, Policy, RequestInfo
    from wasma.scheduler.workflow import ContextOf

    class Retains(Policy):
        name = "retains"

        def place(self, req: RequestInfo, now: float) -> Placement:
            keep = req.node_id == "plan"
            return Placement(0, PlacementKind.RECOMPUTE, retain=keep, retain_s=policy_lease)

    reg = PolicyRegistry()
    reg.register(Retains.name, Retains)
    plan = Workflow.create(
        "w1",
        "x",
        0.0,
        60.0,
        [
            Node("plan", (), 32, (Unique(600),)),
            Node("work", ("plan",), 32, (ContextOf("plan"), Unique(100))),
        ],
    )
    # Arrives long after the first workflow is done; it retains nothing.
    later = Workflow.create("w2", "x", 200.0, 60.0, [Node("a", (), 8, (Unique(300),))])
    replay = SimReplay(
        [plan, later],
        Retains.name,
        1,
        PROFILE,
        registry=reg,
        retain_lease_s=default_lease,
    )
    run = replay.run()
    assert len(run.requests) == 3
    assert bool(replay.engines[0].kv.retained) is kept_at_end


def _retaining_registry(use_s: float | None) -> PolicyRegistry:
    """A policy that puts everything on engine 0 and retains every node's context for
    1,000 s, saying its readers start `use_s` after placement (None: unsaid)."""
    from wasma.scheduler.policy import Placement, PlacementKind, Policy, RequestInfo

    class Retains(Policy):
        name = "retains"

        def place(self, req: RequestInfo, now: float) -> Placement:
            return Placement(
                0, PlacementKind.RECOMPUTE, retain=True, retain_s=1000.0, retain_use_s=use_s
            )

    reg = PolicyRegistry()
    reg.register(Retains.name, Retains)
    return reg


def test_a_retention_ends_once_its_readers_started_with_the_next_request_there() -> None:
    """With a use time (steps-to-use) the planner's KV is kept until both workers that
    extend it have prefilled (they hold it then), not for the rest of a long lease; the
    release reaches the engine with the next request placed there. The workers' own
    retentions (no reader) last their lease."""
    from wasma.scheduler.workflow import ContextOf

    wf = Workflow.create(
        "w1",
        "x",
        0.0,
        60.0,
        [
            Node("plan", (), 32, (Unique(600),)),
            Node("a", ("plan",), 32, (ContextOf("plan"), Unique(100))),
            Node("b", ("plan",), 32, (ContextOf("plan"), Unique(120))),
        ],
    )
    later = Workflow.create("w2", "x", 200.0, 60.0, [Node("z", (), 8, (Unique(300),))])
    plan_blocks = 600 // PROFILE.block_size

    def run(use_s: float | None, wfs: list[Workflow]) -> SimReplay:
        replay = SimReplay(wfs, "retains", 1, PROFILE, registry=_retaining_registry(use_s))
        replay.run()
        return replay

    until_next = run(2.0, [wf])  # nothing placed after the readers started
    assert sorted(until_next._retain) == ["w1/a", "w1/b", "w1/plan"]
    released = run(2.0, [wf, later])
    assert sorted(released._retain) == ["w1/a", "w1/b", "w2/z"]
    kv = released.engines[0].kv
    plan_chain = released.hasher.chain(wf.context_span("plan"))[:plan_blocks]
    # The planner's blocks are kept now only as part of the workers' prompts.
    assert all(len(kv.retained[h]) == 2 for h in plan_chain)
    # Without a use time the lease alone decides.
    lease_only = run(None, [wf, later])
    assert sorted(lease_only._retain) == ["w1/a", "w1/b", "w1/plan", "w2/z"]


def test_wasma_sizes_the_lease_to_the_work_left_after_the_node() -> None:
    from wasma.scheduler.policies.wasma import _lease_s

    assert _lease_s(None) is None
    assert _lease_s(0.1) == 1.0  # never under a second
    assert _lease_s(12.0) == 24.0
    assert _lease_s(1e6) == 600.0


@pytest.mark.parametrize("broadcast", [True, False])
def test_copies_land_when_the_router_booked_them(broadcast: bool) -> None:
    """The router prices each move with the copies it already ordered on the holder's
    link; the simulated network lands every copy exactly then (same planner, same
    order), so its links end where the router's book does. On PCIe, siblings spread
    from one holder, and their copies ride one broadcast or queue."""
    from wasma.benchmarks.sim_replay import topology_pricer

    names = [f"e{i}" for i in range(8)]
    sim = SimReplay(
        trace("mapreduce", n=40, rate=4.0),
        "wasma",
        8,
        PROFILE,
        rate_scale=1.5,
        params={"broadcast": broadcast},
        pricer=topology_pricer(names, "pcie-8"),
    )
    run = sim.run()
    book = sim.ctx.copies
    assert book is not None and book is not sim.links
    moved = [r for r in run.requests if r.kind == "transfer"]
    assert moved and sim.links.booked == book.booked == len(moved)
    assert all(sim.links.free_s(n) == book.free_s(n) for n in names)
    assert (sim.links.joined, sim.links.queued) == (book.joined, book.queued)
    if broadcast:
        assert sim.links.joined > 0
    else:
        assert sim.links.joined == 0 and sim.links.queued > 0


def _conversation() -> Workflow:
    """Three turns: t1 comes 0.2 s after t0 (before t0's long answer is done), t2 comes
    30 s after t0 (long after t1 is done). Each has its own arrival and deadline."""
    nodes = [
        Node("t0", (), 400, (Shared("sys", 2048), Unique(100)), 1.0, 20.0),
        Node("t1", ("t0",), 50, (ContextOf("t0"), Unique(60)), 1.2, 20.0),
        Node("t2", ("t1",), 50, (ContextOf("t1"), Unique(60)), 31.0, 0.5),
    ]
    return Workflow.create("conv", "chat", 1.0, 40.0, nodes)


@pytest.mark.parametrize("scale", [1.0, 2.0])
@pytest.mark.parametrize("policy", ["least_loaded", "wasma"])
def test_a_turn_starts_at_its_arrival_and_never_before_its_parent_finished(
    policy: str, scale: float
) -> None:
    wf = _conversation()
    run = SimReplay([wf], policy, 2, PROFILE, rate_scale=scale).run()
    by = {r.node_id: r for r in run.requests}
    assert by["t0"].submit_s == pytest.approx(1.0 / scale)
    # t1 arrived while t0 was decoding: it waits for t0's answer.
    assert by["t0"].finish_s > 1.2 / scale
    assert by["t1"].submit_s == pytest.approx(by["t0"].finish_s)
    # t2 arrives after t1 finished: it starts at its own arrival; wasma places it where
    # t1's KV is (least_loaded picks the idle engine).
    assert by["t1"].finish_s < 31.0 / scale
    assert by["t2"].submit_s == pytest.approx(31.0 / scale)
    if policy == "wasma":
        assert by["t2"].cached_tokens >= wf.prompt_tokens("t1")
    # Each turn is a unit of its own, timed from its arrival against its own deadline.
    recs = {w.workflow_id: w for w in run.workflows}
    assert sorted(recs) == ["conv/t0", "conv/t1", "conv/t2"]
    assert recs["conv/t1"].arrival_s == pytest.approx(1.2 / scale)
    assert recs["conv/t1"].finish_s == by["t1"].finish_s
    assert recs["conv/t2"].deadline_s == 0.5
    assert summarize(run, "conv")["workflows"] == 3


def test_turns_with_own_arrivals_round_trip_and_are_checked() -> None:
    wf = _conversation()
    again = Workflow.from_dict(wf.to_dict())
    assert again.nodes == wf.nodes
    assert "arrival_s" not in trace("debate")[0].to_dict()["nodes"][0]
    t0 = Node("t0", (), 4, (Unique(10),))
    with pytest.raises(WorkflowError, match="come together"):
        Workflow.create("w", "a", 0.0, 1.0, [dataclasses.replace(t0, arrival_s=1.0)])
    with pytest.raises(WorkflowError, match="workflow's arrival_s"):
        Workflow.create(
            "w", "a", 2.0, 1.0, [dataclasses.replace(t0, arrival_s=1.0, deadline_s=1.0)]
        )
    # A turn's remaining critical path stops where the next turn's own clock starts.
    tail = wf.remaining_critical_path({"t0": 1.0, "t1": 2.0, "t2": 4.0})
    assert tail == {"t0": 1.0, "t1": 2.0, "t2": 4.0}
