"""Workflow DAG validation, spans and (de)serialisation (scheduler/workflow.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from wasma.core.tokens import Piece, span_tokens, stream_id
from wasma.scheduler.workflow import (
    MAX_OUTPUT_TOKENS,
    MAX_SEGMENT_TOKENS,
    ContextOf,
    Node,
    OutputOf,
    Shared,
    Unique,
    Workflow,
    WorkflowError,
)
from wasma.scheduler.workflows import WorkflowRegistry


def node(nid: str, parents: list[str], out: int, prompt: list[Any]) -> Node:
    return Node(nid, tuple(parents), out, tuple(prompt))


def example_dict() -> dict[str, Any]:
    """DESIGN.md's example trace line."""
    return {
        "workflow_id": "w17",
        "app": "mapreduce",
        "arrival_s": 3.25,
        "deadline_s": 40.0,
        "nodes": [
            {
                "id": "plan",
                "parents": [],
                "output_tokens": 120,
                "prompt": [{"shared": "sys:planner", "tokens": 900}, {"unique": 150}],
            },
            {
                "id": "map0",
                "parents": ["plan"],
                "output_tokens": 200,
                "prompt": [
                    {"shared": "sys:worker", "tokens": 600},
                    {"shared": "doc:42", "tokens": 3000},
                    {"output": "plan"},
                ],
            },
            {
                "id": "reduce",
                "parents": ["map0"],
                "output_tokens": 300,
                "prompt": [{"context": "map0"}, {"unique": 40}],
            },
        ],
    }


def chain3() -> Workflow:
    return Workflow.from_dict(example_dict())


def create(nodes: list[Node], **kw: Any) -> Workflow:
    args: dict[str, Any] = {
        "workflow_id": "wf",
        "app": "app",
        "arrival_s": 0.0,
        "deadline_s": 10.0,
    }
    args.update(kw)
    return Workflow.create(nodes=nodes, **args)


# -- validation ------------------------------------------------------------------------


def test_valid_example_parses() -> None:
    wf = chain3()
    assert len(wf) == 3
    assert wf.topo_order() == ("plan", "map0", "reduce")
    assert wf.roots() == ["plan"]
    assert wf.children("plan") == ["map0"]
    assert wf.arrival_s == 3.25 and wf.deadline_s == 40.0 and wf.app == "mapreduce"


def test_cycle_is_rejected_with_path() -> None:
    nodes = [
        node("a", ["c"], 5, [Unique(3)]),
        node("b", ["a"], 5, [Unique(3)]),
        node("c", ["b"], 5, [Unique(3)]),
    ]
    with pytest.raises(WorkflowError, match=r"workflow 'wf'.*cycle") as ei:
        create(nodes)
    msg = str(ei.value)
    assert all(f"{n} ->" in msg for n in ("a", "b", "c"))


def test_self_parent_rejected() -> None:
    with pytest.raises(WorkflowError, match=r"node 'a'.*itself"):
        create([node("a", ["a"], 5, [Unique(3)])])


def test_unknown_parent_names_node_and_parent() -> None:
    with pytest.raises(WorkflowError, match=r"workflow 'wf', node 'b'.*unknown parent 'zz'"):
        create([node("a", [], 5, [Unique(3)]), node("b", ["zz"], 5, [Unique(3)])])


@pytest.mark.parametrize("seg", [OutputOf("c"), ContextOf("c")])
def test_reference_to_non_ancestor_rejected(seg: Any) -> None:
    # b and c are siblings: c is not an ancestor of b
    nodes = [
        node("a", [], 5, [Unique(3)]),
        node("b", ["a"], 5, [Unique(2), seg]),
        node("c", ["a"], 5, [Unique(3)]),
    ]
    with pytest.raises(WorkflowError, match=r"node 'b', prompt segment 1.*'c'.*not an ancestor"):
        create(nodes)


def test_reference_to_self_rejected() -> None:
    with pytest.raises(WorkflowError, match=r"node 'a', prompt segment 0.*not an ancestor"):
        create([node("a", [], 5, [OutputOf("a")])])


