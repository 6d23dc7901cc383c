"""The OpenAI-compatible HTTP gateway: auth, validation, tokenisation, SSE, /metrics.

`create_app(...)` returns a FastAPI app whose lifespan builds the router client once (no
module globals): in-process for tests, a Ray actor under `wasma serve`. The request path
is kept lean because the gateway sits in front of every token: msgspec decodes and
encodes, auth and headers live in one pure-ASGI layer (no BaseHTTPMiddleware), and the
non-streaming path is a single call into the router.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wasma.deploy import json_limits, openapi_schema
from wasma.deploy.api import (
    DONE_EVENT,
    GENERATE_PATHS,
    LOCAL_PATHS,
    POOLING_PATHS,
    ApiAnswer,
    Rendered,
    ResponseStore,
    TokenAnswer,
    error_answer,
    local_answer,
    models_answer,
    parse_json,
    render,
    response_id_of,
)
from wasma.deploy.frontend import Frontend
from wasma.deploy.lifecycle import Lifecycle, lifecycle_refusal
from wasma.deploy.metadata import MetadataError, WorkflowIdentity, workflow_identity
from wasma.deploy.metrics import handler_of
from wasma.deploy.router_client import RouterClient, TokenStream
from wasma.deploy.service_types import ServiceError, ServiceRequest, tenant_of
from wasma.engines.base import Deferred, EngineCall

log = logging.getLogger(__name__)

# vLLM's streams are Starlette's `StreamingResponse(media_type="text/event-stream")`,
# which names the charset.
SSE_TYPE = b"text/event-stream; charset=utf-8"
T = TypeVar("T")

RouterFactory = Callable[[], Awaitable[RouterClient]]
HttpKey = tuple[str, int]  # (handler, status): what the edge counts between scrapes


@dataclass(frozen=True)
class GatewayConfig:
    model_names: tuple[str, ...] = ("wasma",)  # the first is reported by /v1/models
    api_keys: tuple[str, ...] = ()  # empty: the gateway is open
    default_max_tokens: int = 16  # OpenAI's completions default
    default_chat_max_tokens: int = 256
    max_tokens_limit: int = 65_536
    max_prompt_tokens: int = 1 << 20
    max_body_bytes: int = 16 << 20
    max_workflow_bytes: int = 4 << 20
    # OpenAI's own limits on `metadata` (16 pairs, 64-char keys, 512-char values), also
    # applied to `vllm_xargs`; and at most this many stop strings / stop token ids.
    max_metadata_keys: int = 16
    max_metadata_key_chars: int = 64
    max_metadata_value_chars: int = 512
    max_stop: int = 64
    protect_metrics: bool = False  # /metrics and /health open by default (scrapers, probes)
    # Set: /metrics and /health leave the public port for this one (`create_admin_app`),
    # so probes and scrapers need no API key and the internet never sees them.
    admin_port: int | None = None
    extra_model_names: tuple[str, ...] = field(default=())

    @property
    def model(self) -> str:
        return self.model_names[0]


class _Auth:
    """Bearer keys, compared in constant time; the tenant id is derived from the key."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [(k.encode(), tenant_of(k)) for k in keys if k]

    @property
    def open(self) -> bool:
        return not self._keys

    def tenant(self, header: bytes | None) -> str | None:
        """The caller's tenant id, or None if the key is missing or wrong."""
        if not self._keys:
            return ""
        if header is None or header[:7].lower() != b"bearer ":
            return None
        presented = header[7:].strip()
        found: str | None = None
        for key, tenant in self._keys:
            # No early exit: the time taken does not say which key (if any) matched.
            if hmac.compare_digest(presented, key):
                found = tenant
        return found


