"""OpenAIEngine against a fake `vllm serve` (httpx MockTransport) and a real ZMQ socket."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest

from wasma.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from wasma.core.tokens import hash_token_blocks
from wasma.engines.base import GenerateRequest, TokenChunk
from wasma.engines.kv_events import KVEventBatch
from wasma.engines.kv_events import WireBlockRemoved as WireRemoved
from wasma.engines.kv_events import WireBlockStored as WireStored
from wasma.engines.openai_engine import OpenAIEngine, RemoteEngineError, url_host

BS = 32
METRICS = """\
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
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="2048"} 1.0
"""


def _sse(events: list[dict[str, Any]]) -> bytes:
    return (
        b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
    )


class FakeVLLM:
    """Answers like vLLM's OpenAI server for the calls OpenAIEngine makes."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[httpx.Headers] = []
        self.fail_with: int | None = None

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "max_model_len": 4096}]})
        if path == "/metrics":
            return httpx.Response(200, text=METRICS)
        if path == "/health":
            return httpx.Response(200)
        assert path == "/v1/completions"
        body = json.loads(request.content)
        self.bodies.append(body)
        self.headers.append(request.headers)
        if self.fail_with == 400:
            return httpx.Response(
                400, json={"error": {"message": "prompt too long", "type": "BadRequestError"}}
            )
        if self.fail_with is not None:
            return httpx.Response(self.fail_with, text="boom")
        n = body["max_tokens"]
        out = [1000 + i for i in range(n)]
        events: list[dict[str, Any]] = []
        for i, tok in enumerate(out):
            choice: dict[str, Any] = {
                "index": 0,
                "text": f"t{tok}",
                "token_ids": [tok],
                "finish_reason": "length" if i == n - 1 else None,
            }
            if i == 0:
                choice["prompt_token_ids"] = body["prompt"]
            events.append({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
        events.append(
            {
                "id": "cmpl-1",
                "choices": [],
                "usage": {
                    "prompt_tokens": len(body["prompt"]),
                    "completion_tokens": n,
                    "prompt_tokens_details": {"cached_tokens": 64},
                },
            }
        )
        return httpx.Response(
            200, content=_sse(events), headers={"content-type": "text/event-stream"}
        )


async def _engine(fake: FakeVLLM, **kw: Any) -> OpenAIEngine:
    engine = OpenAIEngine("r0", "http://fake:8000", transport=httpx.MockTransport(fake), **kw)
    await engine.start()
    return engine


async def _collect(engine: OpenAIEngine, req: GenerateRequest) -> list[TokenChunk]:
    return [c async for c in engine.generate(req)]


async def test_start_learns_model_block_size_and_kv_pool() -> None:
    engine = await _engine(FakeVLLM())
    try:
        assert engine.model == "tiny" and engine.max_model_len == 4096
        assert engine.block_size == 32 and engine.num_kv_blocks == 2048
        stats = await engine.stats()
        assert (stats.num_running, stats.num_waiting, stats.kv_usage) == (3, 2, 0.25)
        assert (stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens) == (1000, 640)
        assert await engine.healthy()
    finally:
        await engine.close()


async def test_generate_sends_token_ids_and_streams_them_back() -> None:
    fake = FakeVLLM()
    engine = await _engine(fake)
    try:
        req = GenerateRequest(
            "rid-7", [5, 6, 7, 8], 4, priority=3, ignore_eos=True, temperature=0.0
        )
        req.extra["seed"] = 11
        chunks = await _collect(engine, req)
        body = fake.bodies[-1]
        assert body["prompt"] == [5, 6, 7, 8] and body["max_tokens"] == 4
        assert body["stream"] and body["return_token_ids"] and body["ignore_eos"]
        assert body["stream_options"] == {"include_usage": True}
        assert body["priority"] == 3 and body["seed"] == 11 and body["model"] == "tiny"
        assert fake.headers[-1]["x-request-id"] == "rid-7"
        assert [t for c in chunks for t in c.token_ids] == [1000, 1001, 1002, 1003]
        # `finished` exactly once, last, with the cache hit from the usage event.
        assert [c.finished for c in chunks] == [False, False, False, True]
        assert chunks[-1].finish_reason == "length" and chunks[-1].num_cached_tokens == 64
    finally:
        await engine.close()


async def test_client_errors_are_value_errors_and_server_errors_are_engine_failures() -> None:
    fake = FakeVLLM()
    engine = await _engine(fake)
    try:
        fake.fail_with = 400
        with pytest.raises(ValueError, match="prompt too long"):
            await _collect(engine, GenerateRequest("a", [1, 2], 2))
        fake.fail_with = 503
        with pytest.raises(RemoteEngineError):
            await _collect(engine, GenerateRequest("b", [1, 2], 2))
    finally:
        await engine.close()


async def test_unreachable_server_is_unhealthy() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    engine = OpenAIEngine(
        "down", "http://nowhere:1", model="m", block_size=32, transport=httpx.MockTransport(refuse)
    )
    try:
        await engine.start()  # tolerates a failed first scrape
        assert not await engine.healthy()
        with pytest.raises(RemoteEngineError):
            await _collect(engine, GenerateRequest("x", [1], 1))
    finally:
        await engine.close()


async def test_a_failed_start_closes_its_clients() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    # No model given: start must ask the server for it, and cannot.
    engine = OpenAIEngine("down", "http://nowhere:1", transport=httpx.MockTransport(refuse))
    with pytest.raises(httpx.ConnectError):
        await engine.start()
    assert engine._http.is_closed and not engine._tasks


def _stored(hashes: list[bytes | int], parent: bytes | int | None, tokens: list[int]) -> WireStored:
    return WireStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=BS
    )


def _payload(events: list[Any]) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))


