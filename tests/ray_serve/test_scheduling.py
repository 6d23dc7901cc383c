"""The shared scheduling state behind `WorkflowRouter`, driven directly (no Ray): the
decisions Serve gets back for workflows, unrelated requests, retries and dead replicas."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from wasma.deploy.metadata import MetadataError
from wasma.ray_serve.router import request_parts
from wasma.ray_serve.scheduling import SchedulingState

REPLICAS = ["r0", "r1"]


def body(text: str, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8, **extra}


def doc(seed: str, words: int = 200) -> str:
    return " ".join(f"{seed}{i}" for i in range(words))


def wf(wid: str, node: str, parents: str = "") -> dict[str, str]:
    h = {"x-wasma-workflow-id": wid, "x-wasma-node-id": node}
    if parents:
        h["x-wasma-parents"] = parents
    return h


def test_children_follow_their_parent() -> None:
    st = SchedulingState()
    for w in range(6):
        base = doc(f"w{w}-")
        parent = st.place(REPLICAS, f"p{w}", f"ip{w}", wf(f"w{w}", "plan"), body(base))
        st.completed(f"ip{w}")
        for k in range(3):
            child = st.place(
                REPLICAS,
                f"c{w}.{k}",
                f"ic{w}.{k}",
                wf(f"w{w}", f"map{k}", "plan"),
                body(base + doc(f"k{k}-", 20)),
            )
            assert child == parent
            assert st.placement_of(f"c{w}.{k}") == (parent, "reuse")


def test_decide_answers_what_placement_of_reads() -> None:
    """The router's one call: the replica and the placement kind the ingress's headers
    name, the same on Serve's retry of the request."""
    st = SchedulingState()
    base = doc("d-")
    first = st.decide(REPLICAS, "p", "ip", wf("w", "plan"), body(base))
    assert first is not None and first == st.placement_of("p")
    assert first[1] == "recompute"
    st.completed("ip")
    child = st.decide(REPLICAS, "c", "ic", wf("w", "map", "plan"), body(base + " more"))
    assert child == (first[0], "reuse") == st.placement_of("c")
    assert st.decide(REPLICAS, "c", "ic", wf("w", "map", "plan"), body(base)) == child
    assert st.decide(REPLICAS, "e", "ie", {}, {"input": "embed me"}) is None


def test_forget_starts_over_cold() -> None:
    st = SchedulingState()
    base = doc("f-")
    st.place(REPLICAS, "p", "ip", wf("w", "plan"), body(base))
    assert st.placement_of("p") is not None
    assert sum(st.loads().values()) == 1
    st.forget()
    assert st.placement_of("p") is None
    assert st.loads() == {}
    # The prompt's blocks are no longer thought cached anywhere: a recompute, not a reuse.
    st.place(REPLICAS, "p2", "ip2", wf("w2", "plan"), body(base))
    placed = st.placement_of("p2")
    assert placed is not None and placed[1] == "recompute"
    assert sum(st.loads().values()) == 1


def test_unrelated_workflows_use_both_replicas() -> None:
    st = SchedulingState()
    chosen = {
        st.place(REPLICAS, f"r{i}", f"i{i}", wf(f"w{i}", "a"), body(doc(f"u{i}-")))
        for i in range(8)
    }
    assert chosen == set(REPLICAS)


def test_a_repeated_ask_is_charged_once() -> None:
    st = SchedulingState()
    first = st.place(REPLICAS, "r", "i", {}, body(doc("x")))
    again = st.place(REPLICAS, "r", "i", {}, body(doc("x")))
    assert first == again
    assert sum(st.loads().values()) == 1
    st.completed("i")
    assert sum(st.loads().values()) == 0


def test_a_dead_replica_is_left_out() -> None:
    st = SchedulingState()
    base = doc("d")
    first = st.place(REPLICAS, "p", "ip", wf("w", "plan"), body(base))
    assert first is not None
    st.replica_died(first)
    alive = [r for r in REPLICAS if r != first]
    child = st.place(alive, "c", "ic", wf("w", "c", "plan"), body(base + " more"))
    assert child == alive[0]


