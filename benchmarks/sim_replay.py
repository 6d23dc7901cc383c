"""Replay a trace through simulated vLLM engines under a policy (virtual clock).

The driver owns the clock and the event queue; the router, policy and engines are the
same objects the live path uses. Runs are deterministic for a given trace and policy.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wasma.core.profile import Profile
from wasma.core.tokens import BlockHasher
from wasma.engines.base import DEFAULT_RETAIN_S
from wasma.engines.sim.core import SimEngineCore, SimRequest
from wasma.scheduler.copies import CopySchedule
from wasma.scheduler.dispatch import Dispatcher, DispatcherConfig, HeldQueue
from wasma.scheduler.policy import RequestInfo
from wasma.scheduler.pricing import DeviceMappedPricer, TransferPricer, hgx_devices
from wasma.scheduler.registry import PolicyRegistry
from wasma.scheduler.workflow import Workflow


@dataclass(slots=True)
class RequestRecord:
    workflow_id: str
    node_id: str
    engine: int
    kind: str
    submit_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    prefill_tokens_computed: int
    preemptions: int
    transferred_bytes: int
    cpu_hit_tokens: int = 0  # of `cached_tokens`, those loaded from the CPU tier


@dataclass(slots=True)
class WorkflowRecord:
    workflow_id: str
    app: str
    arrival_s: float
    deadline_s: float  # relative to arrival
    finish_s: float

    @property
    def latency_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def met(self) -> bool:
        return self.latency_s <= self.deadline_s


@dataclass
class RunResult:
    policy: str
    engines: int
    profile: str
    rate_scale: float
    requests: list[RequestRecord]
    workflows: list[WorkflowRecord]
    decision_us: list[float]
    wall_s: float
    engine_steps: int
    engine_prefix_queries: int = 0
    engine_prefix_hits: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # Set when the run stopped early because its deadline attainment could no longer
    # reach `SimReplay(stop_below=...)`: `requests` and `workflows` then hold only what
    # had finished by `cut_at_s`, and `missed` counts the units (workflows, or nodes with
    # their own deadline) certain to miss theirs, finished or not, out of `units`.
    cut_short: bool = False
    cut_at_s: float = 0.0
    missed: int = 0
    units: int = 0


_STEP, _READY, _WAKE = 0, 1, 2
_NEVER = float("inf")


@dataclass(slots=True)
class _Retention:
    """KV a request asked its engine to keep (`Placement.retain`)."""

    engine: int
    chain: list[int]
    use_at: float  # when its readers are expected to start (steps-to-use order)
    lease_s: float  # how long after the request finishes the engine keeps it


def topology_pricer(engines: Sequence[str], preset: str = "hgx-h100") -> TransferPricer:
    """The transfer planner on HGX nodes (8 GPUs on NVSwitch, 8x400G NICs a node)."""
    from wasma.transfer import Planner, build_preset

    nodes = -(-len(engines) // 8)
    return DeviceMappedPricer(Planner(build_preset(preset, nodes)), hgx_devices(engines))


class SimReplay:
    """One simulated run: a trace, a policy, N engines of one profile.

    `workflows` is a collection (replayed in arrival order) or an iterator already in
    arrival order (`apps.iter_generate`), read one workflow ahead of the clock. Either
    way the replay lets go of each workflow once it has finished (the dispatcher keeps
    the last `keep_finished`), so what a long run holds is its live state, not its trace.
    """

    def __init__(
        self,
        workflows: Iterable[Workflow],
        policy: str,
        num_engines: int,
        profile: Profile,
        rate_scale: float = 1.0,
        params: Mapping[str, Any] | None = None,
        registry: PolicyRegistry | None = None,
        pricer: TransferPricer | None = None,
        fast_forward: bool = True,
        engine_policy: str = "priority",
        index_cap: int = 4_000_000,
        retain_lease_s: float = DEFAULT_RETAIN_S,
        register_dags: bool = True,
        stop_below: float | None = None,
    ) -> None:
        if num_engines <= 0:
            raise ValueError("need at least one engine")
        if rate_scale <= 0:
            raise ValueError("rate_scale must be positive")
        self._stream: Iterator[Workflow] | None = None
        self._last_arrival = -float("inf")
        if isinstance(workflows, Iterator) and stop_below is None:
            self._stream = workflows
            self._pending: deque[Workflow] = deque()
        else:  # (`stop_below` needs every deadline up front)
            self._pending = deque(sorted(workflows, key=lambda w: w.arrival_s))
        self.profile = profile
        self.rate_scale = rate_scale
        names = [f"e{i}" for i in range(num_engines)]
        self.names = names
        self.dispatch = Dispatcher(
            names,
            profile,
            DispatcherConfig(
                policy=policy,
                params=dict(params or {}),
                num_kv_blocks=profile.num_kv_blocks - 1,
                relay_copies=True,
                keep_finished=1000,
                index_cap=index_cap,
            ),
            registry=registry,
            pricer=pricer or topology_pricer(names),
        )
        self.ctx = self.dispatch.ctx
        self.policy_name = policy
        self.router = self.dispatch.router
        sink = self.dispatch.on_kv_event
        # Every engine's free queue starts as the same block ids: one list of them (one
        # int object an id) for all, not one an engine.
        ids = list(range(profile.num_kv_blocks))
        self.engines = [
            SimEngineCore(
                n, profile, engine_policy, kv_sink=sink, fast_forward=fast_forward, block_ids=ids
            )
            for n in names
        ]
        self.hasher = BlockHasher(profile.block_size)
        # When copies really land: each engine's link sends one copy (or one broadcast
        # group) at a time, as the planner prices it. The router keeps its own book of
        # the same copies to price placements; this one is the simulated network.
        assert self.ctx.pricer is not None
        self.links = CopySchedule(self.ctx.pricer, relay=True)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self._gen = [0] * num_engines
        self._meta: dict[str, tuple[Workflow, str, str, int]] = {}
        self._left: dict[str, int] = {}
        self._arrival: dict[str, float] = {}
        # KV retention, as the live router asks vLLM for it (engines/vllm_retention.py):
        # a request the policy marks `retain` has its chain kept behind every ordinary
        # free block on its engine from placement until the first of
        #  - its lease (`Placement.retain_s`; else `retain_lease_s`) after it finishes;
        #  - the router's release once every request extending its context has started
        #    (`Router.retention`), which reaches the engine with the next request placed
        #    there, as it does a vLLM server.
        # Among retained blocks, those wanted latest are evicted first
        # (`Placement.retain_use_s`, steps-to-use).
        self.retain_lease_s = retain_lease_s
        self._retain: dict[str, _Retention] = {}  # request id -> its retention
        # With `register_dags` off the router sees what an agent that never registers its
        # DAG sends (POST /v1/workflows is optional): each request's workflow id, node id,
        # parents, app and deadline. wasma then plans from the app shapes it learns as
        # workflows finish. The driver, being the agent, still knows when a child is ready.
        self.register_dags = register_dags
        self._finished_nodes: dict[str, set[str]] = {}
        # (end, seq, request id): kept apart from the event heap, so that a lease still
        # running never counts as work that could free capacity for held requests.
        self._leases: list[tuple[float, int, str]] = []
        self._macro: set[int] = set()  # engines in a macro step, synced before decisions
        # Requests the policy held back (deadline-aware admission): (workflow, node, since).
        self._held: HeldQueue[tuple[Workflow, str, float]] = HeldQueue()
        self.held_total = 0
        self.records: list[RequestRecord] = []
        self.wf_records: list[WorkflowRecord] = []
        # A capacity probe needs only its verdict (attainment >= a threshold): with
        # `stop_below` set, the run stops as soon as so many units have missed their
        # deadlines that attainment stays below `stop_below` whatever follows. A unit has
        # missed once it finishes late, or once the clock passes its deadline unfinished.
        self.stop_below = stop_below
        self._deadlines: list[tuple[float, float, float, tuple[str, str]]] = []
        if stop_below is not None:
            for wf in self._pending:
                for nid, nd in wf.nodes.items():
                    if nd.deadline_s is not None:
                        assert nd.arrival_s is not None
                        a = nd.arrival_s / rate_scale
                        unit = (wf.workflow_id, nid)
                        self._deadlines.append((a + nd.deadline_s, a, nd.deadline_s, unit))
                if any(nd.deadline_s is None for nd in wf.nodes.values()):
                    a = wf.arrival_s / rate_scale
                    unit = (wf.workflow_id, "")
                    self._deadlines.append((a + wf.deadline_s, a, wf.deadline_s, unit))
            self._deadlines.sort()
        self._units = len(self._deadlines)
        # unit (workflow id, node id with its own deadline or "") -> True once finished,
        # False once counted missed while unfinished
        self._settled: dict[tuple[str, str], bool] = {}
        self._missed = 0

    # -- event plumbing --------------------------------------------------------------
    def _push(self, t: float, kind: int, payload: Any) -> None:
        heapq.heappush(self._heap, (t, self._seq, kind, payload))
        self._seq += 1

    def _start(self, slot: int, now: float) -> None:
        core = self.engines[slot]
        end = core.start_step(now)
        if core.in_macro:
            self._macro.add(slot)
        if end >= 0:
            self._gen[slot] += 1
            self._push(end, _STEP, (slot, self._gen[slot]))

    def _add(self, slot: int, req: SimRequest, now: float) -> None:
        core = self.engines[slot]
        core.add_request(req, now)
        if not core.busy:
            self._start(slot, now)
        else:
            end = core.interrupt(now)
            if end is not None:
                self._gen[slot] += 1
                self._push(end, _STEP, (slot, self._gen[slot]))

    # -- workflow logic --------------------------------------------------------------
    def _submit(
        self,
        wf: Workflow,
        node_id: str,
        now: float,
        held_since: float | None = None,
        force: bool = False,
    ) -> None:
        bs = self.profile.block_size
        full = self.hasher.chain(wf.context_span(node_id))
        prompt_tokens = wf.prompt_tokens(node_id)
        own = wf.nodes[node_id]
        output = own.output_tokens
        rid = f"{wf.workflow_id}/{node_id}"
        wst = self.ctx.workflows.get(wf.workflow_id)
        if wst is None and not self.register_dags:
            # A live router opens an unregistered workflow at its first request, with the
            # deadline that request carries (relative to the workflow's start).
            wst = self.dispatch.open_request(
                wf.workflow_id, wf.app, wf.deadline_s, wf.arrival_s / self.rate_scale, track=False
            )
        deadline = wst.deadline_s if wst is not None else float("inf")
        if own.deadline_s is not None:
            assert own.arrival_s is not None  # checked together by Workflow.create
            deadline = own.arrival_s / self.rate_scale + own.deadline_s
        info = RequestInfo(
            request_id=rid,
            workflow_id=wf.workflow_id,
            node_id=node_id,
            app=wf.app,
            prompt_tokens=prompt_tokens,
            max_tokens=output,
            block_hashes=full[: prompt_tokens // bs],
            arrival_s=now,
            deadline_s=deadline,
            parents=own.parents,
        )
        # Engines in a macro step bring their KV (and its events) up to now first.
        engines = self.engines
        # (Most have nothing to apply yet: `sync_at` says so without the call. An engine
        # with a CPU tier is synced anyway, as the sync also sets its tier's clock.)
        for slot in self._macro:
            core = engines[slot]
            if now >= core.sync_at or core.cpu is not None:
                core.sync(now)
        decision = self.dispatch.place(info, now, force)
        placement = decision.placement
        if decision.held:
            self._held.push(placement, (wf, node_id, held_since or now))
            self.held_total += 1
            return
        req = SimRequest(rid, full, prompt_tokens, output, priority=placement.priority)
        req.prefetch = placement.prefetch
        for key in decision.release:
            self._end_retention(key, now)
        if placement.retain:
            use = placement.retain_use_s
            use_at = _NEVER if use is None else now + use
            self.engines[placement.engine].kv.retain(full, use_at)
            lease = placement.lease_s(self.retain_lease_s)
            self._retain[rid] = _Retention(placement.engine, full, use_at, lease)
        moved = 0
        self._meta[rid] = (wf, node_id, placement.kind.value, 0)
        if placement.transfer is not None and placement.transfer.num_blocks > 0:
            tr = placement.transfer
            moved = tr.num_bytes
            self._meta[rid] = (wf, node_id, placement.kind.value, moved)
            landed = self.links.book(
                self.names[tr.src],
                self.names[placement.engine],
                full,
                tr.num_blocks,
                tr.num_bytes,
                now,
                tr.broadcast,
            )
            self._push(landed.ready_s, _READY, (placement.engine, req, full[: tr.num_blocks], now))
        else:
            req.arrival_time = now
            self._add(placement.engine, req, now)
        if held_since is not None:
            self._arrival[rid] = held_since

    def _on_finished(self, slot: int, req: SimRequest, now: float) -> None:
        wf, node_id, kind, moved = self._meta.pop(req.request_id)
        kept = self._retain.get(req.request_id)
        if kept is not None:
            heapq.heappush(self._leases, (now + kept.lease_s, self._seq, req.request_id))
            self._seq += 1
        submit = self._arrival.pop(req.request_id, req.arrival_time)
        self.records.append(
            RequestRecord(
                wf.workflow_id,
                node_id,
                slot,
                kind,
                submit,
                req.first_token_time,
                now,
                req.num_prompt_tokens,
                req.num_output_tokens,
                max(req.num_cached_tokens, 0),
                req.prefill_tokens_computed,
                req.num_preemptions,
                moved,
                req.num_cpu_hit_tokens if req.num_cached_tokens > 0 else 0,
            )
        )
        own = wf.nodes[node_id]
        if own.deadline_s is not None:
            # A node with its own arrival and deadline is a unit of its own (a turn of a
            # session): its record is its arrival to its last token.
            assert own.arrival_s is not None
            self._record(
                WorkflowRecord(
                    f"{wf.workflow_id}/{node_id}",
                    wf.app,
                    own.arrival_s / self.rate_scale,
                    own.deadline_s,
                    now,
                ),
                (wf.workflow_id, node_id),
            )
        ready = self.dispatch.finish(req.request_id, wf.workflow_id, node_id, now).ready
        if not self.register_dags:
            done = self._finished_nodes.setdefault(wf.workflow_id, set())
            done.add(node_id)
            ready = wf.ready_children(node_id, done.__contains__)
        self._left[wf.workflow_id] -= 1
        if self._left[wf.workflow_id] == 0:
            del self._left[wf.workflow_id]
            if not self.register_dags:
                # The agent's run is over: the router learns the app's shape from it.
                self._finished_nodes.pop(wf.workflow_id, None)
                self.dispatch.close_live(wf.workflow_id, now)
            if any(n.deadline_s is None for n in wf.nodes.values()):
                # (where every node has its own deadline, each was accounted on its own)
                arrival = wf.arrival_s / self.rate_scale
                rec = WorkflowRecord(wf.workflow_id, wf.app, arrival, wf.deadline_s, now)
                self._record(rec, (wf.workflow_id, ""))
        for child in ready:
            self._when_due(wf, child, now)
        self._release_held(now)

    def _record(self, rec: WorkflowRecord, unit: tuple[str, str]) -> None:
        self.wf_records.append(rec)
        # (a unit already counted when its deadline passed is not counted twice)
        if self.stop_below is not None and self._settled.setdefault(unit, True) and not rec.met:
            self._missed += 1

    def _expire(self, now: float, at: int) -> int:
        """Count the units whose deadline `now` has passed unfinished, from `at` in the
        deadline order; the index of the first not yet passed."""
        dl = self._deadlines
        settled = self._settled
        while at < len(dl):
            _end, arrival, deadline, key = dl[at]
            # `now - arrival`, as `WorkflowRecord.met` computes a latency: such a unit's
            # finish is at least `now`, so its latency exceeds its deadline too.
            if not now - arrival > deadline:
                break
            if key not in settled:
                settled[key] = False
                self._missed += 1
            at += 1
        return at

    def _doomed(self) -> bool:
        """Attainment can no longer reach `stop_below` (tested as `summarize` computes it:
        met / units, met at most units - missed)."""
        assert self.stop_below is not None
        return (self._units - self._missed) / self._units < self.stop_below

    def _end_retention(self, rid: str, now: float) -> None:
        kept = self._retain.pop(rid, None)
        if kept is None:
            return
        self.engines[kept.engine].sync(now)  # a macro step brings its KV up to now
        self.engines[kept.engine].kv.release(kept.chain, kept.use_at)

    def _release_held(self, now: float, force_first: bool = False) -> None:
        """Capacity freed: offer held requests again, most urgent first, until the
        policy holds one back again. `force_first` dispatches the first whatever the
        policy says."""
        held = self._held
        force = force_first
        while held:
            ticket = held.pop()
            assert ticket is not None
            wf, node_id, since = ticket
            before = len(held)
            self._submit(wf, node_id, now, held_since=since, force=force)
            force = False
            if len(held) > before:
                return

    def _arrive(self, wf: Workflow, now: float) -> None:
        if self.register_dags:
            self.dispatch.register(wf, wf.workflow_id, now)
        self._left[wf.workflow_id] = len(wf.nodes)
        for root in wf.roots():
            self._when_due(wf, root, now)

    def _when_due(self, wf: Workflow, node_id: str, now: float) -> None:
        """Submit a ready node now, or at its own arrival if that is still to come."""
        arrival = wf.nodes[node_id].arrival_s
        due = -1.0 if arrival is None else arrival / self.rate_scale
        if due > now:
            self._push(due, _WAKE, (wf, node_id))
        else:
            self._submit(wf, node_id, now)

    # -- main loop -------------------------------------------------------------------
    def _next_workflow(self) -> Workflow | None:
        """The next workflow to arrive, no longer held here (None: none left)."""
        if self._pending:
            return self._pending.popleft()
        if self._stream is None:
            return None
        wf = next(self._stream, None)
        if wf is not None:
            if wf.arrival_s < self._last_arrival:
                raise ValueError(
                    f"workflow {wf.workflow_id} arrives at {wf.arrival_s}, before the one "
                    f"read ahead of it ({self._last_arrival}): an iterator must be in arrival order"
                )
            self._last_arrival = wf.arrival_s
        return wf

    def run(self) -> RunResult:
        t_wall = time.perf_counter()
        nxt = self._next_workflow()
        heap = self._heap
        scale = self.rate_scale
        engines, dispatch = self.engines, self.dispatch
        leases = self._leases
        # Deadline watch (only with `stop_below`): the next deadline to pass, in the order
        # of `_deadlines`, and when.
        at = 0
        dl = self._deadlines
        next_due = dl[0][0] if dl else _NEVER
        missed = 0
        cut_at: float | None = None
        while nxt is not None or heap:
            next_arrival = nxt.arrival_s / scale if nxt is not None else float("inf")
            if leases and leases[0][0] <= min(next_arrival, heap[0][0] if heap else next_arrival):
                end, _seq, rid = heapq.heappop(leases)
                self._end_retention(rid, end)
                continue
            if heap and heap[0][0] <= next_arrival:
                now, _seq, kind, payload = heapq.heappop(heap)
                if kind == _STEP:
                    slot, gen = payload
                    if gen != self._gen[slot]:
                        continue
                    core = engines[slot]
                    self._macro.discard(slot)
                    out = core.complete_step(now)
                    # (what `dispatch.on_stats(slot, core.stats())` reads, without the
                    # report built: one an engine step)
                    kv = core.kv
                    dispatch.on_load(
                        slot, len(core.running), core.num_waiting, kv.usage, kv.num_blocks
                    )
                    for req in out.first_tokens:
                        dispatch.on_first_token(req.request_id)
                    for req in out.finished:
                        if req.first_token_time < 0:
                            dispatch.on_first_token(req.request_id)
                        self._on_finished(slot, req, now)
                    if not core.busy and core.has_work():
                        self._start(slot, now)
                elif kind == _WAKE:
                    wf, node_id = payload
                    self._submit(wf, node_id, now)
                else:
                    slot, req, hashes, submitted = payload
                    engines[slot].sync(now)
                    req.pinned_blocks = engines[slot].kv.seed_pinned(hashes)
                    self._arrival.setdefault(req.request_id, submitted)
                    self._add(slot, req, now)
            else:
                now = next_arrival
                assert nxt is not None
                self._arrive(nxt, now)
                nxt = self._next_workflow()
            if not heap and self._held and nxt is None:
                # Nothing runs and nothing arrives that could free capacity: a held
                # request would wait forever. Policies should not hold for an idle
                # cluster; this keeps a run finite (and every request completed) if one does.
                self._release_held(now, force_first=True)
            if now >= next_due or self._missed != missed:
                at = self._expire(now, at)
                next_due = dl[at][0] if at < len(dl) else _NEVER
                missed = self._missed
                # (a run already at its end is left to finish as a full run)
                if self._doomed() and (nxt is not None or heap):
                    cut_at = now
                    break
        if self._left and cut_at is None:
            raise RuntimeError(f"{len(self._left)} workflows never finished (simulator bug)")
        return RunResult(
            policy=self.policy_name,
            engines=len(engines),
            profile=self.profile.name,
            rate_scale=self.rate_scale,
            requests=self.records,
            workflows=self.wf_records,
            decision_us=list(dispatch.decision_us),
            wall_s=time.perf_counter() - t_wall,
            engine_steps=sum(e.steps for e in engines),
            engine_prefix_queries=sum(e.kv.queries_tokens for e in engines),
            engine_prefix_hits=sum(e.kv.hits_tokens for e in engines),
            cut_short=cut_at is not None,
            cut_at_s=cut_at or 0.0,
            missed=self._missed,
            units=self._units,
        )
