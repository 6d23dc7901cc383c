"""Remote vLLM servers driven through vLLM's token-in/token-out generation
(`/inference/v1/generate`, on the session's `vllm serve --enable-scale-out`): wasma
sends the request vLLM's renderer built and derenders the token ids it gets back.

What is compared with the server's own answer is what the engine generates (token ids,
text, finish reason, usage); the stream chunks' envelope is vLLM 0.32's derenderer's,
which is not yet the API server's byte for byte (docs/api.md), so the byte-exact
comparison stays with the pass-through (tests/deploy/test_conformance.py)."""

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
from wasma.engines.base import Deferred, EngineCall, GenerateRequest
from wasma.engines.openai_engine import OpenAIEngine

pytestmark = pytest.mark.vllm

MODEL = "tiny"
PROMPT = [{"role": "user", "content": "The planner reads the document."}]


def _options(model: str) -> Any:
    from wasma.deploy.frontend import FrontendOptions

    return FrontendOptions(
        model=model,
        served_model_name=(MODEL,),
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        max_model_len=2048,
        prompt_tokens_details=False,  # as the server (no --enable-prompt-tokens-details)
    )


def _frontend(model: str) -> Any:
    from wasma.deploy.frontend import Frontend

    return asyncio.run(Frontend.build(_options(model)))


@pytest.fixture(scope="module")
def tokens_url(vllm_api_server: tuple[str, str]) -> Iterator[str]:
    url, model = vllm_api_server
    cfg = ServiceConfig(
        engines=EngineSpec.parse(f"openai:{url}"),
        policy="wasma",
        model=model,
        engine_options={"tokens_api": True},
    )
    app = create_app(local_router_factory(cfg), _frontend(model), GatewayConfig((MODEL,)))
    with ServerThread(app) as srv:
        yield srv.url


def _stream_text(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, str]:
    text, reason = "", ""
    with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice["delta"].get("content") or ""
                reason = choice.get("finish_reason") or reason
    return text, reason


def test_the_engine_finds_the_servers_token_generation_and_generates_its_tokens(
    vllm_api_server: tuple[str, str],
) -> None:
    """Asked at start (`tokens_api=None`), the engine finds the endpoint; the token ids
    it streams for a rendered request are those the server's own chat answer carries."""
    from wasma.deploy.api import render
    from wasma.deploy.frontend import Frontend

    url, model = vllm_api_server
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": 8, "temperature": 0}

    async def run() -> tuple[list[int], list[int], bool | None]:
        fe = await Frontend.build(_options(model))
        rendered = await render(fe, "chat", dict(body))
        engine = OpenAIEngine("e0", url, tokens_api=None)
        await engine.start()
        try:
            call = EngineCall(
                "/v1/chat/completions", b"{}", False, generate=Deferred(rendered.generate[0])
            )
            req = GenerateRequest("tok-1", rendered.token_ids, 8, call=call)
            ids: list[int] = []
            async for chunk in engine.generate(req):
                ids.extend(chunk.token_ids)
                assert not chunk.raw  # token ids, not the server's bytes
            async with httpx.AsyncClient(timeout=120) as client:
                direct = await client.post(
                    url + "/v1/chat/completions", json={**body, "return_token_ids": True}
                )
            return ids, direct.json()["choices"][0]["token_ids"], engine.tokens_api
        finally:
            await engine.close()

    ids, direct_ids, found = asyncio.run(run())
    assert found is True
    assert ids == direct_ids and len(ids) == 8


def test_answers_in_token_ids_carry_what_the_server_generates(
    vllm_api_server: tuple[str, str], tokens_url: str
) -> None:
    url, _ = vllm_api_server
    chat = {"model": MODEL, "messages": PROMPT, "max_tokens": 12, "temperature": 0}
    comp = {"model": MODEL, "prompt": "The planner reads", "max_tokens": 12, "temperature": 0}
    with httpx.Client(timeout=120) as client:
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
            direct = client.post(url + path, json=body).json()
            through = client.post(tokens_url + path, json=body).json()
            d, t = direct["choices"][0], through["choices"][0]
            if path == "/v1/chat/completions":
                assert t["message"]["content"] == d["message"]["content"]
            else:
                assert t["text"] == d["text"]
            assert t["finish_reason"] == d["finish_reason"]
            for key in ("prompt_tokens", "completion_tokens"):
                assert through["usage"][key] == direct["usage"][key]
        # A stream carries the same text.
        assert _stream_text(client, tokens_url, {**chat, "stream": True}) == _stream_text(
            client, url, {**chat, "stream": True}
        )
        # A grammar is the engine's to apply: the rendered parameters carry it.
        choice = {**chat, "structured_outputs": {"choice": ["alpha", "beta"]}}
        got = client.post(tokens_url + "/v1/chat/completions", json=choice).json()
        assert got["choices"][0]["message"]["content"] in ("alpha", "beta")


def test_the_servers_refusal_inside_a_token_stream_is_the_clients_400(tokens_url: str) -> None:
    """vLLM refuses a stop token id outside the vocabulary inside the generate stream:
    a 400 for the request, and the engine stays up for the next one."""
    body = {
        "model": MODEL,
        "messages": PROMPT,
        "max_tokens": 4,
        "temperature": 0,
        "stop_token_ids": [-1],
    }
    with httpx.Client(timeout=120) as client:
        bad = client.post(tokens_url + "/v1/chat/completions", json=body)
        assert bad.status_code == 400, bad.text
        assert "stop_token_ids" in bad.json()["error"]["message"]
        body.pop("stop_token_ids")
        assert client.post(tokens_url + "/v1/chat/completions", json=body).status_code == 200
