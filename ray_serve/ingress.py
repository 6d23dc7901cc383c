"""The OpenAI ingress of `build_openai_app`: Ray Serve LLM's own, plus wasma's contract.

Requests are answered by Ray's `OpenAiIngress` (and so by vLLM in the `LLMServer`
replicas). This subclass adds what DESIGN.md promises on every response: bad workflow
metadata is a 400 naming the field before anything is placed, and the answer carries
`x-wasma-engine` (the Serve replica id `WorkflowRouter` chose), `x-wasma-placement`
(`reuse`, `transfer` or `recompute`); Serve's proxy echoes `x-request-id`. A request whose replica
dies before it answered is sent again (a stream is, until its first chunk), so a lost
replica costs the client time, not an error.

It also answers what Ray's ingress lacks: `POST /v1/responses`, `/v1/messages` and
`/v1/messages/count_tokens`, by `WasmaLLMServer`'s methods in the replicas (vLLM's own
serving classes), placed by `WorkflowRouter` like chat. Bodies are checked with vLLM's
protocol classes first, so a bad one gets vLLM's 400 here; errors on /v1/messages are in
Anthropic's shape, as vLLM gives them. A Responses answer's id is told to the scheduling
state, which sends a request naming it as `previous_response_id` to the same replica.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import ray
from fastapi import FastAPI, Request, Response
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.llm._internal.common.utils.lora_utils import get_base_model_id
from ray.llm._internal.serve.constants import DEFAULT_LLM_ROUTER_HTTP_TIMEOUT
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
from ray.llm._internal.serve.core.ingress.ingress import (
    DEFAULT_ENDPOINTS,
    OpenAiIngress,
    router_request_timeout,
)
from ray.llm._internal.serve.core.protocol import RawRequestInfo
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve._private.http_util import session_id_from_headers
from starlette.responses import StreamingResponse

from wasma.deploy.api import ApiAnswer, error_answer, parse_json, parse_request
from wasma.deploy.metadata import MetadataError, workflow_identity
from wasma.ray_serve.router import placement_of
from wasma.ray_serve.server import Whole

# Replicas that may die under one request before it fails (Serve replaces a dead one).
RETRIES = 2

# Ray's routes, and the ones its ingress lacks (method name -> route).
WASMA_ENDPOINTS: dict[str, Callable[[FastAPI], Callable[..., Any]]] = {
    **DEFAULT_ENDPOINTS,
    "responses": lambda app: app.post("/v1/responses"),
    "retrieve_responses": lambda app: app.get("/v1/responses/{response_id}"),
    "cancel_responses": lambda app: app.post("/v1/responses/{response_id}/cancel"),
    "anthropic_messages": lambda app: app.post("/v1/messages"),
    "count_tokens": lambda app: app.post("/v1/messages/count_tokens"),
}


def _answer(exc: ApiAnswer) -> Response:
    return Response(exc.body, exc.status, exc.headers, media_type="application/json")


async def _flatten(first: Any, rest: AsyncIterator[Any]) -> AsyncGenerator[str, None]:
    """The replica's SSE events, batched in lists, one string at a time."""
    for event in first:
        yield event
    async for batch in rest:
        for event in batch:
            yield event


