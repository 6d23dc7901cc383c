"""`wasma replay` against a live gateway with simulated engines."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from wasma.benchmarks.replay import Replayer, replay_main
from wasma.deploy.build import EngineSpec, ServiceConfig
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.serve import ServerThread, local_router_factory
from wasma.engines.tiny_model import VOCAB_SIZE
from wasma.scheduler.trace import load_trace, write_trace
from wasma.scheduler.workflow import Workflow

BENCH_KEYS = {
    "trace", "policy", "rate_scale", "engines", "profile", "workflows", "requests",
    "duration_s", "goodput_wf_per_s", "deadline_attainment", "p50_workflow_s",
    "p95_workflow_s", "p99_workflow_s", "p95_request_s", "p95_ttft_s", "prefix_hit_ratio",
    "recomputed_prompt_tokens", "transferred_bytes", "decision_p99_us",
}  # fmt: skip


def _mapreduce(i: int, arrival: float) -> Workflow:
    return Workflow.from_dict(
        {
            "workflow_id": f"mr{i}",
            "app": "mapreduce",
            "arrival_s": arrival,
            "deadline_s": 30.0,
            "nodes": [
                {"id": "plan", "parents": [], "output_tokens": 24,
                 "prompt": [{"shared": "sys:planner", "tokens": 96}, {"unique": 20}]},
                {"id": "map0", "parents": ["plan"], "output_tokens": 16,
                 "prompt": [{"shared": "doc:1", "tokens": 128}, {"output": "plan"}]},
                {"id": "map1", "parents": ["plan"], "output_tokens": 16,
                 "prompt": [{"shared": "doc:1", "tokens": 128}, {"output": "plan"},
                            {"unique": 8}]},
                {"id": "reduce", "parents": ["map0", "map1"], "output_tokens": 8,
                 "prompt": [{"context": "map0"}, {"output": "map1"}, {"unique": 5}]},
            ],
        }
    )  # fmt: skip


@pytest.fixture(scope="module")
def gateway(sim_frontend: Any) -> Iterator[ServerThread]:
    cfg = ServiceConfig(
        engines=EngineSpec.parse("sim:2"),
        policy="wasma",
        sim_speed=50.0,
        sim_vocab_size=VOCAB_SIZE,
    )
    gcfg = GatewayConfig(model_names=("wasma-sim",))
    with ServerThread(create_app(local_router_factory(cfg), sim_frontend, gcfg)) as srv:
        yield srv


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "mapreduce.jsonl"
    write_trace(path, [_mapreduce(i, 0.05 * i) for i in range(6)])
    return path


async def test_dependencies_and_real_outputs(gateway: ServerThread, trace: Path) -> None:
    wfs = load_trace(trace)
    rep = Replayer(url=gateway.url, workflows=wfs, vocab_size=VOCAB_SIZE, progress=False)
    await rep.run()
    assert not rep.failures
    assert len(rep.results) == sum(len(w) for w in wfs)
    colocated = 0
    for wf in wfs:
        res = {n: rep.results[(wf.workflow_id, n)] for n in wf.nodes}
        for nid, node in wf.nodes.items():
            # Dependencies honoured: a node starts after all its parents finished.
            for p in node.parents:
                assert res[nid].submit_s >= res[p].finish_s
            assert len(res[nid].output) == node.output_tokens  # ignore_eos + max_tokens
            assert res[nid].real_output
        plan_out = res["plan"].output
        # Children's prompts splice in the parent's *returned* ids.
        assert res["map0"].prompt[-len(plan_out) :] == plan_out
        assert res["reduce"].prompt[: len(res["map0"].prompt) + 16] == (
            res["map0"].prompt + res["map0"].output
        )
        # The reduce step extends map0's context: where map0 ran, the cache serves it.
        if res["reduce"].engine == res["map0"].engine:
            colocated += 1
            assert res["reduce"].cached_tokens >= len(res["map0"].prompt) // 16 * 16
    # The policy weighs load against reuse, so not always, but mostly it follows the cache.
    assert colocated >= len(wfs) // 2
    # The gateway saw every request under its workflow and node ids.
    status = httpx.get(f"{gateway.url}/v1/workflows/mr0").json()
    assert sorted(n["id"] for n in status["nodes"]) == ["map0", "map1", "plan", "reduce"]
    assert status["nodes_finished"] == 4


def test_replay_main_writes_bench_schema_and_accumulates_runs(
    gateway: ServerThread, trace: Path, tmp_path: Path
) -> None:
    for label in ("wasma", "least_loaded"):
        args = argparse.Namespace(
            trace=str(trace), url=gateway.url, out=str(tmp_path), rate_scale=2.0,
            api_key=None, model="wasma-sim", label=label, vocab_size=None,
            concurrency=64, timeout=60.0, no_progress=True,
            register_workflows=label == "wasma",
        )  # fmt: skip
        assert replay_main(args) == 0
        if label == "wasma":
            # Registered DAGs: the gateway knew each workflow's shape and saw it finish.
            status = httpx.get(f"{gateway.url}/v1/workflows/mr5").json()
            assert status["registered"] and status["status"] == "finished"
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert [r["policy"] for r in runs] == ["wasma", "least_loaded"]
    for row in runs:
        assert set(row) >= BENCH_KEYS
        assert row["trace"] == "mapreduce.jsonl" and row["rate_scale"] == 2.0
        assert row["workflows"] == 6 and row["requests"] == 24
        assert row["failed_requests"] == 0 and row["real_outputs_ratio"] == 1.0
        assert row["deadline_attainment"] == 1.0 and row["goodput_wf_per_s"] > 0
        assert 0 < row["prefix_hit_ratio"] < 1
        assert row["engines"] in (1, 2)  # engines that served at least one request
        # Placement decisions, read from the gateway's histogram (bucket bounds, µs).
        assert 0 < row["decision_p99_us"] <= 100_000


def test_failed_requests_count_against_attainment(trace: Path, tmp_path: Path) -> None:
    # Nothing listens there: every root fails and its children are never sent.
    args = argparse.Namespace(
        trace=str(trace), url="http://127.0.0.1:9", out=str(tmp_path), rate_scale=10.0,
        api_key=None, model=None, label="down", vocab_size=2048,
        concurrency=8, timeout=5.0, no_progress=True,
    )  # fmt: skip
    assert replay_main(args) == 1
    row = json.loads((tmp_path / "results.json").read_text())["runs"][0]
    assert row["failed_workflows"] == 6 and row["deadline_attainment"] == 0.0
