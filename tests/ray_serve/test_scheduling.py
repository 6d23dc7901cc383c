"""The shared scheduling state behind `WorkflowRouter`, driven directly (no Ray): the
decisions Serve gets back for workflows, unrelated requests, retries and dead replicas."""

from __future__ import annotations

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