class _Edge:
    """Pure ASGI: request ids, auth, default wasma headers, status counts, last-resort
    500s in OpenAI's shape."""

    OPEN_PATHS = ("/health", "/live", "/ready", "/metrics", "/docs", "/openapi.json", "/redoc")
    # The API endpoints, served straight from here (see Gateway).
    FAST = frozenset((*GENERATE_PATHS, *LOCAL_PATHS, *POOLING_PATHS))

    def __init__(
        self,
        app: ASGIApp,
        auth: _Auth,
        codes: Counter[HttpKey],
        protect_metrics: bool,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self.app = app
        self.auth = auth
        self.codes = codes
        self.protect_metrics = protect_metrics
        self.lifecycle = lifecycle
        self._prefix = os.urandom(4).hex()
        self._seq = itertools.count(1)

    def _request_id(self, headers: Sequence[tuple[bytes, bytes]]) -> tuple[str, str]:
        """(id echoed to the client, id used inside wasma)."""
        internal = f"{self._prefix}{next(self._seq):x}"
        for name, value in headers:
            if name == b"x-request-id":
                try:
                    text = value.decode("ascii")
                except UnicodeDecodeError:
                    break
                if 0 < len(text) <= 128 and text.isprintable():
                    return text, internal
                break
        return internal, internal

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope["headers"]
        echo, internal = self._request_id(headers)
        state = scope.setdefault("state", {})
        state["request_id"] = internal
        path: str = scope["path"]
        handler = handler_of(path)
        needs_auth = not self.auth.open and (
            self.protect_metrics or not path.startswith(self.OPEN_PATHS)
        )
        started = False
        echo_b = echo.encode()

        async def send_wrapped(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.codes[(handler, message["status"])] += 1
                hdrs = list(message.get("headers", []))
                names = {n for n, _ in hdrs}
                hdrs.append((b"x-request-id", echo_b))
                if b"x-wasma-engine" not in names:
                    hdrs.append((b"x-wasma-engine", b"none"))
                if b"x-wasma-placement" not in names:
                    hdrs.append((b"x-wasma-placement", b"none"))
                message = {**message, "headers": hdrs}
            await send(message)

        if needs_auth:
            auth_header = None
            for name, value in headers:
                if name == b"authorization":
                    auth_header = value
                    break
            tenant = self.auth.tenant(auth_header)
            if tenant is None:
                # The key itself is never logged or echoed.
                await _send_error(
                    send_wrapped,
                    error_answer("invalid or missing API key", 401, "Unauthorized"),
                    extra=[(b"www-authenticate", b"Bearer")],
                )
                return
            state["tenant"] = tenant
        else:
            state["tenant"] = ""
        try:
            fast = scope["method"] == "POST" and path in self.FAST
            refusal = lifecycle_refusal(self.lifecycle, scope, fast)
            if refusal is not None:
                await _send_error(send_wrapped, refusal[0], extra=refusal[1])
                return
            if fast:
                gateway: Gateway = scope["app"].state.gw
                await gateway.handle(scope, receive, send_wrapped)
            else:
                await self.app(scope, receive, send_wrapped)
        except Exception:
            log.exception("unhandled error on %s", path)
            if not started:
                await _send_error(
                    send_wrapped, error_answer("internal error", 500, "InternalServerError")
                )


async def _send_error(
    send: Send, err: ApiAnswer, extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    body = err.body
    hdrs = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *[(k.encode(), v.encode()) for k, v in err.headers.items()],
        *extra,
    ]
    await send({"type": "http.response.start", "status": err.status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send: Send, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _json(body: bytes, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _api_error(exc: ServiceError, anthropic: bool = False) -> ApiAnswer:
    """A router error (admission 429, no engine 503, a request the engine refused) in
    vLLM's error shape."""
    return error_answer(
        exc.message,
        exc.status,
        param=exc.param,
        anthropic=anthropic,
        retry_after_s=exc.retry_after_s,
    )


class _ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class Gateway:
    """The per-app object graph: router client, vLLM's front end, config, counters; and
    the API endpoints as raw ASGI handlers (the hot path skips the framework's routing,
    dependency and exception layers, which cost as much as the router itself)."""

    DISCONNECT_GRACE_S = 0.25

    def __init__(
        self,
        router: RouterClient,
        frontend: Frontend,
        config: GatewayConfig,
        codes: Counter[HttpKey],
    ) -> None:
        self.router = router
        self.fe = frontend
        self.cfg = config
        self.codes = codes
        self.created = int(time.time())
        self.responses = ResponseStore()

    def close(self) -> None:
        pass

    # -- ASGI entry point ------------------------------------------------------------
    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        anthropic = path.startswith("/v1/messages")
        try:
            body = await _read_body(scope, receive, self.cfg.max_body_bytes)
            data = parse_json(body)
            if path in LOCAL_PATHS:
                await _send_json(send, 200, await local_answer(self.fe, path, data))
                return
            if path in POOLING_PATHS:
                await self._pooling(scope, receive, send, path, body, data)
                return
            with self.fe.inline(len(body)):  # a small request skips the renderer's threads
                await self._generate(scope, receive, send, GENERATE_PATHS[path], path, body, data)
        except ApiAnswer as exc:
            await _send_error(send, exc)
        except ServiceError as exc:
            await _send_error(send, _api_error(exc, anthropic))
        except _ClientGone:
            return

    # -- request building ------------------------------------------------------------
    def _identity(self, scope: Scope, data: dict[str, Any], anthropic: bool) -> WorkflowIdentity:
        self._check_sizes(data, anthropic)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            return workflow_identity(headers, data)
        except MetadataError as exc:
            raise error_answer(str(exc), 400, param=exc.param, anthropic=anthropic) from None

    def _check_sizes(self, data: dict[str, Any], anthropic: bool) -> None:
        """Bounded workflow fields, so a request's cost stays in proportion to its body."""
        cfg = self.cfg
        # vllm_xargs carries agentic_context, a JSON string of up to 8 KiB (metadata.py).
        for name, chars in (("metadata", cfg.max_metadata_value_chars), ("vllm_xargs", 8192)):
            value = data.get(name)
            if value is None or not isinstance(value, dict):
                continue
            if len(value) > cfg.max_metadata_keys:
                raise error_answer(
                    f"{name} has over {cfg.max_metadata_keys} keys", param=name, anthropic=anthropic
                )
            for key, item in value.items():
                if len(key) > cfg.max_metadata_key_chars:
                    raise error_answer(
                        f"{name} keys must be at most {cfg.max_metadata_key_chars} chars",
                        param=name,
                        anthropic=anthropic,
                    )
                if isinstance(item, str) and len(item) > chars:
                    raise error_answer(
                        f"{name}.{key} is over {chars} chars",
                        param=f"{name}.{key}",
                        anthropic=anthropic,
                    )

    async def _generate(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        kind: str,
        path: str,
        body: bytes,
        data: dict[str, Any],
    ) -> None:
        anthropic = kind == "messages"
        ident = self._identity(scope, data, anthropic)
        rendered = await render(self.fe, kind, data)
        if len(rendered.token_ids) > self.cfg.max_prompt_tokens:
            raise error_answer(
                f"the prompt has {len(rendered.token_ids)} tokens, over the limit of "
                f"{self.cfg.max_prompt_tokens}",
                param="prompt",
                anthropic=anthropic,
            )
        cfg = self.cfg
        # The operator's bounds (GatewayConfig), on top of vLLM's own checks.
        if rendered.max_tokens > cfg.max_tokens_limit and (
            data.get("max_tokens") is not None
            or data.get("max_completion_tokens") is not None
            or data.get("max_output_tokens") is not None
        ):
            raise error_answer(
                f"max_tokens must be at most {cfg.max_tokens_limit}",
                param="max_tokens",
                anthropic=anthropic,
            )
        for name in ("stop", "stop_sequences", "stop_token_ids"):
            value = data.get(name)
            if isinstance(value, list) and len(value) > cfg.max_stop:
                raise error_answer(
                    f"at most {cfg.max_stop} {name.replace('_', ' ')}",
                    param=name,
                    anthropic=anthropic,
                )
        stop_ids = data.get("stop_token_ids")
        if isinstance(stop_ids, list) and any(not -(2**63) <= t < 2**63 for t in stop_ids):
            # vLLM accepts any integer here, then fails to hand one past 64 bits to its
            # engine core: a 500 that counts against the engine's health. Refused first.
            raise error_answer("stop_token_ids must be 64-bit integers", param="stop_token_ids")
        state = scope["state"]
        rid = state["request_id"]
        pin: str | None = None
        prev = data.get("previous_response_id") if kind == "responses" else None
        if isinstance(prev, str):
            known = self.responses.lookup(prev)
            if known is not None:
                # The previous response is this one's parent, and only the engine that
                # stored it can continue it.
                pin, wf, node = known
                if ident.workflow_id is None or ident.workflow_id == wf:
                    ident = replace(
                        ident,
                        workflow_id=wf,
                        node_id=ident.node_id or rid,
                        parents=tuple(dict.fromkeys((*ident.parents, node))),
                        source="previous_response_id"
                        if ident.workflow_id is None
                        else ident.source,
                    )
        if kind == "responses" and ident.workflow_id is None:
            # A conversation's first response: the workflow its follow-ups (naming it as
            # previous_response_id) join as its children.
            ident = replace(ident, workflow_id=f"resp-{rid}", node_id=rid, source="responses")
        sreq = ServiceRequest(
            request_id=rid,
            prompt_token_ids=rendered.token_ids,
            max_tokens=rendered.max_tokens,
            identity=ident,
            tenant=state.get("tenant", ""),
            temperature=rendered.temperature,
            call=EngineCall(
                path,
                body,
                rendered.stream,
                rendered.needs_model,
                rendered.needs_api,
                Deferred(rendered.generate[0]) if len(rendered.generate) == 1 else None,
            ),
            pin_engine=pin,
        )
        if not rendered.stream:
            await self._unless_gone(receive, self._complete(send, sreq, rendered))
        else:
            # Opening may wait (a request held at the router, a prefill queue): a
            # client that leaves meanwhile takes its request with it.
            tstream = await self._unless_gone(receive, self.router.open(sreq))
            if tstream is not None:
                await self._stream(receive, send, tstream, sreq, rendered)

    def _remember(self, rendered: Rendered, sreq: ServiceRequest, engine: str, body: bytes) -> None:
        if rendered.kind != "responses":
            return
        resp_id = response_id_of(body)
        if resp_id is None:
            return
        ident = sreq.identity
        assert ident.workflow_id is not None  # every Responses request has one (_generate)
        self.responses.remember(
            resp_id, engine, ident.workflow_id, ident.node_id or sreq.request_id
        )

    async def _pooling(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        path: str,
        body: bytes,
        data: dict[str, Any],
    ) -> None:
        """Pooling endpoints go to an engine as they are; placed on the input's tokens
        where it is text (the same text shares its KV nowhere, but its load counts)."""
        text = data.get("input", data.get("text", data.get("query", "")))
        if isinstance(text, list):
            text = " ".join(t for t in text if isinstance(t, str))
        ids = list(self.fe.tokenizer.encode(text)) if isinstance(text, str) and text else []
        state = scope["state"]
        sreq = ServiceRequest(
            request_id=state["request_id"],
            prompt_token_ids=ids or [0],
            max_tokens=1,
            identity=self._identity(scope, data, False),
            tenant=state.get("tenant", ""),
            call=EngineCall(path, body, False, f"{path} needs an engine that serves it"),
        )
        await self._unless_gone(receive, self._complete(send, sreq, None))

    # -- responses -------------------------------------------------------------------
    async def _unless_gone(self, receive: Receive, work: Awaitable[T]) -> T | None:
        """`work`, cancelled if the client disconnects first (then None). Most requests
        finish within the grace period, so they never pay for a disconnect watcher (a
        timer only)."""
        task = asyncio.current_task()
        assert task is not None
        left = False
        watcher: asyncio.Future[None] | None = None

        async def watch() -> None:
            nonlocal left
            await _wait_disconnect(receive)
            left = True
            task.cancel()  # the client left: free the engine

        def start_watching() -> None:
            nonlocal watcher
            watcher = asyncio.ensure_future(watch())

        timer = asyncio.get_running_loop().call_later(self.DISCONNECT_GRACE_S, start_watching)
        try:
            result = await work
        except asyncio.CancelledError:
            if not left:
                raise
            task.uncancel()
            return None
        finally:
            timer.cancel()
            if watcher is not None:
                watcher.cancel()
        return result

    async def _complete(self, send: Send, sreq: ServiceRequest, rendered: Rendered | None) -> None:
        res = await self.router.complete(sreq)
        if res.status:
            # The engine answered the API request itself: its status and bytes, as sent.
            status, body = res.status, res.raw
        else:
            assert rendered is not None
            status = 200
            body = await TokenAnswer(self.fe, rendered, sreq.request_id).whole(
                res.token_ids, res.finish_reason, res.cached_tokens, res.stop_reason
            )
        if rendered is not None and status == 200:
            self._remember(rendered, sreq, res.engine, body)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-wasma-engine", res.engine.encode()),
            (b"x-wasma-placement", res.kind.encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _stream(
        self,
        receive: Receive,
        send: Send,
        tstream: TokenStream,
        sreq: ServiceRequest,
        rendered: Rendered,
    ) -> None:
        async def pump() -> None:
            out = _SseWriter(send, tstream)
            await self._sse(tstream, sreq, rendered, out)
            await out.close()
            self._remember(rendered, sreq, tstream.engine, out.first_raw)

        # The pump runs in this task; a client that leaves cancels it (and so its engine
        # work) through the same disconnect watch as an opening request's.
        try:
            await self._unless_gone(receive, self._logged(pump(), sreq.request_id))
        finally:
            await tstream.aclose()

    @staticmethod
    async def _logged(work: Awaitable[None], request_id: str) -> None:
        """`work`; a failure once the response is under way can only be logged (the
        client sees its stream cut)."""
        try:
            await work
        except (asyncio.CancelledError, _ClientGone):
            raise
        except Exception as exc:
            log.warning("stream %s failed: %s", request_id, exc)

    async def _sse(
        self, tstream: TokenStream, sreq: ServiceRequest, rendered: Rendered, out: _SseWriter
    ) -> None:
        """Write the stream's pieces to `out`: an engine's own answer as it sent it, or
        vLLM's stream chunks derendered from the engine's token ids."""
        answer: TokenAnswer | None = None
        n_out = 0
        cached = 0
        status = 200
        passed_through = False  # the engine answers the API request itself
        try:
            async for chunk in tstream:
                if chunk.status:
                    status = chunk.status
                    passed_through = True
                if passed_through:
                    if chunk.raw:
                        await out.write(chunk.raw, status)
                    relay = getattr(tstream, "relay", None)
                    if relay is not None and chunk.raw and not chunk.finished:
                        # The rest, read by read, straight from the engine's reader to
                        # the client's writer (the proxy's hot path).
                        await relay(out.body)
                        break
                    continue
                if answer is None:
                    answer = TokenAnswer(self.fe, rendered, sreq.request_id)
                if chunk.num_cached_tokens:
                    cached = chunk.num_cached_tokens
                n_out += len(chunk.token_ids)
                reason = chunk.finish_reason if chunk.finished else None
                if chunk.token_ids or reason:
                    ids = list(chunk.token_ids)
                    piece = await answer.chunk(ids, reason, stop_reason=chunk.stop_reason)
                    await out.write(piece, status)
            if answer is not None:
                if answer.include_usage:
                    usage = (len(sreq.prompt_token_ids), n_out, cached)
                    await out.write(await answer.chunk([], None, usage), status)
                await out.write(DONE_EVENT, status)
        except ServiceError as exc:
            # Headers are gone already: the error travels as an SSE event, as vLLM's does.
            err = _api_error(exc, rendered.kind == "messages")
            await out.write(b"data: " + err.body + b"\n\n", status)
            await out.write(DONE_EVENT, status)
        finally:
            await tstream.aclose()


class _SseWriter:
    """A streamed response: its headers with the first piece (the engine and placement
    named as they are then), each piece one write, the `[DONE]` event closing the
    response in the same write as its bytes, nothing after it."""

    __slots__ = ("_send", "_stream", "ended", "first_raw", "started")

    def __init__(self, send: Send, tstream: TokenStream) -> None:
        self._send = send
        self._stream = tstream
        self.started = False
        self.ended = False
        self.first_raw = b""  # the answer's start, for `previous_response_id`

    async def write(self, piece: bytes, status: int) -> None:
        if not self.started:
            ctype = SSE_TYPE if status == 200 else b"application/json"
            headers = [
                (b"content-type", ctype),
                (b"cache-control", b"no-cache"),
                (b"x-wasma-engine", self._stream.engine.encode()),
                (b"x-wasma-placement", self._stream.kind.encode()),
            ]
            await self._send({"type": "http.response.start", "status": status, "headers": headers})
            self.started = True
        await self.body(piece)

    async def body(self, piece: bytes) -> None:
        """One more piece of a response already started."""
        if self.ended:
            return  # nothing follows an OpenAI stream's [DONE]
        if len(self.first_raw) < 4096:
            self.first_raw += piece
        self.ended = piece.endswith(DONE_EVENT)
        await self._send({"type": "http.response.body", "body": piece, "more_body": not self.ended})

    async def close(self) -> None:
        if not self.started:
            headers = [(b"content-type", SSE_TYPE)]
            await self._send({"type": "http.response.start", "status": 200, "headers": headers})
            self.started = True
        if not self.ended:
            await self._send({"type": "http.response.body", "body": b""})


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise error_answer(f"request body exceeds {limit} bytes", 413)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise error_answer(f"request body exceeds {limit} bytes", 413)
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def create_app(
    router_factory: RouterFactory,
    frontend: Frontend,
    config: GatewayConfig | None = None,
    lifecycle: Lifecycle | None = None,
) -> FastAPI:
    """The gateway app over vLLM's front end for the model. `router_factory` is awaited
    once, in the lifespan; with a `lifecycle`, in the background and retried until it
    succeeds (deploy/lifecycle.py), the app answering 503 + Retry-After meanwhile."""
    cfg = config or GatewayConfig()
    codes: Counter[HttpKey] = Counter()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        built: list[Gateway] = []

        def on_built(router: RouterClient) -> None:
            built.append(Gateway(router, frontend, cfg, codes))
            app.state.gw = built[0]

        starting: asyncio.Task[None] | None = None
        if lifecycle is None:
            on_built(await router_factory())
        else:
            starting = asyncio.ensure_future(lifecycle.start(router_factory, on_built))
        try:
            yield
        finally:
            if starting is not None:
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            for gateway in built:
                gateway.close()
                await gateway.router.close()

    app = FastAPI(title="wasma gateway", version="0.1.0", lifespan=lifespan)
    app.add_middleware(
        _Edge,
        auth=_Auth(cfg.api_keys),
        codes=codes,
        protect_metrics=cfg.protect_metrics,
        lifecycle=lifecycle,
    )
    app.state.lifecycle = lifecycle
    # The HTTP protocol's own refusals (deploy/http_limits.py) count here too.
    app.state.http_codes = codes
    openapi_schema.install(app)

    def gw(request: Request) -> Gateway:
        g: Gateway = request.app.state.gw
        return g

    @app.exception_handler(ApiAnswer)
    async def _on_api_answer(request: Request, exc: ApiAnswer) -> Response:
        return Response(exc.body, exc.status, media_type="application/json", headers=exc.headers)

    @app.exception_handler(ServiceError)
    async def _on_service_error(request: Request, exc: ServiceError) -> Response:
        err = _api_error(exc)
        return Response(err.body, err.status, media_type="application/json", headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> Response:
        # vLLM's shape for the framework's own errors (404 on an unknown path, 405).
        status = exc.status_code if exc.status_code >= 400 else 400
        err = error_answer(str(exc.detail), status)
        return Response(
            err.body, status, media_type="application/json", headers=dict(exc.headers or {})
        )

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        g = gw(request)
        return _json(
            await models_answer(g.fe), headers={"x-wasma-vocab-size": str(g.fe.vocab_size)}
        )

    @app.post("/v1/workflows")
    async def register_workflow(request: Request) -> Response:
        g = gw(request)
        raw = await _read_body(request.scope, request.receive, g.cfg.max_workflow_bytes)
        try:
            data = json_limits.decode(raw)
        except json_limits.JsonTooDeep as exc:
            raise error_answer(f"request body is not acceptable JSON: {exc}") from None
        except msgspec.DecodeError as exc:
            raise error_answer(f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise error_answer("a workflow must be a JSON object")
        status = await g.router.register_workflow(data, request.scope["state"].get("tenant", ""))
        return _json(msgspec.json.encode(status), 201)

    @app.get("/v1/workflows/{workflow_id}")
    async def workflow_status(request: Request, workflow_id: str) -> Response:
        g = gw(request)
        status = await g.router.workflow_status(
            workflow_id, request.scope["state"].get("tenant", "")
        )
        return _json(msgspec.json.encode(status))

    if cfg.admin_port is None:
        _admin_routes(app, lambda: gw_of(app))
    return app


def gw_of(app: FastAPI) -> Gateway:
    g: Gateway | None = getattr(app.state, "gw", None)
    if g is None:
        raise error_answer("the gateway is starting", 503, retry_after_s=1.0)
    return g


def _admin_routes(app: FastAPI, gateway: Callable[[], Gateway]) -> None:
    @app.get("/live")
    async def live() -> Response:
        # The process answers: nothing else (an engine down must not restart the pod).
        return _json(b'{"status":"ok"}')

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        lifecycle: Lifecycle | None = getattr(request.app.state, "lifecycle", None)
        if lifecycle is not None and lifecycle.draining:
            return _json(b'{"status":"draining"}', 503, headers={"retry-after": "5"})
        try:
            g = gateway()
        except ApiAnswer:
            why = None if lifecycle is None else lifecycle.start_error
            body = msgspec.json.encode({"status": "starting", "error": why})
            return _json(body, 503, headers={"retry-after": "2"})
        h = await g.router.health()
        if h.get("status") != "ok":
            body = msgspec.json.encode({"status": "no healthy engine"})
            return _json(body, 503, headers={"retry-after": "2"})
        return _json(b'{"status":"ok"}')

    @app.get("/health")
    async def health() -> Response:
        g = gateway()
        h = await g.router.health()
        if h.get("status") != "ok":
            return _json(msgspec.json.encode(h), 503, headers={"retry-after": "2"})
        return _json(msgspec.json.encode(h))

    @app.get("/metrics")
    async def metrics() -> Response:
        g = gateway()
        snapshot = dict(g.codes)
        g.codes.clear()
        body, ctype = await g.router.render_metrics(snapshot)
        return Response(body, media_type=ctype)


def create_admin_app(main: FastAPI) -> FastAPI:
    """`/health` and `/metrics` of `main` on their own app, for `GatewayConfig.admin_port`
    (run it on a second server in the same process; it shares `main`'s router)."""
    app = FastAPI(title="wasma admin", version="0.1.0", openapi_url=None, docs_url=None)

    @app.exception_handler(ApiAnswer)
    async def _on_api_answer(request: Request, exc: ApiAnswer) -> Response:
        return Response(exc.body, exc.status, media_type="application/json", headers=exc.headers)

    app.state.lifecycle = getattr(main.state, "lifecycle", None)
    _admin_routes(app, lambda: gw_of(main))
    return app
