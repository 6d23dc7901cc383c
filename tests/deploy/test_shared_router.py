"""Two gateway processes, one scheduling state: `wasma serve --shared-router NAME` joins
the detached router actor another gateway created, so a workflow's children land on
the engine holding their parent's KV whichever gateway each request reaches."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from wasma.deploy.build import EngineSpec, ServiceConfig
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.serve import ServerThread, free_port, ray_router_factory
from wasma.engines.tiny_model import VOCAB_SIZE

ROOT = Path(__file__).resolve().parents[2]
NAME = "wasma-test-shared"
MODEL = "wasma-sim"


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _second_gateway(address: str, port: int) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WASMA_API_KEYS", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wasma.deploy.cli",
            "serve",
            "--engines",
            "sim:2",
            "--address",
            address,
            "--shared-router",
            NAME,
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _wait_ready(url: str, proc: subprocess.Popen[str], timeout_s: float = 180.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the second gateway exited: {proc.communicate()[0][-3000:]}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError("the second gateway never became ready")


def _ask(url: str, prompt: list[int], node: str, parents: str = "") -> httpx.Response:
    headers = {"x-wasma-workflow-id": "wf-shared", "x-wasma-node-id": node}
    if parents:
        headers["x-wasma-parents"] = parents
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    resp = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def test_two_gateway_processes_share_one_router(ray_cluster: str, sim_frontend: Any) -> None:
    cfg = ServiceConfig(
        engines=EngineSpec.parse("sim:2"),
        policy="wasma",
        sim_speed=100.0,
        sim_vocab_size=VOCAB_SIZE,
    )
    app = create_app(
        ray_router_factory(cfg, shared_name=NAME),
        sim_frontend,
        GatewayConfig(model_names=(MODEL,)),
    )
    port = free_port()
    proc = _second_gateway(ray_cluster, port)
    try:
        with ServerThread(app) as first:
            second = f"http://127.0.0.1:{port}"
            _wait_ready(second, proc)
            context = [300 + (i * 13) % 1500 for i in range(256)]
            parent = _ask(first.url, context, "plan")
            engine = parent.headers["x-wasma-engine"]
            for k in range(4):
                # Children alternate between the gateways; each sees the parent ran.
                url = second if k % 2 == 0 else first.url
                child = _ask(url, [*context, 10 + k, 11 + k], f"work{k}", "plan")
                assert child.headers["x-wasma-engine"] == engine
                assert child.headers["x-wasma-placement"] == "reuse"
            status = httpx.get(second + "/v1/workflows/wf-shared").json()
            assert {n["id"] for n in status["nodes"]} == {
                "plan",
                "work0",
                "work1",
                "work2",
                "work3",
            }
        # The first gateway left; the other still routes through the shared router.
        after = _ask(second, [*context, 99], "late", "plan")
        assert after.headers["x-wasma-engine"] == engine
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
        import ray

        actor = ray.get_actor(NAME, namespace="wasma")
        ray.kill(actor)
    assert "router actor" in out, out[-2000:]
