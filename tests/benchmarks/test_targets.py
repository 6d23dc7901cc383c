"""The `make bench` report (benchmarks/studies/targets.py): which run fills which cell."""

from __future__ import annotations

from typing import Any

from wasma.benchmarks.studies.targets import ABLATIONS, OPTIONS, SWEPT, targets_markdown


def _row(policy: str, scale: float, attainment: float, **extra: Any) -> dict[str, Any]:
    return {
        "trace": "mapreduce.jsonl",
        "policy": policy,
        "rate_scale": scale,
        "deadline_attainment": attainment,
        "goodput_wf_per_s": attainment,
        "p95_workflow_s": 10.0,
        "prefix_hit_ratio": 0.5,
        **extra,
    }


def test_target_cells_use_plain_runs_and_the_ablation_labels_each_variant() -> None:
    knee = 2.0
    runs = []
    for mult in (1.0, 1.5, 2.0):
        runs += [_row("least_loaded", knee * mult, 0.5), _row("wasma", knee * mult, 0.9)]
    # Runs at the same rate that must not fill a target cell.
    runs.append(_row("wasma", knee * 1.5, 0.11, params=ABLATIONS["transfer"]))
    runs.append(_row("wasma", knee * 1.5, 0.22, dags=False))
    runs.append(_row("wasma", knee * 1.5, 0.33, sweep=True))
    runs.append(_row("wasma", knee * 1.5, 0.44, params=OPTIONS["admission_bias"]))
    results = {
        "runs": runs,
        "capacity": {"mapreduce.jsonl": dict.fromkeys(SWEPT, knee)},
        "decision_latency": {
            "64_engines": {"p50_us": 1.0, "p99_us": 2.0, "cpu_p50_us": 1.0, "cpu_p99_us": 2.0}
        },
    }
    md = targets_markdown(results, {"mapreduce": "out/mapreduce.jsonl"})
    assert "| mapreduce | 1.5x (3) | 1.00 | 1.80 | 0.500 | 0.900 |" in md
    assert "| mapreduce | all on | 0.900 |" in md
    assert "| mapreduce | no transfer | 0.110 |" in md
    assert "| mapreduce | no registered DAG (learned shapes) | 0.220 |" in md
    assert "0.330" not in md  # a sweep step is no cell
    # The DAG-less run has its own table, beside the run with the DAG at the same rate.
    assert "| mapreduce | 1.5x | 0.900 / 0.220 | 1.00 / 1.00 | 1.80 / 0.44 |" in md
    assert "| mapreduce | 2x | " not in md  # no DAG-less run there: no row
    # An option's run sits beside the default in its own table, and in no other cell.
    assert "| mapreduce | 1.5x | admission_bias | 0.900 / 0.440 | 1.00 / 1.00 | 1.80 / 0.88 |" in md
    assert md.count("0.440") == 1
    assert "| mapreduce | 1x | admission_bias" not in md


def test_ablation_rows_follow_the_variants_not_the_order_runs_finished_in() -> None:
    knee = 2.0
    runs = [_row(p, knee * m, 0.5) for p in ("least_loaded", "wasma") for m in (1.0, 2.0)]
    runs.append(_row("least_loaded", knee * 1.5, 0.5))
    # Parallel runs finish in any order: here the last variant first.
    for mechanism in reversed(list(ABLATIONS)):
        runs.append(_row("wasma", knee * 1.5, 0.7, params=ABLATIONS[mechanism]))
    runs += [_row("wasma", knee * 1.5, 0.8, dags=False), _row("wasma", knee * 1.5, 0.9)]
    results = {
        "runs": runs,
        "capacity": {"mapreduce.jsonl": dict.fromkeys(SWEPT, knee)},
        "decision_latency": {},
    }
    md = targets_markdown(results, {"mapreduce": "out/mapreduce.jsonl"})
    ablation = md.split("### Ablation", 1)[1].split("\n\n")[1]
    labels = [line.split(" | ")[1] for line in ablation.splitlines()[2:]]
    expected = ["all on", "no registered DAG (learned shapes)"]
    assert labels == expected + [f"no {m}" for m in ABLATIONS]
