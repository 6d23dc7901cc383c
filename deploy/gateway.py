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
import math
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from wasma.deploy import json_limits
from wasma.deploy.lifecycle import Lifecycle, lifecycle_refusal
from wasma.deploy.metadata import MetadataError, workflow_identity
from wasma.deploy.metrics import handler_of
from wasma.deploy.openai_api import (
    DONE_EVENT,
    ApiError,
    ChatCompletionRequest,
    ChunkWriter,
    CompletionRequest,
    chat_body,
    completion_body,
    decode_request,
    error_body,
    message_text,
    models_body,
    prompt_of,
    usage,
)
from wasma.deploy.router_client import RouterClient, TokenStream
from wasma.deploy.service_types import ServiceError, ServiceRequest, tenant_of
from wasma.deploy.tokenizer import Tokenizer

log = logging.getLogger(__name__)
T = TypeVar("T")

RouterFactory = Callable[[], Awaitable[RouterClient]]
HttpKey = tuple[str, int]  # (handler, status): what the edge counts between scrapes
# A tokenizer reporting this vocabulary does not know it (remote engines, token ids only).
UNKNOWN_VOCAB = 1 << 31


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
    # No tokenizer, on purpose: prompts must be token ids (`wasma serve` refuses to start
    # an openai: gateway with neither this nor --model).
    token_ids_only: bool = False

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
    # The generation endpoints, served straight from here (see Gateway).
    FAST = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}

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
                    ApiError(401, "invalid or missing API key", code="invalid_api_key"),
                    extra=[(b"www-authenticate", b"Bearer")],
                )
                return
            state["tenant"] = tenant
        else:
            state["tenant"] = ""
        try:
            fast = self.FAST.get(path) if scope["method"] == "POST" else None
            refusal = lifecycle_refusal(self.lifecycle, scope, fast is not None)
            if refusal is not None:
                await _send_error(send_wrapped, refusal[0], extra=refusal[1])
                return
            if fast is not None:
                gateway: Gateway = scope["app"].state.gw
                await getattr(gateway, fast)(scope, receive, send_wrapped)
            else:
                await self.app(scope, receive, send_wrapped)
        except Exception:
            log.exception("unhandled error on %s", path)
            if not started:
                await _send_error(send_wrapped, ApiError(500, "internal error", code="internal"))


