"""The API through vLLM's front end with simulated engines: vLLM's renderer and
derenderer around token-only engines, vLLM's errors, and a clear 400 where an answer
needs a real model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from wasma.deploy.build import EngineSpec, ServiceConfig
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.serve import ServerThread, local_router_factory

MODEL = "wasma-sim"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "look a word up",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def server(sim_frontend: Any) -> Iterator[ServerThread]:
    cfg = ServiceConfig(
        engines=EngineSpec.parse("sim:2"),
        policy="wasma",
        sim_speed=100.0,
        sim_vocab_size=sim_frontend.vocab_size,
    )
    app = create_app(local_router_factory(cfg), sim_frontend, GatewayConfig(model_names=(MODEL,)))
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def test_chat_is_vllms_answer_and_placed_on_rendered_ids(
    server: ServerThread, client: openai.OpenAI, sim_frontend: Any
) -> None:
    messages = [{"role": "user", "content": "plan the work"}]
    resp = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,  # type: ignore[arg-type]
    )
    out = resp.parse()
    assert resp.headers["x-wasma-engine"].startswith("sim")
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    rendered = httpx.post(
        server.url + "/v1/chat/completions/render",
        json={"model": MODEL, "messages": messages, "max_tokens": 6},
    ).json()
    assert out.usage is not None and out.usage.prompt_tokens == len(rendered["token_ids"])
    assert out.usage.completion_tokens == 6
    tok = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert tok["tokens"] == rendered["token_ids"]


def test_streams_are_vllms_chunks(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    text = [
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="a b", max_tokens=4, stream=True)
        if c.choices
    ]
    assert len(text) >= 1


def test_auto_tools_go_through_vllms_parser(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "look up 'cache'"}],
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=4,
    )
    assert out.choices[0].message.tool_calls in (None, [])


@pytest.mark.parametrize(
    ("path", "body", "why"),
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}},
            "structured output",
        ),
        ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required"}, "structured"),
        ("/v1/responses", {"input": "hi"}, "Responses"),
    ],
)
def test_what_needs_a_model_is_a_clear_400(
    server: ServerThread, path: str, body: dict[str, Any], why: str
) -> None:
    full = {"model": MODEL, "max_tokens": 4, **body}
    if path == "/v1/chat/completions":
        full["messages"] = [{"role": "user", "content": "hi"}]
    else:
        full.pop("max_tokens")
    resp = httpx.post(server.url + path, json=full)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert why in err["message"] and err["code"] == 400


def test_errors_are_vllms(server: ServerThread) -> None:
    resp = httpx.post(
        server.url + "/v1/chat/completions", json={"model": MODEL, "messages": "nope"}
    )
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert err["type"] == "Bad Request" and err["param"].startswith("body.messages")
    resp = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "other", "messages": [{"role": "user", "content": "x"}]},
    )
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFoundError"
    # vLLM answers a body that is not JSON through its validation handler, in the
    # OpenAI shape, on /v1/messages too.
    resp = httpx.post(server.url + "/v1/messages", content=b"{bad")
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "Bad Request"


def test_count_tokens_and_detokenize(server: ServerThread) -> None:
    msgs = {"model": MODEL, "messages": [{"role": "user", "content": "count me"}]}
    n = httpx.post(server.url + "/v1/messages/count_tokens", json=msgs).json()["input_tokens"]
    rendered = httpx.post(server.url + "/v1/messages/render", json={**msgs, "max_tokens": 3})
    assert n == len(rendered.json()["token_ids"])
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "hello"}).json()
    text = httpx.post(
        server.url + "/detokenize", json={"model": MODEL, "tokens": ids["tokens"]}
    ).json()
    assert text["prompt"] == "hello"
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert json.dumps(models)
