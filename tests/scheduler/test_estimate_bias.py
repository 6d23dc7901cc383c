"""EstimateBias: how much longer than the policy estimated requests have been taking."""

from __future__ import annotations

import pytest

from wasma.core.profile import load_profile
from wasma.scheduler.estimate_bias import EstimateBias
from wasma.scheduler.policy import PolicyContext, RequestInfo
from wasma.scheduler.prefix_index import PrefixIndex
from wasma.scheduler.registry import default_registry
from wasma.scheduler.router import Router
from wasma.scheduler.state import ClusterState
from wasma.scheduler.workflows import WorkflowRegistry


def test_the_ratio_follows_requests_that_run_long_and_comes_back() -> None:
    bias = EstimateBias(alpha=0.5)
    assert bias.ratio == 1.0
    for i in range(20):
        bias.placed(f"r{i}", 10.0, 2.0)
        bias.finished(f"r{i}", 16.0)  # 6 s against 2 s estimated
    assert bias.ratio == pytest.approx(3.0, rel=1e-3)
    for i in range(20, 40):
        bias.placed(f"r{i}", 20.0, 2.0)
        bias.finished(f"r{i}", 22.0)
    assert bias.ratio == pytest.approx(1.0, rel=1e-3)
    assert bias.samples == 40 and len(bias) == 0


def test_unknown_finishes_and_empty_estimates_change_nothing_and_one_outlier_is_clamped() -> None:
    bias = EstimateBias(alpha=1.0)
    bias.finished("never-placed", 5.0)
    bias.placed("zero", 0.0, 0.0)  # no estimate to compare with
    bias.finished("zero", 9.0)
    assert bias.ratio == 1.0 and bias.samples == 0
    bias.placed("stuck", 0.0, 1.0)
    bias.finished("stuck", 1000.0)
    assert bias.ratio == EstimateBias.MAX_RATIO


def test_requests_that_never_finish_are_forgotten_oldest_first() -> None:
    bias = EstimateBias()
    bias.MAX_PENDING = 3
    for i in range(5):
        bias.placed(f"r{i}", 0.0, 1.0)
    assert len(bias) == 3
    bias.finished("r0", 4.0)  # forgotten: no sample
    assert bias.samples == 0
    bias.finished("r4", 4.0)
    assert bias.samples == 1


def test_alpha_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="alpha"):
        EstimateBias(alpha=0.0)


def test_the_router_feeds_it_from_placements_and_finishes() -> None:
    prof = load_profile("llama3-8b-h100")
    ctx = PolicyContext(ClusterState(["e0"]), PrefixIndex(["e0"]), WorkflowRegistry(), prof)
    router = Router(ctx, default_registry().create("wasma", ctx))
    req = RequestInfo("a", "w", "n", "app", 2000, 100, [], 0.0)
    placed = router.route(req, 0.0)
    assert placed.estimated_finish_s is not None and placed.estimated_finish_s > 0
    router.on_finish("a", "w", "n", 3 * placed.estimated_finish_s)
    assert ctx.estimates.samples == 1
    assert ctx.estimates.ratio == pytest.approx(1 + ctx.estimates.alpha * 2)
