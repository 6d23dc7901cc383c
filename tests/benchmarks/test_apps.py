"""Workload generators (benchmarks/apps.py)."""

from __future__ import annotations

import numpy as np
import pytest

from wasma.benchmarks.apps import app_specs, critical_path_alone_s, generate
from wasma.core.profile import load_profile
from wasma.core.tokens import Piece
from wasma.scheduler.workflow import ContextOf, OutputOf, Shared, Workflow

PROFILE = load_profile("llama3-8b-h100")
APPS = ["pipeline", "mapreduce", "debate"]


def shared_head_tokens(spans: list[tuple[Piece, ...]]) -> int:
    """Tokens at the head that all spans have in common (pieces compared token-wise)."""
    toks = [[(p.stream, p.start + i) for p in sp for i in range(p.length)] for sp in spans]
    n = 0
    while all(n < len(t) for t in toks) and len({t[n] for t in toks}) == 1:
        n += 1
    return n


@pytest.mark.parametrize("app", APPS)
def test_deterministic_for_a_seed(app: str) -> None:
    a = [w.to_dict() for w in generate(app, 8, 1.0, 7, PROFILE)]
    b = [w.to_dict() for w in generate(app, 8, 1.0, 7, PROFILE)]
    c = [w.to_dict() for w in generate(app, 8, 1.0, 8, PROFILE)]
    assert a == b
    assert a != c


@pytest.mark.parametrize("app", APPS)
def test_workflows_valid_and_round_trip(app: str) -> None:
    wfs = generate(app, 10, 2.0, 1, PROFILE)
    assert len(wfs) == 10
    assert len({w.workflow_id for w in wfs}) == 10
    arrivals = [w.arrival_s for w in wfs]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    for w in wfs:
        assert w.app == app
        again = Workflow.from_dict(w.to_dict())
        assert again.to_dict() == w.to_dict()


@pytest.mark.parametrize("app", APPS)
def test_deadline_is_slack_times_critical_path(app: str) -> None:
    slack = app_specs()[app].slack
    for w in generate(app, 5, 1.0, 3, PROFILE):
        assert w.deadline_s == pytest.approx(slack * critical_path_alone_s(w, PROFILE), abs=1e-3)
    for w in generate(app, 3, 1.0, 3, PROFILE, slack=5.0):
        assert w.deadline_s == pytest.approx(5.0 * critical_path_alone_s(w, PROFILE), abs=1e-3)


def test_poisson_arrivals_have_the_requested_rate() -> None:
    wfs = generate("mapreduce", 400, 4.0, 11, PROFILE)
    gaps = np.diff([0.0] + [w.arrival_s for w in wfs])
    assert gaps.mean() == pytest.approx(0.25, rel=0.15)
    assert gaps.std() == pytest.approx(0.25, rel=0.25)  # exponential: std = mean


def test_mapreduce_shape() -> None:
    for w in generate("mapreduce", 6, 1.0, 2, PROFILE):
        maps = [n for n in w.nodes if n.startswith("map")]
        assert 4 <= len(maps) <= 8
        assert w.roots() == ["plan"]
        assert all(w.nodes[m].parents == ("plan",) for m in maps)
        assert set(w.nodes["reduce"].parents) == set(maps)
        # every worker reads the same document and the plan: their prompts share a long head
        assert shared_head_tokens([w.prompt_span(m) for m in maps]) >= 1000
        for m in maps:
            refs = {s.node for s in w.nodes[m].prompt if isinstance(s, OutputOf | ContextOf)}
            assert refs == {"plan"}


def test_debate_shape() -> None:
    for w in generate("debate", 6, 1.0, 2, PROFILE):
        rounds = {n.split(".r")[1] for n in w.nodes if ".r" in n}
        agents = {n.split(".")[0] for n in w.nodes if ".r" in n}
        assert 2 <= len(rounds) <= 3 and 3 <= len(agents) <= 4
        last = max(int(r) for r in rounds)
        assert set(w.nodes["judge"].parents) == {f"{a}.r{last}" for a in agents}
        for a in agents:
            for r in range(1, last + 1):
                node = w.nodes[f"{a}.r{r}"]
                # each agent continues its own context of the previous round
                assert node.prompt[0] == ContextOf(f"{a}.r{r - 1}")
                assert set(node.parents) == {f"{b}.r{r - 1}" for b in agents}


def test_pipeline_shape() -> None:
    for w in generate("pipeline", 6, 1.0, 2, PROFILE):
        assert w.roots() == ["pm"]
        assert w.nodes["architect"].parents == ("pm",)
        engs = [n for n in w.nodes if n.startswith("eng") and ".r" not in n]
        assert 2 <= len(engs) <= 3
        assert set(w.nodes["review0"].parents) == set(engs)
        assert w.topo_order()[-1].startswith("review")
        # long fixed role prompts shared across workflows
        first = w.nodes["pm"].prompt[0]
        assert isinstance(first, Shared) and first.key == "sys:pm" and first.tokens >= 500


def test_pipeline_role_prompts_shared_across_workflows() -> None:
    a, b = generate("pipeline", 2, 1.0, 4, PROFILE)
    assert shared_head_tokens([a.prompt_span("pm"), b.prompt_span("pm")]) >= 500


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"app": "chat"}, "unknown app 'chat'.*pipeline"),
        ({"workflows": 0}, "workflows"),
        ({"rate": 0.0}, "rate"),
        ({"slack": -1.0}, "slack"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], pattern: str) -> None:
    args: dict[str, object] = {"app": "mapreduce", "workflows": 2, "rate": 1.0, "seed": 0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=pattern):
        generate(profile=PROFILE, **args)  # type: ignore[arg-type]


def test_small_slack_still_gives_positive_deadlines() -> None:
    wfs = generate("mapreduce", 2, 1.0, 0, PROFILE, slack=1e-5)
    assert all(w.deadline_s > 0 for w in wfs)