def test_a_retry_after_its_replica_went_away_moves() -> None:
    st = SchedulingState()
    first = st.place(REPLICAS, "r", "i", {}, body(doc("y")))
    alive = [r for r in REPLICAS if r != first]
    assert st.place(alive, "r", "i", {}, body(doc("y"))) == alive[0]
    assert st.loads()[first] == 0
    assert st.loads()[alive[0]] == 1


def test_bad_metadata_is_an_error_naming_the_field() -> None:
    st = SchedulingState()
    with pytest.raises(MetadataError, match="workflow id"):
        st.place(REPLICAS, "r", "i", {"x-wasma-node-id": "n"}, body("hi"))


def test_agentic_context_names_the_workflow() -> None:
    st = SchedulingState()
    ctx = '{"program_id": "prog", "task_id": "t1"}'
    base = doc("a")
    first = st.place(REPLICAS, "a", "ia", {}, body(base, vllm_xargs={"agentic_context": ctx}))
    ctx2 = '{"program_id": "prog", "task_id": "t2", "parent_task_id": "t1"}'
    st.completed("ia")
    second = st.place(
        REPLICAS, "b", "ib", {}, body(base + " go", vllm_xargs={"agentic_context": ctx2})
    )
    assert second == first
    assert st.ctx.workflows.get("prog") is not None


def test_no_prompt_leaves_the_choice_to_serve() -> None:
    st = SchedulingState()
    assert st.place(REPLICAS, "r", "i", {}, {"input": "embed me"}) is None


def test_prompts_are_rendered_by_vllm() -> None:
    """The state hashes the ids vLLM's renderer gives the engine: the chat template's,
    tools included, and a completion's token-id prompt as it is."""
    st = SchedulingState(frontend={"tool_call_parser": "hermes", "enable_auto_tool_choice": True})
    chat = body("hi there")
    plain = st._render(chat)
    assert plain is not None and plain.max_tokens == 8
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    with_tools = st._render({**chat, "tools": [tool], "tool_choice": "auto"})
    assert with_tools is not None and with_tools.token_ids != plain.token_ids
    text = st.frontend.tokenizer.decode(with_tools.token_ids)
    assert "lookup" in text and "hi there" in text
    ids = st._render({"prompt": [5, 6, 7], "max_tokens": 2})
    assert ids is not None and ids.token_ids == [5, 6, 7]
    # A body vLLM refuses is left to the replica (which answers with vLLM's error).
    assert st._render({"messages": "not a list"}) is None


