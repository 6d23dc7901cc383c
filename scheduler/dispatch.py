"""The scheduling core every driver runs: admission, the held queue, workflows, placement.

A driver (the live router service on the wall clock, the simulator on a virtual one, the
Ray Serve request router) feeds the `Dispatcher` what happens — a request is ready, an
engine reported its KV or its load, a request started or finished — with the time as an
argument, and carries out what the dispatcher decides. The dispatcher knows no HTTP, no
Ray and no clock, so the simulator's decisions are the live router's decisions.

What it owns:
- the policy's context (`PolicyContext`: cluster state, prefix index, workflow registry),
  built once here, and the policy, rebuilt when the cost model changes if the policy
  declares it reads one (`Policy.uses_cost_model`);
- workflow opening (a request names a workflow the router has not seen: it opens one
  with the request's app and deadline), the count of requests still open per live
  workflow, and the idle sweep that closes workflows agents never say are over;
- placement (`place`): the policy's decision, the retentions whose readers have all
  started (sent to the chosen engine with this request), and the held queue when the
  policy holds a request back (`Placement.defer`);
- completion bookkeeping (`finish`): load counters, retention, the DAG's ready children,
  and whether the request ended its workflow.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from wasma.core.events import EngineStats, KVEvent
from wasma.core.profile import Profile
from wasma.scheduler.policy import Placement, PolicyContext, RequestInfo
from wasma.scheduler.prefix_index import PrefixIndex
from wasma.scheduler.pricing import TransferPricer
from wasma.scheduler.registry import PolicyRegistry, default_registry
from wasma.scheduler.router import Router
from wasma.scheduler.state import ClusterState
from wasma.scheduler.workflow import Workflow
from wasma.scheduler.workflows import WorkflowRegistry, WorkflowState

T = TypeVar("T")

# Workflow keys of requests that came without workflow metadata: one-node workflows
# (DESIGN.md) that nothing else refers to.
ANONYMOUS_PREFIX = "~"


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    """How a driver's dispatcher is built (one dataclass, not a dozen arguments)."""

    policy: str = "wasma"
    params: Mapping[str, Any] = field(default_factory=dict)
    # KV blocks an engine holds (None: the profile's).
    num_kv_blocks: int | None = None
    # Engines that share a host, by slot (None: each alone).
    hosts: Sequence[str] | None = None
    # Whether engines can relay a prefix they are still receiving (simulated GPUs).
    relay_copies: bool = False
    keep_finished: int = 10_000  # finished workflows kept for status queries
    index_cap: int | None = None  # blocks the prefix index keeps (None: its default)


@dataclass(frozen=True, slots=True)
class Dispatch:
    """What the dispatcher decided for one request: its placement and, when it goes out
    now, the retentions to end on its engine (their keys) with it."""

    placement: Placement
    release: tuple[str, ...] = ()

    @property
    def held(self) -> bool:
        return self.placement.defer


@dataclass(frozen=True, slots=True)
class Finished:
    """A request's end: the children of its DAG node that became ready, whether its
    workflow is a registered DAG, and the workflow when this request ended it (None
    otherwise)."""

    ready: list[str]
    registered: bool = False
    workflow: WorkflowState | None = None


@dataclass(frozen=True, slots=True)
class Closed:
    """A workflow closed by the idle sweep (or at a new run under its id)."""

    workflow: WorkflowState
    last_s: float  # its last activity: when it is taken to have ended
    met: bool  # whether it ended within its deadline


