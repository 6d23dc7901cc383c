"""`bench()`, the capacity search and the report (benchmarks/bench.py, benchmarks/report.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from wasma.benchmarks.apps import generate
from wasma.benchmarks.bench import (
    CAPACITY_ATTAINMENT,
    CapacitySearch,
    RunSpec,
    attainment_bound,
    bench,
    run_one,
)
from wasma.benchmarks.report import table
from wasma.core.profile import load_profile
from wasma.scheduler.trace import write_trace

PROFILE = load_profile("llama3-8b-h100")


@pytest.fixture(scope="module")
def tiny_trace(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("trace") / "mr.jsonl"
    write_trace(path, generate("mapreduce", 4, 2.0, 3, PROFILE))
    return str(path)


# -- capacity search -------------------------------------------------------------------


def search(threshold: float) -> tuple[CapacitySearch, list[float]]:
    """Drive a search against a monotone attainment: passes iff scale <= threshold."""
    s = CapacitySearch("t", "p")
    tried: list[float] = []
    while s.next_scale is not None:
        x = s.next_scale
        tried.append(x)
        assert len(tried) < 40, "the search does not converge"
        s.report(x, 1.0 if x <= threshold else CAPACITY_ATTAINMENT - 0.01)
    return s, tried


@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.99, 1.0, 1.7, 2.7, 10.0, 50.0])
def test_capacity_search_converges_on_the_threshold(threshold: float) -> None:
    s, tried = search(threshold)
    assert tried[0] == 1.0
    assert s.lo <= threshold
    assert s.hi is not None and s.hi > threshold
    assert s.hi / s.lo <= 1 + s.tol
    assert len(tried) <= 16


def test_capacity_search_caps_at_64() -> None:
    s, tried = search(1000.0)
    assert s.lo == 64 and s.hi is None
    assert tried == [1, 2, 4, 8, 16, 32, 64]


def test_capacity_search_gives_zero_when_nothing_passes() -> None:
    s, tried = search(0.0)
    assert s.lo == 0.0
    assert min(tried) <= 1 / 64


def test_capacity_attainment_boundary_counts_as_pass() -> None:
    s = CapacitySearch("t", "p")
    s.report(1.0, CAPACITY_ATTAINMENT)
    assert s.lo == 1.0 and s.next_scale == 2.0


# -- bench() ---------------------------------------------------------------------------


def test_run_one_row(tiny_trace: str, result_fields: dict[str, type]) -> None:
    row = run_one(RunSpec(tiny_trace, "kv_aware", 1.0, 2, "llama3-8b-h100"))
    assert set(result_fields) <= set(row)
    assert row["trace"] == "mr.jsonl" and row["workflows"] == 4
    row = run_one(RunSpec(tiny_trace, "wasma", 1.0, 2, "llama3-8b-h100", {"transfer": False}))
    assert row["params"] == {"transfer": False} and row["transferred_bytes"] == 0


def test_bench_grid_writes_results_and_plots(
    tiny_trace: str, tmp_path: Path, result_fields: dict[str, type]
) -> None:
    out = tmp_path / "out"
    res = bench(
        [tiny_trace],
        ["least_loaded", "wasma"],
        2,
        "llama3-8b-h100",
        [1.0, 2.0],
        False,
        str(out),
        workers=1,
        show_progress=False,
    )
    saved = json.loads((out / "results.json").read_text())
    assert saved == json.loads(json.dumps(res))
    assert "capacity" not in saved
    runs = saved["runs"]
    assert [(r["policy"], r["rate_scale"]) for r in runs] == [
        ("least_loaded", 1.0),
        ("least_loaded", 2.0),
        ("wasma", 1.0),
        ("wasma", 2.0),
    ]
    for r in runs:
        assert set(result_fields) <= set(r)
        assert r["engines"] == 2 and r["profile"] == "llama3-8b-h100"
        assert r["workflows"] == 4
    for png in ("goodput.png", "p95_latency.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    text = table(saved)
    assert "mr.jsonl" in text and "least_loaded" in text and "wasma" in text


def test_bench_sweep_reports_capacity(tiny_trace: str, tmp_path: Path) -> None:
    res = bench(
        [tiny_trace],
        ["round_robin"],
        2,
        "llama3-8b-h100",
        None,
        True,
        str(tmp_path),
        workers=1,
        show_progress=False,
    )
    cap = res["capacity"]
    assert set(cap) == {"mr.jsonl"} and set(cap["mr.jsonl"]) == {"round_robin"}
    c = cap["mr.jsonl"]["round_robin"]
    runs = res["runs"]
    assert all(r.get("sweep") for r in runs)
    # capacity is a scale that was run and passed; every scale above it that ran failed
    # (a probe cut short carries the best attainment it could have reached instead)
    passed = {r["rate_scale"] for r in runs if attainment_bound(r) >= CAPACITY_ATTAINMENT}
    assert c == 0.0 or c in passed
    assert (
        all(attainment_bound(r) < CAPACITY_ATTAINMENT for r in runs if r["rate_scale"] > c)
        or c == 64
    )
    assert "capacity" in table(res)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["capacity"] == cap


def test_run_all_returns_rows_in_the_order_of_the_specs() -> None:
    from wasma.benchmarks.bench import Runner

    class LastFirst(Runner):
        """Runs finish in reverse order of submission."""

        def submit(self, spec: Any) -> Any:
            return spec

        def wait_any(self, handles: list[Any]) -> tuple[list[Any], list[Any]]:
            return [handles[-1]], handles[:-1]

        def result(self, handle: Any) -> dict[str, Any]:
            return {"spec": handle}

    seen: list[int] = []
    rows = LastFirst(workers=1).run_all(range(5), lambda row: seen.append(row["spec"]))
    assert seen == [4, 3, 2, 1, 0]  # progress as runs finish
    assert [row["spec"] for row in rows] == [0, 1, 2, 3, 4]


def test_worker_trace_parses_once_and_reads_an_edited_file_again(tmp_path: Path) -> None:
    from wasma.benchmarks.bench import worker_trace

    path = tmp_path / "t.jsonl"
    write_trace(path, generate("mapreduce", 3, 2.0, 1, PROFILE))
    first = worker_trace(str(path))
    assert worker_trace(str(path)) is first
    write_trace(path, generate("mapreduce", 5, 2.0, 1, PROFILE))
    again = worker_trace(str(path))
    assert len(first) == 3 and len(again) == 5


def test_runs_sharing_a_parsed_trace_give_the_same_rows(tiny_trace: str) -> None:
    wall = ("sim_wall_s", "decision_p99_us")
    rows = [run_one(RunSpec(tiny_trace, "wasma", 2.0, 2, "llama3-8b-h100")) for _ in range(2)]
    a, b = ({k: v for k, v in r.items() if k not in wall} for r in rows)
    assert a == b
