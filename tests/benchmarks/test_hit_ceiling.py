"""The prefix hit ceiling (benchmarks/metrics.py): what no placement can beat."""

from __future__ import annotations

import pytest

from wasma.benchmarks.apps import generate
from wasma.benchmarks.metrics import prefix_hit_ceiling, summarize
from wasma.benchmarks.sim_replay import SimReplay
from wasma.core.profile import load_profile
from wasma.scheduler.workflow import ContextOf, Node, Shared, Unique, Workflow


def _wf(wid: str, arrival: float, nodes: list[Node]) -> Workflow:
    return Workflow.create(wid, "app", arrival, 10.0, nodes)


def test_each_block_is_computed_once_and_hit_after() -> None:
    # 64 shared tokens (4 blocks of 16) + 16 unique: the first workflow computes all 5
    # blocks, the second hits the 4 shared ones.
    a = _wf("a", 0.0, [Node("n", (), 8, (Shared("sys", 64), Unique(16)))])
    b = _wf("b", 1.0, [Node("n", (), 8, (Shared("sys", 64), Unique(16)))])
    assert prefix_hit_ceiling([a, b], 16) == pytest.approx(64 / 160)
    # The order requests run in does not matter: some request computes each block once.
    late_a = _wf("a", 2.0, [Node("n", (), 8, (Shared("sys", 64), Unique(16)))])
    assert prefix_hit_ceiling([late_a, b], 16) == pytest.approx(64 / 160)


def test_a_child_hits_its_parents_context_but_never_its_whole_prompt() -> None:
    # The parent's context is 48 prompt + 16 output = 64 tokens, 4 full blocks. A child
    # whose prompt is exactly that context may hit all but its last token: 3 blocks.
    wf = _wf(
        "w",
        0.0,
        [
            Node("p", (), 16, (Unique(48),)),
            Node("c", ("p",), 8, (ContextOf("p"),)),
            Node("d", ("p",), 8, (ContextOf("p"), Unique(16))),
        ],
    )
    assert prefix_hit_ceiling([wf], 16) == pytest.approx((48 + 64) / (48 + 64 + 80))


@pytest.mark.parametrize("app", ["pipeline", "mapreduce", "debate"])
def test_no_simulated_run_beats_the_ceiling(app: str) -> None:
    prof = load_profile("llama3-8b-h100")
    wfs = generate(app, 12, 2.0, seed=5, profile=prof)
    ceiling = prefix_hit_ceiling(wfs, prof.block_size)
    for policy in ("prefix_aware", "wasma"):
        row = summarize(SimReplay(wfs, policy, 2, prof).run(), app)
        assert 0 < row["prefix_hit_ratio"] <= ceiling + 1e-12
