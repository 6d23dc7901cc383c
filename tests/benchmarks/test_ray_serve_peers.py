"""The live Ray Serve peers study's pure parts: run plan, rankings, ratios, the report.

No Ray, engine or network: canned rows in the shape `run_one` writes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from wasma.benchmarks.studies.peers_report import aggregate
from wasma.benchmarks.studies.ray_serve_peers import (
    agreement,
    hit_counts,
    plan,
    rank,
    ranking_table,
    ratio_table,
    report,
)


def _row(router: str, goodput: float, att: float, p95: float, rep: int = 0) -> dict[str, Any]:
    return {
        "router": router,
        "app": "mapreduce",
        "rate_scale": 1.0,
        "rep": rep,
        "goodput_wf_per_s": goodput,
        "deadline_attainment": att,
        "p95_workflow_s": p95,
        "engine_prefix_hit_ratio": 0.5,
        "duration_s": 10.0,
        "failed_requests": 0,
    }


def test_plan_visits_every_router_each_rep_and_rotates_who_goes_first() -> None:
    runs = plan(["wasma", "prefix", "pow2"], ["mapreduce", "debate"], [1.0, 2.0], 3)
    assert [(rep, r) for rep, r, _ in runs] == [
        (0, "wasma"), (0, "prefix"), (0, "pow2"),
        (1, "prefix"), (1, "pow2"), (1, "wasma"),
        (2, "pow2"), (2, "wasma"), (2, "prefix"),
    ]  # fmt: skip
    cells = runs[0][2]
    assert [(c.app, c.rate_scale) for c in cells] == [
        ("mapreduce", 1.0), ("mapreduce", 2.0), ("debate", 1.0), ("debate", 2.0)
    ]  # fmt: skip


def test_hit_counts_use_the_servers_token_counts() -> None:
    results = {
        ("w", "a"): SimpleNamespace(cached_tokens=96, server_prompt_tokens=128),
        ("w", "b"): SimpleNamespace(cached_tokens=0, server_prompt_tokens=64),
    }
    assert hit_counts(results) == (96, 192, 0.5)
    assert hit_counts({}) == (0, 0, None)


def test_rank_orders_by_goodput_then_attainment_then_p95() -> None:
    rows = [
        _row("ray_pow2", 0.2, 0.5, 9.0),
        _row("wasma", 0.4, 1.0, 5.0),
        _row("ray_prefix_affinity", 0.4, 1.0, 6.0),
    ]
    assert rank(aggregate(rows)) == ["wasma", "ray_prefix_affinity", "ray_pow2"]
    assert rank(rows) == ["wasma", "ray_prefix_affinity", "ray_pow2"]  # plain values too


def test_agreement() -> None:
    assert agreement(["a", "b", "c"], ["a", "b", "c"]) == "same order"
    assert agreement(["a", "b", "c"], ["a", "c", "b"]) == "same winner"
    assert agreement(["a", "b", "c"], ["b", "a", "c"]) == "differ"
    assert agreement(["a", "b"], ["b", "x", "a"]) == "differ"  # only shared routers count


def test_ratio_table_divides_medians_per_peer() -> None:
    rows = [
        _row("wasma", 0.4, 1.0, 5.0),
        _row("wasma", 0.6, 1.0, 7.0, rep=1),
        _row("ray_pow2", 0.25, 0.5, 10.0),
        _row("ray_pow2", 0.25, 0.5, 12.0, rep=1),
        _row("ray_prefix_affinity", 0.0, 0.0, 8.0),
    ]
    table = ratio_table(aggregate(rows))
    assert "| mapreduce | x1 | ray_pow2 | 2.00x | 2.00x | 0.55x | 2 |" in table
    assert "| mapreduce | x1 | ray_prefix_affinity | inf | inf | 0.75x | 1 |" in table


def test_report_writes_table_and_plot(tmp_path: Path) -> None:
    rows = [_row("wasma", 0.4, 1.0, 5.0), _row("ray_pow2", 0.2, 0.5, 9.0)]
    rows.append({"router": "ray_pow2", "app": "mapreduce", "rate_scale": 1.0, "error": "x"})
    sims = [
        {"app": "mapreduce", "live_rate_scale": 1.0, "basis": basis, "rate_scale": r,
         "policy": p, "goodput_wf_per_s": g, "deadline_attainment": 1.0,
         "p95_workflow_s": 1.0, "prefix_hit_ratio": 0.5}
        for basis, r in (("same_rate", 1.0), ("speed_matched", 2.5))
        for p, g in (("wasma", 0.3 if basis == "same_rate" else 0.1), ("ray_pow2", 0.2))
    ]  # fmt: skip
    meta = {"engine_speed": {"median_s": 0.25, "slowdown": 2.5}, "deadline_scale": 2.5}
    text = report(tmp_path, rows, sims, meta)
    assert (tmp_path / "table.md").read_text().strip() == text
    assert (tmp_path / "ray_serve_peers.png").stat().st_size > 0
    assert (
        "| mapreduce | x1 | wasma > ray_pow2 | wasma > ray_pow2 | same order | "
        "ray_pow2 > wasma | differ |"
    ) in ranking_table(aggregate([r for r in rows if "error" not in r]), sims)
    assert "2.50x the profile" in text
    assert "| mapreduce | x1 | ray_pow2 | 2.00x | 2.00x | 0.56x | 1 |" in text
