"""Cluster load bookkeeping and the workflow registry (scheduler/state.py, workflows.py)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from wasma.core.events import EngineStats
from wasma.scheduler.state import Charge, ClusterState
from wasma.scheduler.workflow import Node, OutputOf, Unique, Workflow
from wasma.scheduler.workflows import WorkflowRegistry


def diamond(wid: str = "w") -> Workflow:
    return Workflow.create(
        wid,
        "app",
        1.0,
        10.0,
        [
            Node("a", (), 2, (Unique(3),)),
            Node("b", ("a",), 2, (OutputOf("a"),)),
            Node("c", ("a",), 2, (OutputOf("a"),)),
            Node("d", ("b", "c"), 2, (OutputOf("b"), OutputOf("c"))),
        ],
    )


def test_cluster_state_dispatch_first_token_finish() -> None:
    st = ClusterState(["e0", "e1"], num_kv_blocks=100)
    assert st.engines == ["e0", "e1"] and st.slot("e1") == 1
    st.on_dispatch("r", 1, Charge(blocks=5, prefill_tokens=40, decode_tokens=8))
    st.on_dispatch("s", 1, Charge(blocks=2, prefill_tokens=0, decode_tokens=3))
    load = st.loads[1]
    assert (load.outstanding, load.active_blocks, load.pending_prefill_tokens) == (2, 7, 40)
    st.on_first_token("r")
    st.on_first_token("r")  # idempotent
    assert load.pending_prefill_tokens == 0
    st.on_finish("r")
    assert (load.outstanding, load.active_blocks, load.pending_decode_tokens) == (1, 2, 3)
    st.on_finish("unknown")
    st.on_finish("s")
    assert (load.outstanding, load.active_blocks, load.pending_decode_tokens) == (0, 0, 0)
    assert load.dispatched_total == 2 and st.loads[0].dispatched_total == 0


def test_cluster_state_stats_health_and_new_engines() -> None:
    st = ClusterState(["e0"], num_kv_blocks=10)
    st.on_stats(0, EngineStats(3, 4, 0.5, 99))
    load = st.loads[0]
    assert (load.reported_running, load.reported_waiting, load.reported_kv_usage) == (3, 4, 0.5)
    assert load.num_kv_blocks == 99
    st.set_healthy(0, False)
    assert not st.loads[0].healthy
    assert st.add_engine("e1", 7) == 1
    assert st.add_engine("e1") == 1
    assert st.loads[1].num_kv_blocks == 7 and st.engines == ["e0", "e1"]


def test_healthy_slots_follow_health_and_new_engines() -> None:
    st = ClusterState(["e0", "e1", "e2"])
    assert st.healthy_slots() == [0, 1, 2]
    st.set_healthy(1, False)
    assert st.healthy_slots() == [0, 2]
    st.add_engine("e3")
    assert st.healthy_slots() == [0, 2, 3]
    st.set_healthy(1, True)
    got = st.healthy_slots()
    assert got == [0, 1, 2, 3]
    got.remove(0)  # a caller's copy: the state's own list is untouched
    assert st.healthy_slots() == [0, 1, 2, 3]


def test_registry_ready_children_and_close() -> None:
    reg = WorkflowRegistry()
    wf = diamond()
    st = reg.register(wf, 5.0)
    assert st.deadline_s == 15.0 and reg.get("w") is st and len(reg) == 1
    reg.mark_submitted("w", "a", 1, 5.0)
    assert st.nodes["a"].engine == 1
    assert sorted(reg.mark_finished("w", "a", 6.0)) == ["b", "c"]
    assert reg.mark_finished("w", "b", 7.0) == []  # d still waits for c
    assert reg.mark_finished("w", "c", 8.0) == ["d"]
    assert not st.done
    assert reg.mark_finished("w", "d", 9.0) == []
    assert st.done and st.finished_s == 9.0
    assert len(reg) == 0 and reg.get("w") is st  # kept among the finished


def test_registry_finds_whose_context_a_prompt_extends_named_or_not() -> None:
    """A loop's next round continues an engineer's conversation but names the review as
    its parent: the engineer's context is still the one it extends."""
    reg = WorkflowRegistry()
    st = reg.ensure("w", "team", 0.0)
    eng = [1, 2, 3, 4]  # block hashes of its prompt
    assert reg.mark_submitted("w", "eng0", 0, 0.0, eng) == []
    assert reg.mark_submitted("w", "eng1", 0, 0.0, [1, 2, 9, 8]) == []  # a shared head only
    assert reg.mark_submitted("w", "review", 1, 1.0, [7, 7], parents=("eng0", "eng1")) == []
    again = [*eng, 5, 6]
    assert reg.mark_submitted("w", "eng0.r1", 0, 2.0, again, parents=("review",)) == ["eng0"]
    assert st.nodes["eng0"].context_reused and not st.nodes["review"].context_reused
    # A later round extends every round before it.
    assert reg.mark_submitted("w", "eng0.r2", 0, 3.0, [*again, 8]) == ["eng0", "eng0.r1"]
    assert reg.mark_submitted("x", "n", 0, 0.0, eng) == []  # no such workflow