def test_reference_to_unknown_node_rejected() -> None:
    with pytest.raises(WorkflowError, match=r"node 'a', prompt segment 1.*unknown node 'ghost'"):
        create([node("a", [], 5, [Unique(1), ContextOf("ghost")])])


def test_reference_to_grandparent_allowed() -> None:
    wf = create(
        [
            node("a", [], 5, [Unique(3)]),
            node("b", ["a"], 5, [Unique(3)]),
            node("c", ["b"], 5, [OutputOf("a"), ContextOf("b")]),
        ]
    )
    assert wf.prompt_tokens("c") == 5 + (3 + 5)  # a's output; b's prompt (3) + output (5)


def test_duplicate_node_id_rejected() -> None:
    with pytest.raises(WorkflowError, match=r"workflow 'wf'.*duplicate node id 'a'"):
        create([node("a", [], 5, [Unique(3)]), node("a", [], 5, [Unique(3)])])


def test_empty_workflow_rejected() -> None:
    with pytest.raises(WorkflowError, match=r"workflow 'wf'.*no nodes"):
        create([])


def test_node_without_prompt_rejected() -> None:
    with pytest.raises(WorkflowError, match=r"node 'a'.*no segments"):
        create([node("a", [], 5, [])])


@pytest.mark.parametrize("out", [0, -1, MAX_OUTPUT_TOKENS + 1, 2.5, "7", None])
def test_bad_output_tokens_rejected(out: Any) -> None:
    with pytest.raises(WorkflowError, match=r"node 'a'.*output_tokens"):
        create([node("a", [], out, [Unique(3)])])


@pytest.mark.parametrize("tokens", [-1, MAX_SEGMENT_TOKENS + 1, 1.5, "3", True, None])
def test_bad_segment_sizes_rejected(tokens: Any) -> None:
    with pytest.raises(WorkflowError, match=r"node 'a', prompt segment 0.*tokens"):
        create([node("a", [], 5, [Unique(tokens)])])
    with pytest.raises(WorkflowError, match=r"node 'a', prompt segment 1.*tokens"):
        create([node("a", [], 5, [Unique(1), Shared("k", tokens)])])


def test_bad_shared_key_rejected() -> None:
    with pytest.raises(WorkflowError, match=r"prompt segment 0.*shared key"):
        create([node("a", [], 5, [Shared("", 4)])])


BAD_FIELDS = [
    ("workflow_id", None),
    ("workflow_id", ""),
    ("workflow_id", "x" * 129),
    ("workflow_id", 7),
    ("app", None),
    ("app", "x" * 129),
    ("arrival_s", -1.0),
    ("arrival_s", float("nan")),
    ("arrival_s", float("inf")),
    ("arrival_s", True),
    ("arrival_s", "0"),
    ("deadline_s", 0.0),
    ("deadline_s", -3.0),
    ("deadline_s", float("nan")),
    ("deadline_s", float("inf")),
    ("deadline_s", None),
]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS)
def test_bad_workflow_fields_rejected(field: str, value: Any) -> None:
    with pytest.raises(WorkflowError, match=field):
        create([node("a", [], 5, [Unique(3)])], **{field: value})


def test_bad_node_ids_rejected() -> None:
    for bad in ["", "x" * 129]:
        with pytest.raises(WorkflowError, match="node id"):
            create([node(bad, [], 5, [Unique(3)])])


def test_too_many_nodes_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    import wasma.scheduler.workflow as wmod

    monkeypatch.setattr(wmod, "MAX_NODES", 3)
    with pytest.raises(WorkflowError, match="exceeds the limit"):
        create([node(f"n{i}", [], 5, [Unique(1)]) for i in range(4)])


def test_bool_output_tokens_rejected() -> None:
    with pytest.raises(WorkflowError, match="output_tokens"):
        create([node("a", [], True, [Unique(3)])])


def test_prompt_of_zero_tokens_rejected() -> None:
    with pytest.raises(WorkflowError, match=r"node 'a'.*prompt"):
        create([node("a", [], 5, [Unique(0), Shared("k", 0)])])


# -- from_dict -------------------------------------------------------------------------