class HeldQueue(Generic[T]):
    """Requests the policy holds at the router, most urgent (lowest hold order) first,
    then first come. Drivers store what they need to offer one again (`T`)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, T]] = []
        self._seq = itertools.count()

    def push(self, placement: Placement, ticket: T) -> None:
        heapq.heappush(self._heap, (placement.hold_order, next(self._seq), ticket))

    def pop(self) -> T | None:
        return heapq.heappop(self._heap)[2] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)


class Dispatcher:
    """One scheduling state: every driver builds one and feeds it events."""

    def __init__(
        self,
        engines: Sequence[str],
        profile: Profile,
        config: DispatcherConfig | None = None,
        *,
        registry: PolicyRegistry | None = None,
        pricer: TransferPricer | None = None,
    ) -> None:
        cfg = config or DispatcherConfig()
        self.config = cfg
        names = list(engines)
        state = ClusterState(
            names,
            num_kv_blocks=profile.num_kv_blocks if cfg.num_kv_blocks is None else cfg.num_kv_blocks,
            hosts=None if cfg.hosts is None else list(cfg.hosts),
        )
        index = PrefixIndex(names) if cfg.index_cap is None else PrefixIndex(names, cfg.index_cap)
        self.ctx = PolicyContext(
            state=state,
            index=index,
            workflows=WorkflowRegistry(keep_finished=cfg.keep_finished),
            profile=profile,
            pricer=pricer,
            params=dict(cfg.params),
            # Every driver can hold a request back and offer it again.
            can_defer=True,
            relay_copies=cfg.relay_copies,
        )
        self.registry = registry or default_registry()
        self.policy_name = cfg.policy
        self.router = Router(self.ctx, self.registry.create(cfg.policy, self.ctx))
        # Live workflows (no registered DAG) by key: [requests still open, last activity].
        self._open: dict[str, list[float]] = {}

    # -- the cluster view ------------------------------------------------------------
    def on_kv_event(self, event: KVEvent) -> None:
        self.router.on_kv_event(event)

    def on_stats(self, slot: int, stats: EngineStats) -> None:
        self.ctx.state.on_stats(slot, stats)

    def on_load(
        self, slot: int, running: int, waiting: int, kv_usage: float, num_kv_blocks: int
    ) -> None:
        """`on_stats` given the fields the cluster state reads, without an `EngineStats`."""
        self.ctx.state.on_load(slot, running, waiting, kv_usage, num_kv_blocks)

    def on_first_token(self, request_id: str) -> None:
        self.router.on_first_token(request_id)

    def set_profile(self, profile: Profile) -> None:
        """A new cost model (same block size and limits); a policy that derives constants
        from it is built afresh, others keep their state (rotation, prefix trees)."""
        self.ctx.profile = profile
        if self.router.policy.uses_cost_model:
            self.router.policy = self.registry.create(self.policy_name, self.ctx)

    @property
    def idle(self) -> bool:
        """Whether no engine has anything outstanding (nothing would free capacity)."""
        return not any(load.outstanding for load in self.ctx.state.loads)

    # -- workflows -------------------------------------------------------------------
    def register(self, wf: Workflow, key: str, now: float) -> WorkflowState:
        """A whole DAG ahead of its requests, under `key` (a driver may scope ids)."""
        registry = self.ctx.workflows
        registry.finished.pop(key, None)
        wst = WorkflowState(wf, key, wf.app, now, now + wf.deadline_s)
        registry.active[key] = wst
        self._open.pop(key, None)
        return wst

    def open_request(
        self, key: str, app: str | None, deadline_s: float | None, now: float, track: bool = True
    ) -> WorkflowState:
        """The workflow a request belongs to, opened at this request if it is new (with
        the request's app and deadline, relative to now). A finished workflow seen again
        is a new run of it. `track` counts the request open in a live workflow (no DAG)
        until `release`, for the idle sweep."""
        registry = self.ctx.workflows
        wst = self.current_run(key)
        if wst is None:
            registry.finished.pop(key, None)  # a finished run under this id is over
            deadline = math.inf if deadline_s is None else deadline_s
            wst = registry.ensure(key, app or "default", now, deadline)
        if track and wst.workflow is None and not key.startswith(ANONYMOUS_PREFIX):
            entry = self._open.setdefault(key, [0, now])
            entry[0] += 1
            entry[1] = now
        return wst

    def current_run(self, key: str) -> WorkflowState | None:
        """The run of workflow `key` in progress; None when a request for it would open a
        new one (never seen, or finished: a finished workflow seen again runs anew)."""
        return self.ctx.workflows.active.get(key)

    def parent_error(self, key: str, node_id: str, parents: tuple[str, ...]) -> str | None:
        """Why a request's declared parents cannot be (itself, a parent that never ran,
        a cycle), checked before its workflow is entered so a refused request leaves
        nothing behind; None when they can."""
        # A new run has nothing in it yet.
        wst = self.current_run(key) or WorkflowState(None, key, "", 0.0, math.inf)
        return wst.parent_error(node_id, parents)

    def busy(self, key: str) -> bool:
        """Whether `key` is a registered DAG, or a live workflow with requests open."""
        wst = self.ctx.workflows.active.get(key)
        if wst is None:
            return False
        entry = self._open.get(key)
        return wst.workflow is not None or (entry is not None and entry[0] > 0)

    def touch(self, key: str, now: float) -> None:
        """Activity in live workflow `key` without a request going out (one refused)."""
        entry = self._open.get(key)
        if entry is not None:
            entry[1] = now

    @property
    def open_workflows(self) -> int:
        """Live workflows (no registered DAG) not closed yet."""
        return len(self._open)

    def release(self, key: str, now: float) -> None:
        """A request of workflow `key` ended (or never went out): one fewer open."""
        if key.startswith(ANONYMOUS_PREFIX):
            # Its one-node workflow goes with it: nothing else refers to it.
            self.ctx.workflows.active.pop(key, None)
            return
        entry = self._open.get(key)
        if entry is not None:
            entry[0] -= 1
            entry[1] = now

    def close_live(self, key: str, now: float) -> Closed | None:
        """End a live workflow at its last activity."""
        _, last = self._open.pop(key, [0, now])
        wst = self.ctx.workflows.active.get(key)
        self.ctx.workflows.close(key, last)
        if wst is None:
            return None
        return Closed(wst, last, last <= wst.deadline_s)

    def sweep_idle(self, now: float, idle_s: float, settle_s: float = 0.0) -> list[Closed]:
        """Close workflows idle for `idle_s`: live ones with nothing open (agents do not
        say when a run ends), and registered DAGs whose client gave up half-way (they
        count as missed). An unbounded registry would otherwise grow forever.

        A live workflow with nothing in flight once its deadline passed has its outcome
        settled (met if its last request ended in time, which a later one could only turn
        into a miss), so it closes once it has also been idle for `settle_s` rather than
        `idle_s` later: an agent's next turn that comes just after the deadline still
        belongs to the run (and makes it a miss); a request for it after that starts a
        new run."""
        closed: list[Closed] = []
        active = self.ctx.workflows.active
        for key, (outstanding, last) in list(self._open.items()):
            if outstanding > 0:
                continue
            wst = active.get(key)
            settled = wst is not None and now > wst.deadline_s and now - last >= settle_s
            if now - last < idle_s and not settled:
                continue
            done = self.close_live(key, now)
            if done is not None:
                closed.append(done)
        for key, wst in list(self.ctx.workflows.active.items()):
            if wst.workflow is None or key in self._open:
                continue
            nodes = wst.nodes.values()
            if any(ns.submitted_s is not None and ns.finished_s is None for ns in nodes):
                continue
            times = [t for ns in nodes for t in (ns.submitted_s, ns.finished_s) if t is not None]
            last = max(times, default=wst.arrival_s)
            if now - last < idle_s:
                continue
            self.ctx.workflows.close(key, last)
            closed.append(Closed(wst, last, False))
        return closed

    # -- placement -------------------------------------------------------------------
    @staticmethod
    def request_info(
        request_id: str,
        key: str,
        node_id: str,
        wst: WorkflowState,
        prompt_tokens: int,
        max_tokens: int,
        block_hashes: Sequence[int],
        now: float,
        parents: tuple[str, ...] = (),
        pinned: int | None = None,
    ) -> RequestInfo:
        """What the policy places, for a request of workflow `wst`."""
        return RequestInfo(
            request_id=request_id,
            workflow_id=key,
            node_id=node_id,
            app=wst.app,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            block_hashes=block_hashes,
            arrival_s=now,
            deadline_s=wst.deadline_s,
            parents=parents,
            pinned=pinned,
        )

    def place(self, info: RequestInfo, now: float, force: bool = False) -> Dispatch:
        """The policy's decision for `info`. Held (`Dispatch.held`): nothing is charged,
        and the driver keeps the request (`HeldQueue`) to offer it again when capacity
        frees. Otherwise it is charged to its engine, and the retentions on that engine
        whose readers have all started go with it. `force` dispatches even what the
        policy would hold (nothing else could free capacity, or it waited too long)."""
        placement = self.router.route(info, now, force)
        if placement.defer:
            return Dispatch(placement)
        return Dispatch(placement, tuple(self.router.retention.take(placement.engine)))

    def finish(self, request_id: str, key: str, node_id: str, now: float) -> Finished:
        """Request `request_id` (node `node_id` of workflow `key`) ended."""
        # `router.on_finish` with the workflow looked up once: what it finds is the
        # workflow `mark_finished` records the node in, and the one this request ended
        # if that closed it (it is then where `get` finds it, unless already forgotten).
        registry = self.ctx.workflows
        before = registry.active.get(key)
        registered = before is not None and before.workflow is not None
        self.router.request_ended(request_id, now)
        if before is None:
            return Finished([], registered, None)
        ready = registry.mark_finished_in(key, before, node_id, now)
        ended = (
            before
            if registered and before.finished_s == now and registry.get(key) is before
            else None
        )
        return Finished(ready, registered, ended)

    @property
    def decision_us(self) -> Sequence[float]:
        return self.router.decision_us
