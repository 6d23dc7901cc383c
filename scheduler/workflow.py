"""Workflow DAGs: nodes with prompt segments, output lengths and parents.

A workflow is what one run of a multi-agent application asks of the LLM: a DAG whose
nodes are requests and whose edges say "starts after". Prompts are built from segments
(shared text, unique text, an ancestor's output or whole context) so the scheduler can
tell which requests will share which KV cache before any of them runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard, cast

import networkx as nx

from wasma.core.tokens import Piece, Span, stream_id

# Bounds that catch generator bugs and hostile input, far above any real model.
MAX_SEGMENT_TOKENS = 2_000_000
MAX_OUTPUT_TOKENS = 1_000_000
MAX_NODES = 10_000
MAX_ID_LEN = 128
# A node's whole prompt, its segments and the contexts they repeat summed: what bounds
# the work of a `{"context": parent}` chain, whose prompts double at each level when a
# node repeats its parent's context twice (26 levels of 2.7 KB would be 2^26 pieces).
MAX_PROMPT_TOKENS = 16_000_000


class WorkflowError(ValueError):
    """A workflow that cannot be run; the message names the workflow, node and field."""


@dataclass(frozen=True, slots=True)
class Shared:
    """The same `tokens` tokens wherever `key` appears, in any workflow."""

    key: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Unique:
    """Tokens that appear nowhere else."""

    tokens: int


@dataclass(frozen=True, slots=True)
class OutputOf:
    """The output tokens of an ancestor node."""

    node: str


@dataclass(frozen=True, slots=True)
class ContextOf:
    """An ancestor's whole context: its prompt followed by its output."""

    node: str


Segment = Shared | Unique | OutputOf | ContextOf


@dataclass(frozen=True, slots=True)
class Node:
    id: str
    parents: tuple[str, ...]
    output_tokens: int
    prompt: tuple[Segment, ...]
    # A node with its own arrival (absolute within the trace, like the workflow's, and
    # divided by the rate scale with it) starts once its parents have finished *and* its
    # arrival has come: the next turn of a conversation, sent when its user sent it but
    # never before the answer it continues. Such a node carries its own deadline
    # (relative to its arrival) and is accounted as a unit of its own (a user waits for
    # each turn); None: the node starts when its parents finish, under the workflow's.
    arrival_s: float | None = None
    deadline_s: float | None = None