def test_from_dict_errors_name_the_place() -> None:
    d = example_dict()
    d["nodes"][1]["prompt"][1] = {"shared": "doc:42"}
    with pytest.raises(WorkflowError, match=r"w17.*map0.*segment 1.*needs 'tokens'"):
        Workflow.from_dict(d)

    d = example_dict()
    d["nodes"][2]["prompt"][0] = {"context": "map0", "unique": 3}
    with pytest.raises(WorkflowError, match=r"reduce.*segment 0.*exactly one"):
        Workflow.from_dict(d)

    d = example_dict()
    d["nodes"][0]["prompt"][1] = {"unique": 3, "extra": 1}
    with pytest.raises(WorkflowError, match=r"plan.*segment 1.*unexpected field"):
        Workflow.from_dict(d)

    d = example_dict()
    d["nodes"][0]["prompt"][0] = "text"
    with pytest.raises(WorkflowError, match=r"plan.*segment 0.*must be an object"):
        Workflow.from_dict(d)

    d = example_dict()
    d["nodes"][1]["parents"] = ["plan", "plan"]
    with pytest.raises(WorkflowError, match=r"map0.*twice"):
        Workflow.from_dict(d)

    d = example_dict()
    d["nodes"][1]["parents"] = "plan"
    with pytest.raises(WorkflowError, match=r"map0.*parents"):
        Workflow.from_dict(d)

    d = example_dict()
    del d["nodes"][1]["id"]
    with pytest.raises(WorkflowError, match=r"node #1.*missing 'id'"):
        Workflow.from_dict(d)

    d = example_dict()
    d["nodes"][2]["prompt"][0] = {"output": 5}
    with pytest.raises(WorkflowError, match=r"reduce.*must name a node"):
        Workflow.from_dict(d)

    d = example_dict()
    d["nodes"][0]["prompt"] = {"unique": 3}
    with pytest.raises(WorkflowError, match=r"plan.*'prompt' must be a list"):
        Workflow.from_dict(d)

    d = example_dict()
    d["nodes"] = {}
    with pytest.raises(WorkflowError, match=r"'nodes' must be a list"):
        Workflow.from_dict(d)

    d = example_dict()
    del d["nodes"]
    with pytest.raises(WorkflowError, match=r"missing field 'nodes'"):
        Workflow.from_dict(d)

    with pytest.raises(WorkflowError, match="JSON object"):
        Workflow.from_dict([1, 2])


def test_from_dict_defaults() -> None:
    d = {"workflow_id": "w", "nodes": [{"id": "a", "output_tokens": 3, "prompt": [{"unique": 2}]}]}
    wf = Workflow.from_dict(d)
    assert wf.nodes["a"].parents == ()
    assert wf.arrival_s == 0.0 and wf.deadline_s > 0


def test_unknown_node_field_rejected() -> None:
    d = example_dict()
    d["nodes"][1]["parent"] = d["nodes"][1].pop("parents")
    with pytest.raises(WorkflowError, match=r"map0.*parent"):
        Workflow.from_dict(d)


def test_unknown_workflow_field_rejected() -> None:
    d = example_dict()
    d["deadline"] = d.pop("deadline_s")
    with pytest.raises(WorkflowError, match="deadline"):
        Workflow.from_dict(d)


def test_round_trip_to_from_dict() -> None:
    d = example_dict()
    wf = Workflow.from_dict(copy.deepcopy(d))
    assert wf.to_dict() == d
    again = Workflow.from_dict(wf.to_dict())
    assert again.to_dict() == d
    for n in wf.nodes:
        assert again.prompt_span(n) == wf.prompt_span(n)


# -- spans -----------------------------------------------------------------------------


def test_prompt_span_segments_in_order() -> None:
    wf = chain3()
    plan = wf.prompt_span("plan")
    assert plan[0] == Piece(stream_id("s", "sys:planner"), 0, 900)
    assert plan[1].length == 150
    assert wf.prompt_tokens("plan") == 1050
    m = wf.prompt_span("map0")
    assert [p.length for p in m] == [600, 3000, 120]
    assert m[2] == wf.output_piece("plan")
    assert m[1] == Piece(stream_id("s", "doc:42"), 0, 3000)