def test_request_parts_reads_the_ingress_call() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    request = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 5,
            "tools": [tool],
            "metadata": {"wasma_workflow_id": "w"},
        }
    )
    raw = SimpleNamespace(headers={"X-Wasma-Node-Id": "n", "x-request-id": "rq"})
    pending = SimpleNamespace(args=[request, raw], kwargs={})
    parts = request_parts(pending)  # type: ignore[arg-type]
    assert parts is not None
    headers, fields = parts
    assert headers["x-wasma-node-id"] == "n"
    assert fields["metadata"] == {"wasma_workflow_id": "w"}
    assert fields["max_tokens"] == 5
    assert fields["tools"][0]["function"]["name"] == "f"  # what the renderer needs
    assert "temperature" not in fields  # only what the client set
    assert request_parts(SimpleNamespace(args=[], kwargs={})) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engines", "sim:2"], "vllm:N"),
        (["--engines", "vllm:2"], "--model DIR"),
        (["--engines", "vllm:2", "--model", ".", "--policy", "nope"], "unknown policy"),
        (["--engines", "vllm:2", "--model", ".", "--api-key-file", "k"], "API keys"),
        (["--engines", "vllm:2", "--model", ".", "--config", "c.yaml"], "no --config"),
    ],
)
def test_cli_ray_serve_mistakes_are_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from wasma.deploy.cli import main

    assert main(["serve", "--ray-serve", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_build_openai_app_from_a_serve_config_installs_the_router() -> None:
    """The `args` KubeRay's serveConfigV2 passes (helm/wasma/examples/rayservice.yaml)."""
    pytest.importorskip("ray.serve.llm")
    from wasma.ray_serve import WorkflowRouter, build_openai_app

    llm = {
        "model_loading_config": {"model_id": "m", "model_source": "/models/m"},
        "deployment_config": {"num_replicas": 2},
        "engine_kwargs": {"block_size": 16},
    }
    app = build_openai_app({"llm_configs": [llm], "wasma": {"policy": "ray_prefix_affinity"}})
    ingress = app._bound_deployment
    assert ingress.name == "WasmaIngress"
    (server,) = ingress.init_kwargs["llm_deployments"].values()
    # The replicas are WasmaLLMServer: Ray's LLMServer plus Responses and Messages.
    assert server._bound_deployment.name == "WasmaLLMServer:m"
    assert server._bound_deployment.func_or_class.__name__ == "WasmaLLMServer"
    router = server._bound_deployment._deployment_config.request_router_config
    assert router.request_router_class.endswith("WorkflowRouter")
    assert WorkflowRouter.__name__ == "WorkflowRouter"
    kwargs = router.request_router_kwargs
    assert kwargs["policy"] == "ray_prefix_affinity"
    assert kwargs["block_size"] == 16
    assert kwargs["model"] == "/models/m"
    assert ingress.init_kwargs["wasma_state_names"] == {"m": "WasmaScheduling::m"}
    with pytest.raises(ValueError, match="unknown policy"):
        build_openai_app({"llm_configs": [llm], "wasma": {"policy": "nope"}})
    with pytest.raises(ValueError, match="only policy"):
        build_openai_app({"llm_configs": [llm], "wasma": {"polcy": "wasma"}})
    other = {**llm, "server_cls": "ray.serve.llm.deployment.LLMServer"}
    assert build_openai_app({"llm_configs": [other]}) is not None  # Ray's own: replaced
    sglang = {**llm, "server_cls": "collections.OrderedDict"}
    with pytest.raises(ValueError, match="WasmaLLMServer"):
        build_openai_app({"llm_configs": [sglang]})


def test_responses_and_messages_render_as_vllm_renders_them() -> None:
    """Responses (`instructions` + `input`) and Messages (`system` + `messages`) give
    the ids of the chat vLLM renders them to, so their prefixes match chat's blocks."""
    st = SchedulingState()
    text = doc("r", 60)
    chat = st._render(
        {
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": text},
            ],
            "max_tokens": 5,
        },
        "chat",
    )
    resp = st._render(
        {"instructions": "be brief", "input": text, "max_output_tokens": 5}, "responses"
    )
    msgs = st._render(
        {"system": "be brief", "messages": [{"role": "user", "content": text}], "max_tokens": 5},
        "messages",
    )
    assert chat is not None and resp is not None and msgs is not None
    assert resp.token_ids == chat.token_ids == msgs.token_ids
    assert resp.max_tokens == msgs.max_tokens == 5
    assert resp.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": text},
    ]
    # A Messages body is not placed as chat, nor a Responses body as an embedding.
    assert st._render({"input": text}, None) is None
    assert st._render({"messages": "nope", "max_tokens": 5}, "messages") is None


def _vllm_response(request_id: str, text: str) -> dict[str, Any]:
    """A completed response as vLLM's `OpenAIServingResponses` returns it."""
    from openai.types.responses import ResponseOutputMessage, ResponseOutputText
    from vllm import SamplingParams
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse

    request = ResponsesRequest.model_validate({"input": "x", "request_id": request_id})
    message = ResponseOutputMessage(
        id="msg_1",
        type="message",
        role="assistant",
        status="completed",
        content=[ResponseOutputText(type="output_text", text=text, annotations=[])],
    )
    response = ResponsesResponse.from_request(
        request, SamplingParams(max_tokens=8), "tiny", 0, [message], "completed"
    )
    return response.model_dump(mode="json", by_alias=True)


