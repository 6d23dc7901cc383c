"""`POST /v1/workflows` and `GET /v1/workflows/{id}`: whole DAGs registered ahead of
their requests, their status, and their journal (a restarted router keeps them)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

from wasma.deploy.journal import WorkflowJournal
from wasma.deploy.service_types import BadRequest, Conflict, NotFound
from wasma.scheduler.dispatch import Closed, Dispatcher
from wasma.scheduler.workflow import MAX_PROMPT_TOKENS, Workflow, WorkflowError
from wasma.scheduler.workflows import WorkflowState

log = logging.getLogger(__name__)


def scoped(workflow_id: str, tenant: str) -> str:
    """A workflow's key: its id within its tenant (one API key cannot see another's)."""
    return f"{tenant}/{workflow_id}" if tenant else workflow_id


class WorkflowAPI:
    def __init__(
        self,
        dispatch: Dispatcher,
        journal: WorkflowJournal | None,
        now: Callable[[], float],
        on_closed: Callable[[Closed], None],
        max_prompt_tokens: int = MAX_PROMPT_TOKENS,
    ) -> None:
        self.dispatch = dispatch
        self.journal = journal
        self.now = now
        self.on_closed = on_closed  # a live run closed by a DAG registered under its id
        self.max_prompt_tokens = max_prompt_tokens  # the engines' context

    def register(self, data: Mapping[str, Any], tenant: str = "") -> dict[str, Any]:
        """Register a whole DAG ahead of its requests (trace format, minus `arrival_s`)."""
        if not isinstance(data, Mapping):
            raise BadRequest("a workflow must be a JSON object")
        body = dict(data)
        body["arrival_s"] = 0.0
        try:
            # A node whose prompt cannot fit the engines is refused now, by its count
            # (memoised, so a doubling context chain costs its segments, not its tokens).
            wf = Workflow.from_dict(body, max_prompt_tokens=self.max_prompt_tokens)
        except WorkflowError as exc:
            raise BadRequest(str(exc), "nodes") from None
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"invalid workflow: {exc}") from None
        key = scoped(wf.workflow_id, tenant)
        dispatch = self.dispatch
        if key in dispatch.ctx.workflows.active:
            if dispatch.busy(key):
                raise Conflict(f"workflow {wf.workflow_id!r} is already registered and running")
            # An idle live run under the same id: it is over; the DAG starts a new one.
            closed = dispatch.close_live(key, self.now())
            if closed is not None:
                self.on_closed(closed)
        dispatch.register(wf, key, self.now())
        if self.journal is not None:
            self.journal.register(key, body, wf.deadline_s)
        return self.status_of(key, wf.workflow_id)

    def status(self, workflow_id: str, tenant: str = "") -> dict[str, Any]:
        key = scoped(workflow_id, tenant)
        if self.dispatch.ctx.workflows.get(key) is None:
            raise NotFound(f"no workflow {workflow_id!r}", "workflow_id")
        return self.status_of(key, workflow_id)

    def status_of(self, key: str, workflow_id: str) -> dict[str, Any]:
        wst = self.dispatch.ctx.workflows.get(key)
        assert wst is not None
        now = self.now()
        names = self.dispatch.ctx.state.engines
        order = list(wst.workflow.topo_order()) if wst.workflow is not None else []
        order += [n for n in wst.nodes if n not in set(order)]
        nodes = []
        counts = {"pending": 0, "running": 0, "finished": 0}
        for node_id in order:
            ns = wst.nodes.get(node_id)
            if ns is None or ns.submitted_s is None:
                status = "pending"
            elif ns.finished_s is None:
                status = "running"
            else:
                status = "finished"
            counts[status] += 1
            nodes.append(
                {
                    "id": node_id,
                    "status": status,
                    "engine": None if ns is None or ns.engine is None else names[ns.engine],
                    # A registered node's declared parents; otherwise (a live workflow,
                    # or a node added to a registered one) the parents its request named.
                    "parents": list(wst.workflow.nodes[node_id].parents)
                    if wst.workflow is not None and node_id in wst.workflow.nodes
                    else list(ns.parents if ns is not None else ()),
                }
            )
        end = wst.finished_s if wst.finished_s is not None else now
        deadline = wst.deadline_s - wst.arrival_s
        return {
            "workflow_id": workflow_id,
            "object": "workflow",
            "app": wst.app,
            "status": "finished" if wst.finished_s is not None else "active",
            "registered": wst.workflow is not None,
            "elapsed_s": round(end - wst.arrival_s, 6),
            "deadline_s": None if math.isinf(deadline) else deadline,
            "nodes_total": len(nodes),
            "nodes_pending": counts["pending"],
            "nodes_running": counts["running"],
            "nodes_finished": counts["finished"],
            "nodes": nodes,
        }

    def replay_journal(self, num_engines: int) -> None:
        """Registered DAGs of a previous router process, with the nodes they finished."""
        assert self.journal is not None
        now = self.now()
        registry = self.dispatch.ctx.workflows
        for key, entry in self.journal.live().items():
            rec = entry["register"]
            body = dict(rec.get("dag") or {})
            body["arrival_s"] = 0.0
            try:
                wf = Workflow.from_dict(body)
            except (WorkflowError, TypeError, ValueError) as exc:
                log.warning("journal: dropping workflow %s: %s", key, exc)
                continue
            # Same deadline on the wall clock as before the restart.
            age = max(time.time() - float(rec.get("wall") or time.time()), 0.0)
            arrival = now - age
            wst = WorkflowState(wf, key, wf.app, arrival, arrival + wf.deadline_s)
            registry.active[key] = wst
            for node_id, engine in entry["finished"].items():
                if node_id in wf.nodes:
                    ns = wst.node(node_id)
                    ns.engine = engine if 0 <= engine < num_engines else None
                    ns.submitted_s = ns.finished_s = now
            log.info("journal: workflow %s back with %d nodes done", key, len(entry["finished"]))
