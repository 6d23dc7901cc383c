"""Capacity probes cut short (`SimReplay(stop_below=...)`, `RunSpec.stop_below`, the
sweep's default): a run stops once so many units have missed their deadlines that its
attainment stays below the threshold whatever follows. The verdict must be the full
run's, the simulation up to the cut the full run's own, and the row must say it was cut
and carry no metrics."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from wasma.benchmarks.apps import generate
from wasma.benchmarks.bench import CAPACITY_ATTAINMENT, RunSpec, bench, run_one
from wasma.benchmarks.report import plot_results, table
from wasma.benchmarks.sim_replay import RunResult, SimReplay
from wasma.core.profile import load_profile
from wasma.scheduler.trace import write_trace
from wasma.scheduler.workflow import Node, Shared, Unique, Workflow

PROFILE = load_profile("llama3-8b-h100")
# The metrics of the results format (DESIGN.md: Results), each describing the whole trace.
DESIGN_METRICS = (
    "requests",
    "duration_s",
    "goodput_wf_per_s",
    "deadline_attainment",
    "p50_workflow_s",
    "p95_workflow_s",
    "p99_workflow_s",
    "p95_request_s",
    "p95_ttft_s",
    "prefix_hit_ratio",
    "recomputed_prompt_tokens",
    "transferred_bytes",
    "decision_p99_us",
)
# Every field a run in "runs" carries in the results format.
CONTRACT = ("trace", "policy", "rate_scale", "engines", "profile", "workflows", *DESIGN_METRICS)
# Metrics of a full row that describe the whole trace; a cut row must carry none.
METRICS = (*DESIGN_METRICS, "preemptions")


def sessions(n: int = 40) -> list[Workflow]:
    """Conversations whose turns carry their own arrivals and deadlines (each turn is a
    unit), with a one-shot request beside them in each (a workflow-level unit too)."""
    out = []
    for i in range(n):
        t0 = 0.4 * i
        nodes = [
            Node("t0", (), 200, (Shared("sys", 800), Unique(3000)), t0, 1.5),
            Node("t1", ("t0",), 200, (Shared("sys", 800), Unique(3000)), t0 + 1.0, 1.5),
            Node("side", (), 100, (Unique(4000),)),
        ]
        out.append(Workflow.create(f"s{i}", "chat", t0, 8.0, nodes))
    return out


def run(wfs: list[Workflow], policy: str, scale: float, stop: float | None) -> RunResult:
    return SimReplay(wfs, policy, 2, PROFILE, scale, stop_below=stop).run()


def attainment(res: RunResult) -> float:
    return sum(w.met for w in res.workflows) / len(res.workflows)


TRACES = {
    "mapreduce": lambda: generate("mapreduce", 24, 2.0, 5, PROFILE),
    "debate": lambda: generate("debate", 24, 2.0, 5, PROFILE),
    "sessions": sessions,
}


@pytest.mark.parametrize("name", sorted(TRACES))
@pytest.mark.parametrize("policy", ["least_loaded", "wasma"])
def test_a_probe_cut_short_has_the_full_runs_verdict(name: str, policy: str) -> None:
    wfs = TRACES[name]()
    # From a load every run passes to one far past capacity: the verdicts differ
    # across the range, and wherever the full run fails the cut run stops early.
    verdicts = set()
    cuts = 0
    for scale in (0.25, 2.0, 32.0):
        full = run(wfs, policy, scale, None)
        cut = run(wfs, policy, scale, CAPACITY_ATTAINMENT)
        passed = attainment(full) >= CAPACITY_ATTAINMENT
        verdicts.add(passed)
        assert cut.units == len(full.workflows)
        if passed:
            # Never cut: the very run, every record the same.
            assert not cut.cut_short
            assert cut.requests == full.requests and cut.workflows == full.workflows
            continue
        assert cut.cut_short
        cuts += 1
        # Up to the cut it is the full run: the same records, in the same order.
        assert len(cut.requests) < len(full.requests)
        assert cut.requests == full.requests[: len(cut.requests)]
        assert cut.workflows == full.workflows[: len(cut.workflows)]
        # Every unit counted missed by the cut misses in the full run too.
        full_missed = sum(not w.met for w in full.workflows)
        assert cut.missed <= full_missed
        assert (cut.units - cut.missed) / cut.units < CAPACITY_ATTAINMENT
        assert all(w.finish_s <= cut.cut_at_s for w in cut.workflows)
    assert verdicts == {True, False}
    assert cuts >= 1


def test_a_cut_row_is_marked_and_holds_no_metrics(tmp_path: Path) -> None:
    path = tmp_path / "mr.jsonl"
    write_trace(path, generate("mapreduce", 24, 2.0, 5, PROFILE))
    spec = RunSpec(str(path), "least_loaded", 32.0, 2, "llama3-8b-h100")
    full = run_one(spec)
    cut = run_one(replace(spec, stop_below=CAPACITY_ATTAINMENT))
    assert full["deadline_attainment"] < CAPACITY_ATTAINMENT and "cut_short" not in full
    assert cut["cut_short"] is True
    assert not set(METRICS) & set(cut)
    assert cut["workflows"] == full["workflows"]
    assert cut["deadline_attainment_max"] < CAPACITY_ATTAINMENT
    assert cut["deadline_attainment_max"] >= full["deadline_attainment"]
    assert cut["requests_finished"] < full["requests"]
    # a passing run with the same threshold is a full row, identical to the plain one
    low = RunSpec(str(path), "least_loaded", 0.25, 2, "llama3-8b-h100")
    plain, watched = run_one(low), run_one(replace(low, stop_below=CAPACITY_ATTAINMENT))
    wall = ("sim_wall_s", "decision_p99_us")
    assert {k: v for k, v in plain.items() if k not in wall} == {
        k: v for k, v in watched.items() if k not in wall
    }
    # the report shows the row without inventing figures; the plots leave it out
    text = table({"runs": [cut, plain]}, include_sweep=True)
    assert "cut" in text
    plot_results({"runs": [cut, plain]}, tmp_path)


def test_the_sweep_finds_the_same_capacities_with_probes_cut_short(tmp_path: Path) -> None:
    traces = []
    for app in ("mapreduce", "pipeline"):
        path = tmp_path / f"{app}.jsonl"
        write_trace(path, generate(app, 16, 2.0, 3, PROFILE))
        traces.append(str(path))
    results: dict[bool, dict[str, Any]] = {}
    for cut in (False, True):
        results[cut] = bench(
            traces,
            ["least_loaded", "wasma"],
            2,
            "llama3-8b-h100",
            None,
            True,
            str(tmp_path / f"out{cut}"),
            workers=1,
            show_progress=False,
            cut_short=cut,
        )
    assert results[True]["capacity"] == results[False]["capacity"]
    full_runs = results[False]["runs"]
    assert "cut_short_runs" not in results[False]
    # "runs" keeps whole runs, each with every field of the results format
    assert all(set(CONTRACT) <= set(r) for r in results[True]["runs"])
    assert not any(r.get("cut_short") for r in results[True]["runs"])
    cut_runs = sorted(
        [*results[True]["runs"], *results[True]["cut_short_runs"]],
        key=lambda r: (r["trace"], r["policy"], r["rate_scale"]),
    )
    key = [(r["trace"], r["policy"], r["rate_scale"]) for r in full_runs]
    assert [(r["trace"], r["policy"], r["rate_scale"]) for r in cut_runs] == key
    assert not any(r.get("cut_short") for r in full_runs)
    marked = [r for r in cut_runs if r.get("cut_short")]
    assert marked, "no probe of the sweep was cut short"
    wall = ("sim_wall_s", "decision_p99_us")
    for f, c in zip(full_runs, cut_runs, strict=True):
        if c.get("cut_short"):
            # only failing probes are cut, and the file says so
            assert f["deadline_attainment"] < CAPACITY_ATTAINMENT
            assert not set(METRICS) & set(c)
        else:
            assert {k: v for k, v in f.items() if k not in wall} == {
                k: v for k, v in c.items() if k not in wall
            }
    saved = json.loads((tmp_path / "outTrue" / "results.json").read_text())
    assert saved["runs"] == results[True]["runs"]
    assert saved["cut_short_runs"] == results[True]["cut_short_runs"] == marked