@dataclass
class Workflow:
    """A validated workflow DAG. Build with `Workflow.create`, which checks everything."""

    workflow_id: str
    app: str
    arrival_s: float
    deadline_s: float
    nodes: dict[str, Node]
    graph: nx.DiGraph
    _spans: dict[str, Span] = field(default_factory=dict, repr=False)
    _order: tuple[str, ...] = field(default=(), repr=False)
    # Each node's prompt length, counted once in topological order at creation: a
    # policy's lookahead reads it without building the prompt's pieces.
    _prompt_tokens: dict[str, int] = field(default_factory=dict, repr=False)
    _readers: dict[str, tuple[str, ...]] | None = field(default=None, repr=False)
    # Each node's children (graph order) and output piece, made once: every finish asks
    # for the children, every reader of an output for its piece (a stream id's hash).
    _children: dict[str, tuple[str, ...]] = field(default_factory=dict, repr=False, compare=False)
    _outputs: dict[str, Piece] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def create(
        cls,
        workflow_id: str,
        app: str,
        arrival_s: float,
        deadline_s: float,
        nodes: Iterable[Node],
        max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    ) -> Workflow:
        where = f"workflow {workflow_id!r}"
        _check_id(workflow_id, "workflow_id", "workflow")
        if not isinstance(app, str) or len(app) > MAX_ID_LEN or not app.isprintable():
            raise WorkflowError(
                f"{where}: app must be a printable string of at most {MAX_ID_LEN} chars"
            )
        if not _finite_nonneg(arrival_s):
            raise WorkflowError(f"{where}: arrival_s must be a finite number >= 0")
        if not _finite_nonneg(deadline_s) or deadline_s <= 0:
            raise WorkflowError(f"{where}: deadline_s must be a finite number > 0")
        table: dict[str, Node] = {}
        for node in nodes:
            _check_id(node.id, "node id", where)
            if node.id in table:
                raise WorkflowError(f"{where}: duplicate node id {node.id!r}")
            table[node.id] = node
        if not table:
            raise WorkflowError(f"{where}: has no nodes")
        if len(table) > MAX_NODES:
            raise WorkflowError(f"{where}: {len(table)} nodes exceeds the limit of {MAX_NODES}")
        graph = nx.DiGraph()
        graph.add_nodes_from(table)
        for node in table.values():
            here = f"{where}, node {node.id!r}"
            if (
                isinstance(node.output_tokens, bool)
                or not isinstance(node.output_tokens, int)
                or not (1 <= node.output_tokens <= MAX_OUTPUT_TOKENS)
            ):
                raise WorkflowError(
                    f"{here}: output_tokens must be an integer in [1, {MAX_OUTPUT_TOKENS}], "
                    f"got {node.output_tokens!r}"
                )
            for parent in node.parents:
                if parent not in table:
                    raise WorkflowError(f"{here}: unknown parent {parent!r}")
                if parent == node.id:
                    raise WorkflowError(f"{here}: lists itself as a parent")
                graph.add_edge(parent, node.id)
            if (node.arrival_s is None) != (node.deadline_s is None):
                raise WorkflowError(f"{here}: arrival_s and deadline_s come together")
            if node.arrival_s is not None:
                if not _finite_nonneg(node.arrival_s) or node.arrival_s < arrival_s:
                    raise WorkflowError(
                        f"{here}: arrival_s must be a finite number >= the workflow's arrival_s"
                    )
                if not _finite_nonneg(node.deadline_s) or cast(float, node.deadline_s) <= 0:
                    raise WorkflowError(f"{here}: deadline_s must be a finite number > 0")
            if not node.prompt:
                raise WorkflowError(f"{here}: prompt has no segments")
            if all(isinstance(s, Shared | Unique) and s.tokens == 0 for s in node.prompt):
                raise WorkflowError(f"{here}: prompt has no tokens (every segment is empty)")
        if not nx.is_directed_acyclic_graph(graph):
            cycle = nx.find_cycle(graph)
            path = " -> ".join(str(u) for u, _ in cycle) + f" -> {cycle[0][0]}"
            raise WorkflowError(f"{where}: dependency cycle {path}")
        position = {n: i for i, n in enumerate(table)}
        order = tuple(nx.lexicographical_topological_sort(graph, key=position.__getitem__))
        ancestors = _AncestorSets(table, order)
        tokens: dict[str, int] = {}
        for node_id in order:
            node = table[node_id]
            total = 0
            for i, seg in enumerate(node.prompt):
                here = f"{where}, node {node.id!r}, prompt segment {i}"
                if isinstance(seg, Shared):
                    if not isinstance(seg.key, str) or not seg.key:
                        raise WorkflowError(f"{here}: shared key must be a non-empty string")
                    _check_tokens(seg.tokens, here)
                    total += seg.tokens
                elif isinstance(seg, Unique):
                    _check_tokens(seg.tokens, here)
                    total += seg.tokens
                elif isinstance(seg, OutputOf | ContextOf):
                    if seg.node not in table:
                        raise WorkflowError(f"{here}: refers to unknown node {seg.node!r}")
                    if seg.node not in node.parents and not ancestors.has(node_id, seg.node):
                        raise WorkflowError(
                            f"{here}: refers to {seg.node!r}, which is not an ancestor"
                        )
                    total += table[seg.node].output_tokens
                    if isinstance(seg, ContextOf):
                        total += tokens[seg.node]  # an ancestor: counted already
                else:
                    raise WorkflowError(f"{here}: unknown segment {seg!r}")
                if total > max_prompt_tokens:
                    raise WorkflowError(
                        f"{where}, node {node.id!r}: prompt of over {max_prompt_tokens} tokens "
                        "(its segments and the contexts they repeat)"
                    )
            tokens[node_id] = total
        wf = cls(workflow_id, app, float(arrival_s), float(deadline_s), table, graph)
        wf._order = order
        wf._prompt_tokens = tokens
        return wf

    # -- structure -------------------------------------------------------------------
    def topo_order(self) -> tuple[str, ...]:
        return self._order

    def roots(self) -> list[str]:
        return [n for n in self._order if not self.nodes[n].parents]

    def children(self, node_id: str) -> list[str]:
        return list(self.child_ids(node_id))

    def child_ids(self, node_id: str) -> tuple[str, ...]:
        """`children`, as the tuple kept for the node (made at its first asking)."""
        have = self._children.get(node_id)
        if have is None:
            have = self._children[node_id] = tuple(self.graph.successors(node_id))
        return have

    def ready_children(self, node_id: str, finished: Callable[[str], bool]) -> list[str]:
        """Children of `node_id` whose parents have all `finished`."""
        nodes = self.nodes
        return [c for c in self.child_ids(node_id) if all(map(finished, nodes[c].parents))]

    def context_readers(self, node_id: str) -> tuple[str, ...]:
        """Nodes whose prompt extends this node's whole context (`ContextOf`): the
        requests that reuse its KV."""
        if self._readers is None:
            readers: dict[str, list[str]] = {}
            for n in self.nodes.values():
                for s in dict.fromkeys(s.node for s in n.prompt if isinstance(s, ContextOf)):
                    readers.setdefault(s, []).append(n.id)
            self._readers = {k: tuple(v) for k, v in readers.items()}
        return self._readers.get(node_id, ())

    def __len__(self) -> int:
        return len(self.nodes)

    # -- prompts ---------------------------------------------------------------------
    def output_piece(self, node_id: str) -> Piece:
        have = self._outputs.get(node_id)
        if have is None:
            have = self._outputs[node_id] = Piece(
                stream_id("o", self.workflow_id, node_id), 0, self.nodes[node_id].output_tokens
            )
        return have

    def prompt_span(self, node_id: str) -> Span:
        """The node's prompt as pieces of token streams. Built with an explicit stack
        (a context chain is as deep as the workflow, past Python's recursion limit)."""
        have = self._spans.get(node_id)
        if have is not None:
            return have
        stack = [node_id]
        while stack:
            n = stack[-1]
            if n in self._spans:
                stack.pop()
                continue
            todo = [
                s.node
                for s in self.nodes[n].prompt
                if isinstance(s, ContextOf) and s.node not in self._spans
            ]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            self._spans[n] = self._build_span(n)
        return self._spans[node_id]

    def _build_span(self, node_id: str) -> Span:
        pieces: list[Piece] = []
        for i, seg in enumerate(self.nodes[node_id].prompt):
            if isinstance(seg, Shared):
                pieces.append(Piece(stream_id("s", seg.key), 0, seg.tokens))
            elif isinstance(seg, Unique):
                sid = stream_id("u", self.workflow_id, node_id, str(i))
                pieces.append(Piece(sid, 0, seg.tokens))
            elif isinstance(seg, OutputOf):
                pieces.append(self.output_piece(seg.node))
            else:
                pieces.extend(self._spans[seg.node])
                pieces.append(self.output_piece(seg.node))
        return tuple([p for p in pieces if p.length])

    def context_span(self, node_id: str) -> Span:
        """The node's prompt followed by its output."""
        return (*self.prompt_span(node_id), self.output_piece(node_id))

    def prompt_tokens(self, node_id: str) -> int:
        """The prompt's length, without building its span (memoised at creation)."""
        return self._prompt_tokens[node_id]

    def critical_path(self, node_cost: Mapping[str, float]) -> float:
        """Longest path through the DAG, weighting each node by `node_cost`."""
        finish: dict[str, float] = {}
        for n in self._order:
            start = max((finish[p] for p in self.nodes[n].parents), default=0.0)
            finish[n] = start + node_cost[n]
        return max(finish.values())

    def remaining_critical_path(self, node_cost: Mapping[str, float]) -> dict[str, float]:
        """For each node, the longest cost path from its start to the end of what its
        deadline covers: the workflow's end, or the node itself where a child has its own
        arrival and deadline (it is not on this node's clock)."""
        tail: dict[str, float] = {}
        nodes = self.nodes
        for n in reversed(self._order):
            after = (tail[c] for c in self.graph.successors(n) if nodes[c].deadline_s is None)
            tail[n] = node_cost[n] + max(after, default=0.0)
        return tail

    # -- (de)serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "workflow_id": self.workflow_id,
            "app": self.app,
            "arrival_s": self.arrival_s,
            "deadline_s": self.deadline_s,
            "nodes": [_node_to_dict(n) for n in self.nodes.values()],
        }

    @classmethod
    def from_dict(cls, data: Any, max_prompt_tokens: int = MAX_PROMPT_TOKENS) -> Workflow:
        if not isinstance(data, dict):
            raise WorkflowError("a workflow must be a JSON object")
        wid = data.get("workflow_id")
        where = f"workflow {wid!r}"
        for key in ("workflow_id", "nodes"):
            if key not in data:
                raise WorkflowError(f"{where}: missing field {key!r}")
        extra = set(data) - {"workflow_id", "app", "arrival_s", "deadline_s", "nodes"}
        if extra:
            raise WorkflowError(f"{where}: unknown field(s) {sorted(extra)}")
        raw_nodes = data["nodes"]
        if not isinstance(raw_nodes, list):
            raise WorkflowError(f"{where}: 'nodes' must be a list")
        nodes = [_node_from_dict(raw, where, i) for i, raw in enumerate(raw_nodes)]
        return cls.create(
            workflow_id=cast(str, wid),
            app=data.get("app", "default"),
            arrival_s=data.get("arrival_s", 0.0),
            deadline_s=data.get("deadline_s", 3600.0),
            nodes=nodes,
            max_prompt_tokens=max_prompt_tokens,
        )


