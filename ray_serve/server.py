"""`WasmaLLMServer`: Ray Serve LLM's `LLMServer`, answering the Responses and Anthropic
Messages APIs too.

Ray 2.60's `LLMServer` answers chat, completions, embeddings, score, tokenize and
detokenize. vLLM's own serving classes for the rest are already built inside each
replica: Ray's engine starts vLLM's front end with vLLM's `init_app_state`, which makes
`OpenAIServingResponses` and `AnthropicServingMessages` over the replica's engine client,
with the same model registry and renderer as its chat class. This server hands requests
to those objects and answers as vLLM's routes do (`vllm/entrypoints/openai/responses/
api_router.py`, `vllm/entrypoints/anthropic/api_router.py`): a whole answer's JSON and
status, or a stream of the SSE events vLLM sends, in batches as `LLMServer` streams chat.

Before its engine starts, a replica routed by `WorkflowRouter` asks the deployment's
scheduling state for a KV event endpoint of its own and points its vLLM publisher there
(`kv_events_config`), so the state's prefix index hears what this engine caches and
evicts (see `kv_feeds`).

Each method takes the request body as the client sent it (a JSON object; the ingress has
already checked it against vLLM's protocol class) and the raw request's headers, and is
an async generator: first item `Whole` (an answer or an error, never followed by more),
or lists of SSE strings.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ray.llm._internal.serve.core.protocol import RawRequestInfo
from ray.llm._internal.serve.core.server.llm_server import LLMServer


@dataclass(frozen=True, slots=True)
class Whole:
    """A whole answer as vLLM's route sends it: status and JSON body."""

    status: int
    body: bytes


def _json(content: Any, status: int = 200) -> Whole:
    return Whole(status, json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode())


def _error(err: Any, anthropic: bool) -> Whole:
    """vLLM's `ErrorResponse` as its route answers it: as it is on /v1/responses,
    Anthropic's shape on /v1/messages (vLLM's `translate_error_response`)."""
    if anthropic:
        from vllm.entrypoints.anthropic.api_router import translate_error_response

        resp = translate_error_response(err)
        return Whole(resp.status_code, bytes(resp.body))
    return _json(err.model_dump(mode="json", by_alias=True), int(err.error.code))


