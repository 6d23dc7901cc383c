"""Ray Serve's two request routers as simulated policies: the rules Ray's code applies."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from wasma.core.profile import load_profile
from wasma.scheduler.policy import PolicyContext, RequestInfo
from wasma.scheduler.prefix_index import PrefixIndex
from wasma.scheduler.registry import default_registry
from wasma.scheduler.router import Router
from wasma.scheduler.state import Charge, ClusterState
from wasma.scheduler.workflows import WorkflowRegistry

PROFILE = load_profile("llama3-8b-h100")
BS = PROFILE.block_size


def make_ctx(n: int = 4, params: dict[str, Any] | None = None, seed: int = 0) -> PolicyContext:
    names = [f"e{i}" for i in range(n)]
    return PolicyContext(
        ClusterState(names),
        PrefixIndex(names),
        WorkflowRegistry(),
        PROFILE,
        params=params or {},
        seed=seed,
    )


def req(rid: str, hashes: list[int], prompt: int | None = None) -> RequestInfo:
    return RequestInfo(
        request_id=rid,
        workflow_id=rid,
        node_id="n",
        app="test",
        prompt_tokens=prompt if prompt is not None else len(hashes) * BS,
        max_tokens=8,
        block_hashes=hashes,
        arrival_s=0.0,
    )


def load(ctx: PolicyContext, slot: int, n: int) -> None:
    for i in range(n):
        ctx.state.on_dispatch(f"bg{slot}.{i}", slot, Charge(1, 0, 0))


def test_both_are_registered() -> None:
    names = default_registry().names()
    assert "ray_pow2" in names
    assert "ray_prefix_affinity" in names


def test_pow2_keeps_the_shorter_queue_of_its_two_draws() -> None:
    ctx = make_ctx(3)
    load(ctx, 0, 5)
    load(ctx, 1, 1)
    load(ctx, 2, 3)
    pol = default_registry().create("ray_pow2", ctx)
    picks = Counter(pol.place(req(f"r{i}", [i]), 0.0).engine for i in range(600))
    # Engine 0 is the longest queue of any pair: never chosen. Engine 1 wins every pair
    # it is drawn in (2/3 of draws), engine 2 only the pair {0, 2} (1/3).
    assert picks[0] == 0
    assert 350 < picks[1] < 450
    assert 150 < picks[2] < 250


def test_pow2_spreads_an_idle_pair_evenly() -> None:
    ctx = make_ctx(2)
    pol = default_registry().create("ray_pow2", ctx)
    picks = Counter(pol.place(req(f"r{i}", [i]), 0.0).engine for i in range(400))
    assert 150 < picks[0] < 250


def test_prefix_affinity_follows_the_longest_match() -> None:
    ctx = make_ctx(4)
    pol = default_registry().create("ray_prefix_affinity", ctx)
    first = pol.place(req("a", [1, 2, 3, 4]), 0.0).engine
    load(ctx, first, 20)  # Ray's default threshold is infinite: load never overrides
    again = pol.place(req("b", [1, 2, 3, 4, 99, 98]), 0.0).engine
    assert again == first


def test_prefix_affinity_below_ten_percent_takes_the_smallest_tree() -> None:
    ctx = make_ctx(2)
    pol = default_registry().create("ray_prefix_affinity", ctx)
    big = pol.place(req("a", list(range(100, 120))), 0.0).engine
    # One block of twenty matches (5% < 10%): the other replica, whose tree is empty.
    other = pol.place(req("b", [100, *range(500, 519)]), 0.0).engine
    assert other != big
    # Two of twenty (10%) is enough to follow the match.
    follow = pol.place(req("c", [100, 101, *range(700, 718)]), 0.0).engine
    assert follow == big


def test_prefix_affinity_rate_counts_tokens_not_blocks() -> None:
    ctx = make_ctx(2)
    pol = default_registry().create("ray_prefix_affinity", ctx)
    first = pol.place(req("a", [1, 2]), 0.0).engine
    # One matched block of a prompt 11 blocks long in tokens (the tail is no full block).
    short = pol.place(req("b", [1, 50], prompt=11 * BS), 0.0).engine
    assert short != first


def test_prefix_affinity_imbalance_falls_back_to_pow2() -> None:
    ctx = make_ctx(2, params={"imbalanced_threshold": 3})
    pol = default_registry().create("ray_prefix_affinity", ctx)
    first = pol.place(req("a", [1, 2, 3]), 0.0).engine
    load(ctx, first, 4)  # spread 4 > 3: power of two, which keeps the shorter queue
    assert pol.place(req("b", [5, 6, 7]), 0.0).engine != first
    load(ctx, 1 - first, 2)  # spread 2 <= 3: the match again
    assert pol.place(req("c", [1, 2, 3]), 0.0).engine == first


def test_prefix_affinity_ties_on_the_match_take_the_shorter_queue() -> None:
    ctx = make_ctx(3)
    pol = default_registry().create("ray_prefix_affinity", ctx)
    router = Router(ctx, pol)
    # The same prefix routed to two replicas (the second time to the smallest tree).
    e0 = router.route(req("a", [7, 8]), 0.0).engine
    ctx.state.set_healthy(e0, False)
    e1 = router.route(req("b", [7, 8]), 0.0).engine
    ctx.state.set_healthy(e0, True)
    assert e1 != e0
    load(ctx, e1, 3)
    assert pol.place(req("c", [7, 8, 9]), 0.0).engine == e0
    load(ctx, e0, 5)
    assert pol.place(req("d", [7, 8, 10]), 0.0).engine == e1


def test_prefix_affinity_skips_an_unhealthy_replica() -> None:
    ctx = make_ctx(2)
    pol = default_registry().create("ray_prefix_affinity", ctx)
    first = pol.place(req("a", [1, 2, 3]), 0.0).engine
    ctx.state.set_healthy(first, False)
    assert pol.place(req("b", [1, 2, 3]), 0.0).engine == 1 - first


def test_bad_parameter_is_named() -> None:
    with pytest.raises(ValueError, match="match_rate_threshold"):
        default_registry().create("ray_prefix_affinity", make_ctx(2, {"match_rate_threshold": 2}))


def test_runs_repeat_under_a_seed() -> None:
    def run(seed: int) -> list[int]:
        ctx = make_ctx(4, seed=seed)
        pol = default_registry().create("ray_pow2", ctx)
        return [pol.place(req(f"r{i}", [i]), 0.0).engine for i in range(50)]

    assert run(3) == run(3)
    assert run(3) != run(4)