class _AncestorSets:
    """Whether one node is an ancestor of another, as bit sets over topological
    positions, built only when a prompt refers past its parents (most refer to a
    parent, answered without them). One pass in topological order: a set is its
    parents' sets and bits, so a 10,000-node chain costs N big-int ORs (~N^2/64 machine
    words), where an ancestor search per node costs N^2 graph steps."""

    def __init__(self, table: Mapping[str, Node], order: Sequence[str]) -> None:
        self._table = table
        self._order = order
        self._sets: dict[str, int] | None = None
        self._bit: dict[str, int] = {}

    def has(self, node_id: str, ancestor: str) -> bool:
        if self._sets is None:
            self._bit = {n: 1 << i for i, n in enumerate(self._order)}
            sets: dict[str, int] = {}
            for n in self._order:
                acc = 0
                for p in self._table[n].parents:
                    acc |= sets[p] | self._bit[p]
                sets[n] = acc
            self._sets = sets
        return bool(self._sets[node_id] & self._bit[ancestor])


def _node_to_dict(n: Node) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": n.id,
        "parents": list(n.parents),
        "output_tokens": n.output_tokens,
        "prompt": [_segment_to_dict(s) for s in n.prompt],
    }
    if n.arrival_s is not None:
        out["arrival_s"] = n.arrival_s
        out["deadline_s"] = n.deadline_s
    return out