async def test_kv_events_are_rekeyed_by_router_chain_hashes() -> None:
    engine = await _engine(FakeVLLM())
    got: list[KVEvent] = []
    engine.subscribe_kv_events(got.append)
    try:
        tokens = list(range(500, 500 + 3 * BS))
        # The server stores 2 blocks, then a third chained to the second (its own hashes).
        engine.handle_kv_payload(_payload([_stored([b"h1", b"h2"], None, tokens[: 2 * BS])]))
        engine.handle_kv_payload(_payload([_stored([b"h3"], b"h2", tokens[2 * BS :])]))
        want = hash_token_blocks(tokens, BS)
        stored = [h for e in got if isinstance(e, BlockStored) for h in e.block_hashes]
        assert stored == want
        engine.handle_kv_payload(_payload([WireRemoved(block_hashes=[b"h3"])]))
        removed = [e for e in got if isinstance(e, BlockRemoved)]
        assert removed == [BlockRemoved("r0", (want[2],))]
    finally:
        await engine.close()


async def test_a_restarted_server_numbering_its_events_again_clears_its_blocks() -> None:
    engine = await _engine(FakeVLLM())
    got: list[KVEvent] = []
    engine.subscribe_kv_events(got.append)
    try:
        tokens = list(range(900, 900 + BS))
        want = tuple(hash_token_blocks(tokens, BS))
        engine.handle_kv_payload(_payload([_stored([b"h1"], None, tokens)]), seq=0)
        engine.handle_kv_payload(_payload([_stored([b"h9"], None, tokens[::-1])]), seq=1)
        got.clear()
        # The server restarts (no removals sent) and caches the same prompt again, under
        # the same engine hash: the router must hear the restart and the block, again.
        engine.handle_kv_payload(_payload([_stored([b"h1"], None, tokens)]), seq=0)
        assert got == [AllBlocksCleared("r0"), BlockStored("r0", want, None)]
        got.clear()
        engine.handle_kv_payload(_payload([WireRemoved(block_hashes=[b"h1"])]), seq=1)
        assert got == [BlockRemoved("r0", want)]
    finally:
        await engine.close()