def test_a_previous_response_id_is_its_parent_and_pins_its_replica() -> None:
    """vLLM keeps a response in the store of the replica that answered it: the follow-up
    goes there whatever the policy prefers, as the response's child in its workflow, and
    is rendered after the stored conversation (its blocks are the first prompt's)."""
    st = SchedulingState(policy="least_loaded")
    first_body = {"instructions": "be brief", "input": doc("conv", 80), "max_output_tokens": 8}
    first = st.place(REPLICAS, "q1", "i1", {}, first_body, "responses")
    assert first is not None
    st.responded("q1", _vllm_response("resp_1", "the answer"))
    st.completed("i1")
    other = next(r for r in REPLICAS if r != first)
    # Load the first replica: least_loaded alone would now pick the other.
    for i in range(3):
        assert st.place([first], f"busy{i}", f"ib{i}", {}, body(doc(f"b{i}")), "chat") == first
    follow = {"previous_response_id": "resp_1", "input": "and then?", "max_output_tokens": 4}
    assert st.place(REPLICAS, "q2", "i2", {}, follow, "responses") == first
    d = st._decisions["q2"]
    assert (d.workflow_id, d.node_id) == ("resp-q1", "q2")
    assert st.holder_of("resp_1") == first  # retrieve and cancel go there too
    assert st.holder_of("resp_unknown") is None
    assert st.ctx.workflows.get("resp-q1") is not None
    # Rendered as vLLM renders it from its store: the first prompt's messages, its
    # output, the new input; the first's instructions do not carry over (vLLM's
    # `construct_input_messages`, as OpenAI's API defines it).
    previous = st._responses["resp_1"]
    whole = st._render(follow, "responses", previous)
    alone = st._render(follow, "responses")
    assert whole is not None and alone is not None
    text = st.frontend.tokenizer.decode(whole.token_ids)
    assert text.index(first_body["input"]) < text.index("the answer") < text.index("and then?")
    assert "be brief" not in text
    assert len(alone.token_ids) < len(whole.token_ids)
    # An id no replica answered is placed as any request (the replica answers vLLM's 404).
    unknown = {"previous_response_id": "resp_x", "input": "hi", "max_output_tokens": 2}
    assert st.place(REPLICAS, "q3", "i3", {}, unknown, "responses") == other


def test_a_follow_up_keeps_its_pin_over_the_prefix_index() -> None:
    """With wasma's policy the follow-up finds the first prompt's blocks on that replica:
    placed there as a reuse."""
    st = SchedulingState()
    first_body = {"input": doc("keep", 120), "max_output_tokens": 8}
    first = st.place(REPLICAS, "a1", "ia1", {}, first_body, "responses")
    st.responded("a1", _vllm_response("resp_a", "fine"))
    st.completed("ia1")
    follow = {"previous_response_id": "resp_a", "input": "more", "max_output_tokens": 4}
    assert st.place(REPLICAS, "a2", "ia2", {}, follow, "responses") == first
    assert st.placement_of("a2") == (first, "reuse")
    opening = st._render(first_body, "responses")
    whole = st._render(follow, "responses", st._responses["resp_a"])
    assert opening is not None and whole is not None
    assert whole.token_ids[: len(opening.token_ids)] == opening.token_ids


def test_request_parts_by_call_kind() -> None:
    from wasma.ray_serve.router import CALL_KINDS

    raw = SimpleNamespace(headers={})
    responses = SimpleNamespace(args=[{"input": "hi", "model": "m"}, raw], kwargs={})
    assert request_parts(responses, "responses") is not None  # type: ignore[arg-type]
    assert request_parts(responses, "chat") is None  # type: ignore[arg-type]
    messages = SimpleNamespace(args=[{"messages": [{"role": "user"}]}, raw], kwargs={})
    assert request_parts(messages, "messages") is not None  # type: ignore[arg-type]
    # count_tokens carries messages but generates nothing: Serve's pick, never placed.
    assert "count_tokens" not in CALL_KINDS
    assert CALL_KINDS["anthropic_messages"] == "messages"


def _publish_until_heard(st: SchedulingState, replica: str, publisher: Any, kv: Any) -> None:
    """Send a harmless batch (a clear, on a replica that holds nothing) until the state
    has heard one: ZMQ's PUB drops what it sends before the SUB's subscription reaches
    it (a replica's engine starts long before it publishes; a test publishes at once)."""
    for _ in range(500):
        publisher.publish(kv.KVEventBatch(ts=0.0, events=[kv.AllBlocksCleared()]))
        time.sleep(0.01)
        if st.kv_index()[replica].get("events", 0):
            return
    raise AssertionError(f"{replica}: no KV event arrived")


def _until(pred: Any) -> None:
    for _ in range(500):
        if pred():
            return
        time.sleep(0.01)
    raise AssertionError("condition not met")