def _segment_to_dict(seg: Segment) -> dict[str, Any]:
    if isinstance(seg, Shared):
        return {"shared": seg.key, "tokens": seg.tokens}
    if isinstance(seg, Unique):
        return {"unique": seg.tokens}
    if isinstance(seg, OutputOf):
        return {"output": seg.node}
    return {"context": seg.node}


def _segment_from_dict(raw: Any, where: str) -> Segment:
    if not isinstance(raw, dict):
        raise WorkflowError(f"{where}: a segment must be an object, got {raw!r}")
    kinds = [k for k in ("shared", "unique", "output", "context") if k in raw]
    if len(kinds) != 1:
        raise WorkflowError(
            f"{where}: a segment needs exactly one of shared/unique/output/context, got {raw!r}"
        )
    kind = kinds[0]
    extra = set(raw) - {kind, "tokens"} if kind == "shared" else set(raw) - {kind}
    if extra:
        raise WorkflowError(f"{where}: unexpected field(s) {sorted(extra)} in {raw!r}")
    if kind == "shared":
        if "tokens" not in raw:
            raise WorkflowError(f"{where}: shared segment {raw['shared']!r} needs 'tokens'")
        return Shared(raw["shared"], raw["tokens"])
    if kind == "unique":
        return Unique(raw["unique"])
    if not isinstance(raw[kind], str):
        raise WorkflowError(f"{where}: '{kind}' must name a node")
    return OutputOf(raw[kind]) if kind == "output" else ContextOf(raw[kind])


