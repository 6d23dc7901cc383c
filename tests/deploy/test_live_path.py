"""The gateway's live token path to remote engines: OpenAIEngine's aiohttp stream over a
real loopback HTTP server, the trimmed `/metrics` parse, and cost calibration wired into
the router service."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, cast

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from wasma.core.profile import load_profile
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.serve import ServerThread
from wasma.deploy.service_types import ServiceRequest
from wasma.engines.base import GenerateRequest, TokenChunk
from wasma.engines.openai_engine import OpenAIEngine, RemoteEngineError, wanted_metric_lines
from wasma.engines.sim_engine import SimEngine
from wasma.engines.vllm_metrics import parse_vllm_metrics

# A vLLM 0.32 /metrics page in miniature: typed families, histograms nobody reads, and
# the samples the router needs.
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 640.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="tiny"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 9.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="tiny"} 9.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="tiny"} 0.75
# TYPE http_request_duration_highr_seconds histogram
http_request_duration_highr_seconds_bucket{le="0.01"} 17.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="2048"} 1.0
"""


class VllmShapedServer:
    """An HTTP server answering the calls OpenAIEngine makes the way vLLM's does (the
    first event echoes the prompt ids; usage with the cache hit comes last)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.disconnects = 0
        self.delay_s = 0.0
        self.status = 200
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models),
                Route("/metrics", self.metrics),
                Route("/health", self.health),
            ]
        )

    async def models(self, request: Request) -> Response:
        return JSONResponse({"data": [{"id": "tiny", "max_model_len": 4096}]})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(METRICS)

    async def health(self, request: Request) -> Response:
        return PlainTextResponse("")

    async def completions(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        if self.status >= 400:
            return JSONResponse(
                {"error": {"message": "prompt too long", "type": "BadRequestError"}},
                status_code=self.status,
            )
        n = body["max_tokens"]

        async def events() -> AsyncIterator[bytes]:
            try:
                for i in range(n):
                    choice: dict[str, Any] = {
                        "index": 0,
                        "text": f"t{i}",
                        "token_ids": [1000 + i],
                        "finish_reason": "length" if i == n - 1 else None,
                    }
                    if i == 0:
                        choice["prompt_token_ids"] = body["prompt"]
                    yield b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"
                    if self.delay_s:
                        await asyncio.sleep(self.delay_s)
                usage = {
                    "prompt_tokens": len(body["prompt"]),
                    "completion_tokens": n,
                    "prompt_tokens_details": {"cached_tokens": 64},
                }
                yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n"
                yield b"data: [DONE]\n\n"
            except asyncio.CancelledError:
                self.disconnects += 1  # the client left: vLLM aborts the request here
                raise

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[ServerThread, VllmShapedServer]]:
    fake = VllmShapedServer()
    with ServerThread(fake.app) as srv:  # type: ignore[arg-type]
        yield srv, fake


async def _engine(url: str) -> OpenAIEngine:
    engine = OpenAIEngine("r0", url)
    await engine.start()
    return engine


async def test_streams_token_ids_over_aiohttp(
    server: tuple[ServerThread, VllmShapedServer],
) -> None:
    srv, fake = server
    fake.status, fake.delay_s = 200, 0.0
    engine = await _engine(srv.url)
    try:
        assert engine._aio is not None  # the token path is aiohttp's, not httpx's
        assert (engine.model, engine.block_size, engine.num_kv_blocks) == ("tiny", 32, 2048)
        req = GenerateRequest("rq1", list(range(16, 1216)), 5, priority=3, ignore_eos=True)
        chunks = [c async for c in engine.generate(req)]
        assert [c.token_ids for c in chunks] == [(1000 + i,) for i in range(5)]
        assert [c.finished for c in chunks] == [False] * 4 + [True]
        assert chunks[-1].finish_reason == "length"
        assert chunks[-1].num_cached_tokens == 64  # from the usage event after it
        assert "".join(c.text for c in chunks) == "t0t1t2t3t4"
        sent = fake.bodies[-1]
        assert sent["prompt"] == list(range(16, 1216))
        assert sent["priority"] == 3 and sent["stream"] and sent["return_token_ids"]
        assert "vllm_xargs" not in sent  # no lease asked for
        lease = GenerateRequest("rq2", list(range(16, 80)), 1, retain_s=30.0)
        _ = [c async for c in engine.generate(lease)]
        assert fake.bodies[-1]["vllm_xargs"] == {"wasma_retain_s": 30.0, "wasma_retain_key": "rq2"}
        used = GenerateRequest(
            "rq3", list(range(16, 80)), 1, retain_s=30.0, retain_use_s=2.5, release=("rq2",)
        )
        _ = [c async for c in engine.generate(used)]
        assert fake.bodies[-1]["vllm_xargs"] == {
            "wasma_retain_s": 30.0,
            "wasma_retain_key": "rq3",
            "wasma_retain_use_s": 2.5,
            "wasma_release": ["rq2"],
        }
        release_only = GenerateRequest("rq4", list(range(16, 80)), 1, release=("rq3",))
        _ = [c async for c in engine.generate(release_only)]
        assert fake.bodies[-1]["vllm_xargs"] == {"wasma_release": ["rq3"]}
        stats = await engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (3, 2, 0.25)
        assert await engine.healthy()
    finally:
        await engine.close()


async def test_closing_the_stream_early_disconnects_the_server(
    server: tuple[ServerThread, VllmShapedServer],
) -> None:
    srv, fake = server
    fake.status, fake.delay_s = 200, 0.05
    engine = await _engine(srv.url)
    try:
        before = fake.disconnects
        gen = cast(
            AsyncGenerator[TokenChunk, None],
            engine.generate(GenerateRequest("rq2", [20, 21, 22], 200)),
        )
        first = await gen.__anext__()
        assert first.token_ids == (1000,)
        await gen.aclose()  # the client left: the engine must stop the request
        for _ in range(100):
            if fake.disconnects > before:
                break
            await asyncio.sleep(0.05)
        assert fake.disconnects == before + 1
    finally:
        fake.delay_s = 0.0
        await engine.close()


async def test_client_errors_are_value_errors_server_errors_engine_faults(
    server: tuple[ServerThread, VllmShapedServer],
) -> None:
    srv, fake = server
    engine = await _engine(srv.url)
    try:
        fake.status = 400
        with pytest.raises(ValueError, match="prompt too long"):
            [c async for c in engine.generate(GenerateRequest("rq3", [20], 2))]
        fake.status = 503
        with pytest.raises(RemoteEngineError, match="HTTP 503"):
            [c async for c in engine.generate(GenerateRequest("rq4", [20], 2))]
    finally:
        fake.status = 200
        await engine.close()


async def test_dead_server_is_an_engine_fault() -> None:
    from wasma.deploy.serve import free_port

    engine = OpenAIEngine("gone", f"http://127.0.0.1:{free_port()}", model="m", block_size=32)
    engine._use_aiohttp = True
    import aiohttp

    engine._aio = aiohttp.ClientSession()
    try:
        with pytest.raises(RemoteEngineError):
            [c async for c in engine.generate(GenerateRequest("rq5", [20], 2))]
    finally:
        await engine.close()


def test_metrics_trimmed_to_the_read_samples_parse_the_same() -> None:
    from wasma.engines.openai_engine import _metric_prefixes

    trimmed = wanted_metric_lines(METRICS, _metric_prefixes())
    assert "bucket" not in trimmed and "#" not in trimmed
    assert parse_vllm_metrics(trimmed) == parse_vllm_metrics(METRICS)


# -- calibration wired into the router service ------------------------------------------


async def test_router_service_learns_engine_speed_and_rebuilds_the_cost_model() -> None:
    """Simulated engines run 4x slower than the profile the policy was given: the
    router's calibrator sees it in the requests' timings and the wasma policy is rebuilt
    on a profile scaled toward it; placement goes on working throughout."""
    true_profile = load_profile("tiny-cpu")
    from wasma.scheduler.calibration import CalibrationConfig, scaled_profile

    slow = scaled_profile(true_profile, 4.0, 4.0)
    engines = [SimEngine(f"s{i}", slow, speed=1.0) for i in range(2)]
    svc = RouterService(
        engines,
        true_profile,
        RouterConfig(policy="wasma", calibration=CalibrationConfig(warmup_requests=4, weight=0.3)),
    )
    await svc.start()
    try:
        assert svc.calibrator is not None
        first_policy = svc.router.policy

        async def one(i: int) -> None:
            req = ServiceRequest(f"r{i}", [16 + (i * 7 + j) % 900 for j in range(256)], 8)
            await svc.complete(req)

        for i in range(12):
            await one(i)
        snap = svc.health()["calibration"]
        assert snap["samples"] == 12
        assert snap["decode_scale"] > 1.5  # slower than profiled, seen
        assert svc.recalibrations >= 1
        assert svc.router.policy is not first_policy  # rebuilt on the new costs
        assert svc.ctx.profile.step.base_s > true_profile.step.base_s
        assert svc.ctx.profile.block_size == true_profile.block_size
        assert svc.completed == 12 and svc.failed == 0
    finally:
        await svc.close()


async def test_simulated_engines_are_not_calibrated_by_default() -> None:
    profile = load_profile("tiny-cpu")
    svc = RouterService(
        [SimEngine("s0", profile, speed=20.0)], profile, RouterConfig(policy="wasma")
    )
    await svc.start()
    try:
        assert svc.calibrator is None
        await svc.complete(ServiceRequest("r0", list(range(16, 80)), 4))
        assert svc.ctx.profile == profile
        assert svc.health()["calibration"] is None
    finally:
        await svc.close()


async def test_baseline_policies_keep_their_instance_when_recalibrated() -> None:
    profile = load_profile("tiny-cpu")
    svc = RouterService(
        [SimEngine("s0", profile, speed=20.0)],
        profile,
        RouterConfig(policy="round_robin", calibration=True),
    )
    policy = svc.router.policy
    svc.set_profile(load_profile("tiny-cpu"))
    assert svc.router.policy is policy
    assert svc.recalibrations == 1
    await svc.close()
