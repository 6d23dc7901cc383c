"""The OpenAI ingress of `build_openai_app`: Ray Serve LLM's own, plus wasma's contract.

Requests are answered by Ray's `OpenAiIngress` (and so by vLLM in the `LLMServer`
replicas). This subclass adds what DESIGN.md promises on every response: bad workflow
metadata is a 400 naming the field before anything is placed, and the answer carries
`x-wasma-engine` (the Serve replica id `WorkflowRouter` chose), `x-wasma-placement`
(`reuse`, `transfer` or `recompute`); Serve's proxy echoes `x-request-id`. A request whose replica
dies before it answered is sent again (a stream is, until its first chunk), so a lost
replica costs the client time, not an error.
"""

from __future__ import annotations

from typing import Any

import ray
from fastapi import Request, Response
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.llm._internal.serve.core.configs.openai_api_models import OpenAIHTTPException
from ray.llm._internal.serve.core.ingress.ingress import OpenAiIngress
from ray.serve._private.constants import SERVE_NAMESPACE

from wasma.deploy.metadata import MetadataError, workflow_identity

# Replicas that may die under one request before it fails (Serve replaces a dead one).
RETRIES = 2


class WasmaIngress(OpenAiIngress):
    def __init__(
        self, *args: Any, wasma_state_names: dict[str, str] | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._state_names = dict(wasma_state_names or {})
        self._states: dict[str, Any] = {}

    def _state(self, model_id: str) -> Any:
        """The model's scheduling actor (made by its router on the first request)."""
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
            state = self._state(await self._get_model_id(body.model))
            if state is not None:
                # Routing is done: Ray's ingress awaited the first chunk above.
                placed = await state.placement_of.remote(request_id)
                if placed is not None:
                    response.headers["x-wasma-engine"] = placed[0]
                    response.headers["x-wasma-placement"] = placed[1]
        return response
