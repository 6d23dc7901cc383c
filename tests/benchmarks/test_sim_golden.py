"""Golden results of the simulated replay: every figure of a few fixed runs, recorded from
the simulator before its speed work, must stay the same to the last digit.

The runs cover the three project apps, a Mooncake-style trace (one-request workflows whose
prompts are chains of 512-token blocks), four policies, a KV pool small enough to evict
and preempt, FCFS engines, and workflows whose DAG the router is never told. Each run's
results row (the results schema of DESIGN.md, less the wall-clock fields) is compared
field by field, and its per-request records through a digest of their exact values.

Re-record (only for a change that is *meant* to alter simulated results):
    WASMA_RECORD_GOLDEN=1 python -m pytest tests/benchmarks/test_sim_golden.py
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from wasma.benchmarks.apps import critical_path_alone_s, generate
from wasma.benchmarks.metrics import summarize
from wasma.benchmarks.sim_replay import RunResult, SimReplay
from wasma.core.profile import Profile, load_profile
from wasma.scheduler.workflow import Node, Shared, Workflow

GOLDEN = Path(__file__).parent / "data" / "sim_golden.json"
PROFILE = load_profile("llama3-8b-h100")
POLICIES = ("least_loaded", "prefix_aware", "kv_aware", "wasma")
# Wall-clock figures: they differ run to run whatever the simulator does.
WALL_FIELDS = ("decision_p99_us", "sim_wall_s")


def small_kv(num_kv_blocks: int) -> Profile:
    return dataclasses.replace(
        PROFILE, num_kv_blocks=num_kv_blocks, max_model_len=(num_kv_blocks - 1) * 16
    )


def mooncake_style(n: int = 60) -> list[Workflow]:
    """Mooncake-style requests (its trace format: `hash_ids` of 512-token blocks), seeded
    here so the record needs no file from outside the repository: a few long shared heads
    that requests extend by varying depths, unique tails, short outputs. Each 512-token
    block is a shared key (its hash id), so requests listing the same leading ids share
    that prefix."""
    rows: list[dict[str, Any]] = []
    for i in range(n):
        head = list(range((i % 4) * 100, (i % 4) * 100 + 8 + i % 5))
        rows.append(
            {
                "timestamp": 40 * i,
                "input_length": 512 * (len(head) + 2) - 100,
                "output_length": 50 + 37 * (i % 9),
                "hash_ids": [*head, 10_000 + 2 * i, 10_001 + 2 * i],
            }
        )
    out = []
    for i, row in enumerate(rows):
        ids = row["hash_ids"]
        last = row["input_length"] - 512 * (len(ids) - 1)
        prompt = tuple(
            Shared(f"mc:{h}", 512 if j < len(ids) - 1 else last) for j, h in enumerate(ids)
        )
        nodes = [Node("r", (), max(int(row["output_length"]), 1), prompt)]
        arrival = row["timestamp"] / 1000.0
        draft = Workflow.create(f"mc{i}", "mooncake", arrival, 1.0, nodes)
        deadline = round(3.0 * critical_path_alone_s(draft, PROFILE), 3)
        out.append(Workflow.create(f"mc{i}", "mooncake", arrival, deadline, nodes))
    return out


@cache
def trace(name: str) -> tuple[Workflow, ...]:
    if name == "mooncake":
        return tuple(mooncake_style())
    rate = {"pipeline": 3.0, "mapreduce": 3.0, "debate": 4.0}[name]
    return tuple(generate(name, 30, rate, seed=7, profile=PROFILE))


# (case name, trace, policy, engines, profile, SimReplay keyword arguments)
CASES: list[tuple[str, str, str, int, Profile, dict[str, Any]]] = [
    (f"{app}-{policy}", app, policy, 4, PROFILE, {})
    for app in ("pipeline", "mapreduce", "debate", "mooncake")
    for policy in POLICIES
]
CASES += [
    ("mapreduce-least_loaded-smallkv", "mapreduce", "least_loaded", 2, small_kv(900), {}),
    ("mapreduce-wasma-smallkv", "mapreduce", "wasma", 2, small_kv(900), {}),
    ("debate-kv_aware-smallkv", "debate", "kv_aware", 2, small_kv(700), {}),
    ("mooncake-wasma-smallkv", "mooncake", "wasma", 2, small_kv(1200), {}),
    (
        "pipeline-least_loaded-fcfs",
        "pipeline",
        "least_loaded",
        3,
        PROFILE,
        {"engine_policy": "fcfs"},
    ),
    ("debate-wasma-nodags", "debate", "wasma", 3, PROFILE, {"register_dags": False}),
    ("mapreduce-prefix_aware-rate2", "mapreduce", "prefix_aware", 4, PROFILE, {"rate_scale": 2.0}),
]


def records_digest(run: RunResult) -> str:
    """A digest of every per-request and per-workflow record, in completion order, with
    floats as their exact repr."""
    h = hashlib.sha256()
    for r in run.requests:
        fields = dataclasses.astuple(r)
        # Recorded before the CPU tier: its field (last, 0 without a tier) is checked here
        # and left out of the digest.
        assert fields[-1] == 0, "a CPU-tier hit in a run with no tier"
        h.update(repr(fields[:-1]).encode())
    for w in run.workflows:
        h.update(repr(dataclasses.astuple(w)).encode())
    return h.hexdigest()


def figures(name: str) -> dict[str, Any]:
    _case, tr, policy, engines, profile, kw = next(c for c in CASES if c[0] == name)
    run = SimReplay(trace(tr), policy, engines, profile, **kw).run()
    row = summarize(run, f"{tr}.jsonl", profile.kv_bytes_per_token)
    for key in WALL_FIELDS:
        row.pop(key)
    # Recorded before the CPU tier existed: with no tier, every hit is a GPU hit.
    tiers = row.pop("prefix_hits_by_tier")
    assert tiers == {"gpu": row["prefix_hit_ratio"], "cpu": 0.0}
    row["preemptions"] = sum(r.preemptions for r in run.requests)
    row["engine_prefix_queries"] = run.engine_prefix_queries
    row["engine_prefix_hits"] = run.engine_prefix_hits
    row["records_sha256"] = records_digest(run)
    return row


def test_record_golden() -> None:
    """With WASMA_RECORD_GOLDEN=1, (re)write the golden file from the current code."""
    if not os.environ.get("WASMA_RECORD_GOLDEN"):
        pytest.skip("set WASMA_RECORD_GOLDEN=1 to re-record")
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    data = {name: figures(name) for name, *_ in CASES}
    GOLDEN.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_simulated_figures_equal_the_golden_record(name: str) -> None:
    if os.environ.get("WASMA_RECORD_GOLDEN"):
        pytest.skip("recording")
    golden = json.loads(GOLDEN.read_text())
    assert name in golden, f"no golden record for {name}: re-record"
    got = figures(name)
    want = golden[name]
    assert set(got) == set(want)
    diffs = {k: (want[k], got[k]) for k in want if want[k] != got[k]}
    assert not diffs, f"{name}: figures changed (golden, now): {diffs}"