async def _send_error(send: Send, err: ApiError, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = err.body()
    hdrs = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *[(k.encode(), v.encode()) for k, v in err.headers().items()],
        *extra,
    ]
    await send({"type": "http.response.start", "status": err.status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


def _json(body: bytes, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def _api_error(exc: ServiceError) -> ApiError:
    return ApiError(
        exc.status,
        exc.message,
        param=exc.param,
        code=exc.code,
        retry_after_s=exc.retry_after_s,
    )


class _ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class Gateway:
    """The per-app object graph: router client, tokenizer, config, counters; and the
    two generation endpoints as raw ASGI handlers (the hot path skips the framework's
    routing, dependency and exception layers, which cost as much as the router itself)."""

    DISCONNECT_GRACE_S = 0.25
    OFFLOAD_CHARS = 8192  # texts at least this long are tokenised off the event loop

    def __init__(
        self,
        router: RouterClient,
        tokenizer: Tokenizer,
        config: GatewayConfig,
        codes: Counter[HttpKey],
    ) -> None:
        self.router = router
        self.tok = tokenizer
        self.cfg = config
        self.codes = codes
        self.created = int(time.time())
        self._names = set(config.model_names) | set(config.extra_model_names)
        # One thread: long texts queue for it rather than each taking a core from the
        # engines, and the tokenizer is never entered by two offloaded calls at once.
        self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="wasma-tokenize")

    def close(self) -> None:
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # -- ASGI entry points -----------------------------------------------------------
    async def completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=False)

    async def chat_completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._generate(scope, receive, send, chat=True)

    async def _generate(self, scope: Scope, receive: Receive, send: Send, chat: bool) -> None:
        try:
            body = await _read_body(scope, receive, self.cfg.max_body_bytes)
            sreq, req = await self._parse(scope, body, chat)
            if not req.stream:
                await self._unless_gone(receive, self._complete(send, sreq, req, chat))
            else:
                # Opening may wait (a request held at the router, a prefill queue): a
                # client that leaves meanwhile takes its request with it.
                tstream = await self._unless_gone(receive, self.router.open(sreq))
                if tstream is not None:
                    await self._stream(receive, send, tstream, sreq, chat, req)
        except ApiError as exc:
            await _send_error(send, exc)
        except ServiceError as exc:
            await _send_error(send, _api_error(exc))
        except _ClientGone:
            return

    # -- request building ------------------------------------------------------------
    async def _tokenize(self, fn: Callable[[Any], list[int]], arg: Any, chars: int) -> list[int]:
        """`fn(arg)` on a worker thread when the text is long: a chat template and BPE
        over tens of kilobytes take milliseconds, during which the event loop would
        relay no other request's tokens. Short texts stay inline (a thread hop costs
        more than encoding them)."""
        if chars < self.OFFLOAD_CHARS:
            return fn(arg)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, arg)

    async def _parse(self, scope: Scope, body: bytes, chat: bool) -> tuple[ServiceRequest, Any]:
        req: Any
        if chat:
            req = decode_request(body, ChatCompletionRequest)
            if not req.messages:
                raise ApiError(400, "messages must not be empty", param="messages")
            mt = self._check_common(
                req,
                req.max_tokens if req.max_completion_tokens is None else req.max_completion_tokens,
                self.cfg.default_chat_max_tokens,
            )
            msgs = [{"role": m.role, "content": message_text(m)} for m in req.messages]
            try:
                ids = await self._tokenize(
                    self.tok.chat, msgs, sum(len(m["content"]) for m in msgs)
                )
            except ApiError:
                raise
            except Exception as exc:  # a template may reject role orders
                raise ApiError(
                    400, f"cannot apply the chat template: {exc}", param="messages"
                ) from None
        else:
            req = decode_request(body, CompletionRequest)
            mt = self._check_common(req, req.max_tokens, self.cfg.default_max_tokens)
            if req.echo:
                raise ApiError(400, "echo is not supported", param="echo")
            prompt = prompt_of(req)
            if isinstance(prompt, str):
                ids = await self._tokenize(self.tok.encode, prompt, len(prompt))
            else:
                ids = prompt
        return self._service_request(scope, req, ids, mt), req

    def _check_common(self, req: Any, max_tokens: int | None, default: int) -> int:
        if req.model is not None and self._names and req.model not in self._names:
            raise ApiError(
                404,
                f"the model {req.model!r} does not exist; this gateway serves {self.cfg.model!r}",
                param="model",
                code="model_not_found",
            )
        if req.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        mt = default if max_tokens is None else max_tokens
        if not 1 <= mt <= self.cfg.max_tokens_limit:
            raise ApiError(
                400, f"max_tokens must be in 1..{self.cfg.max_tokens_limit}", param="max_tokens"
            )
        if req.temperature is not None and not (
            math.isfinite(req.temperature) and 0 <= req.temperature <= 2
        ):
            raise ApiError(400, "temperature must be in [0, 2]", param="temperature")
        if req.top_p is not None and not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
            raise ApiError(400, "top_p must be in (0, 1]", param="top_p")
        if req.min_tokens < 0 or req.min_tokens > mt:
            raise ApiError(400, "min_tokens must be in 0..max_tokens", param="min_tokens")
        return mt

    def _service_request(
        self, scope: Scope, req: Any, ids: list[int], max_tokens: int
    ) -> ServiceRequest:
        if not ids:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(ids) > self.cfg.max_prompt_tokens:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens, over the limit of {self.cfg.max_prompt_tokens}",
                param="prompt",
            )
        if min(ids) < 0 or max(ids) >= self.tok.vocab_size:
            raise ApiError(400, f"token ids must be in [0, {self.tok.vocab_size})", param="prompt")
        self._check_sizes(req)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        try:
            ident = workflow_identity(
                headers, {"metadata": req.metadata, "vllm_xargs": req.vllm_xargs}
            )
        except MetadataError as exc:
            raise ApiError(400, str(exc), param=exc.param) from None
        extra: dict[str, object] = {}
        for key in ("top_p", "seed", "stop", "stop_token_ids"):
            value = getattr(req, key)
            if value is not None:
                extra[key] = value
        if req.min_tokens:
            extra["min_tokens"] = req.min_tokens
        state = scope["state"]
        return ServiceRequest(
            request_id=state["request_id"],
            prompt_token_ids=ids,
            max_tokens=max_tokens,
            identity=ident,
            tenant=state.get("tenant", ""),
            temperature=1.0 if req.temperature is None else req.temperature,
            ignore_eos=req.ignore_eos,
            extra=extra,
        )

    def _check_sizes(self, req: Any) -> None:
        """Bounded fields, so a request's cost stays in proportion to its body limit."""
        cfg = self.cfg
        # vllm_xargs carries agentic_context, a JSON string of up to 8 KiB (metadata.py).
        for name, chars in (("metadata", cfg.max_metadata_value_chars), ("vllm_xargs", 8192)):
            value = getattr(req, name)
            if value is None:
                continue
            if len(value) > cfg.max_metadata_keys:
                raise ApiError(400, f"{name} has over {cfg.max_metadata_keys} keys", param=name)
            for key, item in value.items():
                if len(key) > cfg.max_metadata_key_chars:
                    raise ApiError(
                        400,
                        f"{name} keys must be at most {cfg.max_metadata_key_chars} chars",
                        param=name,
                    )
                if name == "metadata" and not isinstance(item, str | int | float | bool | None):
                    raise ApiError(400, f"{name}.{key} must be a string or number", param=name)
                if isinstance(item, str) and len(item) > chars:
                    raise ApiError(
                        400, f"{name}.{key} is over {chars} chars", param=f"{name}.{key}"
                    )
        stop = req.stop
        if isinstance(stop, list) and len(stop) > cfg.max_stop:
            raise ApiError(400, f"at most {cfg.max_stop} stop strings", param="stop")
        if req.stop_token_ids is not None and len(req.stop_token_ids) > cfg.max_stop:
            raise ApiError(400, f"at most {cfg.max_stop} stop token ids", param="stop_token_ids")
        # Values an engine cannot take would fail there, and an engine failing a request
        # is taken out of rotation: they are the client's error, caught here.
        vocab = self.tok.vocab_size
        if req.stop_token_ids and not all(0 <= t < vocab for t in req.stop_token_ids):
            raise ApiError(400, f"stop token ids must be in [0, {vocab})", param="stop_token_ids")
        if req.seed is not None and not -(2**63) <= req.seed < 2**63:
            raise ApiError(400, "seed must fit in a signed 64-bit integer", param="seed")

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

    async def _complete(self, send: Send, sreq: ServiceRequest, req: Any, chat: bool) -> None:
        res = await self.router.complete(sreq)
        text = res.text or self.tok.decode(res.token_ids)
        use = usage(len(sreq.prompt_token_ids), len(res.token_ids), res.cached_tokens)
        ids = res.token_ids if req.return_token_ids else None
        if chat:
            body = chat_body(sreq.request_id, self.cfg.model, text, res.finish_reason, use, ids)
        else:
            body = completion_body(
                sreq.request_id,
                self.cfg.model,
                text,
                res.finish_reason,
                use,
                ids,
                sreq.prompt_token_ids if ids is not None else None,
            )
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"x-wasma-engine", res.engine.encode()),
            (b"x-wasma-placement", res.kind.encode()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _stream(
        self,
        receive: Receive,
        send: Send,
        tstream: TokenStream,
        sreq: ServiceRequest,
        chat: bool,
        req: Any,
    ) -> None:
        headers = [
            (b"content-type", b"text/event-stream"),
            (b"cache-control", b"no-cache"),
            (b"x-wasma-engine", tstream.engine.encode()),
            (b"x-wasma-placement", tstream.kind.encode()),
        ]

        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for piece in self._sse(tstream, sreq, chat, req):
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

        pumping = asyncio.ensure_future(pump())
        watching = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((pumping, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            # A client that left cancels its engine work (the pump's finally aborts it).
            for task in (pumping, watching):
                task.cancel()
            await asyncio.gather(pumping, watching, return_exceptions=True)
            await tstream.aclose()
        if pumping.done() and not pumping.cancelled() and pumping.exception() is not None:
            log.warning("stream %s failed: %s", sreq.request_id, pumping.exception())

    async def _sse(
        self, tstream: TokenStream, sreq: ServiceRequest, chat: bool, req: Any
    ) -> AsyncIterator[bytes]:
        writer = ChunkWriter(sreq.request_id, self.cfg.model, chat, req.return_token_ids)
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        n_out = 0
        cached = 0
        ids: list[int] = []
        sent_text = ""
        try:
            async for chunk in tstream:
                if chunk.num_cached_tokens:
                    cached = chunk.num_cached_tokens
                n_out += len(chunk.token_ids)
                if chunk.text:
                    delta = chunk.text
                else:
                    # Decode the whole output so far: multi-byte characters split across
                    # tokens come out whole once their last token arrives.
                    ids.extend(chunk.token_ids)
                    full = self.tok.decode(ids)
                    delta, sent_text = full[len(sent_text) :], full
                yield writer.delta(
                    delta, list(chunk.token_ids), chunk.finish_reason if chunk.finished else None
                )
            if include_usage:
                yield writer.usage(usage(len(sreq.prompt_token_ids), n_out, cached))
        except ServiceError as exc:
            # Headers are gone already: the error travels as an SSE event, as OpenAI's does.
            yield writer.error(_api_error(exc))
        finally:
            await tstream.aclose()
        yield DONE_EVENT


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes")
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds {limit} bytes")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


_REF = "#/components/schemas/{name}"


_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type", "param", "code"],
        }
    },
    "required": ["error"],
}


