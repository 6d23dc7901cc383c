"""Which KV retentions the router asked engines for are still wanted.

A request the policy marks `retain` asks its engine to keep its KV (evicted after every
ordinary free block) because later requests of its workflow extend its context
(`ContextOf`). Once the last of those readers has started, the readers hold that KV
themselves, and keeping it any longer only crowds out other retained KV. The tracker
counts the readers still to start (from the workflow's DAG; without one, the lease alone
ends the retention) and, when none is left, queues the retention's key for release on
its engine. Drivers send the queued keys along with the next request they place there
(`GenerateRequest.release`): an engine has no other channel from the router.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from scheduler.workflow import ContextOf, Workflow


@dataclass(slots=True)
class _Kept:
    key: str  # what the engine knows the retention by: the request id
    engine: int
    readers: int  # readers not yet started


class RetentionTracker:
    # Retentions whose readers never start (a workflow abandoned half way) must not grow
    # a long-running router without bound; the oldest are forgotten first (their lease
    # still ends them on the engine).
    MAX_TRACKED = 100_000
    MAX_PENDING = 10_000  # release keys waiting for a request to an engine

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[str, str], _Kept] = OrderedDict()  # (workflow, node)
        # request id -> the retained contexts it reads (workflow id, node id)
        self._reads: dict[str, list[tuple[str, str]]] = {}
        self._pending: dict[int, list[str]] = {}

    def placed(
        self,
        workflow: Workflow | None,
        workflow_id: str,
        node_id: str,
        request_id: str,
        engine: int,
        retain: bool,
    ) -> None:
        """A request was sent to `engine`; `retain` if it asked the engine to keep its KV
        (under the key `request_id`)."""
        if workflow is None or node_id not in workflow.nodes:
            return  # no DAG: nobody to count, the lease decides
        reads = [
            (workflow_id, s.node)
            for s in workflow.nodes[node_id].prompt
            if isinstance(s, ContextOf) and (workflow_id, s.node) in self._kept
        ]
        if reads:
            self._reads[request_id] = reads
        if retain:
            readers = len(workflow.context_readers(node_id))
            if readers:
                self._kept[(workflow_id, node_id)] = _Kept(request_id, engine, readers)
                while len(self._kept) > self.MAX_TRACKED:
                    self._kept.popitem(last=False)

    def started(self, request_id: str) -> None:
        """A request's prefill is done: it holds the KV it read, so the retentions it
        read have one reader fewer to wait for."""
        for ref in self._reads.pop(request_id, ()):
            entry = self._kept.get(ref)
            if entry is None:
                continue
            entry.readers -= 1
            if entry.readers > 0:
                continue
            del self._kept[ref]
            pending = self._pending.setdefault(entry.engine, [])
            pending.append(entry.key)
            if len(pending) > self.MAX_PENDING:
                del pending[: len(pending) - self.MAX_PENDING]

    def take(self, engine: int) -> tuple[str, ...]:
        """Keys of retentions on `engine` to end, to send with the next request there."""
        return tuple(self._pending.pop(engine, ()))

    def engine_lost(self, engine: int) -> None:
        """The engine restarted or failed: what it kept is gone with it."""
        self._pending.pop(engine, None)
        for ref in [r for r, e in self._kept.items() if e.engine == engine]:
            del self._kept[ref]

    def __len__(self) -> int:
        return len(self._kept)
