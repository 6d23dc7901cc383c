"""The gateway's OpenAPI document, API endpoints included.

The API endpoints are served straight from the ASGI edge (deploy/gateway.py), outside
FastAPI's routing, so FastAPI's generated document would list only the admin and
workflow routes. Their request bodies are vLLM's own protocol classes, so their schemas
come from those classes (pydantic's JSON schema): the document says what the gateway
accepts because it is what vLLM validates against.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_RESPONSES = {
    "400": {"description": "vLLM's error answer: the request is not valid"},
    "404": {"description": "vLLM's error answer: unknown model"},
    "429": {"description": "admission refused; retry after the Retry-After header"},
    "503": {"description": "no engine can serve it now; retry after Retry-After"},
}


def _operations() -> dict[str, tuple[str, Any]]:
    """path -> (summary, vLLM's request type) for the endpoints the edge serves."""
    from vllm.entrypoints.anthropic.protocol import (
        AnthropicCountTokensRequest,
        AnthropicMessagesRequest,
    )
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest
    from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest

    return {
        "/v1/chat/completions": ("Chat completion", ChatCompletionRequest),
        "/v1/completions": ("Completion", CompletionRequest),
        "/v1/responses": ("Responses API", ResponsesRequest),
        "/v1/messages": ("Anthropic Messages", AnthropicMessagesRequest),
        "/v1/messages/count_tokens": ("Anthropic token count", AnthropicCountTokensRequest),
        "/tokenize": ("Tokenize a prompt or chat", TokenizeRequest),
        "/detokenize": ("Detokenize token ids", DetokenizeRequest),
        "/v1/chat/completions/render": ("Render a chat request", ChatCompletionRequest),
        "/v1/completions/render": ("Render a completion request", CompletionRequest),
    }


def _schema_ref(kind: Any, components: dict[str, Any]) -> dict[str, Any]:
    from pydantic import TypeAdapter

    name = getattr(kind, "__name__", None) or str(kind).replace(" ", "")
    if name not in components:
        schema = TypeAdapter(kind).json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        components[name] = schema
    return {"$ref": f"#/components/schemas/{name}"}


def install(app: FastAPI) -> None:
    """Make `app.openapi()` (and /openapi.json) list the API endpoints too."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        paths = doc.setdefault("paths", {})
        for path, (summary, kind) in _operations().items():
            paths[path] = {
                "post": {
                    "summary": summary,
                    "operationId": "api" + path.replace("/", "_"),
                    "requestBody": {
                        "required": True,
                        "content": {"application/json": {"schema": _schema_ref(kind, components)}},
                    },
                    "responses": {"200": {"description": "vLLM's answer"}, **ERROR_RESPONSES},
                }
            }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
