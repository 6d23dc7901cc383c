"""A remote `vllm serve` as an engine: tokens over HTTP, load from /metrics, KV over ZMQ.

- tokens: `POST /v1/completions` with the prompt as token ids, streamed (SSE), with
  `return_token_ids` so the router sees the exact ids (children reuse them) and
  `stream_options.include_usage` so the prefix-cache hit comes back (vLLM fills
  `prompt_tokens_details.cached_tokens` when started with `--enable-prompt-tokens-details`);
- load: `/metrics` scraped every `scrape_interval_s` into `EngineStats`;
- KV events: the server's ZMQ publisher (`--kv-events-config`), msgpack `KVEventBatch`es,
  decoded and re-keyed by wasma chain hashes over their token ids by `kv_events` (as for
  in-process engines), so the cluster prefix index matches what the router hashes,
  without knowing the server's hash seed (Dynamo's approach).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import msgspec

from wasma.core.events import EngineStats, KVEvent
from wasma.engines.base import (
    EngineCall,
    EngineClient,
    EngineView,
    GenerateRequest,
    KVEventSink,
    RequestRefused,
    TokenChunk,
    deliver_kv_events,
    start_or_close,
)
from wasma.engines.kv_events import KVEventFeed
from wasma.engines.vllm_metrics import VllmMetrics, VllmMetricsParser, parse_vllm_metrics

log = logging.getLogger(__name__)


# -- the streamed completion events, decoded into just the fields the router reads. vLLM's
#    first event echoes the whole prompt (`prompt_token_ids`, from `return_token_ids`):
#    a typed decode skips it instead of building a Python list of every prompt id.


class _Details(msgspec.Struct, gc=False):
    cached_tokens: int | None = None


class _Usage(msgspec.Struct, gc=False):
    prompt_tokens_details: _Details | None = None


class _Choice(msgspec.Struct, gc=False):
    text: str | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class _StreamEvent(msgspec.Struct, gc=False):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: Any = None


_EVENT_DECODER = msgspec.json.Decoder(_StreamEvent)
_JSON_DECODER = msgspec.json.Decoder()
_JSON_ENCODER = msgspec.json.Encoder()


# vLLM's token-in/token-out generation endpoint.
GENERATE_PATH = "/inference/v1/generate"

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0"})


def url_host(url: str) -> str:
    """The machine a server URL points at, loopback spellings made one: two servers on
    it share that machine (its cores, for CPU engines)."""
    host = (httpx.URL(url).host or "").lower()
    return "localhost" if host in _LOOPBACK_NAMES or host.startswith("127.") else host


def _metric_prefixes() -> tuple[str, ...]:
    """The sample names `VllmMetricsParser` reads (as line prefixes)."""
    names = [n for spec in VllmMetricsParser.FIELDS.values() for n in spec.names]
    names += [*VllmMetricsParser.DEPRECATED_WAITING_EXTRA, VllmMetricsParser.CACHE_INFO]
    return tuple(dict.fromkeys(names))


def wanted_metric_lines(text: str, prefixes: tuple[str, ...]) -> str:
    """The lines of a `/metrics` page whose samples the router reads. vLLM's page has
    ~650 lines, mostly histogram buckets nobody here reads; parsing all of them with
    prometheus_client took ~10 ms a scrape on the gateway's event loop, the few that
    matter well under 1 ms. Comment lines go too: the samples parse the same untyped."""
    return "\n".join(line for line in text.splitlines() if line.startswith(prefixes)) + "\n"


class RemoteEngineError(RuntimeError):
    """The server failed (5xx, connection lost): the engine's fault, not the client's."""


@dataclass(frozen=True)
class OpenAIView(EngineView):
    """An `OpenAIEngine` as another process reaches it: the server's address and what
    the router learnt of it at start (model, block size, token generation)."""

    name: str
    base_url: str
    model: str | None
    api_key: str | None
    block_size: int
    request_timeout_s: float
    tokens_api: bool | None
    max_model_len: int | None
    # The router supervises the gateway's streams as its own (its stall check, through
    # the channel's orders): as `OpenAIEngine.supervised`.
    supervised: bool = False

    async def connect(self) -> OpenAIEngine:
        engine = OpenAIEngine(
            self.name,
            self.base_url,
            model=self.model,
            api_key=self.api_key,
            block_size=self.block_size,
            request_timeout_s=self.request_timeout_s,
            tokens_api=bool(self.tokens_api),
            supervised=self.supervised,
        )
        engine.max_model_len = self.max_model_len
        engine.open_streams()
        return engine


class OpenAIEngine(EngineClient):
    """One remote vLLM OpenAI server. `await start()` before use."""

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        kv_events_endpoint: str | None = None,
        block_size: int | None = None,
        # The router's own counters carry load between scrapes; a scrape costs the
        # engine's API server (which also streams tokens) a render of its whole page.
        scrape_interval_s: float = 1.0,
        request_timeout_s: float = 600.0,
        stale_after_s: float = 10.0,
        transport: httpx.AsyncBaseTransport | None = None,
        # Drive the server through vLLM's token-in/token-out generation
        # (`/inference/v1/generate`, on `vllm serve --enable-scale-out` or
        # `--tokens-only`) where a request's answer fits in token ids; None: when the
        # server offers it (asked at start). Off (the default): every API request is
        # passed through, which answers exactly as the server does; vLLM 0.32's
        # derenderer does not yet (docs/api.md, "Remote engines in token ids").
        tokens_api: bool | None = False,
        # A caller's stall check ends a stream that waits too long (the router's does,
        # EngineHealth.check_stalls): no socket read timeout, which aiohttp re-arms on
        # every read of a stream (the pass-through's hot path). Unsupervised (the
        # default), a read waits at most `request_timeout_s`.
        supervised: bool = False,
    ) -> None:
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.shared_host = url_host(self.base_url)
        self.model = model
        self.block_size = block_size or 16
        self.num_kv_blocks = 0
        self.max_model_len: int | None = None
        self._fixed_block_size = block_size is not None
        self._kv_endpoint = kv_events_endpoint
        self._scrape_interval_s = scrape_interval_s
        self._stale_after_s = stale_after_s
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            transport=transport,
            timeout=httpx.Timeout(request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )
        # Token streams go over aiohttp (its C HTTP parser): through httpx (h11, pure
        # Python) a 40-token stream cost ~3 ms of the gateway's CPU, through aiohttp ~0.6.
        # httpx stays for the rare calls (models, metrics, health) and whenever a
        # transport is injected (tests), which then carries the tokens too.
        self._use_aiohttp = transport is None
        self._aio: Any = None  # aiohttp.ClientSession, opened on the loop in start()
        self._request_timeout_s = request_timeout_s
        self._supervised = supervised
        self._api_key = api_key
        self._headers = headers
        self._sinks: list[KVEventSink] = []
        self._feed = KVEventFeed(name, self.block_size)
        self._metric_prefixes = _metric_prefixes()
        self._last: VllmMetrics | None = None
        self._last_ok = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self.tokens_api = tokens_api

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        await start_or_close(self, self._start)

    async def _start(self) -> None:
        if self._use_aiohttp and self._aio is None:
            self._aio = self._open_session()
        if self.model is None:
            resp = await self._http.get("/v1/models")
            resp.raise_for_status()
            data = resp.json().get("data") or [{}]
            self.model = data[0].get("id")
            if data[0].get("max_model_len"):
                self.max_model_len = int(data[0]["max_model_len"])
        if self.tokens_api is None:
            self.tokens_api = await self._offers_tokens_api()
        await self._scrape()
        if self._last is not None:
            if not self._fixed_block_size and self._last.block_size_tokens:
                # The server's block size decides how its KV events chain tokens.
                self.block_size = self._last.block_size_tokens
                self._feed = KVEventFeed(self.name, self.block_size)
            if self._last.num_gpu_blocks:
                self.num_kv_blocks = self._last.num_gpu_blocks
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._scrape_loop()))
        if self._kv_endpoint:
            self._tasks.append(loop.create_task(self._kv_loop(self._kv_endpoint)))

    def open_streams(self) -> None:
        """Ready to generate without `start()` (no model lookup, no scrapes): how a
        gateway reaches the engine through its `direct_view`."""
        if self._use_aiohttp and self._aio is None:
            self._aio = self._open_session()

    def direct_view(self) -> OpenAIView:
        return OpenAIView(
            self.name,
            self.base_url,
            self.model,
            self._api_key,
            self.block_size,
            self._request_timeout_s,
            self.tokens_api,
            self.max_model_len,
            self._supervised,
        )

    async def _offers_tokens_api(self) -> bool:
        """Whether the server answers token-in/token-out generation: an empty request
        is refused (400/422) where the route exists and is a 404 where it does not."""
        try:
            resp = await self._http.post(GENERATE_PATH, json={}, timeout=10.0)
        except httpx.HTTPError as exc:
            log.debug("engine %s: token generation probe failed: %s", self.name, exc)
            return False
        return resp.status_code not in (404, 405) and resp.status_code < 500

    def _open_session(self) -> Any:
        """An aiohttp session for the token streams, or None (httpx carries them) where
        aiohttp is missing: it comes with ray[default], not as wasma's own dependency."""
        try:
            import aiohttp
        except ImportError:
            log.warning("engine %s: aiohttp missing; streaming tokens over httpx", self.name)
            self._use_aiohttp = False
            return None
        return aiohttp.ClientSession(
            headers=self._headers,
            connector=aiohttp.TCPConnector(
                limit=1024,
                # Under the server's keep-alive (uvicorn: 5 s), so a pooled connection is
                # dropped here before the server drops it mid-reuse.
                keepalive_timeout=4.0,
            ),
            timeout=aiohttp.ClientTimeout(
                total=None,
                sock_connect=10.0,
                sock_read=None if self._supervised else self._request_timeout_s,
            ),
            # vLLM's first event echoes the whole prompt; lines are split here anyway.
            read_bufsize=1 << 16,
        )

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        await self._http.aclose()
        if self._aio is not None:
            await self._aio.close()
            self._aio = None

    # -- load ------------------------------------------------------------------------
    async def _scrape(self) -> None:
        try:
            text = await self._metrics_page()
            self._last = parse_vllm_metrics(wanted_metric_lines(text, self._metric_prefixes))
            self._last_ok = time.monotonic()
        except (httpx.HTTPError, ValueError, RemoteEngineError) as exc:
            log.debug("engine %s: /metrics scrape failed: %s", self.name, exc)

    async def _metrics_page(self) -> str:
        """The server's /metrics text. Over aiohttp when the token streams use it: httpx
        reads the whole page in pure Python and closes its pooled connection through a
        cancellation shield each time, about a quarter of the gateway's GIL-holding
        samples (py-spy) during a peers run."""
        if self._aio is None:
            resp = await self._http.get("/metrics", timeout=5.0)
            resp.raise_for_status()
            return resp.text
        import aiohttp

        try:
            async with self._aio.get(
                self.base_url + "/metrics", timeout=aiohttp.ClientTimeout(total=5.0)
            ) as resp:
                text: str = await resp.text(errors="replace")
                if resp.status >= 400:
                    raise RemoteEngineError(f"{self.name}: /metrics: HTTP {resp.status}")
                return text
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RemoteEngineError(f"{self.name}: /metrics: {type(exc).__name__}: {exc}") from exc

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(self._scrape_interval_s)
            await self._scrape()

    async def stats(self) -> EngineStats:
        m = self._last or VllmMetrics()
        return EngineStats(
            num_running=int(m.num_requests_running or 0),
            num_waiting=int(m.num_requests_waiting or 0),
            kv_usage=float(m.kv_cache_usage_ratio or 0.0),
            num_kv_blocks=self.num_kv_blocks or int(m.num_gpu_blocks or 0),
            prefix_cache_queries_tokens=int(m.prefix_cache_queries_tokens or 0),
            prefix_cache_hits_tokens=int(m.prefix_cache_hits_tokens or 0),
            num_preemptions=int(m.num_preemptions or 0),
        )

    async def healthy(self) -> bool:
        # A server whose /metrics answered recently is up; otherwise ask /health.
        if time.monotonic() - self._last_ok < self._stale_after_s:
            return True
        try:
            resp = await self._http.get("/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200

    # -- KV events -------------------------------------------------------------------
    def subscribe_kv_events(self, sink: KVEventSink) -> None:
        self._sinks.append(sink)

    def handle_kv_payload(self, payload: bytes, seq: int | None = None) -> None:
        """Decode one published batch and hand its translated events to the sinks.
        `seq` is the batch's sequence number where the publisher sends one."""
        self._deliver(self._feed.payload(payload, seq))

    @property
    def events_received(self) -> int:
        """vLLM KV events decoded from this server."""
        return self._feed.events_received

    def _deliver(self, events: list[KVEvent]) -> None:
        deliver_kv_events(self.name, self._sinks, events)

    async def _kv_loop(self, endpoint: str) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.connect(endpoint)
        try:
            while True:
                self._deliver(self._feed.frames(await sock.recv_multipart()))
        finally:
            sock.close(linger=0)
            ctx.term()

    # -- tokens ----------------------------------------------------------------------
    def _body(self, request: GenerateRequest) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": request.prompt_token_ids,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "ignore_eos": request.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if request.priority:
            # Only servers started with --scheduling-policy priority accept it.
            body["priority"] = request.priority
        for key in ("top_p", "seed", "stop", "stop_token_ids", "min_tokens"):
            if key in request.extra:
                body[key] = request.extra[key]
        xargs = request.retention_args()
        if xargs:
            # Read by wasma's retaining scheduler (`--scheduler-cls
            # wasma.engines.vllm_retention.WasmaScheduler`); other servers ignore them.
            body["vllm_xargs"] = xargs
        return body

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        call = request.call
        if call is not None and not (
            self.tokens_api and call.generate is not None and not call.needs_api
        ):
            # The client's request as it is: the stream it reads is this one, with no
            # generator between (the pass-through is the gateway's hot path).
            return self._forward(request, call)
        return self._generate_tokens(request)

    async def _generate_tokens(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        call = request.call
        path = "/v1/completions"
        if call is not None:
            assert call.generate is not None
            # Token ids out: the gateway derenders them with vLLM's derenderer, and a
            # stream cut by a failure continues on another engine from them.
            content = self._generate_body(request, call.generate.get())
            path = GENERATE_PATH
        else:
            content = _JSON_ENCODER.encode(self._body(request))
        headers = {"x-request-id": request.request_id, "content-type": "application/json"}
        # The finishing chunk is held back until the usage event that follows it (it
        # carries the cache hit), so `finished` comes exactly once, last.
        last: TokenChunk | None = None
        async for data in self._post_stream(content, headers, path):
            try:
                event = _EVENT_DECODER.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise RemoteEngineError(f"{self.name}: bad stream event: {exc}") from None
            if event.error is not None:
                raise _stream_error(self.name, event.error)
            chunk = _chunk_of(event)
            if chunk is None:
                continue
            if not chunk.token_ids and chunk.finish_reason is None and last is not None:
                last = replace(last, num_cached_tokens=chunk.num_cached_tokens)
            elif chunk.finished:
                if last is not None:
                    yield replace(last, finished=False, finish_reason=None)
                last = chunk
            else:
                yield chunk
        if last is None:
            raise RemoteEngineError(f"{self.name}: stream ended without finishing")
        yield last

    def _generate_body(self, request: GenerateRequest, rendered: Any) -> bytes:
        """vLLM's rendered `GenerateRequest` for this engine: the router's prompt (a
        continuation carries the tokens already sent) and token budget, a streamed
        answer with its usage (the cache hit), the retention tags as `extra_args`."""
        from vllm.entrypoints.generate.base.protocol import StreamOptions

        params = rendered.sampling_params.clone()
        params.max_tokens = request.max_tokens
        xargs = request.retention_args()
        if xargs:
            params.extra_args = {**(params.extra_args or {}), **xargs}
        body = rendered.model_copy(
            update={
                "request_id": request.request_id,
                "token_ids": list(request.prompt_token_ids),
                "sampling_params": params,
                "stream": True,
                "stream_options": StreamOptions(include_usage=True),
            }
        )
        out: bytes = body.model_dump_json().encode()
        return out

    def _call_body(self, request: GenerateRequest, call: EngineCall) -> bytes:
        """The client's body, with the router's retention tags merged into its
        `vllm_xargs` (read by wasma's retaining scheduler) where it asks for any."""
        xargs = request.retention_args()
        if not xargs:
            return call.body
        body = _JSON_DECODER.decode(call.body)
        own = body.get("vllm_xargs")
        body["vllm_xargs"] = {**own, **xargs} if isinstance(own, dict) else xargs
        return _JSON_ENCODER.encode(body)

    def _forward(self, request: GenerateRequest, call: EngineCall) -> AsyncIterator[TokenChunk]:
        """Pass the client's request through: the server's status and body bytes come
        back as they are (an error too: a 4xx is the server's answer, not its fault).
        The first chunk carries the status; the last one is `finished`."""
        content = self._call_body(request, call)
        headers = {"x-request-id": request.request_id, "content-type": "application/json"}
        if self._aio is not None:
            return self._forward_aio(call, content, headers)
        return self._forward_httpx(call, content, headers)

    async def _forward_httpx(
        self, call: EngineCall, content: bytes, headers: dict[str, str]
    ) -> AsyncIterator[TokenChunk]:
        try:
            async with self._http.stream(
                "POST", call.path, content=content, headers=headers
            ) as resp:
                status = resp.status_code
                if status >= 500:
                    text = (await resp.aread()).decode(errors="replace")
                    raise RemoteEngineError(f"{self.name}: HTTP {status}: {text[:300]}")
                if status >= 400 or not call.stream:
                    body = await resp.aread()
                    yield TokenChunk((), True, "stop", raw=body, status=status)
                    return
                first = True
                async for part in resp.aiter_raw():
                    if part:
                        yield TokenChunk((), False, raw=part, status=status if first else 0)
                        first = False
                yield TokenChunk((), True, "stop", status=status if first else 0)
        except httpx.HTTPError as exc:
            raise RemoteEngineError(f"{self.name}: {type(exc).__name__}: {exc}") from exc

    async def _forward_aio(
        self, call: EngineCall, content: bytes, headers: dict[str, str]
    ) -> AsyncIterator[TokenChunk]:
        """`_forward` over the aiohttp session (its C parser: the pass-through is the
        gateway's hot path for remote engines)."""
        import aiohttp

        url = self.base_url + call.path
        try:
            answer = await self._post_aio(url, content, headers)
            async with answer:
                status = answer.status
                if status >= 500:
                    text = await answer.text(errors="replace")
                    raise RemoteEngineError(f"{self.name}: HTTP {status}: {text[:300]}")
                if status >= 400 or not call.stream:
                    body = await answer.read()
                    yield TokenChunk((), True, "stop", raw=body, status=status)
                    return
                first = True
                async for part in answer.content.iter_any():
                    if part:
                        yield TokenChunk((), False, raw=part, status=status if first else 0)
                        first = False
                yield TokenChunk((), True, "stop", status=status if first else 0)
        except aiohttp.ClientError as exc:
            raise RemoteEngineError(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        except TimeoutError as exc:
            raise RemoteEngineError(f"{self.name}: timed out: {exc}") from exc

    async def _post_aio(self, url: str, content: bytes, headers: dict[str, str]) -> Any:
        import aiohttp

        for attempt in (0, 1):
            try:
                return await self._aio.post(url, data=content, headers=headers)
            except aiohttp.ServerDisconnectedError:
                # A pooled keep-alive connection the server closed just as it was
                # reused: nothing reached the engine, so sending again is safe.
                if attempt:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_status(self, status: int, text: str) -> None:
        if status < 400:
            return
        if status < 500:
            raise RequestRefused(_error_message(text, status), _error_param(text))
        raise RemoteEngineError(f"{self.name}: HTTP {status}: {text[:300]}")

    async def _post_stream(
        self, content: bytes, headers: dict[str, str], path: str = "/v1/completions"
    ) -> AsyncIterator[bytes]:
        """POST a streamed generation to `path`; the `data:` payloads of its SSE answer.
        Closing the iterator early closes the connection, which makes vLLM abort the
        request."""
        if self._aio is None:
            # An injected httpx transport (tests) or no running aiohttp session yet.
            try:
                async with self._http.stream(
                    "POST", path, content=content, headers=headers
                ) as resp:
                    if resp.status_code >= 400:
                        text = (await resp.aread()).decode(errors="replace")
                        self._check_status(resp.status_code, text)
                    async for data in sse_data(resp.aiter_bytes()):
                        yield data
            except httpx.HTTPError as exc:
                raise RemoteEngineError(f"{self.name}: {type(exc).__name__}: {exc}") from exc
            return
        import aiohttp

        url = self.base_url + path
        try:
            answer = await self._post_aio(url, content, headers)
            async with answer:
                if answer.status >= 400:
                    self._check_status(answer.status, await answer.text(errors="replace"))
                async for data in sse_data(answer.content.iter_any()):
                    yield data
        except aiohttp.ClientError as exc:
            raise RemoteEngineError(f"{self.name}: {type(exc).__name__}: {exc}") from exc
        except TimeoutError as exc:
            raise RemoteEngineError(f"{self.name}: timed out: {exc}") from exc


async def sse_data(parts: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The `data:` payloads of a server-sent event stream (its body, as it arrives), up
    to `[DONE]`, as bytes (split by hand: a text line decoder costs more than the JSON)."""
    pending = b""
    async for part in parts:
        lines = (pending + part).split(b"\n") if pending else part.split(b"\n")
        pending = lines.pop()
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield data
    if pending.startswith(b"data:"):
        data = pending[5:].strip()
        if data and data != b"[DONE]":
            yield data


async def sse_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style server-sent event stream, up to `[DONE]`."""
    async for data in sse_data(resp.aiter_bytes()):
        event: dict[str, Any] = _JSON_DECODER.decode(data)
        yield event


def _chunk_of(event: _StreamEvent) -> TokenChunk | None:
    """One SSE event as a chunk; the final usage event carries the cache hit."""
    choices = event.choices
    usage = event.usage
    cached = None
    if usage is not None:
        details = usage.prompt_tokens_details
        cached = int(details.cached_tokens or 0) if details is not None else 0
    if not choices:
        if usage is None:
            return None
        return TokenChunk((), False, None, cached)
    choice = choices[0]
    reason = choice.finish_reason
    ids = tuple(choice.token_ids) if choice.token_ids else ()
    return TokenChunk(
        ids, reason is not None, reason, cached, choice.stop_reason, choice.text or ""
    )


def _stream_error(name: str, error: Any) -> Exception:
    """An error event in a token stream: the request's own fault where the server says
    so with a 4xx code (a stop token id out of the vocabulary), else the server's."""
    if isinstance(error, dict):
        code = error.get("code")
        if isinstance(code, int) and 400 <= code < 500 and "message" in error:
            param = error.get("param")
            return RequestRefused(str(error["message"]), param if isinstance(param, str) else None)
    return RemoteEngineError(f"{name}: {error}")


def _error_param(text: str) -> str | None:
    """The request field a vLLM error body names (`error.param`), if any."""
    try:
        err = json.loads(text)
    except ValueError:
        return None
    inner = err.get("error") if isinstance(err, dict) else None
    param = inner.get("param") if isinstance(inner, dict) else None
    return param if isinstance(param, str) else None


def _error_message(text: str, status: int) -> str:
    try:
        err = json.loads(text)
        if isinstance(err, dict):
            inner = err.get("error", err)
            if isinstance(inner, dict) and "message" in inner:
                return str(inner["message"])
            if "message" in err:
                return str(err["message"])
    except ValueError:
        pass
    return f"HTTP {status}: {text[:300]}"