def _node_from_dict(raw: Any, where: str, index: int) -> Node:
    if not isinstance(raw, dict):
        raise WorkflowError(f"{where}, node #{index}: must be an object")
    nid = raw.get("id")
    here = f"{where}, node {nid!r}"
    if "id" not in raw:
        raise WorkflowError(f"{where}, node #{index}: missing 'id'")
    extra = set(raw) - {"id", "parents", "output_tokens", "prompt", "arrival_s", "deadline_s"}
    if extra:
        raise WorkflowError(f"{here}: unknown field(s) {sorted(extra)}")
    parents = raw.get("parents", [])
    if not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise WorkflowError(f"{here}: 'parents' must be a list of node ids")
    if len(set(parents)) != len(parents):
        raise WorkflowError(f"{here}: 'parents' lists a node twice")
    prompt = raw.get("prompt")
    if not isinstance(prompt, list):
        raise WorkflowError(f"{here}: 'prompt' must be a list of segments")
    segs = tuple(_segment_from_dict(s, f"{here}, prompt segment {i}") for i, s in enumerate(prompt))
    # Types are checked by Workflow.create, which names the place of any mistake.
    return Node(
        id=cast(str, nid),
        parents=tuple(parents),
        output_tokens=cast(int, raw.get("output_tokens")),
        prompt=segs,
        arrival_s=raw.get("arrival_s"),
        deadline_s=raw.get("deadline_s"),
    )


def _check_id(value: Any, what: str, where: str) -> None:
    # Printable, as the request headers' ids must be: ids reach logs, metrics labels
    # and the status API, where a newline or an escape sequence would forge lines.
    if (
        not isinstance(value, str)
        or not value
        or len(value) > MAX_ID_LEN
        or not value.isprintable()
    ):
        raise WorkflowError(
            f"{where}: {what} must be a non-empty printable string of at most {MAX_ID_LEN} "
            f"chars, got {value!r}"
        )


def _check_tokens(value: Any, where: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (0 <= value <= MAX_SEGMENT_TOKENS)
    ):
        raise WorkflowError(
            f"{where}: tokens must be an integer in [0, {MAX_SEGMENT_TOKENS}], got {value!r}"
        )


def finite_number(x: Any) -> TypeGuard[int | float]:
    """A number (not a bool) that a float can hold: JSON and YAML allow integers too
    large for one, on which `math.isfinite` raises instead of answering."""
    if not isinstance(x, int | float) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def _finite_nonneg(x: Any) -> bool:
    return finite_number(x) and x >= 0
