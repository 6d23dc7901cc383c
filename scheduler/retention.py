"""Which KV retentions the router asked engines for are still wanted.

A request the policy marks `retain` asks its engine to keep its KV (evicted after every
ordinary free block) because later requests of its workflow extend its context
(`ContextOf`). Once the last of those readers has started, the readers hold that KV
themselves, and keeping it any longer only crowds out other retained KV. The tracker
counts the readers still to start and, when none is left, queues the retention's key for
release on its engine. Drivers send the queued keys along with the next request they
place there (`GenerateRequest.release`): an engine has no other channel from the router.

With a registered DAG the readers are known ahead. Without one, the requests whose prompt
extends the retained node's are its readers, counted as they arrive. How many more will
come is unknown, but requests that continue one context are mostly ready together (the
children of one node, when it finishes), so the retention ends once a reader has
finished and every reader seen so far has started.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from wasma.scheduler.workflow import ContextOf, Workflow


@dataclass(slots=True)
class _Kept:
    key: str  # what the engine knows the retention by: the request id
    engine: int
    readers: int  # readers not yet started (without a DAG: of those seen so far)
    learned: bool = False  # no DAG: readers are the requests that extend its prompt
    reader_done: bool = False  # (no DAG) a reader has finished


class RetentionTracker:
    # Retentions whose readers never start (a workflow abandoned half way) must not grow
    # a long-running router without bound; the oldest are forgotten first (their lease
    # still ends them on the engine).
    MAX_TRACKED = 100_000
    MAX_PENDING = 10_000  # release keys waiting for a request to an engine

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[str, str], _Kept] = OrderedDict()  # (workflow, node)
        # request id -> the retained contexts it reads (workflow id, node id), until it
        # starts; without a DAG also until it finishes
        self._reads: dict[str, list[tuple[str, str]]] = {}
        self._reading: OrderedDict[str, list[tuple[str, str]]] = OrderedDict()
        self._pending: dict[int, list[str]] = {}

    def placed(
        self,
        workflow: Workflow | None,
        workflow_id: str,
        node_id: str,
        request_id: str,
        engine: int,
        retain: bool,
        extends: Sequence[str] = (),
    ) -> None:
        """A request was sent to `engine`; `retain` if it asked the engine to keep its KV
        (under the key `request_id`). `extends`: the earlier nodes whose prompt its prompt
        extends (`WorkflowRegistry.mark_submitted`; what is read without a DAG)."""
        if workflow is None or node_id not in workflow.nodes:
            self._placed_without_dag(workflow_id, node_id, request_id, engine, retain, extends)
            return
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
                self._keep((workflow_id, node_id), _Kept(request_id, engine, readers))

    def _placed_without_dag(
        self,
        workflow_id: str,
        node_id: str,
        request_id: str,
        engine: int,
        retain: bool,
        extends: Sequence[str],
    ) -> None:
        reads = []
        # A failover places a request again: it is counted as a reader once.
        for p in extends if request_id not in self._reading else ():
            entry = self._kept.get((workflow_id, p))
            if entry is not None and entry.learned:
                entry.readers += 1
                reads.append((workflow_id, p))
        if reads:
            self._reads[request_id] = reads
            self._reading[request_id] = reads
            while len(self._reading) > self.MAX_TRACKED:
                self._reading.popitem(last=False)
        if retain:
            self._keep((workflow_id, node_id), _Kept(request_id, engine, 0, learned=True))

    def _keep(self, ref: tuple[str, str], entry: _Kept) -> None:
        self._kept[ref] = entry
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
            if entry.readers > 0 or (entry.learned and not entry.reader_done):
                continue
            self._release(ref, entry)

    def finished(self, request_id: str) -> None:
        """A request left its engine. Without a DAG, a retention's first reader to finish
        says its siblings have arrived: the retention ends once those have started."""
        for ref in self._reading.pop(request_id, ()):
            entry = self._kept.get(ref)
            if entry is None:
                continue
            entry.reader_done = True
            if entry.readers <= 0:
                self._release(ref, entry)

    def _release(self, ref: tuple[str, str], entry: _Kept) -> None:
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
