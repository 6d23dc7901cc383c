"""The OpenAI-compatible gateway, end to end: the official `openai` client against a real
uvicorn server on loopback, with simulated engines behind the router."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wasma.core.events import EngineStats
from wasma.core.profile import load_profile
from wasma.deploy.build import EngineSpec, ServiceConfig
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.router_client import LocalRouterClient, RouterClient
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.serve import ServerThread, local_router_factory
from wasma.engines.base import EngineClient, GenerateRequest, KVEventSink, TokenChunk
from wasma.engines.sim_engine import SimEngine
from wasma.engines.tiny_model import VOCAB_SIZE
from wasma.scheduler.policy import Placement, PlacementKind, Policy, RequestInfo
from wasma.scheduler.registry import PolicyRegistry

KEY_A, KEY_B = "key-a-0123456789", "key-b-9876543210"
MODEL = "wasma-sim"


@pytest.fixture(scope="module")
def server(sim_frontend: Any) -> Iterator[ServerThread]:
    cfg = ServiceConfig(
        engines=EngineSpec.parse("sim:2"),
        policy="wasma",
        sim_speed=100.0,
        sim_vocab_size=VOCAB_SIZE,
    )
    gcfg = GatewayConfig(model_names=(MODEL,), api_keys=(KEY_A, KEY_B))
    with ServerThread(create_app(local_router_factory(cfg), sim_frontend, gcfg)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY_A, max_retries=0)


def _auth(key: str = KEY_A) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _assert_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert resp.headers["x-wasma-engine"] and resp.headers["x-wasma-placement"]
    assert resp.headers["x-request-id"]
    return dict(err)


def _wait(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


# -- happy paths through the openai client ---------------------------------------------


def test_completion_non_streaming(client: openai.OpenAI, server: ServerThread) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt="The planner says: ",
        max_tokens=7,
        extra_headers={"x-request-id": "req-1"},
    )
    assert raw.headers["x-request-id"] == "req-1"
    assert raw.headers["x-wasma-engine"] in ("sim0", "sim1")
    assert raw.headers["x-wasma-placement"] in ("reuse", "recompute")
    comp = raw.parse()
    assert comp.object == "text_completion" and comp.model == MODEL
    assert comp.choices[0].finish_reason == "length"
    assert comp.usage is not None and comp.usage.completion_tokens == 7
    # The prompt's tokens as vLLM's renderer counts them (the tiny model's tokenizer).
    ids = httpx.post(
        server.url + "/tokenize",
        json={"model": MODEL, "prompt": "The planner says: "},
        headers=_auth(),
    ).json()["tokens"]
    assert comp.usage.prompt_tokens == len(ids)


def test_completion_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=[300 + i for i in range(50)],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks[-1].choices[0].finish_reason == "length"
    ids = [t for c in text_chunks for t in (c.choices[0].model_extra or {})["token_ids"]]
    assert len(ids) == 12
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == 50


def test_chat_non_streaming_and_streaming(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "system", "content": "You plan."}, {"role": "user", "content": "Go"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5)
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert isinstance(chat.choices[0].message.content, str)
    assert chat.usage is not None and chat.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content  # same prompt, same (simulated) output
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_models_health_and_metrics(server: ServerThread, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert health.headers["x-wasma-engine"] == "none"
    client.completions.create(model=MODEL, prompt="count me", max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "wasma_request_ttft_seconds_bucket",
        "wasma_request_e2e_seconds_count",
        "wasma_placement_decisions_total",
        "wasma_engine_outstanding_requests",
        'wasma_http_requests_total{code="200",handler="/v1/completions"}',
    ):
        assert name in text
    # The router publishes how its estimates compare with what requests took (0 would
    # mean never set: the ratio starts at 1 and stays positive).
    (ratio,) = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("wasma_estimate_slowdown_ratio ")
    ]
    assert ratio > 0


def test_child_extending_parent_context_reuses_parents_engine(client: openai.OpenAI) -> None:
    parent_prompt = [400 + (i * 37) % 1500 for i in range(300)]  # in the tiny vocabulary
    headers = {"x-wasma-workflow-id": "wf-reuse", "x-wasma-app": "pipeline"}
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=parent_prompt,
        max_tokens=40,
        extra_headers={**headers, "x-wasma-node-id": "parent"},
        extra_body={"return_token_ids": True},
    )
    parent_engine = raw.headers["x-wasma-engine"]
    out = (raw.parse().choices[0].model_extra or {})["token_ids"]
    assert len(out) == 40
    child_prompt = parent_prompt + out + [401, 402, 403]
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=child_prompt,
        max_tokens=4,
        extra_headers={**headers, "x-wasma-node-id": "child", "x-wasma-parents": "parent"},
    )
    assert raw.headers["x-wasma-engine"] == parent_engine
    assert raw.headers["x-wasma-placement"] == "reuse"
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= 320  # 340 tokens, 16-blocks


def test_agentic_context_alone_identifies_the_workflow(
    client: openai.OpenAI, server: ServerThread
) -> None:
    ctx = json.dumps({"program_id": "prog-ac", "task_id": "t0"})
    client.completions.create(
        model=MODEL,
        prompt="agent",
        max_tokens=2,
        extra_body={"vllm_xargs": {"agentic_context": ctx}},
    )
    status = httpx.get(server.url + "/v1/workflows/prog-ac", headers=_auth()).json()
    assert [n["id"] for n in status["nodes"]] == ["t0"]
    assert status["nodes"][0]["status"] == "finished"


# -- registered workflows -------------------------------------------------------------

DAG = {
    "workflow_id": "wf-dag",
    "app": "mapreduce",
    "deadline_s": 60.0,
    "nodes": [
        {"id": "plan", "parents": [], "output_tokens": 4, "prompt": [{"unique": 20}]},
        {"id": "map0", "parents": ["plan"], "output_tokens": 4, "prompt": [{"output": "plan"}]},
        {"id": "map1", "parents": ["plan"], "output_tokens": 4, "prompt": [{"output": "plan"}]},
        {
            "id": "reduce",
            "parents": ["map0", "map1"],
            "output_tokens": 4,
            "prompt": [{"output": "map0"}, {"output": "map1"}],
        },
    ],
}


def test_registered_workflow_progress(server: ServerThread, client: openai.OpenAI) -> None:
    resp = httpx.post(server.url + "/v1/workflows", json=DAG, headers=_auth())
    assert resp.status_code == 201, resp.text
    status = resp.json()
    assert status["nodes_total"] == 4 and status["nodes_pending"] == 4
    assert status["registered"] and status["deadline_s"] == 60.0
    again = httpx.post(server.url + "/v1/workflows", json=DAG, headers=_auth())
    _assert_openai_error(again, 409)

    def run(node: str, parents: str = "") -> None:
        client.completions.create(
            model=MODEL,
            prompt=f"node {node}",
            max_tokens=4,
            extra_headers={
                "x-wasma-workflow-id": "wf-dag",
                "x-wasma-node-id": node,
                "x-wasma-parents": parents,
            },
        )

    run("plan")
    run("map0", "plan")
    run("check", "map0")  # a node the DAG did not declare: an agent's extra step joins it
    mid = httpx.get(server.url + "/v1/workflows/wf-dag", headers=_auth()).json()
    by_id = {n["id"]: n for n in mid["nodes"]}
    assert by_id["plan"]["status"] == "finished" and by_id["plan"]["engine"] in ("sim0", "sim1")
    assert by_id["reduce"]["status"] == "pending" and by_id["reduce"]["parents"] == ["map0", "map1"]
    assert mid["status"] == "active" and mid["nodes_finished"] == 3
    assert by_id["check"]["parents"] == ["map0"] and by_id["check"]["status"] == "finished"
    run("map1", "plan")
    run("reduce", "map0,map1")
    done = httpx.get(server.url + "/v1/workflows/wf-dag", headers=_auth()).json()
    assert done["status"] == "finished" and done["nodes_finished"] == 5


def test_workflows_are_scoped_to_the_api_key(server: ServerThread) -> None:
    dag = {**DAG, "workflow_id": "wf-private"}
    assert (
        httpx.post(server.url + "/v1/workflows", json=dag, headers=_auth(KEY_A)).status_code == 201
    )
    other = httpx.get(server.url + "/v1/workflows/wf-private", headers=_auth(KEY_B))
    _assert_openai_error(other, 404)
    mine = httpx.get(server.url + "/v1/workflows/wf-private", headers=_auth(KEY_A))
    assert mine.status_code == 200


# -- errors -----------------------------------------------------------------------------


def test_missing_or_wrong_api_key_is_401(server: ServerThread) -> None:
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": KEY_A}):
        resp = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "x"},
            headers={**headers, "x-request-id": "r401"},
        )
        err = _assert_openai_error(resp, 401)
        assert err["type"] == "Unauthorized"  # vLLM's type names are HTTP phrases
        assert resp.headers["x-request-id"] == "r401"
        assert KEY_A not in resp.text
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "body.max_tokens"),
        ("/v1/completions", {"max_tokens": 3}, 400, None),
        ("/v1/completions", {"prompt": [], "max_tokens": 3}, 400, None),
        ("/v1/completions", {"prompt": [1, "a"], "max_tokens": 3}, 400, "body.prompt.1"),
        ("/v1/completions", {"prompt": [-1, 5], "max_tokens": 3}, 400, "body.prompt.0"),
        ("/v1/completions", {"prompt": [10**9], "max_tokens": 3}, 400, None),
        ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "body.seed"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**70]}, 400, "stop_token_ids"),
        ("/v1/completions", {"prompt": "x", "temperature": 9}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-5"}, 404, "model"),
        ("/v1/completions", {"prompt": "x" * 200, "max_tokens": 200_000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [300] * 70_000, "max_tokens": 65_000}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": []}, 400, None),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, None),
        ("/v1/chat/completions", {"messages": "hi"}, 400, "body.messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
            400,
            "max_tokens",
        ),
        (
            "/v1/completions",
            {"prompt": "x", "metadata": {"wasma_workflow_id": "w", "wasma_deadline_ms": 10**400}},
            400,
            "metadata.wasma_deadline_ms",
        ),
        (
            "/v1/workflows",
            {
                "workflow_id": "w",
                "deadline_s": 10**400,
                "nodes": [
                    {"id": "a", "parents": [], "output_tokens": 4, "prompt": [{"unique": 8}]}
                ],
            },
            400,
            None,
        ),
        ("/v1/workflows", {"workflow_id": "w", "nodes": []}, 400, None),
        (
            "/v1/workflows",
            {"workflow_id": "w", "nodes": [{"id": "a", "parents": ["a"]}]},
            400,
            None,
        ),
    ],
)
def test_bad_requests_get_openai_shaped_4xx(
    server: ServerThread, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    resp = httpx.post(server.url + path, json=body, headers=_auth())
    err = _assert_openai_error(resp, status)
    if param is not None:
        assert err["param"] == param


def test_malformed_bodies_and_unknown_routes(server: ServerThread) -> None:
    for raw in (b"{not json", b"", b"[1,2]", b'"a string"', b"\xff\xfe"):
        resp = httpx.post(
            server.url + "/v1/completions",
            content=raw,
            headers={**_auth(), "content-type": "application/json"},
        )
        _assert_openai_error(resp, 400)
    _assert_openai_error(httpx.get(server.url + "/v1/nothing", headers=_auth()), 404)
    _assert_openai_error(httpx.get(server.url + "/v1/workflows/unknown", headers=_auth()), 404)
    bad_meta = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "x"},
        headers={**_auth(), "x-wasma-workflow-id": "w", "x-wasma-deadline-ms": "soon"},
    )
    assert _assert_openai_error(bad_meta, 400)["param"] == "x-wasma-deadline-ms"


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=-3)
    assert info.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


@pytest.fixture(scope="module")
def slow_server(sim_frontend: Any) -> Iterator[ServerThread]:
    """Engines at real time: a long answer (4,000 tokens, about 25 s) is still running
    when its client leaves."""
    cfg = ServiceConfig(
        engines=EngineSpec.parse("sim:1"), policy="wasma", sim_vocab_size=VOCAB_SIZE
    )
    gcfg = GatewayConfig(model_names=(MODEL,), api_keys=(KEY_A,))
    with ServerThread(create_app(local_router_factory(cfg), sim_frontend, gcfg)) as srv:
        yield srv


# As long as the tiny model's 4,096-token context allows, after a 64-token prompt.
LONG = 4000


def test_client_disconnect_aborts_engine_work(slow_server: ServerThread) -> None:
    server = slow_server
    before = httpx.get(server.url + "/health").json()["cancelled"]
    body = {"prompt": [500] * 64, "max_tokens": LONG, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=_auth()) as resp:
        assert resp.status_code == 200
        next(resp.iter_bytes())  # the first event arrived: the request is running

    def idle() -> bool:
        h = httpx.get(server.url + "/health").json()
        return bool(h["outstanding"] == 0)

    _wait(idle)
    # It ended because the client left, not because all its tokens were generated.
    assert httpx.get(server.url + "/health").json()["cancelled"] == before + 1


def test_client_leaving_a_non_streamed_request_aborts_it(slow_server: ServerThread) -> None:
    server = slow_server
    before = httpx.get(server.url + "/health").json()["cancelled"]
    body = {"prompt": [501] * 64, "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=_auth(), timeout=0.5)
    _wait(lambda: httpx.get(server.url + "/health").json()["outstanding"] == 0)
    assert httpx.get(server.url + "/health").json()["cancelled"] == before + 1


# -- overload and dead engines (their own small gateways) --------------------------------


class _DeadEngine(EngineClient):
    block_size = 16

    def __init__(self, name: str) -> None:
        self.name = name

    async def generate(self, request: GenerateRequest) -> Any:
        raise RuntimeError("dead")
        yield TokenChunk((), True)  # pragma: no cover

    async def stats(self) -> EngineStats:
        raise RuntimeError("dead")

    def subscribe_kv_events(self, sink: KVEventSink) -> None:
        pass

    async def healthy(self) -> bool:
        return False

    async def close(self) -> None:
        pass


def _small_gateway(
    frontend: Any, engines: Callable[[], list[EngineClient]], **kw: Any
) -> ServerThread:
    profile = load_profile("llama3-8b-h100")

    async def factory() -> RouterClient:
        service = RouterService(engines(), profile, RouterConfig(policy="least_loaded", **kw))
        await service.start()
        return LocalRouterClient(service)

    return ServerThread(create_app(factory, frontend, GatewayConfig(model_names=(MODEL,))))


def test_all_engines_down_is_a_fast_503_with_retry_after(sim_frontend: Any) -> None:
    with _small_gateway(sim_frontend, lambda: [_DeadEngine("d0"), _DeadEngine("d1")]) as srv:
        resp = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        err = _assert_openai_error(resp, 503)
        assert err["type"] == "ServiceUnavailable"
        assert int(resp.headers["retry-after"]) >= 1
        assert httpx.get(srv.url + "/health").status_code == 503


class _HoldsEverything(Policy):
    """Asks to hold every request: each runs only once nothing else does."""

    name = "holds_everything"

    def place(self, req: RequestInfo, now: float) -> Placement:
        return Placement(engine=0, kind=PlacementKind.RECOMPUTE, defer=True)


def test_a_streaming_client_that_leaves_while_held_takes_its_request_with_it(
    sim_frontend: Any,
) -> None:
    profile = load_profile("llama3-8b-h100")
    reg = PolicyRegistry()
    reg.register(_HoldsEverything.name, _HoldsEverything)

    async def factory() -> RouterClient:
        engines: list[EngineClient] = [SimEngine("s0", profile, vocab_size=VOCAB_SIZE)]
        service = RouterService(
            engines, profile, RouterConfig(policy=_HoldsEverything.name), registry=reg
        )
        await service.start()
        return LocalRouterClient(service)

    app = create_app(factory, sim_frontend, GatewayConfig(model_names=(MODEL,)))
    with ServerThread(app) as srv:
        long = {"prompt": [7] * 32, "max_tokens": LONG, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=long) as running:
            chunks = running.iter_bytes()  # kept: a dropped iterator closes the stream
            next(chunks)  # runs: nothing else did
            body = {"prompt": [8] * 32, "max_tokens": 4, "stream": True}
            with pytest.raises(httpx.ReadTimeout):  # held behind it; the client gives up
                httpx.post(srv.url + "/v1/completions", json=body, timeout=0.5)
            _wait(lambda: httpx.get(srv.url + "/health").json()["held"] == 0)
            health = httpx.get(srv.url + "/health").json()
            # The long one still runs; the one that left never went live.
            assert health["outstanding"] == 1 and health["held_total"] == 1


def test_past_the_admission_limit_is_429_with_retry_after(sim_frontend: Any) -> None:
    profile = load_profile("llama3-8b-h100")
    # Real-time speed: a 2,000-token decode holds its seat for seconds.
    with _small_gateway(
        sim_frontend, lambda: [SimEngine("s0", profile, vocab_size=VOCAB_SIZE)], max_outstanding=1
    ) as srv:

        async def go() -> None:
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                body = {"prompt": [300] * 32, "max_tokens": 2000, "stream": True}
                async with http.stream("POST", "/v1/completions", json=body) as first:
                    assert first.status_code == 200
                    second = await http.post(
                        "/v1/completions", json={"prompt": "x", "max_tokens": 1}
                    )
                    _assert_openai_error(second, 429)
                    assert int(second.headers["retry-after"]) >= 1

        asyncio.run(go())
        # Served normally once the stream left.
        _wait(lambda: httpx.get(srv.url + "/health").json()["outstanding"] == 0)
        ok = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200


# -- the router as a Ray actor (what `wasma serve` runs) ------------------------------


def test_router_in_a_ray_actor(sim_frontend: Any) -> None:
    ray = pytest.importorskip("ray")
    from wasma.deploy.serve import ray_router_factory

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfg = ServiceConfig(
            engines=EngineSpec.parse("sim:2"),
            policy="wasma",
            sim_speed=10.0,  # a 4,000-token answer runs for seconds: time to leave it
            sim_vocab_size=VOCAB_SIZE,
        )
        gcfg = GatewayConfig(model_names=(MODEL,))
        with ServerThread(create_app(ray_router_factory(cfg), sim_frontend, gcfg)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
            raw = client.completions.with_raw_response.create(
                model=MODEL, prompt=[300 + i for i in range(40)], max_tokens=5
            )
            assert raw.headers["x-wasma-engine"] in ("sim0", "sim1")
            assert raw.parse().usage.completion_tokens == 5  # type: ignore[union-attr]
            chunks = list(
                client.completions.create(
                    model=MODEL,
                    prompt="stream me",
                    max_tokens=6,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
            # Errors raised inside the actor keep their status across Ray.
            too_long = {"prompt": [300] * 70_000, "max_tokens": 65_000}
            _assert_openai_error(httpx.post(srv.url + "/v1/completions", json=too_long), 400)
            _assert_openai_error(httpx.get(srv.url + "/v1/workflows/none"), 404)
            # Many concurrent requests share the channel; each gets its own answer.

            async def burst() -> list[int]:
                async with httpx.AsyncClient(base_url=srv.url, timeout=30) as http:
                    resps = await asyncio.gather(
                        *(
                            http.post(
                                "/v1/completions", json={"prompt": f"r{i}", "max_tokens": 1 + i % 4}
                            )
                            for i in range(100)
                        )
                    )
                return [r.json()["usage"]["completion_tokens"] for r in resps]

            assert asyncio.run(burst()) == [1 + i % 4 for i in range(100)]
            # A client that leaves mid-stream cancels the work inside the actor.
            body = {"prompt": [500] * 64, "max_tokens": LONG, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", srv.url + "/v1/completions", json=body) as resp:
                next(resp.iter_bytes())
            _wait(lambda: httpx.get(srv.url + "/health").json()["outstanding"] == 0)
            assert httpx.get(srv.url + "/health").json()["cancelled"] == 1
            assert "wasma_request_e2e_seconds_count" in httpx.get(srv.url + "/metrics").text
    finally:
        ray.shutdown()


# -- fuzz: whatever arrives, the answer is never a 5xx and errors keep OpenAI's shape ----

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)
_fields = st.sampled_from(
    ["prompt", "messages", "max_tokens", "stream", "n", "temperature", "model", "metadata",
     "vllm_xargs", "stream_options", "top_p", "min_tokens", "return_token_ids", "stop", "echo"]
)  # fmt: skip


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/workflows"]),
    body=st.dictionaries(_fields, _json_values, max_size=6),
    headers=st.dictionaries(
        st.sampled_from(
            ["x-wasma-workflow-id", "x-wasma-deadline-ms", "x-wasma-parents", "x-session-id"]
        ),
        # HTTP forbids leading/trailing blanks in header values (the client refuses them).
        st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30).map(
            str.strip
        ),
        max_size=3,
    ),
)
def test_fuzzed_requests_never_get_a_5xx(
    server: ServerThread, path: str, body: dict[str, Any], headers: dict[str, str]
) -> None:
    if "max_tokens" in body and isinstance(body["max_tokens"], int) and body["max_tokens"] > 64:
        body["max_tokens"] = 64  # keep simulated generations short
    try:
        content = json.dumps(body).encode()
    except ValueError:
        return
    resp = httpx.post(
        server.url + path,
        content=content,
        headers={**_auth(), **headers, "content-type": "application/json"},
        timeout=30,
    )
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        _assert_openai_error(resp, resp.status_code)


def _metric_sum(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_inter_token_latency_is_one_sample_an_engine_step(
    server: ServerThread, client: openai.OpenAI
) -> None:
    """As vLLM's histogram: every token after the first is a sample (not one mean a
    request), and the gaps add up to at most the time from the first token to the end."""
    names = (
        "wasma_request_inter_token_seconds_count",
        "wasma_request_inter_token_seconds_sum",
        "wasma_request_e2e_seconds_sum",
        "wasma_request_ttft_seconds_sum",
    )
    before = [_metric_sum(server.url, n) for n in names]
    stream = client.completions.create(
        model=MODEL,
        prompt="tick tock",
        max_tokens=24,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    pieces = [c for c in stream if c.choices and c.choices[0].text]
    count, itl_sum, e2e_sum, ttft_sum = (
        _metric_sum(server.url, n) - b for n, b in zip(names, before, strict=True)
    )
    # A simulated engine streams a decode stretch as one chunk: each of its tokens is a
    # sample, so every token after the first is one, however the chunks fell.
    assert len(pieces) >= 2 and count == 23
    assert 0 < itl_sum <= e2e_sum - ttft_sum
