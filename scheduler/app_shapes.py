"""What wasma learns about an application's usual workflow shape.

Live agents rarely register their DAG; they send requests with a workflow id, a node id
and parents. From finished workflows of the same app the learner keeps, per node *role*
(the node id with its digits folded, so `map3` and `map7` are one role):
- how long the workflow still ran after a node of that role was submitted (its remaining
  critical path, the quantity slack-ordered priority needs), and
- how often a later node extended that node's context (so its KV is worth retaining).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

from scheduler.workflows import WorkflowState

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

    def observe(self, wf: WorkflowState) -> None:
        """Learn from a finished workflow (called when the registry closes it)."""
        end = wf.finished_s
        if end is None:
            return
        a = self.alpha
        for node_id, ns in wf.nodes.items():
            if ns.submitted_s is None:
                continue
            key = (wf.app, role_of(node_id))
            rem = max(end - ns.submitted_s, 0.0)
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
        st = self._roles.get((app, role_of(node_id)))
        return None if st is None else st.remaining_s

    def context_reused(self, app: str, node_id: str) -> bool:
        st = self._roles.get((app, role_of(node_id)))
        return st is not None and st.reused >= 0.5

    def __len__(self) -> int:
        return len(self._roles)
