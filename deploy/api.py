"""The API `vllm serve` answers, through vLLM's own serving classes (deploy/frontend.py).

What each endpoint needs from the gateway, apart from its I/O: the request parsed by
vLLM's protocol class and rendered by vLLM's renderer (`render`), answers computed in
process (`local_answer`: tokenize, detokenize, count_tokens, the render endpoints,
models), and vLLM's answer built from token ids (`TokenAnswer`, vLLM's derenderer) for
engines that return only tokens. Errors are vLLM's: its `ErrorResponse` shape and
status (Anthropic's shape on `/v1/messages`), its validation messages.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from wasma.deploy import json_limits
from wasma.deploy.frontend import Frontend

# Endpoints that generate: rendered here, placed on the rendered ids, run on an engine.
GENERATE_PATHS: dict[str, str] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
}
# Answered in this process by vLLM's serving classes (no engine needed).
LOCAL_PATHS = frozenset(
    {
        "/tokenize",
        "/detokenize",
        "/v1/messages/count_tokens",
        "/v1/chat/completions/render",
        "/v1/completions/render",
        "/v1/messages/render",
        "/v1/responses/render",
    }
)
# vLLM's pooling endpoints: passed through to an engine that serves them.
POOLING_PATHS = frozenset(
    {
        "/v1/embeddings",
        "/pooling",
        "/classify",
        "/v1/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
    }
)


class ApiAnswer(Exception):
    """A finished answer (an error, in vLLM's shape) that ends the request here."""

    def __init__(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        super().__init__(body[:200].decode(errors="replace"))
        self.status = status
        self.body = body
        self.headers = headers or {}


def error_answer(
    message: str,
    status: int = 400,
    err_type: str | None = None,
    param: str | None = None,
    anthropic: bool = False,
    retry_after_s: float | None = None,
) -> ApiAnswer:
    """An error in vLLM's shape (`{"error": {message, type, param, code}}`), or in
    Anthropic's (`{"type": "error", "error": {type, message}}`) on /v1/messages, as
    vLLM's own handlers answer."""
    kind = err_type or _error_type(status)
    body: dict[str, Any]
    if anthropic:
        body = {"type": "error", "error": {"type": kind, "message": message}}
    else:
        body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    headers = {}
    if retry_after_s is not None:
        headers["retry-after"] = str(max(1, round(retry_after_s)))
    return ApiAnswer(status, _dumps(body), headers)


def _error_type(status: int) -> str:
    if status == 400:
        return "BadRequestError"
    if status == 404:
        return "NotFoundError"
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + (
            "" if status in (429, 503) else "Error"
        )
    except ValueError:
        return "BadRequestError" if status < 500 else "InternalServerError"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def _vllm_error(err: Any, anthropic: bool) -> ApiAnswer:
    """vLLM's `ErrorResponse` as its handlers send it."""
    info = err.error
    if anthropic:
        body = {"type": "error", "error": {"type": info.type, "message": info.message}}
        return ApiAnswer(int(info.code), _dumps(body))
    return ApiAnswer(int(info.code), _dumps(err.model_dump()))


def validation_answer(exc: Any) -> ApiAnswer:
    """A pydantic `ValidationError` of a request body, as vLLM's FastAPI handler words
    it (its locations start with `body`, as FastAPI's do; the OpenAI shape on every
    endpoint, /v1/messages included, as vLLM's handler answers there)."""
    errors = []
    for e in exc.errors():
        e = dict(e)
        e["loc"] = ("body", *e.get("loc", ()))
        e.pop("url", None)
        errors.append(e)
    return _validation_errors(errors)


def _validation_errors(errors: list[dict[str, Any]]) -> ApiAnswer:
    from vllm.entrypoints.serve.exception_handling.handlers.validation import (
        _format_error,
        clean_loc_for_param,
    )
    from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
    from vllm.exceptions import VLLMValidationError

    param = None
    for err in errors:
        ctx_error = (err.get("ctx") or {}).get("error")
        if isinstance(ctx_error, VLLMValidationError):
            param = ctx_error.parameter
            break
    if param is None and errors:
        param = clean_loc_for_param(tuple(errors[0]["loc"]))
    count = len(errors)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "".join(
        f"  {_format_error(err)}\n" for err in errors[:10]
    )
    if count > 10:
        message += f"  ...and {count - 10} more {label}\n"
    return error_answer(sanitize_message(message.rstrip()), 400, "Bad Request", param)


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; a body that is not one is vLLM's validation 400
    (FastAPI's `json_invalid`, worded by vLLM's handler)."""
    try:
        data = json.loads(body)
        # Nesting no request needs: refused before a parser or validator recurses into it
        # (a RecursionError would be a 500).
        json_limits.check_depth(data)
    except (RecursionError, json_limits.JsonTooDeep):
        raise error_answer(
            f"request body nests deeper than {json_limits.MAX_JSON_DEPTH} levels"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        pos = getattr(exc, "pos", 0)
        msg = getattr(exc, "msg", str(exc))
        raise _validation_errors(
            [
                {
                    "type": "json_invalid",
                    "loc": ("body", pos),
                    "msg": "JSON decode error",
                    "input": {},
                    "ctx": {"error": msg},
                }
            ]
        ) from None
    if not isinstance(data, dict):
        raise _validation_errors(
            [
                {
                    "type": "model_attributes_type",
                    "loc": ("body",),
                    "msg": "Input should be a valid dictionary or object to extract fields from",
                    "input": data,
                }
            ]
        )
    return data


def _protocol(kind: str) -> Any:
    if kind == "chat":
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        return ChatCompletionRequest
    if kind == "completion":
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        return CompletionRequest
    if kind == "responses":
        from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

        return ResponsesRequest
    if kind == "count_tokens":
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

        return AnthropicCountTokensRequest
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    return AnthropicMessagesRequest


def parse_request(kind: str, data: dict[str, Any]) -> Any:
    """`data` as vLLM's protocol class for `kind`; its validation errors as vLLM's 400."""
    from pydantic import ValidationError

    try:
        return _protocol(kind).model_validate(data)
    except ValidationError as exc:
        raise validation_answer(exc) from None
    except Exception as exc:  # vLLM's own checks raise VLLMValidationError directly
        if not _is_client_error(exc):
            raise
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        raise _vllm_error(create_error_response(exc), False) from None


@dataclass(slots=True)
class Rendered:
    """One generation request after vLLM's renderer."""

    kind: str
    request: Any  # vLLM's protocol object
    token_ids: list[int]  # the first (or only) prompt's ids: what placement hashes
    max_tokens: int
    stream: bool
    temperature: float
    needs_model: str  # what an engine with no model cannot sample ("" = nothing)
    needs_api: str  # what an answer in token ids cannot carry ("" = nothing)
    prompts: int = 1  # completions may carry several
    generate: list[Any] = field(default_factory=list)  # vLLM GenerateRequests


async def render(frontend: Frontend, kind: str, data: dict[str, Any]) -> Rendered:
    """Parse and render `data` with vLLM's renderer; vLLM's error answer if it fails."""
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    req = parse_request(kind, data)
    anthropic = kind == "messages"
    serving = frontend.render
    result: Any
    try:
        if kind == "chat":
            result = await serving.render_chat_request(req)
        elif kind == "completion":
            result = await serving.render_completion_request(req)
        elif kind == "messages":
            result = await serving.render_messages_request(req)
        elif req.previous_response_id is not None:
            # The stateless renderer refuses it: render the new input alone for placement
            # (the engine that stored the previous response prepends it).
            result = await serving.render_responses_request(
                req.model_copy(update={"previous_response_id": None})
            )
        else:
            result = await serving.render_responses_request(req)
    except Exception as exc:  # vLLM's handlers turn these into its error answers
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        raise _vllm_error(create_error_response(exc), anthropic) from None
    if isinstance(result, ErrorResponse):
        raise _vllm_error(result, anthropic)
    gens = result if isinstance(result, list) else [result]
    try:
        for gen in gens:
            # vLLM's engine checks these on input (input_processor) and answers a 400;
            # here no engine sees ids it would refuse (a failed request on an engine
            # counts against its health).
            frontend.renderer.validate_token_ids(gen.token_ids)
    except Exception as exc:
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        raise _vllm_error(create_error_response(exc), anthropic) from None
    first = gens[0]
    params = first.sampling_params
    return Rendered(
        kind=kind,
        request=req,
        token_ids=list(first.token_ids),
        max_tokens=int(params.max_tokens or 1),
        stream=bool(getattr(req, "stream", False)),
        temperature=float(params.temperature),
        needs_model=_needs_model(gens),
        needs_api=_needs_api(kind, req, gens),
        prompts=len(gens),
        generate=gens,
    )


def _needs_api(kind: str, req: Any, gens: list[Any]) -> str:
    """Why an answer cannot be given from sampled token ids (vLLM's derenderer)."""
    if kind in ("responses", "messages"):
        return f"vLLM has no derenderer for the {kind.capitalize()} API"
    if len(gens) > 1:
        return "a completion of several prompts"
    params = gens[0].sampling_params
    if params.logprobs is not None or params.prompt_logprobs is not None:
        return "logprobs need vLLM's API server"
    if params.n > 1:
        return "n > 1 needs vLLM's API server"
    if getattr(req, "echo", False):
        return "echo needs vLLM's API server"
    return ""


def _needs_model(gens: list[Any]) -> str:
    """Why an engine with no model (the simulator) cannot sample this answer."""
    if gens and gens[0].sampling_params.structured_outputs is not None:
        return "structured output (a grammar) needs a real model"
    return ""


# -- answers computed in process -------------------------------------------------------


async def local_answer(frontend: Frontend, path: str, data: dict[str, Any]) -> bytes:
    """vLLM's answer to a request that needs no engine (`LOCAL_PATHS`); what its
    handlers raise is answered as vLLM's app answers it (`create_error_response`: a
    ValueError from the chat template is a 400)."""
    try:
        return await _local_answer(frontend, path, data)
    except ApiAnswer:
        raise
    except Exception as exc:
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        raise _vllm_error(create_error_response(exc), path.startswith("/v1/messages")) from None


async def _local_answer(frontend: Frontend, path: str, data: dict[str, Any]) -> bytes:
    from pydantic import BaseModel
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    anthropic = path.startswith("/v1/messages")
    result: Any
    if path == "/tokenize":
        from vllm.entrypoints.serve.tokenize.protocol import TokenizeRequest

        req = _validate(TokenizeRequest, data)
        result = await frontend.tokenization.create_tokenize(req, None)
    elif path == "/detokenize":
        from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest

        req = _validate(DetokenizeRequest, data)
        result = await frontend.tokenization.create_detokenize(req, None)
    elif path == "/v1/messages/count_tokens":
        from vllm.entrypoints.anthropic.protocol import (
            AnthropicContextManagement,
            AnthropicCountTokensRequest,
            AnthropicCountTokensResponse,
            AnthropicMessagesRequest,
        )

        creq = _validate(AnthropicCountTokensRequest, data, anthropic=True)
        try:
            mreq = AnthropicMessagesRequest.model_validate(
                {**creq.model_dump(exclude_none=True), "max_tokens": 1}
            )
            rendered = await frontend.render.render_messages_request(mreq)
        except Exception as exc:  # as vLLM's count_tokens route: its error answer
            from vllm.entrypoints.serve.exception_handling.error_response import (
                create_error_response,
            )

            raise _vllm_error(create_error_response(exc), True) from None
        if isinstance(rendered, ErrorResponse):
            raise _vllm_error(rendered, True)
        n = len(rendered.token_ids)
        result = AnthropicCountTokensResponse(
            input_tokens=n,
            context_management=AnthropicContextManagement(original_input_tokens=n),
        )
        return _dumps(result.model_dump(exclude_none=True))
    else:
        kind = path.removesuffix("/render").rsplit("/", 1)[-1]
        kind = {"completions": "chat", "messages": "messages", "responses": "responses"}[kind]
        if path == "/v1/completions/render":
            kind = "completion"
        req = parse_request(kind, data)
        serving = frontend.render
        if kind == "chat":
            result = await serving.render_chat_request(req)
        elif kind == "completion":
            result = await serving.render_completion_request(req)
        elif kind == "messages":
            result = await serving.render_messages_request(req)
        else:
            result = await serving.render_responses_request(req)
    if isinstance(result, ErrorResponse):
        raise _vllm_error(result, anthropic)
    if isinstance(result, list):
        return _dumps([r.model_dump() for r in result])
    assert isinstance(result, BaseModel)
    return _dumps(result.model_dump())


def _validate(cls: Any, data: dict[str, Any], anthropic: bool = False) -> Any:
    from pydantic import TypeAdapter, ValidationError

    try:
        # TypeAdapter: some of vLLM's request types are unions (TokenizeRequest).
        return TypeAdapter(cls).validate_python(data)
    except ValidationError as exc:
        raise validation_answer(exc) from None
    except Exception as exc:
        if not _is_client_error(exc):
            raise
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        raise _vllm_error(create_error_response(exc), anthropic) from None


def _is_client_error(exc: Exception) -> bool:
    from vllm.exceptions import VLLMError

    return isinstance(exc, ValueError | TypeError | VLLMError)


async def models_answer(frontend: Frontend) -> bytes:
    """/v1/models as vLLM's model registry lists them (without an engine: no LoRA
    adapters). The body is vLLM's exactly; wasma's one addition, the tokenizer's
    vocabulary size (`wasma replay` draws token-id prompts below it), rides in the
    `x-wasma-vocab-size` header the route adds."""
    listing = await frontend.models.show_available_models()
    return _dumps(listing.model_dump())


# -- vLLM's answer from token ids (engines that return only tokens) --------------------


class TokenAnswer:
    """vLLM's derenderer over one request's output token ids: the whole answer, or SSE
    chunks one by one (its `stream_state` carried between them)."""

    def __init__(self, frontend: Frontend, rendered: Rendered, request_id: str) -> None:
        self.frontend = frontend
        self.r = rendered
        self.request_id = request_id
        self.state: Any = None
        self.created = int(time.time())
        self.sent_role = False
        self.sent_text = ""  # the stream's last characters sent (a stop string may span)
        # vLLM's detokenizer holds back the last (longest stop string - 1) characters of
        # a stream until more text shows they do not begin a stop string (unless the
        # stop string is to be shown): a stop string spanning chunks is never half sent.
        params = rendered.generate[0].sampling_params if rendered.generate else None
        stops = [] if params is None or not params.stop else params.stop
        if isinstance(stops, str):
            stops = [stops]
        keep = params is not None and params.include_stop_str_in_output
        self.hold = max(map(len, stops)) - 1 if stops and not keep else 0
        self.held = ""  # text derendered but not yet sent

    def _cached(self, usage: Any, cached: int) -> None:
        """The prefix-cache hit in `usage`, as vLLM reports it with
        `--enable-prompt-tokens-details` (wasma's placement reports rely on it; off
        only to answer exactly as a server without the flag)."""
        from vllm.entrypoints.serve.engine.protocol import PromptTokenUsageInfo

        if usage is not None and self.frontend.options.prompt_tokens_details:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached)

    def _text_ids(
        self, token_ids: list[int], finish_reason: str | None, stop_reason: int | str | None
    ) -> list[int]:
        """The ids whose text the answer shows: as vLLM's detokenizer does, the token that
        ended the request (end of sequence, a stop token id) is counted, not printed,
        unless the request asked for `include_stop_str_in_output`."""
        if finish_reason != "stop" or isinstance(stop_reason, str) or not token_ids:
            return token_ids
        params = self.r.generate[0].sampling_params if self.r.generate else None
        if params is not None and params.include_stop_str_in_output:
            return token_ids
        return token_ids[:-1]

    def _cut(self, text: str, stop: str, before: str) -> str:
        """`text` (following `before`, already sent) ended where vLLM's detokenizer
        ends it on the stop string `stop`: before it, or just after it with
        `include_stop_str_in_output`; the engine's derenderer does not cut it."""
        params = self.r.generate[0].sampling_params if self.r.generate else None
        keep = bool(params is not None and params.include_stop_str_in_output)
        tail = before[-(len(stop) - 1) :] if len(stop) > 1 else ""
        found = (tail + text).find(stop)
        if found < 0:
            return text
        end = found + (len(stop) if keep else 0) - len(tail)
        return text[: max(0, end)]

    async def whole(
        self,
        token_ids: list[int],
        finish_reason: str | None,
        cached: int = 0,
        stop_reason: int | str | None = None,
    ) -> bytes:
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            DerenderChatRequest,
            DerenderCompletionRequest,
            GenerateTokensChoice,
            GenerateTokensResponse,
        )
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        r = self.r
        shown = self._text_ids(token_ids, finish_reason, stop_reason)
        gen = GenerateTokensResponse(
            request_id=r.generate[0].request_id,
            choices=[
                GenerateTokensChoice(
                    index=0,
                    # vLLM's derenderer takes no empty choice: one that stopped at its
                    # first token is derendered whole and its text emptied below.
                    token_ids=shown or token_ids,
                    finish_reason=finish_reason or "stop",
                    stop_reason=stop_reason,
                )
            ],
        )
        serving = self.frontend.derender
        out: Any
        if r.kind == "chat":
            out = await serving.derender_chat_response(
                DerenderChatRequest(
                    generate_response=gen,
                    chat_request=r.request,
                    prompt_tokens=len(r.token_ids),
                    prompt_token_ids=r.token_ids,
                    model=r.request.model,
                )
            )
        else:
            out = await serving.derender_completion_response(
                DerenderCompletionRequest(
                    generate_responses=[gen],
                    prompt_tokens=[len(r.token_ids)],
                    prompt_token_ids=[r.token_ids],
                    completion_request=r.request,
                    model=r.request.model,
                )
            )
        if isinstance(out, ErrorResponse):
            raise _vllm_error(out, False)
        if len(shown) != len(token_ids) and out.usage is not None:
            # The stop token is generated (counted) though not shown.
            out.usage.completion_tokens = len(token_ids)
            out.usage.total_tokens = out.usage.prompt_tokens + len(token_ids)
        if token_ids and not shown:
            for choice in out.choices:
                if r.kind == "chat":
                    choice.message.content = ""
                else:
                    choice.text = ""
        elif isinstance(stop_reason, str) and finish_reason == "stop":
            for choice in out.choices:
                if r.kind == "chat" and isinstance(choice.message.content, str):
                    choice.message.content = self._cut(choice.message.content, stop_reason, "")
                elif r.kind != "chat" and isinstance(choice.text, str):
                    choice.text = self._cut(choice.text, stop_reason, "")
        self._cached(out.usage, cached)
        if getattr(r.request, "return_token_ids", False):
            # vLLM 0.32's derenderer leaves out the ids its API server returns for
            # `return_token_ids` (agents and `wasma replay` extend prompts with them).
            for choice in out.choices:
                choice.token_ids = list(token_ids)
                if r.kind == "completion":
                    choice.prompt_token_ids = list(r.token_ids)
            if r.kind == "chat":
                out.prompt_token_ids = list(r.token_ids)
        return _dumps(out.model_dump())

    async def chunk(
        self,
        token_ids: list[int],
        finish_reason: str | None,
        usage: tuple[int, int, int] | None = None,
        stop_reason: int | str | None = None,
    ) -> bytes:
        """One SSE event: `token_ids` (with `finish_reason` on the last), or, with
        `usage` (prompt, completion, cached tokens), the closing usage-only event."""
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            DerenderChatStreamRequest,
            DerenderCompletionStreamRequest,
            GenerateTokensStreamChoice,
            GenerateTokensStreamResponse,
        )
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse, UsageInfo

        r = self.r
        choices = (
            []
            if usage is not None
            else [
                GenerateTokensStreamChoice(
                    index=0,
                    token_ids=self._text_ids(token_ids, finish_reason, stop_reason),
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                )
            ]
        )
        gen = GenerateTokensStreamResponse(
            request_id=r.generate[0].request_id,
            choices=choices,
            usage=None
            if usage is None
            else UsageInfo(
                prompt_tokens=usage[0],
                completion_tokens=usage[1],
                total_tokens=usage[0] + usage[1],
            ),
        )
        serving = self.frontend.derender
        out: Any
        if r.kind == "chat":
            out = await serving.derender_chat_stream_response(
                DerenderChatStreamRequest(
                    stream=True,
                    generate_chunk=gen,
                    stream_state=self.state,
                    chat_request=r.request,
                    prompt_tokens=len(r.token_ids),
                    prompt_token_ids=r.token_ids,
                    model=r.request.model,
                )
            )
        else:
            out = await serving.derender_completion_stream_response(
                DerenderCompletionStreamRequest(
                    stream=True,
                    generate_chunk=gen,
                    stream_state=self.state,
                    prompt_tokens=len(r.token_ids),
                    prompt_token_ids=r.token_ids,
                    completion_request=r.request,
                    model=r.request.model,
                )
            )
        if isinstance(out, ErrorResponse):
            raise _vllm_error(out, False)
        piece, self.state = out
        if usage is not None:
            self._cached(piece.usage, usage[2])
        if r.kind == "completion" and getattr(r.request, "return_token_ids", False):
            # vLLM 0.32's completion stream derenderer leaves out the ids its API server
            # sends for `return_token_ids` (`wasma replay` reads them): put them back.
            for choice in piece.choices:
                choice.token_ids = token_ids
        event = piece.model_dump(exclude_unset=True)
        for choice in event.get("choices", []):
            holder, key = (
                (choice.get("delta", {}), "content") if r.kind == "chat" else (choice, "text")
            )
            text = holder.get(key)
            if not isinstance(text, str):
                if not (self.held and finish_reason is not None):
                    continue
                text = ""  # the last event carries what was held back
            if self.hold:
                text, self.held = self.held + text, ""
                if finish_reason is None:
                    split = max(0, len(text) - self.hold)
                    text, self.held = text[:split], text[split:]
            if isinstance(stop_reason, str) and finish_reason == "stop":
                text = self._cut(text, stop_reason, self.sent_text)
            holder[key] = text
        for choice in event.get("choices", []):
            text = (
                choice.get("delta", {}).get("content") if r.kind == "chat" else choice.get("text")
            )
            if isinstance(text, str):
                self.sent_text = (self.sent_text + text)[-64:]
        events = self._as_api_server(event, usage is not None)
        return b"".join(b"data: " + _dumps(event) + b"\n\n" for event in events)

    def _as_api_server(self, event: dict[str, Any], is_usage: bool) -> list[dict[str, Any]]:
        """A derendered stream event in the envelope vLLM's API server streams (0.32's
        derenderer leaves out `object`, `created`, `logprobs: null` and a chat stream's
        role-only first chunk, and adds `usage: null` / `metrics: null`): chat and
        completion streams then read as `vllm serve`'s, event for event."""
        chat = self.r.kind == "chat"
        head = {
            "id": event.pop("id", None),
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": self.created,
        }
        fingerprint = getattr(self.frontend.derender, "system_fingerprint", None)
        out: list[dict[str, Any]] = []
        if is_usage:
            # The closing usage event: vLLM leaves out every null in it.
            body = _without_nulls(event)
            body.setdefault("choices", [])
            if fingerprint is not None:
                body["system_fingerprint"] = fingerprint
            return [{**head, **body}]
        for key in ("usage", "metrics"):
            if event.get(key) is None:
                event.pop(key, None)
        finished = False
        for choice in event.get("choices", []):
            finished = finished or choice.get("finish_reason") is not None
            if chat:
                if choice.get("finish_reason") is None and choice.get("stop_reason") is None:
                    # vLLM's chat stream names a stop reason on the last chunk only.
                    choice.pop("stop_reason", None)
                delta = choice.get("delta", {})
                if not self.sent_role and "role" in delta:
                    # vLLM's first chunk carries the role alone (and the prompt's ids
                    # when asked for); content follows in its own chunks.
                    role = delta.pop("role")
                    first = {**head, "model": event.get("model")}
                    first["choices"] = [
                        {
                            "index": choice.get("index", 0),
                            "delta": {"role": role, "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                    ids = (
                        list(self.r.token_ids)
                        if getattr(self.r.request, "return_token_ids", False)
                        else None
                    )
                    first["prompt_token_ids"] = ids
                    first["prompt_text"] = None
                    out.append(first)
                    self.sent_role = True
            _put_after(choice, "logprobs", None, "delta" if chat else "text")
            if not chat:
                choice.setdefault("prompt_token_ids", None)
                choice.setdefault("token_ids", None)
        if finished and fingerprint is not None and not self.include_usage:
            event["system_fingerprint"] = fingerprint
        out.append({**head, **event})
        return out

    @property
    def include_usage(self) -> bool:
        opts = getattr(self.r.request, "stream_options", None)
        return bool(opts is not None and opts.include_usage)


DONE_EVENT = b"data: [DONE]\n\n"


def _without_nulls(obj: Any) -> Any:
    """`obj` with every None-valued key dropped, at every depth (pydantic's
    `exclude_none`, as vLLM dumps its closing usage event)."""
    if isinstance(obj, dict):
        return {k: _without_nulls(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [_without_nulls(v) for v in obj]
    return obj


def _put_after(mapping: dict[str, Any], key: str, value: Any, after: str) -> None:
    """Set `key` (if absent) just after `after`, keeping vLLM's key order."""
    if key in mapping:
        return
    items = list(mapping.items())
    mapping.clear()
    for k, v in items:
        mapping[k] = v
        if k == after:
            mapping[key] = value
    mapping.setdefault(key, value)


# -- Responses: the engine that stored a response answers what follows it ---------------


class ResponseStore:
    """Which engine answered each response id (and its workflow place), so a request
    naming `previous_response_id` goes to the one engine whose store holds it, as a
    child of that response in its workflow. Bounded: the oldest ids are forgotten."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self._by_id: dict[str, tuple[str, str, str]] = {}  # id -> engine, workflow, node

    def remember(self, response_id: str, engine: str, workflow_id: str, node_id: str) -> None:
        self._by_id[response_id] = (engine, workflow_id, node_id)
        while len(self._by_id) > self.limit:
            self._by_id.pop(next(iter(self._by_id)))

    def lookup(self, response_id: str) -> tuple[str, str, str] | None:
        return self._by_id.get(response_id)


def response_id_of(body: bytes) -> str | None:
    """The `id` of a Responses answer: the JSON body, or the SSE stream's first event
    (`response.created`, which carries the response object)."""
    text = body.lstrip()
    try:
        if text.startswith(b"{"):
            rid = json.loads(text).get("id")
            return rid if isinstance(rid, str) else None
        for line in text.split(b"\n"):
            if line.startswith(b"data:"):
                event = json.loads(line[5:])
                resp = event.get("response") if isinstance(event, dict) else None
                if isinstance(resp, dict) and isinstance(resp.get("id"), str):
                    return str(resp["id"])
    except (ValueError, AttributeError):
        return None
    return None