def _install_openapi(app: FastAPI) -> None:
    """/openapi.json, with the two generation endpoints (served by the edge's fast path,
    so FastAPI does not see them) described from their msgspec structs."""
    from fastapi.openapi.utils import get_openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            (comp, chat), components = msgspec.json.schema_components(
                (CompletionRequest, ChatCompletionRequest), ref_template=_REF
            )
            doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
            for path, schema, summary in (
                ("/v1/completions", comp, "Completions"),
                ("/v1/chat/completions", chat, "Chat completions"),
            ):
                doc.setdefault("paths", {})[path] = {
                    "post": {
                        "summary": summary,
                        "operationId": summary.lower().replace(" ", "_"),
                        "requestBody": {
                            "required": True,
                            "content": {"application/json": {"schema": schema}},
                        },
                        "responses": {
                            "200": {"description": "JSON, or SSE when stream is true"},
                            "default": {
                                "description": "an error in OpenAI's shape",
                                "content": {"application/json": {"schema": _ERROR_SCHEMA}},
                            },
                        },
                    }
                }
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    router_factory: RouterFactory,
    tokenizer: Tokenizer,
    config: GatewayConfig | None = None,
    lifecycle: Lifecycle | None = None,
) -> FastAPI:
    """The gateway app. `router_factory` is awaited once, in the lifespan; with a
    `lifecycle`, in the background and retried until it succeeds (deploy/lifecycle.py),
    the app answering 503 + Retry-After meanwhile."""
    cfg = config or GatewayConfig()
    codes: Counter[HttpKey] = Counter()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        built: list[Gateway] = []

        def on_built(router: RouterClient) -> None:
            built.append(Gateway(router, tokenizer, cfg, codes))
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

    def gw(request: Request) -> Gateway:
        g: Gateway = request.app.state.gw
        return g

    @app.exception_handler(ApiError)
    async def _on_api_error(request: Request, exc: ApiError) -> Response:
        return Response(
            exc.body(), exc.status, media_type="application/json", headers=exc.headers()
        )

    @app.exception_handler(ServiceError)
    async def _on_service_error(request: Request, exc: ServiceError) -> Response:
        err = _api_error(exc)
        return Response(
            err.body(), err.status, media_type="application/json", headers=err.headers()
        )

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(request: Request, exc: StarletteHTTPException) -> Response:
        status = exc.status_code if exc.status_code >= 400 else 400
        code = "not_found" if status == 404 else None
        return Response(
            error_body(status, str(exc.detail), None, code),
            status,
            media_type="application/json",
            headers=dict(exc.headers or {}),
        )

    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        param = ".".join(str(p) for p in errors[0]["loc"][1:]) if errors else None
        return Response(
            error_body(400, f"invalid request: {errors}", param or None),
            400,
            media_type="application/json",
        )

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        g = gw(request)
        vocab = g.tok.vocab_size if g.tok.vocab_size < UNKNOWN_VOCAB else None
        return _json(models_body(g.cfg.model, g.created, vocab))

    @app.post("/v1/workflows")
    async def register_workflow(request: Request) -> Response:
        g = gw(request)
        raw = await _read_body(request.scope, request.receive, g.cfg.max_workflow_bytes)
        try:
            data = json_limits.decode(raw)
        except json_limits.JsonTooDeep as exc:
            raise ApiError(400, f"request body is not acceptable JSON: {exc}") from None
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ApiError(400, "a workflow must be a JSON object")
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
    _install_openapi(app)
    return app


def gw_of(app: FastAPI) -> Gateway:
    g: Gateway | None = getattr(app.state, "gw", None)
    if g is None:
        raise ApiError(503, "the gateway is starting", retry_after_s=1.0)
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
        except ApiError:
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

    @app.exception_handler(ApiError)
    async def _on_api_error(request: Request, exc: ApiError) -> Response:
        return Response(
            exc.body(), exc.status, media_type="application/json", headers=exc.headers()
        )

    app.state.lifecycle = getattr(main.state, "lifecycle", None)
    _admin_routes(app, lambda: gw_of(main))
    return app
