"""Workflows in flight: their DAGs, which nodes ran where, and what is left.

The registry is the router's memory of workflows. Nodes arrive as requests (live) or
from a trace (simulated); either way the registry knows each node's parents, so the
policy can look ahead at children that will reuse a node's context.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from wasma.scheduler.workflow import Workflow


@dataclass
class NodeState:
    engine: int | None = None
    submitted_s: float | None = None
    finished_s: float | None = None
    prompt_blocks: int = 0
    last_prompt_hash: int | None = None  # chain hash of the prompt's last full block
    context_reused: bool = False  # a later node's prompt extended this node's context
    # What the request said of itself, for learning the app's shape: its parents and its
    # latency on an idle engine (the unit of a registered DAG's critical path).
    parents: tuple[str, ...] = ()
    alone_s: float = 0.0
    seq: int = 0  # order of first mention in its workflow


@dataclass
class WorkflowState:
    workflow: Workflow | None  # None for live workflows known only by their requests
    workflow_id: str
    app: str
    arrival_s: float
    deadline_s: float  # absolute
    nodes: dict[str, NodeState] = field(default_factory=dict)
    finished_s: float | None = None
    # Submitted nodes by the chain hash their prompt ends with: which earlier contexts a
    # new prompt extends, in O(its blocks) for a workflow with more nodes than that.
    ends: dict[int, list[str]] = field(default_factory=dict, repr=False)

    def node(self, node_id: str) -> NodeState:
        st = self.nodes.get(node_id)
        if st is None:
            st = self.nodes[node_id] = NodeState(seq=len(self.nodes))
        return st

    def ready_children(self, node_id: str) -> list[str]:
        """Children of `node_id` whose parents have all finished."""
        wf = self.workflow
        if wf is None or node_id not in wf.nodes:
            # A live workflow, or a node an agent added to a registered DAG (requests may
            # name nodes it did not declare): no registered child waits on it.
            return []
        nodes = self.nodes
        return wf.ready_children(
            node_id, lambda p: (st := nodes.get(p)) is not None and st.finished_s is not None
        )

    def parent_error(self, node_id: str, parents: Sequence[str]) -> str | None:
        """Why a request for `node_id` naming `parents` cannot join this workflow, or
        None: the shapes `Workflow.create` rejects in a registered DAG (a node its own
        parent, a parent that is no node, a cycle), here for requests that declare
        their edges one at a time. A parent must be a node of the registered DAG or a
        node already submitted; so a cycle can only close through a node seen before
        (a repeated node id), and only then is the recorded ancestry walked."""
        if not parents:
            return None
        if node_id in parents:
            return f"node {node_id!r} lists itself as a parent"
        wf = self.workflow
        for p in parents:
            if wf is not None and p in wf.nodes:
                continue
            ns = self.nodes.get(p)
            if ns is None or ns.submitted_s is None:
                return f"parent {p!r} of node {node_id!r} has not run in this workflow"
        if node_id not in self.nodes and (wf is None or node_id not in wf.nodes):
            return None
        seen: set[str] = set()
        stack = list(parents)
        while stack:
            n = stack.pop()
            if n == node_id:
                return f"parents {list(parents)} of node {node_id!r} make a dependency cycle"
            if n in seen:
                continue
            seen.add(n)
            if (ns := self.nodes.get(n)) is not None:
                stack.extend(ns.parents)
            if wf is not None and n in wf.nodes:
                stack.extend(wf.nodes[n].parents)
        return None

    def child_unfinished(self, node_id: str) -> bool:
        """Whether a child of `node_id` in the registered DAG has not finished."""
        wf = self.workflow
        if wf is None or node_id not in wf.nodes:
            return False
        nodes = self.nodes
        return any(
            (st := nodes.get(c)) is None or st.finished_s is None for c in wf.child_ids(node_id)
        )

    def mark_submitted(
        self,
        node_id: str,
        engine: int,
        now: float,
        block_hashes: Sequence[int] = (),
        parents: Sequence[str] = (),
        alone_s: float = 0.0,
    ) -> list[str]:
        """Record a node's request; returns the earlier nodes whose context its prompt
        extends (the requests reading their KV). (The router calls it on the state it
        looked up once for the request.)"""
        ns = self.node(node_id)
        ns.engine = engine
        ns.submitted_s = now
        ns.parents = tuple(parents)
        ns.alone_s = alone_s
        if ns.last_prompt_hash is not None:  # submitted again (a failover)
            self.ends[ns.last_prompt_hash].remove(node_id)
        ns.prompt_blocks = len(block_hashes)
        ns.last_prompt_hash = block_hashes[-1] if block_hashes else None
        # Whose context does this prompt extend? Any earlier node of the workflow, not
        # only a named parent: a loop's next round continues a conversation it does not
        # name (an engineer's second round names the review). Chain hashes make each a
        # single compare: node by node, or block by block through `ends` when the
        # workflow has more nodes than the prompt has blocks.
        n = len(block_hashes)
        nodes = self.nodes
        extended: list[str] = []
        if len(nodes) <= n:
            for other, ps in nodes.items():
                k = ps.prompt_blocks
                if (
                    other != node_id
                    and ps.last_prompt_hash is not None
                    and n > k
                    and block_hashes[k - 1] == ps.last_prompt_hash
                ):
                    extended.append(other)
        else:
            ends = self.ends
            for i in range(n - 1):
                for other in ends.get(block_hashes[i], ()):
                    if nodes[other].prompt_blocks == i + 1:
                        extended.append(other)
            extended.sort(key=lambda other: nodes[other].seq)
        for other in extended:
            nodes[other].context_reused = True
        if ns.last_prompt_hash is not None:
            self.ends.setdefault(ns.last_prompt_hash, []).append(node_id)
        return extended

    @property
    def done(self) -> bool:
        wf = self.workflow
        if wf is None:
            return False
        return all(
            (st := self.nodes.get(n)) is not None and st.finished_s is not None for n in wf.nodes
        )


class WorkflowRegistry:
    """Workflows by id; finished ones are kept for `keep_finished` entries (LRU)."""

    def __init__(
        self,
        keep_finished: int = 10_000,
        on_close: Callable[[WorkflowState], None] | None = None,
    ) -> None:
        self.active: dict[str, WorkflowState] = {}
        self.finished: OrderedDict[str, WorkflowState] = OrderedDict()
        self.keep_finished = keep_finished
        self.on_close = on_close

    def __len__(self) -> int:
        return len(self.active)

    def get(self, workflow_id: str) -> WorkflowState | None:
        return self.active.get(workflow_id) or self.finished.get(workflow_id)

    def register(self, wf: Workflow, now: float) -> WorkflowState:
        st = WorkflowState(wf, wf.workflow_id, wf.app, now, now + wf.deadline_s)
        self.active[wf.workflow_id] = st
        return st

    def ensure(
        self, workflow_id: str, app: str, now: float, deadline_s: float = float("inf")
    ) -> WorkflowState:
        st = self.active.get(workflow_id)
        if st is None:
            st = WorkflowState(None, workflow_id, app, now, now + deadline_s)
            self.active[workflow_id] = st
        return st

    def mark_submitted(
        self,
        workflow_id: str,
        node_id: str,
        engine: int,
        now: float,
        block_hashes: Sequence[int] = (),
        parents: Sequence[str] = (),
        alone_s: float = 0.0,
    ) -> list[str]:
        """Record a node's request; returns the earlier nodes whose context its prompt
        extends (the requests reading their KV). `WorkflowState.mark_submitted`, for a
        workflow in flight ([] for any other)."""
        st = self.active.get(workflow_id)
        if st is None:
            return []
        return st.mark_submitted(node_id, engine, now, block_hashes, parents, alone_s)

    def mark_finished(self, workflow_id: str, node_id: str, now: float) -> list[str]:
        """Record a node's end; returns children that became ready."""
        st = self.active.get(workflow_id)
        if st is None:
            return []
        return self.mark_finished_in(workflow_id, st, node_id, now)

    def mark_finished_in(
        self, workflow_id: str, st: WorkflowState, node_id: str, now: float
    ) -> list[str]:
        """`mark_finished` given the workflow's state, `active[workflow_id]`, which the
        caller looked up already."""
        st.node(node_id).finished_s = now
        ready = st.ready_children(node_id)
        # A workflow is done once every node has finished: a child of this node still
        # to finish (the usual case for all but the last nodes) answers that without
        # the walk over every node.
        if not st.child_unfinished(node_id) and st.done:
            self.close(workflow_id, now)
        return ready

    def close(self, workflow_id: str, now: float) -> None:
        st = self.active.pop(workflow_id, None)
        if st is None:
            return
        st.finished_s = now
        self.finished[workflow_id] = st
        if self.on_close is not None:
            self.on_close(st)
        while len(self.finished) > self.keep_finished:
            self.finished.popitem(last=False)
