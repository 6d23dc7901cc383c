"""Placement decisions of the baseline policies and wasma on constructed cluster states."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wasma.core.events import BlockStored
from wasma.core.profile import Profile, load_profile
from wasma.scheduler.policies.wasma import Wasma
from wasma.scheduler.policy import (
    NoHealthyEngine,
    Placement,
    PlacementKind,
    PolicyContext,
    RequestInfo,
)
from wasma.scheduler.prefix_index import PrefixIndex
from wasma.scheduler.pricing import LinkBandwidthPricer
from wasma.scheduler.registry import UnknownPolicy, default_registry
from wasma.scheduler.router import Router
from wasma.scheduler.state import Charge, ClusterState
from wasma.scheduler.workflow import ContextOf, Node, OutputOf, Shared, Unique, Workflow
from wasma.scheduler.workflows import WorkflowRegistry

PROFILE = load_profile("llama3-8b-h100")
BS = PROFILE.block_size
DESIGN_POLICIES = ["round_robin", "least_loaded", "prefix_aware", "kv_aware", "session", "wasma"]


def make_ctx(
    n: int = 4,
    params: dict[str, Any] | None = None,
    profile: Profile = PROFILE,
    hosts: list[str] | None = None,
) -> PolicyContext:
    names = [f"e{i}" for i in range(n)]
    return PolicyContext(
        state=ClusterState(names, num_kv_blocks=profile.num_kv_blocks - 1, hosts=hosts),
        index=PrefixIndex(names),
        workflows=WorkflowRegistry(),
        profile=profile,
        params=params or {},
    )


def policy(name: str, ctx: PolicyContext) -> Any:
    return default_registry().create(name, ctx)


def req(
    rid: str = "r",
    hashes: list[int] | None = None,
    prompt: int | None = None,
    max_tokens: int = 16,
    wid: str | None = None,
    node: str = "n",
    deadline: float = float("inf"),
) -> RequestInfo:
    hashes = list(range(1000, 1010)) if hashes is None else hashes
    return RequestInfo(
        request_id=rid,
        workflow_id=wid if wid is not None else rid,
        node_id=node,
        app="test",
        prompt_tokens=prompt if prompt is not None else len(hashes) * BS + 5,
        max_tokens=max_tokens,
        block_hashes=hashes,
        arrival_s=0.0,
        deadline_s=deadline,
    )


def hold(ctx: PolicyContext, engine: int, hashes: list[int]) -> None:
    ctx.index.apply(BlockStored(f"e{engine}", tuple(hashes), None))


# -- registry --------------------------------------------------------------------------


def test_registry_has_every_design_policy() -> None:
    reg = default_registry()
    assert set(DESIGN_POLICIES) <= set(reg.names())
    for name in DESIGN_POLICIES:
        p = reg.create(name, make_ctx())
        assert p.name == name


def test_unknown_policy_lists_choices() -> None:
    with pytest.raises(UnknownPolicy) as ei:
        default_registry().create("fastest", make_ctx())
    msg = str(ei.value)
    assert "'fastest'" in msg
    for name in DESIGN_POLICIES:
        assert name in msg


def test_double_registration_rejected() -> None:
    reg = default_registry()
    with pytest.raises(ValueError, match="twice"):
        reg.register("wasma", lambda ctx: policy("wasma", ctx))


def test_unknown_policy_parameter_rejected() -> None:
    with pytest.raises(ValueError, match=r"prefix_aware.*bogus.*accepted"):
        policy("prefix_aware", make_ctx(params={"bogus": 1}))
    with pytest.raises(ValueError, match="none"):
        policy("round_robin", make_ctx(params={"x": 1}))


# -- health ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", DESIGN_POLICIES)
def test_unhealthy_engines_skipped(name: str) -> None:
    ctx = make_ctx()
    for s in (0, 1, 3):
        ctx.state.set_healthy(s, False)
    hold(ctx, 0, list(range(1000, 1010)))  # the unhealthy engine holds the prefix
    p = policy(name, ctx)
    for i in range(6):
        assert p.place(req(f"r{i}"), 0.0).engine == 2


@pytest.mark.parametrize("name", DESIGN_POLICIES)
def test_no_healthy_engine_raises(name: str) -> None:
    ctx = make_ctx()
    for s in range(4):
        ctx.state.set_healthy(s, False)
    with pytest.raises(NoHealthyEngine):
        policy(name, ctx).place(req(), 0.0)


@pytest.mark.parametrize("name", DESIGN_POLICIES)
def test_placement_reports_real_hits(name: str) -> None:
    """hit_blocks/kind agree with the index for whichever engine is chosen (no transfer)."""
    ctx = make_ctx(params={"transfer": False} if name == "wasma" else None)
    hold(ctx, 1, list(range(1000, 1006)))
    p = policy(name, ctx)
    for i in range(4):
        pl = p.place(req(f"r{i}"), 0.0)
        real = ctx.index.match(list(range(1000, 1010)))[pl.engine]
        if name != "wasma":
            assert pl.hit_blocks == real
        assert pl.kind == (PlacementKind.REUSE if pl.hit_blocks else PlacementKind.RECOMPUTE)


# -- round robin / least loaded --------------------------------------------------------


def test_round_robin_cycles() -> None:
    p = policy("round_robin", make_ctx())
    assert [p.place(req(f"r{i}"), 0.0).engine for i in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_round_robin_cycles_over_healthy_only() -> None:
    ctx = make_ctx()
    ctx.state.set_healthy(1, False)
    p = policy("round_robin", ctx)
    got = [p.place(req(f"r{i}"), 0.0).engine for i in range(6)]
    assert 1 not in got
    assert Counter(got) == {0: 2, 2: 2, 3: 2}


def test_least_loaded_picks_fewest_outstanding() -> None:
    ctx = make_ctx()
    for s, n in enumerate([5, 2, 7, 3]):
        ctx.state.loads[s].outstanding = n
    p = policy("least_loaded", ctx)
    assert all(p.place(req(f"r{i}"), 0.0).engine == 1 for i in range(5))


def test_least_loaded_ties_rotate() -> None:
    ctx = make_ctx()
    p = policy("least_loaded", ctx)
    got = [p.place(req(f"r{i}"), 0.0).engine for i in range(8)]
    assert set(got) == {0, 1, 2, 3}


def test_least_loaded_through_router_balances() -> None:
    ctx = make_ctx()
    router = Router(ctx, policy("least_loaded", ctx))
    for i in range(12):
        router.route(req(f"r{i}"), 0.0)
    assert [load.outstanding for load in ctx.state.loads] == [3, 3, 3, 3]


# -- prefix_aware (SGLang cache-aware) -------------------------------------------------


def test_prefix_aware_imbalance_goes_to_least_loaded() -> None:
    ctx = make_ctx()
    p = policy("prefix_aware", ctx)
    h = list(range(1000, 1010))
    first = p.place(req("a", h), 0.0).engine
    loads = [100, 100, 100, 100]
    loads[first] = 100
    least = (first + 1) % 4
    loads[least] = 10  # diff 90 > 64 and 100 > 10 * 1.5
    for s, n in enumerate(loads):
        ctx.state.loads[s].outstanding = n
    assert p.place(req("b", h), 0.0).engine == least


def test_prefix_aware_needs_both_thresholds_for_imbalance() -> None:
    ctx = make_ctx(n=2)
    p = policy("prefix_aware", ctx)
    h = list(range(1000, 1010))
    first = p.place(req("a", h), 0.0).engine
    other = 1 - first
    # abs diff 70 > 64 but 210 > 140 * 1.5 is false: balanced, so the cache decides
    ctx.state.loads[first].outstanding = 210
    ctx.state.loads[other].outstanding = 140
    assert p.place(req("b", h), 0.0).engine == first
    # rel 3x but abs diff 60 <= 64: balanced
    ctx.state.loads[first].outstanding = 90
    ctx.state.loads[other].outstanding = 30
    assert p.place(req("c", h), 0.0).engine == first
    # both exceeded: least loaded
    ctx.state.loads[first].outstanding = 200
    ctx.state.loads[other].outstanding = 30
    assert p.place(req("d", h), 0.0).engine == other


def test_prefix_aware_high_match_rate_goes_to_holder() -> None:
    ctx = make_ctx()
    p = policy("prefix_aware", ctx)
    h = list(range(1000, 1010))
    e = p.place(req("a", h), 0.0).engine
    ctx.state.loads[e].outstanding = 20  # busier but within thresholds
    # 4 of 10 blocks match: rate 0.4 > 0.3
    assert p.place(req("b", h[:4] + list(range(2000, 2006))), 0.0).engine == e


def test_prefix_aware_low_match_rate_goes_to_smallest_tree() -> None:
    ctx = make_ctx(n=2)
    p = policy("prefix_aware", ctx)
    h = list(range(1000, 1010))
    e = p.place(req("a", h), 0.0).engine
    # 3 of 10 = 0.3, not above the threshold: the engine with the smaller tree
    assert p.place(req("b", h[:3] + list(range(2000, 2007))), 0.0).engine == 1 - e


def test_prefix_aware_tree_is_routing_time_belief_not_engine_truth() -> None:
    ctx = make_ctx(n=2)
    p = policy("prefix_aware", ctx)
    h = list(range(1000, 1010))
    hold(ctx, 1, h)  # the engine truly holds it, but the router never routed it there
    first = p.place(req("a", h), 0.0)
    assert first.engine == 0  # smallest tree, lowest load: engine 0
    assert p.place(req("b", h), 0.0).engine == 0  # follows its own tree


def test_prefix_aware_threshold_param() -> None:
    ctx = make_ctx(n=2, params={"cache_threshold": 0.5})
    p = policy("prefix_aware", ctx)
    h = list(range(1000, 1010))
    e = p.place(req("a", h), 0.0).engine
    assert p.place(req("b", h[:4] + list(range(2000, 2006))), 0.0).engine == 1 - e
    assert p.place(req("c", h[:6] + list(range(3000, 3004))), 0.0).engine == e


# -- kv_aware (Dynamo) -----------------------------------------------------------------


def kv_case(active0: int, weight: float = 1.0, pending1: int = 0) -> int:
    """e0 holds all 10 prompt blocks; e1 holds none. Returns the chosen engine."""
    ctx = make_ctx(n=2, params={"overlap_score_weight": weight})
    h = list(range(1000, 1010))
    hold(ctx, 0, h)
    ctx.state.loads[0].active_blocks = active0
    ctx.state.loads[1].pending_prefill_tokens = pending1
    # prompt 160 tokens = 10 blocks; request blocks = ceil((160 + 16) / 16) = 11
    return int(policy("kv_aware", ctx).place(req("r", h, prompt=160, max_tokens=16), 0.0).engine)


def test_kv_aware_cost_argmin() -> None:
    # e0: w*0 + (a0 + 11); e1: w*10 + (0 + 11)
    assert kv_case(active0=9) == 0  # 20 < 21
    assert kv_case(active0=11) == 1  # 22 > 21
    assert kv_case(active0=19, weight=2.0) == 0  # 30 < 31
    assert kv_case(active0=21, weight=2.0) == 1  # 32 > 31
    # e1's in-flight prefill counts: e1 = (160 + 160) / 16 + 11 = 31
    assert kv_case(active0=19, pending1=160) == 0
    assert kv_case(active0=21, pending1=160) == 1


def test_kv_aware_reports_overlap() -> None:
    ctx = make_ctx(n=2)
    h = list(range(1000, 1010))
    hold(ctx, 0, h[:7])
    pl = policy("kv_aware", ctx).place(req("r", h, prompt=160), 0.0)
    assert pl.engine == 0 and pl.hit_blocks == 7 and pl.kind == PlacementKind.REUSE


def test_kv_aware_ties_rotate() -> None:
    ctx = make_ctx()
    p = policy("kv_aware", ctx)
    got = {p.place(req(f"r{i}"), 0.0).engine for i in range(4)}
    assert got == {0, 1, 2, 3}


# -- session (consistent hash) ---------------------------------------------------------


def test_session_stable_per_workflow_and_across_instances() -> None:
    a, b = policy("session", make_ctx()), policy("session", make_ctx())
    for w in range(20):
        wid = f"wf-{w}"
        e = a.place(req(f"{wid}/x", wid=wid), 0.0).engine
        assert a.place(req(f"{wid}/y", wid=wid), 0.0).engine == e
        assert b.place(req(f"{wid}/z", wid=wid), 0.0).engine == e


def test_session_spreads_workflows() -> None:
    p = policy("session", make_ctx())
    got = Counter(p.place(req(f"w{i}/n", wid=f"w{i}"), 0.0).engine for i in range(400))
    assert set(got) == {0, 1, 2, 3}
    assert min(got.values()) >= 40  # no engine starved (64 virtual nodes each)


def test_session_unhealthy_moves_only_its_workflows() -> None:
    ctx = make_ctx()
    p = policy("session", ctx)
    before = {f"w{i}": p.place(req(f"w{i}/n", wid=f"w{i}"), 0.0).engine for i in range(200)}
    ctx.state.set_healthy(2, False)
    for wid, e in before.items():
        now = p.place(req(f"{wid}/m", wid=wid), 0.0).engine
        assert now != 2
        if e != 2:
            assert now == e


# -- router bookkeeping ----------------------------------------------------------------


def test_router_charges_and_releases_load() -> None:
    ctx = make_ctx(n=2)
    router = Router(ctx, policy("round_robin", ctx))
    h = list(range(1000, 1010))
    hold(ctx, 0, h[:4])
    pl = router.route(req("r1", h, prompt=170, max_tokens=30), 0.0)
    assert pl.engine == 0 and pl.hit_blocks == 4
    load = ctx.state.loads[0]
    assert load.outstanding == 1
    assert load.active_blocks == -(-(170 + 30) // BS)
    assert load.pending_prefill_tokens == 170 - 4 * BS
    assert load.pending_decode_tokens == 30
    assert ctx.state.engine_of("r1") == 0
    router.on_first_token("r1")
    assert load.pending_prefill_tokens == 0 and load.outstanding == 1
    router.on_finish("r1", "r1", "n", 1.0)
    assert (load.outstanding, load.active_blocks, load.pending_prefill_tokens) == (0, 0, 0)
    assert load.pending_decode_tokens == 0 and load.dispatched_total == 1
    assert ctx.state.engine_of("r1") is None
    router.on_finish("r1", "r1", "n", 1.0)  # twice: no double release
    assert load.outstanding == 0
    assert len(router.decision_us) == 1 and router.decision_us[0] >= 0


# -- wasma -----------------------------------------------------------------------------


def siblings_workflow(k: int = 4, doc: int = 3000) -> Workflow:
    nodes = [Node("plan", (), 50, (Shared("sys", 500), Unique(40)))]
    for i in range(k):
        nodes.append(
            Node(f"map{i}", ("plan",), 100, (Shared("doc", doc), OutputOf("plan"), Unique(30)))
        )
    return Workflow.create("wf", "mapreduce", 0.0, 60.0, nodes)


def test_wasma_colocates_siblings_with_shared_prefix() -> None:
    """Siblings placed back to back, before any engine reports KV, land together."""
    from wasma.core.tokens import BlockHasher

    ctx = make_ctx(n=4)
    router = Router(ctx, policy("wasma", ctx))
    wf = siblings_workflow()
    ctx.workflows.register(wf, 0.0)
    hasher = BlockHasher(BS)
    engines = []
    for i in range(4):
        nid = f"map{i}"
        hs = hasher.chain(wf.prompt_span(nid))
        r = RequestInfo(
            f"wf/{nid}", "wf", nid, "mapreduce", wf.prompt_tokens(nid), 100, hs, 0.0, 60.0
        )
        engines.append(router.route(r, 0.0).engine)
    # the second sibling joins the first; the group may split once it is large
    assert engines[1] == engines[0], engines
    assert len(set(engines)) <= 2, engines


def test_wasma_spreads_unrelated_requests() -> None:
    ctx = make_ctx(n=4)
    router = Router(ctx, policy("wasma", ctx))
    got = {
        router.route(
            req(f"r{i}", list(range(i * 1000, i * 1000 + 100)), max_tokens=200), 0.0
        ).engine
        for i in range(4)
    }
    assert got == {0, 1, 2, 3}


def spread_two_unrelated(contention: float, hosts: list[str] | None) -> list[int]:
    """Where wasma puts two unrelated requests arriving together on two engines."""
    ctx = make_ctx(n=2, profile=replace(PROFILE, host_contention=contention), hosts=hosts)
    router = Router(ctx, policy("wasma", ctx))
    return [
        router.route(req(f"r{i}", list(range(i * 1000, i * 1000 + 30)), max_tokens=200), 0.0).engine
        for i in range(2)
    ]


def test_wasma_keeps_to_one_engine_when_host_neighbours_slow_each_other() -> None:
    # Engines with devices of their own (or no measured contention): the idle one wins.
    assert sorted(spread_two_unrelated(0.0, ["h", "h"])) == [0, 1]
    assert sorted(spread_two_unrelated(1.5, ["a", "b"])) == [0, 1]
    assert sorted(spread_two_unrelated(1.5, None)) == [0, 1]
    # Two engines on one host's cores, each step twice as slow (+1.5) beside a busy
    # neighbour: waking the idle one costs both more than batching the two together.
    first, second = spread_two_unrelated(1.5, ["h", "h"])
    assert first == second


def test_wasma_host_contention_slows_the_idle_neighbour() -> None:
    def place_beside_busy(contention: float) -> tuple[int, float]:
        ctx = make_ctx(n=2, profile=replace(PROFILE, host_contention=contention), hosts=["h"] * 2)
        # Engine 0 has a long prefill queue: the request goes to engine 1 either way.
        ctx.state.on_dispatch(
            "busy", 0, Charge(blocks=400, prefill_tokens=600_000, decode_tokens=400)
        )
        placed = policy("wasma", ctx).place(req("r", list(range(30)), max_tokens=200), 0.0)
        return placed.engine, placed.estimated_finish_s

    (e0, plain), (e1, slowed) = place_beside_busy(0.0), place_beside_busy(0.5)
    assert e0 == e1 == 1
    # Engine 0 stays busy longer than the request runs: every step of it is 1.5x.
    assert slowed == pytest.approx(plain * 1.5)


def test_wasma_host_contention_param_overrides_the_profile() -> None:
    ctx = make_ctx(n=2, params={"host_contention": 1.5}, hosts=["h", "h"])
    router = Router(ctx, policy("wasma", ctx))
    first, second = (
        router.route(req(f"r{i}", list(range(i * 1000, i * 1000 + 30)), max_tokens=200), 0.0).engine
        for i in range(2)
    )
    assert first == second
    with pytest.raises(ValueError, match="host_contention must be a number >= 0"):
        policy("wasma", make_ctx(params={"host_contention": -1}))


def test_cluster_state_groups_engines_by_host() -> None:
    st = ClusterState(["a", "b", "c", "d"], hosts=["h1", "h1", "", "h2"])
    assert st.host_neighbours() == [[1], [0], [], []]
    st.add_engine("e", host="h2")
    assert st.host_neighbours()[3] == [4]
    with pytest.raises(ValueError, match="2 hosts for 1 engines"):
        ClusterState(["a"], hosts=["x", "y"])


def wasma_priority(deadline_abs: float, now: float = 0.0, known: bool = True) -> int:
    ctx = make_ctx(n=2)
    p = policy("wasma", ctx)
    wf = Workflow.create(
        "wf",
        "a",
        0.0,
        1000.0,
        [
            Node("a", (), 200, (Unique(1000),)),
            Node("b", ("a",), 200, (OutputOf("a"), Unique(100))),
        ],
    )
    if known:
        ctx.workflows.register(wf, 0.0)
    r = req(
        "wf/a",
        list(range(60)),
        prompt=1000,
        max_tokens=200,
        wid="wf",
        node="a",
        deadline=deadline_abs,
    )
    return p.place(r, now).hold_order


def test_wasma_priority_orders_by_slack() -> None:
    tight, loose, looser = wasma_priority(30.0), wasma_priority(100.0), wasma_priority(500.0)
    assert tight < loose < looser


def test_wasma_hopeless_workflow_gets_the_lowest_class() -> None:
    hopeless = wasma_priority(0.5)  # the critical path alone is longer than 0.5 s
    worse = wasma_priority(0.1)
    assert hopeless > wasma_priority(10_000.0)  # behind any workflow that can still make it
    assert hopeless > wasma_priority(float("inf"))  # and behind requests without deadlines
    assert worse >= hopeless  # further past its deadline: no higher


def test_wasma_priority_off_gives_zero() -> None:
    ctx = make_ctx(n=2, params={"priority": False})
    placed = policy("wasma", ctx).place(req("r", deadline=1.0), 0.0)
    assert placed.priority == 0 and placed.hold_order == 0


def test_wasma_sends_the_slack_order_to_the_engine_only_when_asked() -> None:
    def placed(params: dict[str, Any]) -> Any:
        ctx = make_ctx(n=2, params=params)
        ctx.workflows.register(siblings_workflow(k=1), 0.0)
        r = req("wf/plan", list(range(10)), wid="wf", node="plan", deadline=60.0)
        return policy("wasma", ctx).place(r, 0.0)

    default = placed({})
    # The router releases held work by slack; the engine runs first come, first served.
    assert default.priority == 0 and default.hold_order > 0
    sent = placed({"engine_priority": True})
    assert sent.priority == sent.hold_order == default.hold_order


class _Unpruned(Wasma):
    prune = False


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(2, 80),
    seed=st.integers(0, 2**32 - 1),
    kv=st.booleans(),
)
def test_wasma_pruning_never_changes_the_decision(n: int, seed: int, kv: bool) -> None:
    """Skipping engines that cannot win must choose exactly what scoring every one does."""
    rng = random.Random(seed)
    ctx = make_ctx(n=n, params={"kv_admission": kv})
    ctx.relay_copies = rng.random() < 0.5
    ctx.pricer = LinkBandwidthPricer(ctx.state.engines)
    chains = [[rng.getrandbits(40) for _ in range(rng.randint(4, 300))] for _ in range(4)]
    book = ctx.copies
    assert book is not None
    for _ in range(rng.randint(0, 6)):  # copies already on some links, some broadcasts
        chain = rng.choice(chains)
        src, dst = rng.sample(range(n), 2)
        book.book(f"e{src}", f"e{dst}", chain, len(chain), len(chain) << 21, 0.0)
    for e in range(n):
        for chain in rng.sample(chains, rng.randint(0, 2)):
            hold(ctx, e, chain[: rng.randint(1, len(chain))])
        ctx.state.on_dispatch(
            f"bg{e}", e, Charge(rng.randint(0, 30_000), rng.randint(0, 9000), rng.randint(0, 500))
        )
    pruned, full = Wasma(ctx), _Unpruned(ctx)
    for i in range(6):
        chain = rng.choice(chains)
        hashes = [*chain[: rng.randint(1, len(chain))], rng.getrandbits(40)]
        r = req(f"r{i}", hashes=hashes, max_tokens=rng.randint(1, 400))
        assert pruned.place(r, 0.0) == full.place(r, 0.0)


def test_a_placement_asks_for_its_own_lease_else_the_drivers() -> None:
    kind = PlacementKind.REUSE
    assert Placement(0, kind).lease_s(120.0) == 0.0  # nothing to keep
    assert Placement(0, kind, retain_s=30.0).lease_s(120.0) == 0.0
    assert Placement(0, kind, retain=True).lease_s(120.0) == 120.0
    assert Placement(0, kind, retain=True, retain_s=30.0).lease_s(120.0) == 30.0


@pytest.mark.parametrize("by_use", [True, False])
def test_wasma_says_when_retained_context_is_next_wanted(by_use: bool) -> None:
    """Steps-to-use: a node whose context a child extends is retained, wanted when the
    node is estimated to finish (its child can start then); a leaf is not retained."""
    ctx = make_ctx(n=2, params={"retain_by_use": by_use})
    p = policy("wasma", ctx)
    wf = Workflow.create(
        "wf",
        "a",
        0.0,
        1000.0,
        [
            Node("a", (), 200, (Unique(1000),)),
            Node("b", ("a",), 200, (ContextOf("a"), Unique(100))),
        ],
    )
    ctx.workflows.register(wf, 0.0)
    parent = p.place(req("wf/a", list(range(60)), 1000, 200, "wf", "a", 1000.0), 5.0)
    assert parent.retain and parent.estimated_finish_s is not None
    if by_use:
        assert parent.retain_use_s == pytest.approx(parent.estimated_finish_s - 5.0)
        assert parent.retain_use_s > 0
    else:
        assert parent.retain_use_s is None
    child = p.place(req("wf/b", list(range(70)), 1116, 200, "wf", "b", 1000.0), 9.0)
    assert not child.retain and child.retain_use_s is None


@pytest.mark.parametrize("oldest_first", [True, False])
def test_wasma_retains_a_conversation_turn_for_its_next_turn(oldest_first: bool) -> None:
    """A turn whose next turn arrives on its own (a user answering) is retained for the
    session lease; its steps-to-use is unknown (infinity: kept contexts of this kind go
    oldest first), or with `session_oldest_first` off its own finish estimate. Either
    way the retention is one its reader ends on start (a use time is given)."""
    ctx = make_ctx(n=2, params={"session_oldest_first": oldest_first})
    p = policy("wasma", ctx)
    wf = Workflow.create(
        "conv",
        "chat",
        0.0,
        1000.0,
        [
            Node("t0", (), 200, (Unique(1000),)),
            Node("t1", ("t0",), 200, (ContextOf("t0"), Unique(100)), 120.0, 60.0),
        ],
    )
    ctx.workflows.register(wf, 0.0)
    turn = p.place(req("conv/t0", list(range(60)), 1000, 200, "conv", "t0", 1000.0), 5.0)
    assert turn.retain and turn.retain_s == p.p["session_lease_s"]
    assert turn.estimated_finish_s is not None
    if oldest_first:
        assert turn.retain_use_s == float("inf")
    else:
        assert turn.retain_use_s == pytest.approx(turn.estimated_finish_s - 5.0)


def test_an_unknown_use_time_is_not_sent_to_the_engine() -> None:
    """vLLM's retaining scheduler reads a missing steps-to-use as infinity; JSON has no
    infinity to send."""
    from wasma.engines.base import RETAIN_USE_ARG, GenerateRequest

    base = GenerateRequest("r", [1, 2, 3], 4, retain_s=600.0)
    assert RETAIN_USE_ARG not in replace(base, retain_use_s=float("inf")).retention_args()
    assert replace(base, retain_use_s=2.5).retention_args()[RETAIN_USE_ARG] == 2.5


def spread_siblings(broadcast: bool, relay: bool) -> list[Placement]:
    """Three requests sharing a 200-block prefix that only a busy e0 holds."""
    from wasma.transfer import BandwidthPricer

    ctx = make_ctx(n=4, params={"broadcast": broadcast})
    ctx.relay_copies = relay
    ctx.pricer = BandwidthPricer(25e9, latency_s=1e-3)
    prefix = list(range(5000, 5200))
    hold(ctx, 0, prefix)
    ctx.state.on_dispatch("bg", 0, Charge(1000, 60_000, 500))
    router = Router(ctx, policy("wasma", ctx))
    return [router.route(req(f"s{i}", [*prefix, 9000 + i], max_tokens=100), 0.0) for i in range(3)]


def test_wasma_siblings_spreading_from_one_holder_ride_one_broadcast() -> None:
    placed = spread_siblings(broadcast=True, relay=True)
    assert [p.engine for p in placed] == [1, 2, 3]
    transfers = [p.transfer for p in placed]
    assert all(t is not None and t.src == 0 and t.broadcast for t in transfers)
    first, second, third = (t.predicted_s for t in transfers if t is not None)
    # Each joins the copy in flight: a hop more, not a whole copy more.
    assert first < second < third < first + 0.01


@pytest.mark.parametrize("broadcast,relay", [(False, True), (True, False)])
def test_wasma_copies_from_one_holder_queue_without_a_broadcast(
    broadcast: bool, relay: bool
) -> None:
    placed = spread_siblings(broadcast, relay)
    times = [p.transfer.predicted_s for p in placed if p.transfer is not None]
    assert len(times) >= 2
    # The second copy waits for the first on e0's link.
    assert times[1] == pytest.approx(2 * times[0])


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("wasma", {"transfer": "maybe"}, "transfer must be true or false"),
        ("wasma", {"transfer": 1}, "transfer must be true or false"),
        ("wasma", {"kv_headroom": "abc"}, r"kv_headroom must be a number in \[0.01, 1\]"),
        ("wasma", {"kv_headroom": -1}, r"kv_headroom must be a number in \[0.01, 1\]"),
        ("wasma", {"externality": float("nan")}, "externality must be a number >= 0"),
        ("wasma", {"max_candidates": -5}, "max_candidates must be an integer >= 1"),
        ("wasma", {"max_candidates": 2.5}, "max_candidates must be an integer >= 1"),
        ("wasma", {"admission_margin": 10**400}, "admission_margin must be a number in"),
        ("prefix_aware", {"cache_threshold": 2}, r"cache_threshold must be a number in \[0, 1\]"),
        ("session", {"virtual_nodes": 0}, r"virtual_nodes must be an integer in \[1, 4096\]"),
        ("kv_aware", {"overlap_score_weight": True}, "overlap_score_weight must be a number"),
    ],
)
def test_a_parameter_of_the_wrong_kind_or_out_of_range_is_refused(
    name: str, params: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        policy(name, make_ctx(params=params))


def test_parameters_of_the_right_kind_are_taken() -> None:
    ctx = make_ctx(params={"kv_headroom": 1, "max_candidates": 8, "host_contention": None})
    assert policy("wasma", ctx).p["kv_headroom"] == 1
