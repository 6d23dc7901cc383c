"""Workflow identity from every convention agents use (deploy/metadata.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wasma.deploy.metadata import MetadataError, WorkflowIdentity, workflow_identity


def ident(
    headers: dict[str, str] | None = None, body: dict[str, Any] | None = None
) -> WorkflowIdentity:
    return workflow_identity(headers or {}, body or {})


def test_no_metadata_is_a_one_node_workflow() -> None:
    assert ident() == WorkflowIdentity()


def test_wasma_headers() -> None:
    got = ident(
        {
            "x-wasma-workflow-id": "w1",
            "x-wasma-node-id": "map0",
            "x-wasma-parents": "plan, split",
            "x-wasma-app": "mapreduce",
            "x-wasma-deadline-ms": "40000",
        }
    )
    assert got.workflow_id == "w1" and got.node_id == "map0"
    assert got.parents == ("plan", "split")
    assert got.app == "mapreduce" and got.deadline_s == 40.0
    assert got.source == "headers"


def test_body_metadata() -> None:
    got = ident(
        body={
            "metadata": {
                "wasma_workflow_id": "w2",
                "wasma_node_id": "reduce",
                "wasma_parents": "map0,map1",
                "wasma_deadline_ms": "1500",
            }
        }
    )
    assert (got.workflow_id, got.node_id, got.parents, got.deadline_s) == (
        "w2",
        "reduce",
        ("map0", "map1"),
        1.5,
    )
    assert got.source == "metadata"


def test_agentic_context_json_string() -> None:
    ctx = {
        "program_id": "prog-9",
        "task_id": "t3",
        "parent_task_id": "t1",
        "priority": 2,
        "deadline": 30,
        "app": "debate",
    }
    got = ident(body={"vllm_xargs": {"agentic_context": json.dumps(ctx)}})
    assert got.workflow_id == "prog-9" and got.node_id == "t3"
    assert got.parents == ("t1",)
    assert got.priority == 2 and got.deadline_s == 30.0 and got.app == "debate"
    assert got.source == "agentic_context"


def test_agentic_context_session_and_agent() -> None:
    ctx = {"session_id": "s1", "agent_id": "critic", "parent_agent_id": "writer"}
    got = ident(body={"vllm_xargs": {"agentic_context": json.dumps(ctx)}})
    assert (got.workflow_id, got.node_id, got.parents) == ("s1", "critic", ("writer",))


def test_claude_code_headers() -> None:
    got = ident(
        {
            "x-claude-code-session-id": "cc-1",
            "x-claude-code-agent-id": "sub-2",
            "x-claude-code-parent-agent-id": "main",
        }
    )
    assert (got.workflow_id, got.node_id, got.parents) == ("cc-1", "sub-2", ("main",))
    assert got.source == "claude-code"


@pytest.mark.parametrize("header", ["session-id", "thread-id", "x-session-id"])
def test_session_headers_name_the_workflow(header: str) -> None:
    got = ident({header: "sess-7"})
    assert got.workflow_id == "sess-7" and got.node_id is None and got.source == header


def test_wasma_headers_win_and_lower_conventions_fill_gaps() -> None:
    got = ident(
        {"x-wasma-workflow-id": "w", "x-session-id": "other"},
        {
            "metadata": {"wasma_workflow_id": "w", "wasma_node_id": "n", "wasma_app": "a"},
            "vllm_xargs": {"agentic_context": json.dumps({"program_id": "p", "priority": 5})},
        },
    )
    assert got.workflow_id == "w" and got.node_id == "n" and got.app == "a"
    assert got.priority == 5  # a hint from a lower convention is still used
    assert got.source == "headers"


def test_node_of_another_workflow_is_not_borrowed() -> None:
    # The agentic context names a different program: its task id is not this node's.
    got = ident(
        {"x-wasma-workflow-id": "w"},
        {"vllm_xargs": {"agentic_context": json.dumps({"program_id": "p", "task_id": "t"})}},
    )
    assert got.workflow_id == "w" and got.node_id is None


def test_every_convention_at_once_agrees() -> None:
    # What `wasma replay` sends: the same identity in every dialect.
    ctx = {"program_id": "w5", "task_id": "n2", "parent_task_ids": ["n0", "n1"], "deadline": 12}
    got = ident(
        {
            "x-wasma-workflow-id": "w5",
            "x-wasma-node-id": "n2",
            "x-wasma-parents": "n0,n1",
            "x-wasma-deadline-ms": "12000",
            "x-session-id": "w5",
        },
        {"vllm_xargs": {"agentic_context": json.dumps(ctx)}},
    )
    assert (got.workflow_id, got.node_id, got.parents, got.deadline_s) == (
        "w5",
        "n2",
        ("n0", "n1"),
        12.0,
    )


@pytest.mark.parametrize(
    ("headers", "body", "param"),
    [
        ({"x-wasma-workflow-id": "x" * 129}, {}, "x-wasma-workflow-id"),
        ({"x-wasma-workflow-id": "w", "x-wasma-deadline-ms": "soon"}, {}, "x-wasma-deadline-ms"),
        ({"x-wasma-workflow-id": "w", "x-wasma-deadline-ms": "-5"}, {}, "x-wasma-deadline-ms"),
        ({"x-wasma-workflow-id": "w", "x-wasma-deadline-ms": "nan"}, {}, "x-wasma-deadline-ms"),
        ({"x-wasma-node-id": "n"}, {}, "x-wasma-workflow-id"),
        ({}, {"metadata": ["not", "a", "dict"]}, "metadata"),
        ({}, {"vllm_xargs": {"agentic_context": "{not json"}}, "vllm_xargs.agentic_context"),
        ({}, {"vllm_xargs": {"agentic_context": "[1, 2]"}}, "vllm_xargs.agentic_context"),
        (
            {},
            {"vllm_xargs": {"agentic_context": json.dumps({"program_id": "p", "priority": "hi"})}},
            "vllm_xargs.agentic_context.priority",
        ),
        ({"x-session-id": "bad\x00id"}, {}, "x-session-id"),
        # Numbers JSON allows that a float cannot hold, or an int cannot take.
        (
            {},
            {"metadata": {"wasma_workflow_id": "w", "wasma_deadline_ms": 10**400}},
            "metadata.wasma_deadline_ms",
        ),
        (
            {},
            {"vllm_xargs": {"agentic_context": {"program_id": "p", "deadline": 10**400}}},
            "vllm_xargs.agentic_context.deadline",
        ),
        (
            {},
            {"vllm_xargs": {"agentic_context": {"program_id": "p", "priority": 1e400}}},
            "vllm_xargs.agentic_context.priority",
        ),
    ],
)
def test_bad_metadata_is_a_client_error(
    headers: dict[str, str], body: dict[str, Any], param: str
) -> None:
    with pytest.raises(MetadataError) as info:
        ident(headers, body)
    assert info.value.param == param


@settings(max_examples=300, deadline=None)
@given(
    headers=st.dictionaries(
        st.sampled_from(
            [
                "x-wasma-workflow-id",
                "x-wasma-node-id",
                "x-wasma-parents",
                "x-wasma-deadline-ms",
                "x-claude-code-session-id",
                "x-session-id",
            ]
        ),
        st.text(max_size=200),
    ),
    body=st.dictionaries(
        st.sampled_from(["metadata", "vllm_xargs"]),
        st.one_of(
            st.none(),
            st.text(max_size=50),
            st.dictionaries(st.text(max_size=20), st.one_of(st.text(max_size=50), st.integers())),
        ),
    ),
)
def test_any_input_gives_an_identity_or_a_metadata_error(
    headers: dict[str, str], body: dict[str, Any]
) -> None:
    try:
        got = ident(headers, body)
    except MetadataError as exc:
        assert exc.param
        return
    for value in (got.workflow_id, got.node_id, *got.parents):
        assert value is None or 0 < len(value) <= 128