async def test_a_failing_sink_does_not_starve_the_others() -> None:
    engine = await _engine(FakeVLLM())
    got: list[KVEvent] = []

    def broken(event: KVEvent) -> None:
        raise RuntimeError("consumer bug")

    engine.subscribe_kv_events(broken)
    engine.subscribe_kv_events(got.append)
    try:
        tokens = list(range(950, 950 + BS))
        engine.handle_kv_payload(_payload([_stored([b"h1"], None, tokens)]))
        assert got == [BlockStored("r0", tuple(hash_token_blocks(tokens, BS)), None)]
    finally:
        await engine.close()


async def test_decodes_vllms_own_event_encoding() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    engine = await _engine(FakeVLLM())
    got: list[KVEvent] = []
    engine.subscribe_kv_events(got.append)
    try:
        tokens = list(range(700, 700 + BS))
        batch = kv_events.KVEventBatch(
            ts=1.0,
            events=[
                kv_events.BlockStored(
                    block_hashes=[123456789],
                    parent_block_hash=None,
                    token_ids=tokens,
                    block_size=BS,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            ],
        )
        engine.handle_kv_payload(msgspec.msgpack.Encoder().encode(batch))
        assert got == [BlockStored("r0", tuple(hash_token_blocks(tokens, BS)), None)]
    finally:
        await engine.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.01)


async def test_subscribes_to_the_servers_zmq_publisher() -> None:
    import zmq

    port = _free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    engine = await _engine(FakeVLLM(), kv_events_endpoint=f"tcp://127.0.0.1:{port}")
    got: list[KVEvent] = []
    engine.subscribe_kv_events(got.append)
    tokens = list(range(900, 900 + BS))
    try:
        seq = 0
        # PUB drops messages until the subscription propagates: publish until one lands.
        async with asyncio.timeout(10):
            while not got:
                pub.send_multipart(
                    (b"", seq.to_bytes(8, "big"), _payload([_stored([seq], None, tokens)]))
                )
                seq += 1
                await asyncio.sleep(0.02)
        assert got[0] == BlockStored("r0", tuple(hash_token_blocks(tokens, BS)), None)
    finally:
        await engine.close()
        pub.close(linger=0)
        ctx.term()


def test_servers_on_one_machine_share_its_host() -> None:
    same = {
        url_host(u) for u in ("http://127.0.0.1:8000", "http://localhost:8001/", "http://[::1]:9")
    }
    assert same == {"localhost"}
    assert url_host("http://GPU-node-3:8000/v1") == "gpu-node-3"
    assert OpenAIEngine("e", "http://127.0.0.1:1").shared_host == "localhost"


async def test_scrapes_metrics_over_aiohttp_and_survives_a_failing_page() -> None:
    """With no injected transport the engine reads /metrics over its aiohttp session
    (as in production); a failing page keeps the last good reading, and no error
    escapes the scrape."""
    from aiohttp import web

    status = {"code": 200}
    agents: list[str] = []

    async def metrics(request: web.Request) -> web.Response:
        agents.append(request.headers.get("user-agent", ""))
        if status["code"] != 200:
            return web.Response(status=status["code"], text="boom")
        return web.Response(text=METRICS, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    engine = OpenAIEngine("real", f"http://127.0.0.1:{port}", model="m", scrape_interval_s=60)
    try:
        await engine.start()
        assert agents and all("aiohttp" in a for a in agents)  # not httpx's pure-Python parser
        assert engine.block_size == BS and engine.num_kv_blocks == 2048
        stats = await engine.stats()
        assert (stats.num_running, stats.num_waiting) == (3, 2)
        status["code"] = 500
        await engine._scrape()
        assert (await engine.stats()).num_running == 3  # the last good reading stays
    finally:
        await engine.close()
        await runner.cleanup()