class WasmaIngress(OpenAiIngress):
    def __init__(
        self, *args: Any, wasma_state_names: dict[str, str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._state_names = dict(wasma_state_names or {})
        self._states: dict[str, Any] = {}

    def _state(self, model_id: str) -> Any:
        """The model's scheduling actor (made by its router on the first request)."""
        model_id = get_base_model_id(model_id)  # a LoRA adapter's: its base model's
        handle = self._states.get(model_id)
        if handle is None:
            name = self._state_names.get(model_id)
            if name is None:
                return None
            try:
                handle = ray.get_actor(name, namespace=SERVE_NAMESPACE)
            except ValueError:
                return None
            self._states[model_id] = handle
        return handle

    async def _process_llm_request(
        self, body: Any, call_method: str, raw_request: Request | None = None
    ) -> Response:
        headers = dict(raw_request.headers) if raw_request is not None else {}
        fields = {
            k: v
            for k in ("metadata", "vllm_xargs")
            if (v := getattr(body, k, None) or (getattr(body, "model_extra", None) or {}).get(k))
            is not None
        }
        try:
            workflow_identity(headers, fields)
        except MetadataError as exc:
            raise OpenAIHTTPException(
                message=str(exc), status_code=400, type="BadRequestError"
            ) from None
        response: Response | None = None
        for attempt in range(RETRIES + 1):
            try:
                response = await super()._process_llm_request(body, call_method, raw_request)
                break
            except (RayActorError, ActorUnavailableError):
                # The replica died before answering (Ray's ingress awaits a non-streaming
                # answer, or a stream's first chunk, before it responds): nothing reached
                # the client, so ask again; the router places it on a live replica.
                if attempt == RETRIES:
                    raise
        assert response is not None
        request_id = headers.get("x-request-id")
        if request_id is None and raw_request is not None:
            request_id = getattr(raw_request.state, "request_id", None)
        if request_id:
            # x-request-id: Serve's proxy echoes it on every answer (setting it here too
            # would send it twice).
            model_id = await self._get_model_id(body.model)
            state = self._state(model_id)
            if state is not None:
                # Routing is done: Ray's ingress awaited the first chunk above.
                handle = self._get_configured_serve_handle(model_id)
                placed = await placement_of(handle, state, request_id)
                if placed is not None:
                    response.headers["x-wasma-engine"] = placed[0]
                    response.headers["x-wasma-placement"] = placed[1]
        return response

    # -- Responses and Messages: routes Ray's ingress lacks ---------------------------

    async def responses(self, request: Request) -> Response:
        """POST /v1/responses (vLLM's `OpenAIServingResponses` in the replica)."""
        return await self._wasma_call(request, "responses", "responses")

    async def retrieve_responses(
        self,
        response_id: str,
        request: Request,
        starting_after: int | None = None,
        stream: bool | None = False,
    ) -> Response:
        """GET /v1/responses/{response_id}, from the replica that stored it."""
        body = {"response_id": response_id, "starting_after": starting_after, "stream": stream}
        return await self._store_call(request, "retrieve_responses", body)

    async def cancel_responses(self, response_id: str, request: Request) -> Response:
        """POST /v1/responses/{response_id}/cancel, on the replica that stored it."""
        return await self._store_call(request, "cancel_responses", {"response_id": response_id})

    async def _store_call(
        self, request: Request, call_method: str, body: dict[str, Any]
    ) -> Response:
        """A call about a stored response; `WorkflowRouter` sends it to the replica whose
        vLLM store holds it. The path names no model: the one whose state saw the
        response (the first model's replicas answer vLLM's 404 for an unknown id)."""
        model_id = next(iter(self._model_cards))
        for model in self._model_cards:
            state = self._state(model)
            if state is not None and await state.holder_of.remote(body["response_id"]):
                model_id = model
                break
        handle = self._get_configured_serve_handle(model_id)
        raw = RawRequestInfo.from_starlette_request(request)
        async with router_request_timeout(DEFAULT_LLM_ROUTER_HTTP_TIMEOUT):
            first, rest = await self._first_answer(handle, call_method, body, raw)
        if isinstance(first, Whole):
            return Response(first.body, first.status, media_type="application/json")
        return StreamingResponse(_flatten(first, rest), media_type="text/event-stream")

    async def anthropic_messages(self, request: Request) -> Response:
        """POST /v1/messages (vLLM's `AnthropicServingMessages` in the replica)."""
        return await self._wasma_call(request, "messages", "anthropic_messages")

    async def count_tokens(self, request: Request) -> Response:
        """POST /v1/messages/count_tokens (vLLM's `AnthropicServingMessages`)."""
        return await self._wasma_call(request, "count_tokens", "count_tokens")

    async def _wasma_call(self, request: Request, kind: str, call_method: str) -> Response:
        anthropic = kind != "responses"
        headers = dict(request.headers)
        try:
            data = parse_json(await request.body())
            # vLLM's route validates the body first (FastAPI): its 400s, worded as vLLM's.
            parse_request(kind, data)
            try:
                workflow_identity(headers, data)
            except MetadataError as exc:
                raise error_answer(str(exc), 400, param=exc.param, anthropic=anthropic) from None
            model_id = await self._model_for(data.get("model"), anthropic)
        except ApiAnswer as exc:
            return _answer(exc)
        handle = self._get_configured_serve_handle(model_id)
        session_id = session_id_from_headers(headers)
        if session_id:
            handle = handle.options(session_id=session_id)
        raw = RawRequestInfo.from_starlette_request(request)
        async with router_request_timeout(DEFAULT_LLM_ROUTER_HTTP_TIMEOUT):
            first, rest = await self._first_answer(handle, call_method, data, raw)
        request_id = str(headers.get("x-request-id") or getattr(request.state, "request_id", ""))
        state = self._state(model_id) if request_id else None
        if isinstance(first, Whole):
            if state is not None and kind == "responses" and first.status == 200:
                await state.responded.remote(request_id, json.loads(first.body))
            response: Response = Response(first.body, first.status, media_type="application/json")
        else:
            events = _flatten(first, rest)
            if state is not None and kind == "responses":
                events = self._telling_completion(events, state, request_id)
            response = StreamingResponse(events, media_type="text/event-stream")
        if state is not None and kind != "count_tokens":
            placed = await placement_of(handle, state, request_id)
            if placed is not None:
                response.headers["x-wasma-engine"] = placed[0]
                response.headers["x-wasma-placement"] = placed[1]
        return response

    async def _model_for(self, model: Any, anthropic: bool) -> str:
        """The deployment a body's `model` names. With one model served, any name goes
        to it: its vLLM answers an unknown name with its own 404, as `vllm serve` does."""
        if isinstance(model, str) and get_base_model_id(model) in self._model_cards:
            return model  # a LoRA adapter's id too: Serve multiplexes it to its replica
        if len(self._model_cards) == 1:
            (only,) = self._model_cards
            return only
        if not isinstance(model, str) or model not in self._model_cards:
            raise error_answer(
                f"The model `{model}` does not exist.", 404, "NotFoundError", anthropic=anthropic
            )
        return model

    async def _first_answer(
        self, handle: Any, call_method: str, data: dict[str, Any], raw: RawRequestInfo
    ) -> tuple[Any, AsyncIterator[Any]]:
        """The replica's first item and the rest of its stream; sent again, to a live
        replica, when the replica dies before its first item (nothing has reached the
        client yet)."""
        for attempt in range(RETRIES + 1):
            gen = getattr(handle, call_method).remote(data, raw)
            try:
                return await gen.__anext__(), gen
            except (RayActorError, ActorUnavailableError):
                if attempt == RETRIES:
                    raise
        raise AssertionError("unreachable")

    async def _telling_completion(
        self, events: AsyncIterator[str], state: Any, request_id: str
    ) -> AsyncGenerator[str, None]:
        """A Responses stream, passed on; its `response.completed` event is told to the
        scheduling state before the client sees it (a follow-up may come right after)."""
        async for event in events:
            if event.startswith("event: response.completed"):
                _, _, data = event.partition("\ndata: ")
                try:
                    body = json.loads(data)
                except ValueError:
                    body = None
                if isinstance(body, dict) and isinstance(body.get("response"), dict):
                    await state.responded.remote(request_id, body["response"])
            yield event
