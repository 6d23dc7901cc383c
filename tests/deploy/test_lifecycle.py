"""The gateway's Kubernetes life cycle without a cluster: liveness apart from engines,
start-up with no engine reachable, readiness once one answers, drain on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from wasma.core.profile import load_profile
from wasma.deploy.build import EngineSpec, ServiceConfig
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.lifecycle import Lifecycle, LifecycleConfig
from wasma.deploy.router_client import LocalRouterClient, RouterClient
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.serve import ServerThread, free_port, local_router_factory
from wasma.engines.sim_engine import SimEngine
from wasma.engines.tiny_model import VOCAB_SIZE

ROOT = Path(__file__).resolve().parents[2]
FAST_RETRY = LifecycleConfig(start_retry_s=0.1, start_retry_max_s=0.3, drain_delay_s=0.0)


def _sim_gateway(sim_frontend: Any, port: int | None = None) -> ServerThread:
    """A wasma gateway on simulated engines: here the `openai:` engine another gateway
    places on (it answers /v1/models and token-id completions as vLLM does)."""
    profile = load_profile("tiny-cpu")

    async def factory() -> RouterClient:
        service = RouterService(
            [SimEngine("s0", profile, speed=50.0, vocab_size=VOCAB_SIZE)],
            profile,
            RouterConfig(policy="least_loaded"),
        )
        await service.start()
        return LocalRouterClient(service)

    return ServerThread(create_app(factory, sim_frontend, GatewayConfig()), port=port)


def _wait_for(url: str, status: int, timeout_s: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = httpx.get(url, timeout=5)
            if resp.status_code == status:
                return resp
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered {status}"
        time.sleep(0.1)


def test_starts_with_no_engine_reachable_and_turns_ready_when_one_answers(
    sim_frontend: Any,
) -> None:
    engine_port = free_port()
    cfg = ServiceConfig(
        engines=EngineSpec.parse(f"openai:http://127.0.0.1:{engine_port}"),
        policy="least_loaded",
        profile="tiny-cpu",
    )
    app = create_app(
        local_router_factory(cfg), sim_frontend, GatewayConfig(), Lifecycle(FAST_RETRY)
    )
    with ServerThread(app) as gw:
        # Before any engine: alive, not ready, and new work is a retryable 503.
        assert httpx.get(gw.url + "/live").status_code == 200
        ready = httpx.get(gw.url + "/ready")
        assert ready.status_code == 503 and ready.headers["retry-after"]
        assert ready.json()["status"] == "starting" and ready.json()["error"]
        resp = httpx.post(gw.url + "/v1/completions", json={"prompt": [20, 21], "max_tokens": 2})
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"] == "2"
        assert resp.json()["error"]["message"].startswith("the gateway is starting")
        assert httpx.get(gw.url + "/health").status_code == 503
        with _sim_gateway(sim_frontend, engine_port):
            _wait_for(gw.url + "/ready", 200)
            resp = httpx.post(
                gw.url + "/v1/completions",
                json={"prompt": [20, 21, 22], "max_tokens": 3, "ignore_eos": True},
                timeout=30,
            )
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 3
        # The engine gone again: still alive (no restart), no longer ready.
        _wait_for(gw.url + "/ready", 503)
        assert httpx.get(gw.url + "/live").status_code == 200


def _serve(port: int, tmp: Path, extra: list[str], config: dict[str, Any]) -> subprocess.Popen[str]:
    import yaml

    conf = tmp / "wasma.yaml"
    conf.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WASMA_API_KEYS", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wasma.deploy.cli",
            "serve",
            "--router-in-process",
            "--port",
            str(port),
            "--policy",
            "least_loaded",
            "--config",
            str(conf),
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_sigterm_drains_streams_in_flight_and_refuses_new_work(tmp_path: Path) -> None:
    port = free_port()
    # Slow simulated engines: a 200-token stream takes seconds, long past the signal.
    proc = _serve(
        port,
        tmp_path,
        ["--engines", "sim:1", "--sim-speed", "0.05"],
        {"lifecycle": {"drain_delay_s": 2.0, "drain_timeout_s": 120.0}},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(url + "/ready", 200)
        body = {"prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with (
            httpx.Client(timeout=120) as client,
            client.stream("POST", url + "/v1/completions", json=body) as stream,
        ):
            assert stream.status_code == 200
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert first != "data: [DONE]"
            proc.send_signal(signal.SIGTERM)
            # Draining: not ready, new work refused with a retryable 503, probes answer.
            ready = _wait_for(url + "/ready", 503, timeout_s=10)
            assert ready.json()["status"] == "draining"
            refused = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert refused.headers["connection"] == "close"
            assert httpx.get(url + "/live").status_code == 200
            # The stream in flight runs to its end.
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        chunks = [first, *rest[:-1]]
        assert len(chunks) >= 2
        # uvicorn ends by re-raising the signal it caught, after its graceful shutdown.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0]
    assert "draining" in out


def test_openai_engines_are_named_by_url_not_position() -> None:
    from wasma.deploy.build import openai_engine_names

    pods = [f"http://vllm-{i}.vllm.llm.svc.cluster.local:8000" for i in range(3)]
    assert openai_engine_names(pods) == ["vllm-0", "vllm-1", "vllm-2"]  # the pods' names
    # A URL added in front renames none of the others.
    grown = ["http://vllm-extra.llm.svc.cluster.local:8000", *pods]
    assert openai_engine_names(grown)[1:] == ["vllm-0", "vllm-1", "vllm-2"]
    assert openai_engine_names(["http://127.0.0.1:8001", "http://127.0.0.1:8002"]) == [
        "127.0.0.1:8001",
        "127.0.0.1:8002",
    ]
    # The same first label on two hosts, and a URL listed twice, stay distinct.
    assert openai_engine_names(["http://a.x:1", "http://a.y:1", "http://a.y:1"]) == [
        "a.x:1",
        "a.y:1",
        "a.y:1#2",
    ]