def test_context_span_is_prompt_then_output() -> None:
    wf = chain3()
    for n in wf.nodes:
        ctx = wf.context_span(n)
        assert ctx == (*wf.prompt_span(n), wf.output_piece(n))
        assert span_tokens(ctx) == wf.prompt_tokens(n) + wf.nodes[n].output_tokens
    # reduce's prompt starts with map0's whole context
    r = wf.prompt_span("reduce")
    assert r[: len(wf.context_span("map0"))] == wf.context_span("map0")
    assert wf.prompt_tokens("reduce") == 600 + 3000 + 120 + 200 + 40


def test_shared_streams_equal_across_workflows_unique_differs() -> None:
    a = Workflow.from_dict(example_dict())
    d = example_dict()
    d["workflow_id"] = "w18"
    b = Workflow.from_dict(d)
    assert a.prompt_span("plan")[0] == b.prompt_span("plan")[0]  # shared
    assert a.prompt_span("plan")[1] != b.prompt_span("plan")[1]  # unique
    assert a.output_piece("plan") != b.output_piece("plan")


def test_unique_segments_distinct_within_node() -> None:
    wf = create([node("a", [], 5, [Unique(4), Unique(4)])])
    p = wf.prompt_span("a")
    assert p[0].stream != p[1].stream


def test_zero_length_segments_dropped_from_span() -> None:
    wf = create([node("a", [], 5, [Unique(0), Shared("k", 4), Unique(0)])])
    assert wf.prompt_span("a") == (Piece(stream_id("s", "k"), 0, 4),)


# -- critical paths --------------------------------------------------------------------


def diamond() -> Workflow:
    return create(
        [
            node("a", [], 1, [Unique(1)]),
            node("b", ["a"], 1, [Unique(1)]),
            node("c", ["a"], 1, [Unique(1)]),
            node("d", ["b", "c"], 1, [Unique(1)]),
        ]
    )


def test_critical_path_diamond() -> None:
    wf = diamond()
    cost = {"a": 1.0, "b": 5.0, "c": 2.0, "d": 3.0}
    assert wf.critical_path(cost) == pytest.approx(9.0)
    tail = wf.remaining_critical_path(cost)
    assert tail == pytest.approx({"a": 9.0, "b": 8.0, "c": 5.0, "d": 3.0})


def test_critical_path_of_independent_roots_is_the_max() -> None:
    wf = create([node("x", [], 1, [Unique(1)]), node("y", [], 1, [Unique(1)])])
    assert wf.critical_path({"x": 2.0, "y": 7.0}) == 7.0
    assert wf.roots() == ["x", "y"]


def test_topo_order_respects_edges() -> None:
    wf = create(
        [
            node("d", ["b", "c"], 1, [Unique(1)]),
            node("c", ["a"], 1, [Unique(1)]),
            node("b", ["a"], 1, [Unique(1)]),
            node("a", [], 1, [Unique(1)]),
        ]
    )
    order = wf.topo_order()
    pos = {n: i for i, n in enumerate(order)}
    for n, nd in wf.nodes.items():
        for p in nd.parents:
            assert pos[p] < pos[n]


def test_a_workflow_closes_at_its_last_finish_whatever_the_order() -> None:
    # The registry answers "done?" from the finishing node's children where one is still
    # to finish; the workflow must still close exactly when its last node finishes.
    wf = Workflow.create(
        "w",
        "app",
        0.0,
        10.0,
        [
            Node("a", (), 5, (Unique(8),)),
            Node("b", ("a",), 5, (Unique(8),)),
            Node("c", ("a",), 5, (Unique(8),)),
            Node("d", ("b",), 5, (Unique(8),)),
        ],
    )
    for order in (["a", "b", "d", "c"], ["a", "c", "b", "d"]):
        reg = WorkflowRegistry()
        reg.register(wf, 0.0)
        for i, node in enumerate(order):
            assert "w" in reg.active
            reg.mark_finished("w", node, float(i))
        assert "w" not in reg.active and reg.finished["w"].finished_s == 3.0
