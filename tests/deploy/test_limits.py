"""Overload and bad input: size and field limits, admission under a burst, /health and
/metrics apart, API keys kept out of logs, idle workflows swept."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from wasma.core.profile import load_profile
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.metadata import WorkflowIdentity
from wasma.deploy.router_client import LocalRouterClient, RouterClient
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.serve import ServerThread, free_port
from wasma.deploy.service_types import ServiceRequest
from wasma.engines.sim_engine import SimEngine

KEY = "sk-secret-key-0123456789abcdef"
LIMITS = GatewayConfig(
    model_names=("wasma-sim",),
    api_keys=(KEY,),
    max_body_bytes=4096,
    max_workflow_bytes=2048,
    max_prompt_tokens=256,
    max_tokens_limit=64,
)


def _gateway(
    frontend: Any, cfg: GatewayConfig, admin_port: int | None = None, **kw: Any
) -> ServerThread:
    profile = load_profile("llama3-8b-h100")

    async def factory() -> RouterClient:
        engines = [
            SimEngine(f"s{i}", profile, speed=kw.pop("speed", 50.0), vocab_size=frontend.vocab_size)
            for i in range(2)
        ]
        service = RouterService(engines, profile, RouterConfig(policy="least_loaded", **kw))
        await service.start()
        return LocalRouterClient(service)

    return ServerThread(create_app(factory, frontend, cfg), admin_port=admin_port)


@pytest.fixture(scope="module")
def server(sim_frontend: Any) -> Iterator[ServerThread]:
    with _gateway(sim_frontend, LIMITS) as srv:
        yield srv


def _error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err: dict[str, Any] = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": "x" * 5000, "max_tokens": 1}, 413, None),  # body bytes
        ({"prompt": "x" * 300, "max_tokens": 1}, 400, "prompt"),  # prompt tokens
        ({"prompt": "x", "max_tokens": 65}, 400, "max_tokens"),
        ({"prompt": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, 400, "metadata"),
        ({"prompt": "x", "metadata": {"k" * 65: "v"}}, 400, "metadata"),
        ({"prompt": "x", "metadata": {"note": "v" * 513}}, 400, "metadata.note"),
        ({"prompt": "x", "metadata": {"wasma_workflow_id": "w" * 129}}, 400, None),
        ({"prompt": "x", "stop": ["s"] * 65}, 400, "body.stop"),  # vLLM's own bound
        ({"prompt": "x", "vllm_xargs": {f"k{i}": 1 for i in range(17)}}, 400, "vllm_xargs"),
    ],
)
def test_size_and_field_limits(
    server: ServerThread, body: dict[str, Any], status: int, param: str | None
) -> None:
    resp = httpx.post(
        server.url + "/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"}
    )
    _error(resp, status, param)


def test_dag_size_limits(server: ServerThread) -> None:
    auth = {"authorization": f"Bearer {KEY}"}
    nodes = [{"id": f"n{i}", "parents": [], "output_tokens": 1, "prompt": [{"unique": 1}]}
             for i in range(40)]  # fmt: skip
    big = {"workflow_id": "big", "deadline_s": 10.0, "nodes": nodes}
    _error(httpx.post(server.url + "/v1/workflows", json=big, headers=auth), 413)
    bad = {"workflow_id": "x" * 200, "deadline_s": 10.0, "nodes": nodes[:1]}
    _error(httpx.post(server.url + "/v1/workflows", json=bad, headers=auth), 400)


def test_api_keys_never_reach_the_logs(
    server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    for key in (KEY, KEY[:-1] + "X", "Bearer " + KEY):
        httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "hello", "max_tokens": 2},
            headers={"authorization": f"Bearer {key}"},
        )
        httpx.get(server.url + "/v1/workflows/none", headers={"authorization": key})
    assert caplog.records  # something was logged, and none of it holds a key
    assert KEY not in caplog.text and KEY[:-1] not in caplog.text


def test_health_and_metrics_on_their_own_port(sim_frontend: Any) -> None:
    cfg = GatewayConfig(model_names=("wasma-sim",), api_keys=(KEY,), admin_port=free_port())
    assert cfg.admin_port is not None
    with _gateway(sim_frontend, cfg, admin_port=cfg.admin_port) as srv:
        admin = f"http://127.0.0.1:{cfg.admin_port}"
        assert httpx.get(admin + "/health").json()["status"] == "ok"
        assert "wasma_" in httpx.get(admin + "/metrics").text
        # Not on the public port, and the admin port serves nothing else.
        auth = {"authorization": f"Bearer {KEY}"}
        _error(httpx.get(srv.url + "/health", headers=auth), 404)
        _error(httpx.get(srv.url + "/metrics", headers=auth), 404)
        assert httpx.post(admin + "/v1/completions", json={"prompt": "x"}).status_code == 404


def test_a_burst_far_above_capacity_gets_429s_then_normal_service(sim_frontend: Any) -> None:
    cfg = GatewayConfig(model_names=("wasma-sim",))
    with _gateway(sim_frontend, cfg, max_outstanding=8, speed=2.0) as srv:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as http:
                body = {"prompt": "burst", "max_tokens": 64}
                return list(
                    await asyncio.gather(
                        *(http.post("/v1/completions", json=body) for _ in range(300))
                    )
                )

        resps = asyncio.run(burst())
        codes = [r.status_code for r in resps]
        assert set(codes) <= {200, 429} and codes.count(429) >= 150 and 200 in codes
        for r in resps:
            if r.status_code == 429:
                _error(r, 429)
                assert int(r.headers["retry-after"]) >= 1
        health = httpx.get(srv.url + "/health").json()
        assert health["outstanding"] == 0 and health["failed"] == 0
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "after", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


async def test_abandoned_registered_workflows_are_swept() -> None:
    profile = load_profile("llama3-8b-h100")
    svc = RouterService(
        [SimEngine("s0", profile, speed=50.0)], profile, RouterConfig(idle_workflow_s=0.2)
    )
    await svc.start()
    try:
        node = {"parents": [], "output_tokens": 2, "prompt": [{"unique": 4}]}
        nodes = [{**node, "id": "a"}, {**node, "id": "b", "parents": ["a"]}]
        dag = {"workflow_id": "w", "deadline_s": 5.0, "nodes": nodes}
        svc.register_workflow(dag)
        ident = WorkflowIdentity(workflow_id="w", node_id="a")
        await svc.complete(ServiceRequest("ra", [5] * 20, 2, ident))
        assert "w" in svc.ctx.workflows.active
        await asyncio.sleep(0.3)
        svc.sweep_idle_workflows()  # the background sweep may have been first
        assert "w" not in svc.ctx.workflows.active  # node b never came
        assert svc.workflow_status("w")["status"] == "finished"
    finally:
        await svc.close()
