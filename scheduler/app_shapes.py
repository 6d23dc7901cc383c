"""What wasma learns about an application's usual workflow shape.

Live agents rarely register their DAG; they send requests with a workflow id, a node id
and parents. From finished workflows of the same app the learner keeps, per node *role*
(the node id with its digits folded, so `map3` and `map7` are one role):
- its remaining critical path: the longest chain of requests from it to the workflow's
  end, each costed at its latency on an idle engine, as wasma costs a registered DAG
  (slack-ordered priority and deadline-aware admission read it), and
- how often a later node extended that node's context (so its KV is worth retaining).

The critical path follows the parents each request named. The time the workflow
actually ran after the node is no substitute: it already holds the queueing and batching
of the load it ran under, which admission then multiplies by the load again, and a
router that learns that way holds back work an idle cluster could finish in time. Only a
workflow whose requests named no parents at all falls back to that time, divided by how
much slower than alone its requests ran.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

from wasma.scheduler.workflows import WorkflowState

_DIGITS = re.compile(r"\d+")


def role_of(node_id: str) -> str:
    return _DIGITS.sub("#", node_id)


@dataclass(slots=True)
class RoleStats:
    remaining_s: float
    reused: float  # EWMA of "a descendant extended this node's context" (0..1)
    samples: int


class AppShapes:
    def __init__(self, alpha: float = 0.2, max_roles: int = 10_000) -> None:
        self.alpha = alpha
        self.max_roles = max_roles
        self._roles: OrderedDict[tuple[str, str], RoleStats] = OrderedDict()
        # Node id -> its role (`role_of`, a regex substitution), as a workflow's node ids
        # recur in every run of its app; bounded like the roles.
        self._role: dict[str, str] = {}

    def _role_of(self, node_id: str) -> str:
        role = self._role.get(node_id)
        if role is None:
            if len(self._role) >= self.max_roles:
                self._role.clear()
            role = self._role[node_id] = role_of(node_id)
        return role

    def observe(self, wf: WorkflowState) -> None:
        """Learn from a finished workflow (called when the registry closes it)."""
        end = wf.finished_s
        if end is None:
            return
        a = self.alpha
        remaining = _remaining_alone(wf, end)
        for node_id, rem in remaining.items():
            ns = wf.nodes[node_id]
            key = (wf.app, self._role_of(node_id))
            reused = 1.0 if ns.context_reused else 0.0
            st = self._roles.get(key)
            if st is None:
                self._roles[key] = RoleStats(rem, reused, 1)
                if len(self._roles) > self.max_roles:
                    self._roles.popitem(last=False)
            else:
                st.remaining_s += a * (rem - st.remaining_s)
                st.reused += a * (reused - st.reused)
                st.samples += 1
                self._roles.move_to_end(key)

    def remaining_s(self, app: str, node_id: str) -> float | None:
        st = self._roles.get((app, self._role_of(node_id)))
        return None if st is None else st.remaining_s

    def context_reused(self, app: str, node_id: str) -> bool:
        st = self._roles.get((app, self._role_of(node_id)))
        return st is not None and st.reused >= 0.5

    def __len__(self) -> int:
        return len(self._roles)


def _remaining_alone(wf: WorkflowState, end: float) -> dict[str, float]:
    """Each submitted node's remaining critical path in idle-engine seconds."""
    submitted = {n: ns.submitted_s for n, ns in wf.nodes.items() if ns.submitted_s is not None}
    nodes = {n: wf.nodes[n] for n in submitted}
    if len(nodes) > 1 and not any(ns.parents for ns in nodes.values()):
        # No edges to follow: the time the workflow ran after each node, scaled by the
        # slowdown its requests saw (time to finish over time alone, summed).
        ran = alone = 0.0
        for n, ns in nodes.items():
            if ns.finished_s is not None:
                ran += ns.finished_s - submitted[n]
                alone += ns.alone_s
        scale = alone / ran if alone > 0 and ran > 0 else 1.0
        return {n: max(end - t, 0.0) * scale for n, t in submitted.items()}
    children: dict[str, list[str]] = {}
    for n, ns in nodes.items():
        for p in ns.parents:
            if p in nodes:
                children.setdefault(p, []).append(n)
    # A child is submitted after its parents finish, so latest-submitted first is a
    # reverse topological order; a child not yet costed (a misreported parent) is skipped.
    tail: dict[str, float] = {}
    for n in sorted(submitted, key=submitted.__getitem__, reverse=True):
        later = [tail[c] for c in children.get(n, ()) if c in tail]
        tail[n] = nodes[n].alone_s + max(later, default=0.0)
    return tail
