"""The router: asks the policy for a placement and keeps the cluster view current.

The same object runs under every driver (simulator, live gateway); drivers call
`route` when a request is ready and the `on_*` hooks as engines report progress.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

from wasma.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from wasma.core.profile import Profile
from wasma.scheduler.policy import (
    Placement,
    PlacementKind,
    Policy,
    PolicyContext,
    RequestInfo,
)
from wasma.scheduler.retention import RetentionTracker


class Router:
    MAX_SHAPES = 100_000  # request shapes whose idle-engine latency is kept

    def __init__(self, ctx: PolicyContext, policy: Policy, keep_decisions: int = 1_000_000):
        self.ctx = ctx
        self.policy = policy
        # Decision latencies (µs), bounded so a long-running server does not grow.
        self.decision_us: deque[float] = deque(maxlen=keep_decisions)
        self._inflight: dict[str, tuple[str, tuple[int, ...]]] = {}
        # Retentions to end once their readers started; drivers send the keys with the
        # next request they place on that engine (`retention.take`).
        self.retention = RetentionTracker()
        self._alone: dict[tuple[int, int], float] = {}
        self._alone_profile: Profile | None = None

    def route(self, req: RequestInfo, now: float, force: bool = False) -> Placement:
        """The policy's placement for `req`, charged to its engine, unless the policy
        holds it (`defer`): then nothing is charged. `force` dispatches it anyway (a
        driver releasing held work because nothing else could free capacity)."""
        t0 = time.perf_counter_ns()
        placement = self.policy.place(req, now)
        self.decision_us.append((time.perf_counter_ns() - t0) / 1000)
        if req.pinned is not None and placement.engine != req.pinned:
            # Only the pinned engine can answer: it recomputes what it lacks, now.
            placement = replace(
                placement,
                engine=req.pinned,
                kind=PlacementKind.RECOMPUTE,
                hit_blocks=0,
                transfer=None,
                defer=False,
            )
        if placement.defer:
            if not force:
                return placement
            placement = replace(placement, defer=False)
        if placement.estimated_finish_s is not None:
            self.ctx.estimates.placed(req.request_id, now, placement.estimated_finish_s - now)
        bs = self.ctx.block_size
        # (a `Charge`, given as its fields)
        self.ctx.state.dispatched(
            req.request_id,
            placement.engine,
            -(-(req.prompt_tokens + req.max_tokens) // bs),
            max(req.prompt_tokens - placement.hit_blocks * bs, 0),
            req.max_tokens,
        )
        name = self.ctx.state.loads[placement.engine].name
        tr = placement.transfer
        if tr is not None and self.ctx.copies is not None:
            # The copy now occupies the holder's link: the next placement sees it there.
            self.ctx.copies.book(
                self.ctx.state.loads[tr.src].name,
                name,
                req.block_hashes,
                tr.num_blocks,
                tr.num_bytes,
                now,
                tr.broadcast,
            )
        if self.policy.reads_inflight:
            hashes = tuple(req.block_hashes)
            if hashes:
                self._inflight[req.request_id] = (name, hashes)
                self.ctx.inflight.store(name, hashes)
        # One lookup of the workflow for both (`WorkflowRegistry.mark_submitted`, then
        # `get`): a finished one records nothing but still names its DAG.
        registry = self.ctx.workflows
        wst = registry.active.get(req.workflow_id)
        if wst is not None:
            extends = wst.mark_submitted(
                req.node_id,
                placement.engine,
                now,
                req.block_hashes,
                req.parents,
                self._alone_s(req.prompt_tokens, req.max_tokens),
            )
        else:
            extends = []
            wst = registry.finished.get(req.workflow_id)
        self.retention.placed(
            wst.workflow if wst is not None else None,
            req.workflow_id,
            req.node_id,
            req.request_id,
            placement.engine,
            placement.retain and placement.retain_use_s is not None,
            extends,
        )
        return placement

    def _alone_s(self, prompt_tokens: int, max_tokens: int) -> float:
        """`profile.request_alone_s` (a loop over prefill chunks), kept per request shape
        and profile: the apps' nodes repeat a few shapes."""
        profile = self.ctx.profile
        if profile is not self._alone_profile or len(self._alone) >= self.MAX_SHAPES:
            self._alone.clear()
            self._alone_profile = profile
        key = (prompt_tokens, max_tokens)
        alone = self._alone.get(key)
        if alone is None:
            alone = self._alone[key] = profile.request_alone_s(prompt_tokens, max_tokens)
        return alone

    def on_kv_event(self, event: KVEvent) -> None:
        # An engine's CPU tier (vLLM's offloading, medium "CPU") is indexed apart from
        # its GPU pool: a hit there costs a load, not nothing.
        # (`PrefixIndex.apply` of the two common events, its dispatch done here)
        if isinstance(event, AllBlocksCleared):
            self.ctx.index.apply(event)
            self.ctx.cpu_index.apply(event)
            return
        medium = event.medium
        cpu = medium is not None and medium.upper() == "CPU"
        index = self.ctx.cpu_index if cpu else self.ctx.index
        if isinstance(event, BlockStored):
            index.store(event.engine, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            index.remove(event.engine, event.block_hashes)

    def on_first_token(self, request_id: str) -> None:
        self.ctx.state.on_first_token(request_id)
        self._forget_inflight(request_id)
        self.retention.started(request_id)

    def _forget_inflight(self, request_id: str) -> None:
        # Once a request started, the engine's own KV events say where its blocks are.
        entry = self._inflight.pop(request_id, None)
        if entry is not None:
            self.ctx.inflight.remove(entry[0], entry[1])

    def on_finish(self, request_id: str, workflow_id: str, node_id: str, now: float) -> list[str]:
        """A request finished; returns the workflow's children that became ready."""
        self.request_ended(request_id, now)
        return self.ctx.workflows.mark_finished(workflow_id, node_id, now)

    def request_ended(self, request_id: str, now: float) -> None:
        """`on_finish` up to the workflow's own record (`WorkflowRegistry.mark_finished`),
        for a caller that looked the workflow up already."""
        self.ctx.state.on_finish(request_id)
        self.ctx.estimates.finished(request_id, now)
        self._forget_inflight(request_id)
        self.retention.finished(request_id)
