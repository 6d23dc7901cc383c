"""OpenAI wire format: request structs, response bodies, SSE chunks and the error shape.

Requests decode with msgspec (typed, validated, several times faster than pydantic) and
responses encode from plain dicts with msgspec too: the gateway's per-request cost is
dominated by these two steps, and the throughput target leaves ~0.6 ms per request.
Unknown request fields are accepted and ignored, as OpenAI and vLLM do (clients send
vendor extras).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from wasma.deploy import json_limits

JSON_ENCODER = msgspec.json.Encoder()
DONE_EVENT = b"data: [DONE]\n\n"

# Status -> OpenAI's error `type`.
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ApiError(Exception):
    """An error the gateway answers in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> bytes:
        return error_body(self.status, self.message, self.param, self.code)

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"retry-after": str(max(1, round(self.retry_after_s)))}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> bytes:
    err = {
        "message": message,
        "type": ERROR_TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        ),
        "param": param,
        "code": code,
    }
    return JSON_ENCODER.encode({"error": err})


# -- requests ------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Sampling(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int | None = None
    return_token_ids: bool = False
    metadata: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    # str | list[int] | list[str] | list[list[int]]: msgspec unions allow one array type,
    # so the shape is checked in `prompt_of`.
    prompt: str | list[Any]
    echo: bool = False


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def decode_request(body: bytes, cls: type[msgspec.Struct]) -> Any:
    """Decode and type-check a request body; raises ApiError(400) naming the field."""
    try:
        req = json_limits.decode(body, cls)
    except json_limits.JsonTooDeep as exc:
        raise ApiError(400, f"request body is not acceptable JSON: {exc}") from None
    except msgspec.ValidationError as exc:
        text = str(exc)
        # msgspec says "... - at `$.max_tokens`": surface the path as OpenAI's `param`.
        param = None
        if "`$." in text:
            param = text.split("`$.", 1)[1].split("`", 1)[0]
        raise ApiError(400, f"invalid request: {text}", param=param) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    # The fields typed `Any` take any JSON: bound their nesting as the body's.
    for name in _ANY_FIELDS:
        value = getattr(req, name, None)
        if value is not None and json_limits.depth_exceeds(value, json_limits.MAX_JSON_DEPTH - 1):
            raise ApiError(
                400, f"{name} is nested deeper than {json_limits.MAX_JSON_DEPTH} levels", param=name
            )
    return req


_ANY_FIELDS = ("metadata", "vllm_xargs", "prompt")


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (text or token ids)."""
    p = req.prompt
    if isinstance(p, str):
        return p
    if len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
        if isinstance(p, str):
            return p
    if not p:
        raise ApiError(400, "prompt must not be empty", param="prompt")
    if all(type(t) is int for t in p):
        return p
    raise ApiError(
        400,
        "prompt must be a string or a list of token ids (batches of several prompts are "
        "not supported; send one request each)",
        param="prompt",
    )


def message_text(msg: ChatMessage) -> str:
    if msg.content is None:
        return ""
    if isinstance(msg.content, str):
        return msg.content
    parts = []
    for part in msg.content:
        if part.type != "text" or part.text is None:
            raise ApiError(400, "only text content parts are supported", param="messages")
        parts.append(part.text)
    return "".join(parts)


# -- responses -----------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_body(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_: dict[str, Any],
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> bytes:
    choice: dict[str, Any] = {
        "index": 0,
        "text": text,
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
        choice["prompt_token_ids"] = prompt_token_ids
    return JSON_ENCODER.encode(
        {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage_,
        }
    )


def chat_body(
    rid: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage_: dict[str, Any],
    token_ids: list[int] | None = None,
) -> bytes:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish_reason,
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return JSON_ENCODER.encode(
        {
            "id": f"chatcmpl-{rid}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage_,
        }
    )


class ChunkWriter:
    """SSE events of one streamed response, completion or chat flavoured."""

    def __init__(self, rid: str, model: str, chat: bool, return_token_ids: bool) -> None:
        self.chat = chat
        self.return_token_ids = return_token_ids
        self._head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
        }
        self._role_sent = False

    def _event(self, obj: dict[str, Any]) -> bytes:
        return b"data: " + JSON_ENCODER.encode(obj) + b"\n\n"

    def delta(self, text: str, token_ids: list[int], finish_reason: str | None) -> bytes:
        choice: dict[str, Any]
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if not self._role_sent:
                delta["role"] = "assistant"
                self._role_sent = True
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        return self._event({**self._head, "choices": [choice]})

    def usage(self, usage_: dict[str, Any]) -> bytes:
        return self._event({**self._head, "choices": [], "usage": usage_})

    @staticmethod
    def error(err: ApiError) -> bytes:
        return b"data: " + err.body() + b"\n\n"


def models_body(model: str, created: int, vocab_size: int | None, owned_by: str = "wasma") -> bytes:
    # `vocab_size` is wasma's extension: `wasma replay` draws prompt token ids below it.
    card: dict[str, Any] = {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": owned_by,
        "vocab_size": vocab_size,
    }
    return JSON_ENCODER.encode({"object": "list", "data": [card]})