def test_a_replicas_vllm_kv_events_feed_the_index() -> None:
    """A replica that asked for a KV event endpoint is indexed by what its vLLM publisher
    sends there (vLLM's own publisher and event classes): what it stores, under the
    state's chain hash of the rendered prompt, then what it evicts; the placement adds
    nothing for it. A replica that publishes nothing still gets the placement's hint,
    and a dead replica's subscription goes."""
    kv = pytest.importorskip("vllm.distributed.kv_events")
    st = SchedulingState()
    bs = st.block_size
    endpoint = st.kv_events_endpoint("r0")
    assert endpoint.startswith("tcp://") and "*" not in endpoint  # vLLM connects to it
    publisher = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint)
    try:
        _publish_until_heard(st, "r0", publisher, kv)
        base = body(doc("kv-"))
        prompt = st._render(base)
        assert prompt is not None
        n = len(prompt.token_ids) // bs
        assert n >= 3
        # Placed on r0 (its only candidate): r0 publishes, so the index waits for it.
        assert st.place(["r0"], "p", "ip", wf("w", "plan"), base) == "r0"
        assert st.cached_blocks(base) == {"r0": 0}
        # vLLM's own hashes (any: the state re-keys by the tokens), one block's parent
        # in an earlier event, as a prefill over two steps publishes them.
        stored = [
            kv.BlockStored(
                block_hashes=hashes,
                parent_block_hash=parent,
                token_ids=prompt.token_ids[first * bs : (first + len(hashes)) * bs],
                block_size=bs,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
            for first, hashes, parent in (
                (0, [1001, 1002], None),
                (2, list(range(1003, 1001 + n)), 1002),
            )
        ]
        publisher.publish(kv.KVEventBatch(ts=1.0, events=stored))
        _until(lambda: st.cached_blocks(base).get("r0") == n)
        assert st.kv_index()["r0"]["blocks"] == n
        assert st.kv_index()["r0"]["stored"] == n
        st.completed("ip")
        # r1 joins (no KV events of its own): the child still goes where its blocks are.
        child = body(doc("kv-") + " and more")
        assert st.place(REPLICAS, "c", "ic", wf("w", "c", "plan"), child) == "r0"
        assert st.placement_of("c") == ("r0", "reuse")
        st.completed("ic")
        # vLLM evicts the last block: the prefix the index holds ends one block earlier.
        last = 1000 + n
        publisher.publish(
            kv.KVEventBatch(ts=2.0, events=[kv.BlockRemoved(block_hashes=[last], medium="GPU")])
        )
        _until(lambda: st.cached_blocks(base).get("r0") == n - 1)
        assert st.kv_index()["r0"]["removed"] == 1
        # An unrelated prompt on r1, which publishes nothing: the placement is its feed.
        other = body(doc("r1-only-"))
        assert st.place(["r1"], "o", "io", wf("w2", "a"), other) == "r1"
        assert st.cached_blocks(other)["r1"] > 0
        assert "events" not in st.kv_index()["r1"]
        # r0 dies: out of the index, its subscription closed.
        st.replica_died("r0")
        assert st.kv_index()["r0"] == {"blocks": 0}
    finally:
        publisher.shutdown()


def test_a_replica_finds_its_routers_kwargs_in_its_deployment_config() -> None:
    """`WasmaLLMServer` reads the state's settings from `request_router_config`, as Serve
    gives it to a replica: the config object or, from a config file, its fields; any
    other router means no KV subscription."""
    from ray.serve.config import RequestRouterConfig

    from wasma.ray_serve.router import WorkflowRouter, workflow_router_kwargs

    kwargs = {"policy": "wasma", "state_name": "WasmaScheduling::tiny"}
    config = RequestRouterConfig(request_router_class=WorkflowRouter, request_router_kwargs=kwargs)
    assert workflow_router_kwargs({"request_router_config": config}) == kwargs
    fields = {
        "request_router_class": "wasma.ray_serve.router.WorkflowRouter",
        "request_router_kwargs": kwargs,
    }
    assert workflow_router_kwargs({"request_router_config": fields}) == kwargs
    other = {"request_router_class": "ray.serve.llm.request_router.PrefixCacheAffinityRouter"}
    assert workflow_router_kwargs({"request_router_config": other}) is None
    assert workflow_router_kwargs({}) is None