# Prompts as chain-hash lists over a tiny alphabet, so prompts often extend each other;
# short prompts and many nodes drive the registry onto its by-hash path, long ones and few
# nodes onto its node-by-node one.
_SUBMISSIONS = st.lists(
    st.tuples(st.integers(0, 40), st.lists(st.integers(0, 3), max_size=6)), max_size=60
)


@settings(max_examples=200, deadline=None)
@given(_SUBMISSIONS)
def test_registry_finds_extended_contexts_as_a_scan_of_every_node_would(
    submissions: list[tuple[int, list[int]]],
) -> None:
    reg = WorkflowRegistry()
    reg.ensure("w", "app", 0.0)
    prompts: dict[str, list[int]] = {}  # the last prompt each node was submitted with
    reused: set[str] = set()
    for t, (node, prompt) in enumerate(submissions):
        nid = f"n{node}"
        # Raw values, not chain hashes: the same value at several positions makes a
        # match depend on the position too, which chain hashes would hide.
        hashes = prompt
        want = [
            other
            for other, p in prompts.items()
            if other != nid and p and len(hashes) > len(p) and hashes[len(p) - 1] == p[-1]
        ]
        got = reg.mark_submitted("w", nid, 0, float(t), hashes)
        assert got == want
        reused.update(want)
        prompts[nid] = hashes  # submitted again: its new prompt, its first place in order
    nodes = reg.active["w"].nodes
    assert {n for n, ns in nodes.items() if ns.context_reused} == reused


def test_registry_keeps_a_bounded_number_of_finished() -> None:
    reg = WorkflowRegistry(keep_finished=2)
    for i in range(4):
        reg.register(diamond(f"w{i}"), 0.0)
        reg.close(f"w{i}", 1.0)
    assert reg.get("w0") is None and reg.get("w1") is None
    assert reg.get("w2") is not None and reg.get("w3") is not None


def test_registry_live_workflows() -> None:
    reg = WorkflowRegistry()
    st = reg.ensure("live", "app", 2.0, deadline_s=3.0)
    assert reg.ensure("live", "app", 9.0) is st
    assert st.deadline_s == 5.0 and st.workflow is None
    assert reg.mark_finished("live", "x", 3.0) == [] and not st.done
    assert reg.mark_finished("nope", "x", 3.0) == []


def test_on_load_sets_what_on_stats_sets() -> None:
    a, b = ClusterState(["e0", "e1"]), ClusterState(["e0", "e1"])
    a.on_stats(1, EngineStats(3, 4, 0.25, 900, 10, 5, num_preemptions=2))
    b.on_load(1, 3, 4, 0.25, 900)
    assert a.loads == b.loads
    assert (b.loads[1].reported_running, b.loads[1].reported_waiting) == (3, 4)
    assert (b.loads[1].reported_kv_usage, b.loads[1].num_kv_blocks) == (0.25, 900)
