"""A replay reads its workflows as they arrive and lets go of each once it has finished:
from an iterator (`apps.iter_generate`) it never holds the whole trace, and its results
are those of the same workflows given as a list."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from dataclasses import astuple

import pytest

from wasma.benchmarks.apps import generate, iter_generate
from wasma.benchmarks.sim_replay import RunResult, SimReplay
from wasma.core.profile import load_profile
from wasma.scheduler.workflow import Workflow

PROFILE = load_profile("llama3-8b-h100")


def _rows(run: RunResult) -> tuple[list[tuple[object, ...]], list[tuple[object, ...]]]:
    return [astuple(r) for r in run.requests], [astuple(r) for r in run.workflows]


def test_iter_generate_draws_generates_workflows() -> None:
    listed = generate("pipeline", 12, 2.0, seed=5, profile=PROFILE, token_scale=0.1)
    drawn = list(iter_generate("pipeline", 12, 2.0, seed=5, profile=PROFILE, token_scale=0.1))
    assert [(w.workflow_id, w.arrival_s, w.deadline_s, w.nodes) for w in drawn] == [
        (w.workflow_id, w.arrival_s, w.deadline_s, w.nodes) for w in listed
    ]


def test_iter_generate_checks_arguments_at_the_call() -> None:
    with pytest.raises(ValueError, match="unknown app"):
        iter_generate("nope", 3, 1.0, seed=1, profile=PROFILE)


@pytest.mark.parametrize("app,policy", [("mapreduce", "least_loaded"), ("debate", "wasma")])
def test_streamed_replay_matches_listed_replay(app: str, policy: str) -> None:
    kw = {"seed": 3, "profile": PROFILE, "token_scale": 0.2}
    listed = SimReplay(generate(app, 25, 3.0, **kw), policy, 4, PROFILE).run()
    streamed = SimReplay(iter_generate(app, 25, 3.0, **kw), policy, 4, PROFILE).run()
    assert _rows(streamed) == _rows(listed)
    assert streamed.engine_steps == listed.engine_steps
    assert streamed.engine_prefix_hits == listed.engine_prefix_hits


def test_stream_out_of_arrival_order_is_refused() -> None:
    wfs = generate("mapreduce", 4, 3.0, seed=3, profile=PROFILE, token_scale=0.2)
    sim = SimReplay(iter([wfs[0], wfs[2], wfs[1], wfs[3]]), "least_loaded", 2, PROFILE)
    with pytest.raises(ValueError, match="arrival order"):
        sim.run()


def test_finished_workflows_are_let_go() -> None:
    alive: list[weakref.ref[Workflow]] = []

    def tracked() -> Iterator[Workflow]:
        for wf in iter_generate("mapreduce", 40, 3.0, seed=3, profile=PROFILE, token_scale=0.2):
            alive.append(weakref.ref(wf))
            yield wf

    sim = SimReplay(tracked(), "least_loaded", 4, PROFILE)
    sim.dispatch.ctx.workflows.keep_finished = 5  # the registry keeps the last 5 finished
    run = sim.run()
    gc.collect()
    assert len(run.workflows) == 40 and len(alive) == 40
    # (the router's other books hold no workflow: only the registry's last 5 are left)
    assert sum(r() is not None for r in alive) <= 5
