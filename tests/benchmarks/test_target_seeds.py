"""The targets on several trace seeds (benchmarks/studies/target_seeds.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from wasma.benchmarks.studies.target_seeds import main, summary_markdown, targets


def _row(app: str, seed: int, load: float, policy: str, p95: float, goodput: float) -> dict:
    return {
        "app": app,
        "seed": seed,
        "load": load,
        "policy": policy,
        "p95_workflow_s": p95,
        "goodput_wf_per_s": goodput,
    }


def test_targets_are_ratios_against_least_loaded_on_the_same_seed() -> None:
    runs: list[dict[str, Any]] = []
    for seed, wasma_p95 in ((1, 5.0), (2, 6.0)):
        for load in (1.0, 1.5, 2.0):
            runs.append(_row("debate", seed, load, "least_loaded", 10.0 * seed, 1.0))
            runs.append(_row("debate", seed, load, "wasma", wasma_p95, 3.0))
    # A sweep's rows carry no load: they must not count as cells.
    runs.append({**_row("debate", 1, 2.0, "wasma", 99.0, 0.0), "sweep": True, "load": None})
    capacity: dict[tuple[str, int], dict[str, float]] = {
        ("debate", 1): {"least_loaded": 4, "prefix_aware": 8, "kv_aware": 5, "wasma": 12},
        ("debate", 2): {"least_loaded": 4, "prefix_aware": 8, "kv_aware": 10, "wasma": 12},
    }
    found = {t.label: t for t in targets(runs, capacity)}
    p95 = found["P95 / LL at 1.5x"]
    assert p95.values == {1: 0.5, 2: 0.3}
    assert p95.upper and all(p95.met(v) for v in p95.values.values())
    assert found["goodput / LL at 2x"].values == {1: 3.0, 2: 3.0}
    cap = found["capacity / best KV peer"]
    # Against the better of prefix_aware and kv_aware on each seed.
    assert cap.values == {1: 1.5, 2: 1.2}
    assert [cap.met(v) for v in cap.values.values()] == [True, False]
    md = summary_markdown(list(found.values()), [1, 2])
    assert (
        "| debate | capacity / best KV peer (>= 1.3) | 1.500 | 1.200 | 1.350 | 1.200-1.500 | 1/2 |"
        in md
    )


def test_a_baseline_that_met_no_deadline_makes_the_goodput_ratio_unbounded() -> None:
    runs = [
        _row("mapreduce", seed, 2.0, pol, 1.0, goodput)
        for seed, ll_goodput in ((1, 0.0), (2, 0.5))
        for pol, goodput in (("least_loaded", ll_goodput), ("wasma", 2.0))
    ]
    capacity: dict[tuple[str, int], dict[str, float]] = {
        ("mapreduce", s): {"least_loaded": 1, "prefix_aware": peer, "kv_aware": 0, "wasma": 2}
        for s, peer in ((1, 0), (2, 1))
    }
    found = {t.label: t for t in targets(runs, capacity)}
    # Neither KV-aware peer met 90% at any load on seed 1.
    assert found["capacity / best KV peer"].values == {1: math.inf, 2: 2.0}
    goodput = found["goodput / LL at 2x"]
    assert goodput.values == {1: math.inf, 2: 4.0}
    assert all(goodput.met(v) for v in goodput.values.values())
    md = summary_markdown([goodput], [1, 2])
    assert "| inf | 4.000 | inf | 4.000-inf | 2/2 |" in md


def test_main_writes_every_seed_and_target(tmp_path: Path) -> None:
    out = tmp_path / "seeds"
    argv = ["--out", str(out), "--seeds", "3,4", "--apps", "mapreduce"]
    argv += ["--param", "wasma.admission_bias=true"]
    assert main([*argv, "--workflows", "4", "--engines", "2", "--workers", "1"]) == 0
    data = json.loads((out / "results.json").read_text())
    # The parameter reached every wasma run, sweeps included, and no other policy's.
    assert data["params"] == {"wasma": {"admission_bias": True}}
    for r in data["runs"]:
        assert r.get("params") == ({"admission_bias": True} if r["policy"] == "wasma" else None)
    said = (out / "summary.md").read_text().splitlines()[0]
    assert said == "Policy parameters: wasma.admission_bias=True"
    assert set(data["capacity"]) == {"mapreduce-s3.jsonl", "mapreduce-s4.jsonl"}
    cells = [r for r in data["runs"] if not r.get("sweep")]
    # least_loaded and wasma at 1x, 1.5x and 2x on each seed.
    assert sorted((r["seed"], r["load"], r["policy"]) for r in cells) == sorted(
        (s, x, p) for s in (3, 4) for x in (1.0, 1.5, 2.0) for p in ("least_loaded", "wasma")
    )
    assert all(r["app"] == "mapreduce" for r in data["runs"])
    assert len(data["targets"]) == 5  # P95 at three loads, goodput, capacity
    assert all(set(t["values"]) == {"3", "4"} for t in data["targets"])
    # Five target rows and the prefix hits beside the trace's ceiling.
    assert (out / "summary.md").read_text().count("| mapreduce |") == 6
    assert set(data["prefix_hit_ceiling"]) == set(data["capacity"])
    assert all(0 < v < 1 for v in data["prefix_hit_ceiling"].values())
    assert (out / "seeds.png").stat().st_size > 0
    # The two seeds are different traces.
    assert (out / "mapreduce-s3.jsonl").read_text() != (out / "mapreduce-s4.jsonl").read_text()
    # The summary again from results.json alone, without running anything.
    summary = (out / "summary.md").read_text()
    (out / "summary.md").unlink()
    assert main(["--out", str(out), "--report-only"]) == 0
    assert (out / "summary.md").read_text() == summary


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--seeds", "1,1"], "--seeds: expected distinct integers"),
        (["--seeds", "a"], "--seeds: expected comma-separated integers"),
        (["--apps", "chess"], "--apps: unknown"),
        (["--workflows", "0"], "must be positive"),
        (["--report-only"], "does not exist"),
        (["--param", "wasma.nope=1"], "unknown parameter"),
        (["--param", "round_robin.x=1"], "no runs of"),
        (["--param", "wasma"], "expected POLICY.KEY=VALUE"),
    ],
)
def test_bad_flags_get_a_readable_error(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["--out", str(tmp_path), *argv])