def _exception(exc: Exception, anthropic: bool) -> Whole:
    """What vLLM's app answers for an exception its handler raised."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    return _error(create_error_response(exc), anthropic)


class WasmaLLMServer(LLMServer):
    """`LLMServer` plus `responses` (and `retrieve_responses`, `cancel_responses` on
    this replica's store), `anthropic_messages` and `count_tokens`."""

    async def start(self) -> None:
        await self._publish_kv_events()
        await super().start()

    async def _publish_kv_events(self) -> None:
        """Point this replica's vLLM KV event publisher at the socket its scheduling
        state binds for it (replicas share `engine_kwargs`, so each sets its own
        endpoint here, on its own copy of the config). Not for a deployment another
        router routes, nor an engine that caches no prefixes or was told to publish none."""
        from ray import serve

        from wasma.ray_serve.router import scheduling_actor, workflow_router_kwargs

        cfg = self._llm_config
        kwargs = workflow_router_kwargs(cfg.deployment_config or {})
        own = dict(cfg.engine_kwargs.get("kv_events_config") or {})
        if (
            kwargs is None
            or cfg.engine_kwargs.get("enable_prefix_caching") is False
            or own.get("enable_kv_cache_events") is False
        ):
            return
        replica = serve.get_replica_context().replica_id
        state = scheduling_actor(replica.deployment_id, **kwargs)
        endpoint = await state.kv_events_endpoint.remote(replica.to_full_id_str())
        # A replay socket would be one port for every replica: none (the state is
        # subscribed before the engine publishes anything).
        own.pop("replay_endpoint", None)
        own.update(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
        cfg.update_engine_kwargs(kv_events_config=own)

    def _serving(self, name: str) -> Any:
        """The replica's vLLM serving object `name` (None where the engine built none:
        a pooling model, or an engine that is not vLLM's)."""
        state = getattr(self.engine, "_app_state", None)
        return getattr(state, name, None) if state is not None else None

    async def _whole_or_stream(
        self, first: Whole | None, stream: AsyncIterator[str] | None
    ) -> AsyncGenerator[Any, None]:
        if first is not None:
            yield first
            return
        assert stream is not None
        batches: AsyncIterator[list[str]] = self._batch_output_stream(stream)  # type: ignore[arg-type]
        async for batch in batches:
            yield list(batch)

    async def _answer(
        self,
        serving: str,
        missing: str,
        anthropic: bool,
        call: Callable[[Any], Awaitable[Any]],
        whole: Callable[[Any], Any],
        streamed: Callable[[Any], AsyncIterator[str]] | None = None,
    ) -> AsyncGenerator[Any, None]:
        """The answer of vLLM serving object `serving` to `call`, as vLLM's routes send
        it: any failure, or its `ErrorResponse`, in the API's error shape (Anthropic's
        for Messages); a whole answer as `whole(result)` JSON; otherwise, where the call
        streams, `streamed(result)` in batches."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        first: Whole | None = None
        stream: AsyncIterator[str] | None = None
        handler = self._serving(serving)
        try:
            if handler is None:
                raise NotImplementedError(missing)
            result = await call(handler)
        except Exception as exc:  # vLLM's app turns these into its error answers
            first = _exception(exc, anthropic)
        else:
            if isinstance(result, ErrorResponse):
                first = _error(result, anthropic)
            else:
                answer = whole(result)
                if answer is not None or streamed is None:
                    first = _json(answer)
                else:
                    stream = streamed(result)
        async for item in self._whole_or_stream(first, stream):
            yield item

    async def responses(
        self, body: Mapping[str, Any], raw_request_info: RawRequestInfo | None = None
    ) -> AsyncGenerator[Any, None]:
        """POST /v1/responses, answered by vLLM's `OpenAIServingResponses`."""
        from vllm.entrypoints.openai.responses.api_router import _convert_stream_to_sse_events
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        async def call(handler: Any) -> Any:
            await self._maybe_resolve_lora_from_multiplex()
            request = ResponsesRequest.model_validate(dict(body))
            raw = RawRequestInfo.to_starlette_request_optional(raw_request_info)
            return await handler.create_responses(request, raw)

        async for item in self._answer(
            "openai_serving_responses",
            "The model does not support Responses API",
            False,
            call,
            _response_json,
            _convert_stream_to_sse_events,
        ):
            yield item

    async def retrieve_responses(
        self, body: Mapping[str, Any], raw_request_info: RawRequestInfo | None = None
    ) -> AsyncGenerator[Any, None]:
        """GET /v1/responses/{response_id} (`body`: response_id, starting_after, stream),
        answered from this replica's vLLM response store."""
        from vllm.entrypoints.openai.responses.api_router import _convert_stream_to_sse_events

        async def call(handler: Any) -> Any:
            return await handler.retrieve_responses(
                str(body["response_id"]),
                starting_after=body.get("starting_after"),
                stream=bool(body.get("stream")),
            )

        async for item in self._answer(
            "openai_serving_responses",
            "The model does not support Responses API",
            False,
            call,
            _response_json,
            _convert_stream_to_sse_events,
        ):
            yield item

    async def cancel_responses(
        self, body: Mapping[str, Any], raw_request_info: RawRequestInfo | None = None
    ) -> AsyncGenerator[Whole, None]:
        """POST /v1/responses/{response_id}/cancel, on this replica's vLLM store."""

        async def call(handler: Any) -> Any:
            return await handler.cancel_responses(str(body["response_id"]))

        async for item in self._answer(
            "openai_serving_responses",
            "The model does not support Responses API",
            False,
            call,
            lambda result: result.model_dump(mode="json", by_alias=True),
        ):
            yield item

    async def anthropic_messages(
        self, body: Mapping[str, Any], raw_request_info: RawRequestInfo | None = None
    ) -> AsyncGenerator[Any, None]:
        """POST /v1/messages, answered by vLLM's `AnthropicServingMessages` (as vLLM's
        route: every failure in Anthropic's shape)."""
        from vllm.entrypoints.anthropic.protocol import (
            AnthropicMessagesRequest,
            AnthropicMessagesResponse,
        )

        async def call(handler: Any) -> Any:
            await self._maybe_resolve_lora_from_multiplex()
            request = AnthropicMessagesRequest.model_validate(dict(body))
            raw = RawRequestInfo.to_starlette_request_optional(raw_request_info)
            return await handler.create_messages(request, raw)

        def whole(result: Any) -> Any:
            if isinstance(result, AnthropicMessagesResponse):
                return result.model_dump(exclude_none=True)
            return None  # a stream of SSE strings

        async for item in self._answer(
            "anthropic_serving_messages",
            "The model does not support Messages API",
            True,
            call,
            whole,
            lambda result: result,
        ):
            yield item

    async def count_tokens(
        self, body: Mapping[str, Any], raw_request_info: RawRequestInfo | None = None
    ) -> AsyncGenerator[Whole, None]:
        """POST /v1/messages/count_tokens, answered by vLLM's `AnthropicServingMessages`."""
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

        async def call(handler: Any) -> Any:
            request = AnthropicCountTokensRequest.model_validate(dict(body))
            raw = RawRequestInfo.to_starlette_request_optional(raw_request_info)
            return await handler.count_tokens(request, raw)

        async for item in self._answer(
            "anthropic_serving_messages",
            "The model does not support Messages API",
            True,
            call,
            lambda result: result.model_dump(exclude_none=True),
        ):
            yield item


def _response_json(result: Any) -> Any:
    """A whole Responses answer as vLLM's route dumps it; None for a stream."""
    from vllm.entrypoints.openai.responses.protocol import ResponsesResponse

    if isinstance(result, ResponsesResponse):
        return result.model_dump(mode="json", by_alias=True)
    return None


__all__ = ["WasmaLLMServer", "Whole"]
