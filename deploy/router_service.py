"""The live router: `scheduler.Router` driven by real requests on the wall clock.

It owns the engines, places each request with the policy, streams the engine's tokens
back, and keeps the cluster view current: KV events feed the prefix index, a background
task polls engine stats and health, and every request's start and end moves the load
counters. Workflows come from request metadata (live, one node at a time) or are
registered whole ahead of their requests (`register_workflow`).

Runs in-process (tests, `--router-in-process`) or as an async Ray actor (`RouterActor`),
whose methods are this class's; nothing here knows which.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import itertools
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from wasma.deploy.journal import WorkflowJournal
from wasma.deploy.metadata import WorkflowIdentity
from wasma.deploy.metrics import WasmaMetrics
from wasma.engines.base import (
    DEFAULT_RETAIN_S,
    EngineCall,
    EngineClient,
    GenerateRequest,
    KVEvent,
    TokenChunk,
)
from wasma.engines.sim.profile import Profile
from wasma.scheduler.calibration import CalibrationConfig, CostCalibrator, RequestTiming
from wasma.scheduler.policy import (
    NoHealthyEngine,
    Placement,
    PolicyContext,
    RequestInfo,
)
from wasma.scheduler.prefix_index import PrefixIndex
from wasma.scheduler.pricing import TransferPricer
from wasma.scheduler.registry import PolicyRegistry, default_registry
from wasma.scheduler.router import Router
from wasma.scheduler.state import ClusterState
from wasma.scheduler.tokens import hash_token_blocks
from wasma.scheduler.workflow import Workflow, WorkflowError
from wasma.scheduler.workflows import WorkflowRegistry, WorkflowState

log = logging.getLogger(__name__)

# Policies that derive constants from the profile when built (wasma: its per-token
# prefill price, its critical-path cache), so a recalibrated profile reaches them only
# through a fresh instance. The baselines never read the profile; rebuilding them would
# only reset their state (rotation counters, the prefix tree).
_COST_MODEL_POLICIES = frozenset({"wasma"})


# -- errors (mapped to HTTP statuses by the gateway; picklable across Ray) -------------


class ServiceError(Exception):
    status = 500
    code: str | None = None

    def __init__(self, message: str, param: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.message, self.param, self.retry_after_s))


class BadRequest(ServiceError):
    status = 400


class NotFound(ServiceError):
    status = 404
    code = "not_found"


class Conflict(ServiceError):
    status = 409
    code = "conflict"


class Overloaded(ServiceError):
    status = 429
    code = "overloaded"


class Unavailable(ServiceError):
    status = 503
    code = "no_healthy_engine"


# -- requests and results ------------------------------------------------------------


@dataclass(slots=True)
class ServiceRequest:
    """One request as the gateway hands it to the router (already tokenised)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    identity: WorkflowIdentity = field(default_factory=WorkflowIdentity)
    tenant: str = ""  # workflow ids are scoped per API key ("" when the gateway is open)
    temperature: float = 0.0
    ignore_eos: bool = False
    extra: dict[str, object] = field(default_factory=dict)
    # The client's API request, for engines that answer it themselves (pass-through).
    call: EngineCall | None = None
    # The engine (by name) that must serve it, whatever the policy prefers.
    pin_engine: str | None = None


@dataclass(slots=True)
class ServiceResult:
    """A finished non-streamed request."""

    engine: str
    kind: str
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int
    text: str = ""
    raw: bytes = b""  # a passed-through answer's body, and its HTTP status
    status: int = 0


class _EngineFault(Exception):
    """An engine failed a request by its own fault (died, hung, errored): the request may
    move to another engine. Never raised for the client's own mistakes."""

    def __init__(self, slot: int, cause: BaseException | str) -> None:
        super().__init__(str(cause))
        self.slot = slot
        self.cause = cause


@dataclass(slots=True)
class _Live:
    """A request between dispatch and finish."""

    req: ServiceRequest
    slot: int
    wkey: str
    node_id: str
    start_s: float
    info: RequestInfo | None = None
    first_s: float | None = None
    cached: int = 0
    n_out: int = 0
    failed: bool = False
    cancelled: bool = False  # the caller left before the engine finished
    # Output ids sent so far: a request cut mid-stream continues elsewhere from them.
    out_ids: list[int] = field(default_factory=list)
    raw_sent: bool = False  # a passed-through answer has bytes out already
    failovers: int = 0
    last_s: float = 0.0  # when the request last got a chunk (or was placed)
    # The running wait for this request's next chunk; rescheduled to "now" to pull the
    # request off an engine the health check found dead or hung.
    waiting: asyncio.Timeout | None = None
    # Its engine's load when it was placed, excluding itself (prefill tokens queued
    # ahead, requests, KV tokens): what cost calibration compares the timings against.
    load_at_dispatch: tuple[int, int, int] = (0, 0, 0)
    busy_neighbours: int = 0  # other engines busy on its engine's host, at dispatch


class RouterStream:
    """A placed request's token stream; `aclose()` (always called) settles the books."""

    def __init__(
        self,
        service: RouterService,
        live: _Live,
        engine: str,
        kind: str,
        gen: AsyncIterator[TokenChunk],
        first: TokenChunk,
    ) -> None:
        self.engine = engine
        self.kind = kind
        self.request_id = live.req.request_id
        self._service = service
        self._live = live
        self._gen: AsyncIterator[TokenChunk] = gen
        self._first: TokenChunk | None = first
        self._done = first.finished
        self._closed = False
        self.resumed = 0  # times the stream moved to another engine mid-request

    def __aiter__(self) -> RouterStream:
        return self

    async def __anext__(self) -> TokenChunk:
        if self._first is not None:
            chunk, self._first = self._first, None
            return chunk
        if self._done:
            raise StopAsyncIteration
        service, live = self._service, self._live
        while True:
            try:
                chunk = await service._next_chunk(live, self._gen)
                break
            except _EngineFault as fault:
                if live.failed or (live.req.call is not None and live.raw_sent):
                    # A passed-through answer half sent cannot be continued elsewhere:
                    # its bytes are the engine's own, not tokens to resume from.
                    live.failed = True
                    raise Unavailable(str(fault), None, 1.0) from None
                # Continue on another engine from the tokens already sent: the client
                # sees one stream, whatever happened behind it.
                await _aclose(self._gen)
                try:
                    self._gen, chunk = await service._failover(live, fault)
                except ServiceError:
                    live.failed = True
                    raise
                self.engine = service.engines[live.slot].name
                self.resumed += 1
                break
        service._on_chunk(live, chunk)
        if chunk.finished:
            self._done = True
        return chunk

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._done:
            self._live.cancelled = True
        try:
            await _aclose(self._gen)  # aborts the engine's work if the client left early
        finally:
            self._service._finish(self._live)


async def _empty() -> AsyncIterator[TokenChunk]:
    return
    yield  # an async generator with nothing in it


def _expire(live: _Live) -> None:
    """End `live`'s wait for its engine now (it moves to another engine)."""
    waiting = live.waiting
    if waiting is not None and not waiting.expired():
        waiting.reschedule(asyncio.get_running_loop().time())


async def _aclose(gen: AsyncIterator[TokenChunk]) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()


# -- the service ---------------------------------------------------------------------


class RouterService:
    """Places requests on engines with a policy and tracks them to the end."""

    def __init__(
        self,
        engines: Sequence[EngineClient],
        profile: Profile,
        *,
        policy: str = "wasma",
        params: Mapping[str, Any] | None = None,
        metrics: WasmaMetrics | None = None,
        registry: PolicyRegistry | None = None,
        pricer: TransferPricer | None = None,
        max_outstanding: int = 8192,
        stats_interval_s: float = 0.25,
        idle_workflow_s: float = 60.0,
        request_timeout_s: float = 60.0,
        health_timeout_s: float = 5.0,
        max_failovers: int = 3,
        breaker_base_s: float = 1.0,
        breaker_max_s: float = 30.0,
        journal: WorkflowJournal | None = None,
        calibration: CalibrationConfig | bool | None = None,
        held_recheck_s: float = 0.5,
        max_hold_s: float = 300.0,
        retain_lease_s: float = DEFAULT_RETAIN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not engines:
            raise ValueError("the router needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        sizes = {e.block_size for e in engines}
        if len(sizes) != 1:
            raise ValueError(f"engines disagree on block size: {sorted(sizes)}")
        self.block_size = sizes.pop()
        if profile.block_size != self.block_size:
            # The policy's cost model must count blocks the way the engines cache them.
            profile = replace(profile, block_size=self.block_size)
        self.engines = list(engines)
        lens = [n for n in map(_max_model_len, self.engines) if n]
        # Checked here because vLLM's engine (unlike its HTTP server) silently shortens
        # a request that does not fit instead of refusing it.
        self.max_model_len = min(lens) if lens else None
        self.policy_name = policy
        self.metrics = metrics or WasmaMetrics()
        self._clock = clock
        self._t0 = clock()
        state = ClusterState(
            names, num_kv_blocks=profile.num_kv_blocks, hosts=[e.shared_host for e in engines]
        )
        # Policies order KV moves only when given a pricer, and `build_service` gives one
        # only when every engine runs the wasma connector (`--kv-transfer`) and so can
        # carry a move out.
        self.ctx = PolicyContext(
            state=state,
            index=PrefixIndex(names),
            workflows=WorkflowRegistry(keep_finished=10_000),
            profile=profile,
            pricer=pricer,
            params=dict(params or {}),
            # Requests may wait here: deadline-aware admission (see `_admit`).
            can_defer=True,
        )
        self._registry = registry or default_registry()
        self.router = Router(self.ctx, self._registry.create(policy, self.ctx))
        self._fitted_profile = profile
        self.calibrator: CostCalibrator | None = None
        self.recalibrations = 0
        self.set_calibration(calibration)
        self.max_outstanding = max_outstanding
        self.stats_interval_s = stats_interval_s
        # The last KV load (EngineStats.kv_loads) counted into the metrics, per engine.
        self._kv_loads_seen: dict[str, int] = {}
        self.idle_workflow_s = idle_workflow_s
        # A request waiting this long for its next chunk (the first one included) while
        # its engine produced nothing for anyone counts the engine as stalled, and moves;
        # an engine busy with others only stalls a request past 5x this.
        self.request_timeout_s = request_timeout_s
        self._progress = [0.0] * len(self.engines)  # an engine's last chunk, any request
        self.health_timeout_s = health_timeout_s
        self.max_failovers = max_failovers
        # Circuit breaker per engine: consecutive failures of the engine's own making
        # keep it out of rotation for base * 2^(n-1) seconds (capped), even when its
        # health check says ok; a request it serves to the end closes the breaker.
        self.breaker_base_s = breaker_base_s
        self.breaker_max_s = breaker_max_s
        self._fails = [0] * len(self.engines)
        self._open_until = [0.0] * len(self.engines)
        self.failovers = 0
        self.engine_faults = 0
        # Registered DAGs and their finished nodes, replayed by a restarted router.
        self.journal = journal
        self._journal_replayed = False
        self._live: dict[str, _Live] = {}
        # Requests the policy holds at the router (deadline-aware admission): a heap of
        # (priority, arrival order, the future that wakes it).
        self._held: list[tuple[int, int, asyncio.Future[None]]] = []
        self._held_seq = itertools.count()
        self._held_n = 0
        self._held_ids: set[str] = set()
        self.held_total = 0  # requests that waited at the router before going live
        self.held_recheck_s = held_recheck_s
        # A held request goes through after this long even while engines are busy: its
        # client is waiting on an open connection, and would otherwise time out on work
        # that was accepted (a hopeless workflow can be held as long as overload lasts).
        if not max_hold_s > 0:
            raise ValueError(f"max_hold_s must be > 0, got {max_hold_s!r}")
        self.max_hold_s = max_hold_s
        # How long after it finishes an engine keeps the KV of a request the policy marks
        # `retain`, when the policy does not size the lease itself (`Placement.retain_s`).
        # A lease lapses by itself if the router goes away. The simulator keeps the same.
        self.retain_lease_s = retain_lease_s
        # Live workflows (no registered DAG): key -> [outstanding requests, last activity].
        self._open_wf: dict[str, list[float]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        for engine in self.engines:
            engine.subscribe_kv_events(self._on_kv_event)

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        if not self._tasks:
            self._tasks = [
                self._loop.create_task(self._poll_engines()),
                self._loop.create_task(self._sweep_workflows()),
            ]
        if self.journal is not None and not self._journal_replayed:
            self._journal_replayed = True
            self._replay_journal()
        await self._refresh_engines()

    def _replay_journal(self) -> None:
        assert self.journal is not None
        now = self.now()
        registry = self.ctx.workflows
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
                    ns.engine = engine if 0 <= engine < len(self.engines) else None
                    ns.submitted_s = ns.finished_s = now
            log.info("journal: workflow %s back with %d nodes done", key, len(entry["finished"]))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self.journal is not None:
            self.journal.close()
        await asyncio.gather(*(e.close() for e in self.engines), return_exceptions=True)

    def now(self) -> float:
        return self._clock() - self._t0

    # -- cluster view ----------------------------------------------------------------
    def _on_kv_event(self, event: KVEvent) -> None:
        # Engines may publish from their own threads (ZMQ, Ray); the index is not locked.
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.router.on_kv_event, event)
        else:
            self.router.on_kv_event(event)

    async def _refresh_engines(self) -> None:
        state = self.ctx.state

        async def one(slot: int, engine: EngineClient) -> None:
            timeout = self.health_timeout_s
            try:
                ok = await asyncio.wait_for(engine.healthy(), timeout=timeout)
                stats = await asyncio.wait_for(engine.stats(), timeout=timeout) if ok else None
            except Exception as exc:  # an engine's failure must not stop the poller
                log.warning("engine %s: health/stats failed: %r", engine.name, exc)
                ok, stats = False, None
            if not ok:
                # Dead or hung: pull its requests off now rather than at their timeouts.
                self._mark_down(slot, "health check failed")
            elif not state.loads[slot].healthy and self.now() >= self._open_until[slot]:
                log.info("engine %s is back", engine.name)
                state.set_healthy(slot, True)
                self.metrics.set_engine_up(engine.name, True)
            if stats is not None:
                kv = stats.kv_usage
                # An engine's own report, possibly NaN or out of range over HTTP: the
                # policy and the gauge take a fraction in [0, 1].
                kv = min(max(kv, 0.0), 1.0) if math.isfinite(kv) else 0.0
                if kv != stats.kv_usage:
                    stats = replace(stats, kv_usage=kv)
                state.on_stats(slot, stats)
                self._observe_kv_loads(engine.name, stats.kv_loads)
            load = state.loads[slot]
            self.metrics.set_engine(
                engine.name,
                outstanding=load.outstanding,
                running=None if stats is None else stats.num_running,
                waiting=None if stats is None else stats.num_waiting,
                kv_usage=None if stats is None else stats.kv_usage,
            )

        await asyncio.gather(*(one(i, e) for i, e in enumerate(self.engines)))

    def _observe_kv_loads(self, engine: str, loads: tuple[tuple[int, int, float], ...]) -> None:
        """Count the engine's KV loads from peers not counted yet (transfer bytes and
        seconds, as its connector measured them)."""
        seen = self._kv_loads_seen.get(engine, 0)
        if loads and loads[-1][0] < seen:
            seen = 0  # a new engine process numbers its loads from 1 again
        for seq, nbytes, seconds in loads:
            if seq > seen:
                self.metrics.observe_transfer(nbytes, seconds)
                seen = seq
        self._kv_loads_seen[engine] = seen

    async def _poll_engines(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            try:
                self._check_stalls()
                await self._refresh_engines()
            except Exception:
                # The poller is what finds stalled requests and brings engines back: one
                # bad report must not end it for the life of the service.
                log.exception("engine poll failed; polling goes on")

    def _check_stalls(self) -> None:
        now = self.now()
        limit = self.request_timeout_s
        for live in list(self._live.values()):
            if live.waiting is None:
                continue
            waited = now - live.last_s
            quiet = now - max(live.last_s, self._progress[live.slot])
            if quiet > limit or waited > 5 * limit:
                if self.ctx.state.loads[live.slot].healthy:
                    self._engine_failed(live.slot, f"no output for {waited:.1f} s")
                _expire(live)

    def _engine_failed(self, slot: int, exc: BaseException | str) -> None:
        """A request failed by the engine's fault: count it on the breaker."""
        self.engine_faults += 1
        if not self.ctx.state.loads[slot].healthy:
            # Already out: the other requests it held fail with it, one outage not many.
            log.info("engine %s failed a request while out: %r", self.engines[slot].name, exc)
            return
        self._fails[slot] += 1
        backoff = self.breaker_base_s * 2 ** min(self._fails[slot] - 1, 16)
        self._open_until[slot] = self.now() + min(backoff, self.breaker_max_s)
        log.warning("engine %s failed a request: %r", self.engines[slot].name, exc)
        self._mark_down(slot, str(exc))

    def _mark_down(self, slot: int, why: str) -> None:
        """Out of rotation until a health check after the breaker's cool-down says it is
        back; its cache is unreachable (or gone), so its prefixes leave the index."""
        state = self.ctx.state
        if state.loads[slot].healthy:
            log.warning("engine %s out of rotation: %s", self.engines[slot].name, why)
            state.set_healthy(slot, False)
            self.ctx.index.remove_engine_blocks(self.engines[slot].name)
            self.metrics.set_engine_up(self.engines[slot].name, False)
            self.metrics.forget_engine_reports(self.engines[slot].name)
            self.router.retention.engine_lost(slot)
        self._open_until[slot] = max(self._open_until[slot], self.now() + self.breaker_base_s)
        for live in self._live.values():
            if live.slot == slot:
                _expire(live)

    def _engine_ok(self, slot: int) -> None:
        self._fails[slot] = 0

    # -- placement -------------------------------------------------------------------
    def _scoped(self, workflow_id: str, tenant: str) -> str:
        return f"{tenant}/{workflow_id}" if tenant else workflow_id

    def _prepare(self, req: ServiceRequest) -> RequestInfo:
        """Check `req` and enter it in its workflow; what the policy places."""
        held = len(self._live) + self._held_n
        if held >= self.max_outstanding:
            self.metrics.observe_admission_rejected()
            raise Overloaded(
                f"the router holds {held} requests, its limit; retry shortly",
                None,
                1.0,
            )
        if req.request_id in self._live or req.request_id in self._held_ids:
            raise BadRequest(f"request id {req.request_id!r} is already in flight", "x-request-id")
        if not req.prompt_token_ids:
            raise BadRequest("the prompt is empty", "prompt")
        total = len(req.prompt_token_ids) + req.max_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            raise BadRequest(
                f"this model's maximum context length is {self.max_model_len} tokens; the "
                f"request asks for {total} ({len(req.prompt_token_ids)} prompt + "
                f"{req.max_tokens} output)",
                "prompt",
            )
        now = self.now()
        ident = req.identity
        if ident.workflow_id is None:
            wkey, node_id = f"~{req.request_id}", "0"
        else:
            wkey = self._scoped(ident.workflow_id, req.tenant)
            node_id = ident.node_id or req.request_id
        registry = self.ctx.workflows
        wst = registry.get(wkey)
        if wst is not None and wst.finished_s is not None:
            # A finished DAG (or idle-closed live workflow) seen again: a new run of it.
            registry.finished.pop(wkey, None)
            wst = None
        if wst is None:
            deadline = ident.deadline_s if ident.deadline_s is not None else math.inf
            wst = registry.ensure(wkey, ident.app or "default", now, deadline)
        if wst.workflow is None and ident.workflow_id is not None:
            entry = self._open_wf.setdefault(wkey, [0, now])
            entry[0] += 1
            entry[1] = now
        return RequestInfo(
            request_id=req.request_id,
            workflow_id=wkey,
            node_id=node_id,
            app=wst.app,
            prompt_tokens=len(req.prompt_token_ids),
            max_tokens=req.max_tokens,
            block_hashes=hash_token_blocks(req.prompt_token_ids, self.block_size),
            arrival_s=now,
            deadline_s=wst.deadline_s,
            parents=ident.parents,
            pinned=self._pinned_slot(req),
        )

    def _pinned_slot(self, req: ServiceRequest) -> int | None:
        if req.pin_engine is None:
            return None
        for slot, engine in enumerate(self.engines):
            if engine.name == req.pin_engine:
                return slot
        raise BadRequest(
            f"the engine that holds this request's state ({req.pin_engine}) is gone",
            "previous_response_id",
        )

    def _place(
        self, req: ServiceRequest, info: RequestInfo, force: bool = False
    ) -> tuple[_Live | None, Placement]:
        """Ask the policy; the request goes live on its engine, or (no `_Live`) the
        policy holds it at the router for now (deadline-aware admission)."""
        now = self.now()
        try:
            placement = self.router.route(info, now, force)
        except NoHealthyEngine:
            raise Unavailable("no healthy engine can take the request", None, 2.0) from None
        if placement.defer:
            return None, placement
        self.metrics.observe_decision(
            self.policy_name, placement.kind.value, self.router.decision_us[-1] * 1e-6
        )
        live = _Live(req, placement.engine, info.workflow_id, info.node_id, now, info)
        if self.calibrator is not None:
            loads = self.ctx.state.loads
            load = loads[placement.engine]
            bs = self.block_size
            own_prefill = max(info.prompt_tokens - placement.hit_blocks * bs, 0)
            own_blocks = -(-(info.prompt_tokens + info.max_tokens) // bs)
            live.load_at_dispatch = (
                max(load.pending_prefill_tokens - own_prefill, 0),
                max(load.outstanding - 1, 0),
                max(load.active_blocks - own_blocks, 0) * bs,
            )
            live.busy_neighbours = sum(
                1
                for j in self.ctx.state.host_neighbours()[placement.engine]
                if loads[j].outstanding > 0
            )
        self._live[req.request_id] = live
        return live, placement

    async def _admit(self, req: ServiceRequest) -> tuple[_Live, Placement]:
        """Place `req`, waiting at the router while the policy holds it.

        A held request is offered again, most urgent (lowest priority value) first,
        whenever a request finishes and at least every `held_recheck_s`; one admitted
        offers the next in line. Held work is accepted work: it is dispatched at the
        latest when no engine has anything left to run (nothing would free capacity), or
        once it has waited `max_hold_s`."""
        info = self._prepare(req)
        try:
            live, placement = self._place(req, info)
        except BaseException:
            self._release_open(info.workflow_id, self.now())
            raise
        if live is not None:
            return live, placement
        loop = asyncio.get_running_loop()
        held_since = self.now()
        self._held_n += 1
        self._held_ids.add(req.request_id)
        self.metrics.set_queue_depth(self._held_n)
        try:
            while live is None:
                turn = loop.create_future()
                heapq.heappush(self._held, (placement.hold_order, next(self._held_seq), turn))
                try:
                    async with asyncio.timeout(self.held_recheck_s):
                        await turn
                except TimeoutError:
                    pass
                finally:
                    turn.cancel()  # a no-op when it came; dropped lazily from the heap
                idle = not any(load.outstanding for load in self.ctx.state.loads)
                overdue = self.now() - held_since >= self.max_hold_s
                live, placement = self._place(req, info, force=idle or overdue)
            self.held_total += 1
            self._offer_held()
            return live, placement
        except BaseException:
            # The caller left (or no engine is healthy) while the request waited.
            self._release_open(info.workflow_id, self.now())
            raise
        finally:
            self._held_n -= 1
            self._held_ids.discard(req.request_id)
            self.metrics.set_queue_depth(self._held_n)

    def _offer_held(self) -> None:
        """Capacity freed: wake the most urgent held request to be placed again."""
        held = self._held
        while held:
            turn = heapq.heappop(held)[2]
            if not turn.done():
                turn.set_result(None)
                return

    async def open(self, req: ServiceRequest) -> RouterStream:
        """Place `req` and start it; returns once its first chunk is in hand, so a bad
        request or a dead engine is an error status, not a broken stream. An engine that
        fails before the first chunk hands the request to another engine."""
        live, placement = await self._admit(req)
        try:
            try:
                gen, first = await self._start(live, placement)
            except _EngineFault as fault:
                gen, first = await self._failover(live, fault)
        except BaseException:
            live.failed = True
            self._finish(live)
            raise
        self._on_chunk(live, first)
        stream = RouterStream(
            self, live, self.engines[live.slot].name, placement.kind.value, gen, first
        )
        stream.resumed = live.failovers
        return stream

    async def _start(
        self, live: _Live, placement: Placement
    ) -> tuple[AsyncIterator[TokenChunk], TokenChunk]:
        """Submit `live` (from the tokens it already has) to its engine; its first chunk.

        A transfer order becomes the engine's `kv_transfer` (its connector loads the prefix
        from the holder's peer server, and recomputes it if that fails); `retain` becomes a
        KV retention lease (`GenerateRequest.retain_s`)."""
        priority, transfer = placement.priority, placement.transfer
        req = live.req
        engine = self.engines[live.slot]
        kv_transfer: dict[str, object] | None = None
        if transfer is not None and transfer.src != live.slot and not live.out_ids:
            peer = self.engines[transfer.src].kv_peer
            if peer and engine.kv_peer:
                kv_transfer = {"wasma_peer": peer}
        if not priority and req.identity.priority is not None:
            priority = req.identity.priority  # the client's hint when the policy has none
        prompt = req.prompt_token_ids
        if live.out_ids:
            # A continuation: what the client already has becomes part of the prompt.
            prompt = prompt + live.out_ids
        greq = GenerateRequest(
            request_id=req.request_id
            if not live.failovers
            else f"{req.request_id}~{live.failovers}",
            prompt_token_ids=prompt,
            max_tokens=req.max_tokens - len(live.out_ids),
            priority=priority,
            ignore_eos=req.ignore_eos,
            temperature=req.temperature,
            extra=req.extra,
            kv_transfer=kv_transfer,
            retain_s=placement.lease_s(self.retain_lease_s),
            retain_use_s=placement.retain_use_s if placement.retain else None,
            # The router's id: a failover's resubmission is released by it all the same.
            retain_key=req.request_id,
            # Retentions on this engine whose readers have all started ride along.
            release=self.router.retention.take(live.slot),
            call=req.call,
        )
        self.metrics.observe_retention(engine.name, int(greq.retain_s > 0), len(greq.release))
        try:
            gen = engine.generate(greq)
        except ValueError as exc:
            raise BadRequest(str(exc), "prompt") from None
        except Exception as exc:
            raise _EngineFault(live.slot, exc) from None
        try:
            first = await self._next_chunk(live, gen)
        except BaseException:
            await _aclose(gen)
            raise
        return gen, first

    async def _next_chunk(self, live: _Live, gen: AsyncIterator[TokenChunk]) -> TokenChunk:
        """The engine's next chunk, or `_EngineFault` if it errs, stalls past the request
        timeout or is found dead meanwhile. A `ValueError` is the request's own fault."""
        slot = live.slot
        live.last_s = self.now()
        try:
            try:
                # No timer per chunk: the poller's stall check (_check_stalls) and the
                # health check end this wait when the engine stops making progress.
                async with asyncio.timeout(None) as waiting:
                    live.waiting = waiting
                    return await gen.__anext__()
            finally:
                live.waiting = None  # before the handlers below, which may mark engines down
        except TimeoutError:
            raise _EngineFault(slot, "stalled or found down") from None
        except StopAsyncIteration:
            self._engine_failed(slot, "ended the request without output")
            raise _EngineFault(slot, "ended the request without output") from None
        except ValueError as exc:
            raise BadRequest(str(exc), "prompt") from None
        except (ServiceError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            self._engine_failed(slot, exc)
            raise _EngineFault(slot, exc) from None

    async def _failover(
        self, live: _Live, fault: _EngineFault
    ) -> tuple[AsyncIterator[TokenChunk], TokenChunk]:
        """Move `live` off a failed engine: placed again (without the engines now down),
        resubmitted with the prompt plus the tokens already sent, max_tokens reduced."""
        rid = live.req.request_id
        if live.info is not None and live.info.pinned is not None:
            raise Unavailable(
                f"request {rid} can run only on {self.engines[live.info.pinned].name}, "
                f"which failed: {fault}",
                None,
                1.0,
            )
        while True:
            if live.failovers >= self.max_failovers:
                raise Unavailable(
                    f"request {rid} failed on {live.failovers + 1} engines; last: {fault}",
                    None,
                    1.0,
                )
            if len(live.out_ids) >= live.req.max_tokens:
                # Every token was sent; only the engine's closing chunk was lost.
                return _empty(), TokenChunk((), True, "length")
            live.failovers += 1
            self.failovers += 1
            # Release the failed engine's charge, then place as if the request were new.
            self.router.on_first_token(rid)
            self.ctx.state.on_finish(rid)
            prompt = live.req.prompt_token_ids + live.out_ids
            info = live.info
            assert info is not None
            info = replace(
                info,
                prompt_tokens=len(prompt),
                max_tokens=live.req.max_tokens - len(live.out_ids),
                block_hashes=hash_token_blocks(prompt, self.block_size),
            )
            try:
                # Half-streamed already: it cannot wait at the router like new work.
                placement = self.router.route(info, self.now(), force=True)
            except NoHealthyEngine:
                raise Unavailable("no healthy engine can take the request", None, 2.0) from None
            log.info(
                "request %s moves from %s to %s after %d tokens",
                rid,
                self.engines[fault.slot].name,
                self.engines[placement.engine].name,
                len(live.out_ids),
            )
            live.slot = placement.engine
            try:
                return await self._start(live, placement)
            except _EngineFault as again:
                fault = again

    async def complete(self, req: ServiceRequest) -> ServiceResult:
        """Run `req` to the end (the non-streaming path: one call, one answer)."""
        stream = await self.open(req)
        ids: list[int] = []
        text: list[str] = []
        raw: list[bytes] = []
        status = 0
        reason: str | None = None
        try:
            async for chunk in stream:
                ids.extend(chunk.token_ids)
                if chunk.text:
                    text.append(chunk.text)
                if chunk.raw:
                    raw.append(chunk.raw)
                if chunk.status:
                    status = chunk.status
                if chunk.finished:
                    reason = chunk.finish_reason
        finally:
            await stream.aclose()
        return ServiceResult(
            stream.engine,
            stream.kind,
            ids,
            reason,
            stream._live.cached,
            "".join(text),
            b"".join(raw),
            status,
        )

    def _on_chunk(self, live: _Live, chunk: TokenChunk) -> None:
        if live.first_s is None and (chunk.token_ids or chunk.finished):
            live.first_s = self.now()
            self.router.on_first_token(live.req.request_id)
        # In-process engines report the hit with the first chunk; a remote server only in
        # its final usage: take it whenever it comes.
        if chunk.num_cached_tokens:
            live.cached = chunk.num_cached_tokens
        live.n_out += len(chunk.token_ids)
        live.last_s = self._progress[live.slot] = self.now()
        if chunk.token_ids:
            live.out_ids.extend(chunk.token_ids)
        if chunk.raw:
            live.raw_sent = True
        if chunk.finished and chunk.finish_reason != "abort":
            self._engine_ok(live.slot)

    def _finish(self, live: _Live) -> None:
        rid = live.req.request_id
        if self._live.pop(rid, None) is None:
            return
        self._offer_held()
        now = self.now()
        if live.first_s is None:
            self.router.on_first_token(rid)
        before = self.ctx.workflows.active.get(live.wkey)
        registered = before is not None and before.workflow is not None
        self.router.on_finish(rid, live.wkey, live.node_id, now)
        self.metrics.set_estimate_ratio(self.ctx.estimates.ratio)
        if registered and self.journal is not None:
            if not (live.failed or live.cancelled):
                self.journal.finish(live.wkey, live.node_id, live.slot)
            if live.wkey not in self.ctx.workflows.active:
                self.journal.close_workflow(live.wkey)
        engine = self.engines[live.slot].name
        prompt = len(live.req.prompt_token_ids)
        self.metrics.observe_request(
            engine,
            None if live.first_s is None else live.first_s - live.start_s,
            now - live.start_s,
            prompt,
            min(live.cached, prompt),
        )
        if live.failed:
            self.failed += 1
        elif live.cancelled:
            self.cancelled += 1
        else:
            self.completed += 1
            self._calibrate(live, now)
        registry = self.ctx.workflows
        if live.wkey.startswith("~"):
            # A request without workflow metadata is a one-node workflow (DESIGN.md) with
            # no deadline; the request metrics above already describe it, so the workflow
            # series (goodput, attainment) stay about the workflows agents declared.
            registry.active.pop(live.wkey, None)
            return
        if live.wkey in self._open_wf:
            self._release_open(live.wkey, now)
            return
        wst = registry.get(live.wkey)
        if wst is not None and wst.finished_s is not None and wst.finished_s == now:
            # The registered DAG's last node just finished.
            latency = now - wst.arrival_s
            self.metrics.observe_workflow(wst.app, latency, now <= wst.deadline_s)

    def _calibrate(self, live: _Live, now: float) -> None:
        """Feed a request served start to finish by one engine to the calibrator; swap
        in a rescaled profile when the engines' speed moved."""
        cal = self.calibrator
        if cal is None or live.first_s is None or live.failovers:
            return
        queued, others, ctx_tokens = live.load_at_dispatch
        prompt = len(live.req.prompt_token_ids)
        timing = RequestTiming(
            prompt_tokens=prompt,
            cached_tokens=min(live.cached, prompt),
            output_tokens=live.n_out,
            ttft_s=live.first_s - live.start_s,
            decode_s=now - live.first_s,
            queued_prefill_tokens=queued,
            batch=others + 1,
            batch_context_tokens=ctx_tokens,
            busy_neighbours=live.busy_neighbours,
        )
        if cal.observe(timing):
            self.set_profile(cal.publish())

    def set_calibration(self, calibration: CalibrationConfig | bool | None) -> None:
        """Cost calibration (scheduler/calibration.py): the profile was fitted in-process
        on an idle engine; real engines behind HTTP on a busy host run slower, by factors
        learned from finished requests. None: on unless every engine is simulated (they
        follow the profile by construction, and their tests expect exact placements).
        Turning it off puts the fitted profile back."""
        if calibration is None:
            calibration = not all(_simulated(e) for e in self.engines)
        if calibration is True:
            calibration = CalibrationConfig()
        self.calibrator = (
            CostCalibrator(self._fitted_profile, calibration)
            if isinstance(calibration, CalibrationConfig)
            else None
        )
        if self.ctx.profile != self._fitted_profile:
            self.set_profile(self._fitted_profile)  # a new calibrator starts from it

    def set_profile(self, profile: Profile) -> None:
        """Give the policy a new cost model (same block size and limits)."""
        self.ctx.profile = profile
        self.recalibrations += 1
        if self.policy_name in _COST_MODEL_POLICIES:
            self.router.policy = self._registry.create(self.policy_name, self.ctx)
        if self.calibrator is not None:
            c = self.calibrator.current()
            log.info(
                "cost model recalibrated: prefill x%.2f, step x%.2f, batching x%.2f",
                c.prefill,
                c.step,
                c.seq,
            )

    def _release_open(self, wkey: str, now: float) -> None:
        if wkey.startswith("~"):
            # A request without workflow metadata that never went live (held, then its
            # client left): its one-node workflow goes with it.
            self.ctx.workflows.active.pop(wkey, None)
            return
        entry = self._open_wf.get(wkey)
        if entry is not None:
            entry[0] -= 1
            entry[1] = now

    async def _sweep_workflows(self) -> None:
        while True:
            await asyncio.sleep(min(self.idle_workflow_s / 4, 5.0))
            self.sweep_idle_workflows()

    def sweep_idle_workflows(self) -> int:
        """Close live workflows idle for `idle_workflow_s`: agents do not say when a run
        ends, and an unbounded registry would grow forever. Returns how many closed."""
        now = self.now()
        closed = 0
        for wkey, (outstanding, last) in list(self._open_wf.items()):
            if outstanding > 0 or now - last < self.idle_workflow_s:
                continue
            self._close_live(wkey)
            closed += 1
        # Registered DAGs whose client gave up half-way would otherwise stay forever.
        for wkey, wst in list(self.ctx.workflows.active.items()):
            if wst.workflow is None or wkey in self._open_wf:
                continue
            nodes = wst.nodes.values()
            if any(ns.submitted_s is not None and ns.finished_s is None for ns in nodes):
                continue
            times = [t for ns in nodes for t in (ns.submitted_s, ns.finished_s) if t is not None]
            last = max(times, default=wst.arrival_s)
            if now - last < self.idle_workflow_s:
                continue
            self.ctx.workflows.close(wkey, last)
            if self.journal is not None:
                self.journal.close_workflow(wkey)
            self.metrics.observe_workflow(wst.app, last - wst.arrival_s, False)
            closed += 1
        return closed

    def _close_live(self, wkey: str) -> None:
        """End a live workflow at its last activity and count it."""
        _, last = self._open_wf.pop(wkey, [0, self.now()])
        wst = self.ctx.workflows.active.get(wkey)
        self.ctx.workflows.close(wkey, last)
        if wst is not None:
            self.metrics.observe_workflow(wst.app, last - wst.arrival_s, last <= wst.deadline_s)

    # -- workflows API ---------------------------------------------------------------
    def register_workflow(self, data: Mapping[str, Any], tenant: str = "") -> dict[str, Any]:
        """Register a whole DAG ahead of its requests (trace format, minus `arrival_s`)."""
        if not isinstance(data, Mapping):
            raise BadRequest("a workflow must be a JSON object")
        body = dict(data)
        body["arrival_s"] = 0.0
        try:
            wf = Workflow.from_dict(body)
        except WorkflowError as exc:
            raise BadRequest(str(exc), "nodes") from None
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"invalid workflow: {exc}") from None
        key = self._scoped(wf.workflow_id, tenant)
        registry = self.ctx.workflows
        existing = registry.active.get(key)
        if existing is not None:
            entry = self._open_wf.get(key)
            if existing.workflow is not None or (entry is not None and entry[0] > 0):
                raise Conflict(f"workflow {wf.workflow_id!r} is already registered and running")
            # An idle live run under the same id: it is over; the DAG starts a new one.
            self._close_live(key)
        registry.finished.pop(key, None)
        now = self.now()
        # Keyed by the tenant-scoped id: one API key cannot see or extend another's run.
        registry.active[key] = WorkflowState(wf, key, wf.app, now, now + wf.deadline_s)
        self._open_wf.pop(key, None)
        if self.journal is not None:
            self.journal.register(key, body, wf.deadline_s)
        return self._status(key, wf.workflow_id)

    def workflow_status(self, workflow_id: str, tenant: str = "") -> dict[str, Any]:
        key = self._scoped(workflow_id, tenant)
        if self.ctx.workflows.get(key) is None:
            raise NotFound(f"no workflow {workflow_id!r}", "workflow_id")
        return self._status(key, workflow_id)

    def _status(self, key: str, workflow_id: str) -> dict[str, Any]:
        wst = self.ctx.workflows.get(key)
        assert wst is not None
        now = self.now()
        names = self.ctx.state.engines
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
                    "parents": list(wst.workflow.nodes[node_id].parents)
                    if wst.workflow is not None and node_id in wst.workflow.nodes
                    else [],
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

    # -- introspection ---------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        loads = self.ctx.state.loads
        return {
            "status": "ok" if any(load.healthy for load in loads) else "unavailable",
            "policy": self.policy_name,
            "engines": [
                {"name": load.name, "healthy": load.healthy, "outstanding": load.outstanding}
                for load in loads
            ],
            "outstanding": len(self._live),
            "held": self._held_n,
            "held_total": self.held_total,
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "failovers": self.failovers,
            "engine_faults": self.engine_faults,
            "calibration": None
            if self.calibrator is None
            else {**self.calibrator.snapshot(), "recalibrations": self.recalibrations},
        }

    def render_metrics(self, http_codes: Mapping[int, int] | None = None) -> tuple[bytes, str]:
        """The /metrics page; `http_codes` are the gateway's status counts since the
        last scrape (the gateway counts locally so requests never wait on metrics)."""
        for code, count in (http_codes or {}).items():
            for _ in range(count):
                self.metrics.observe_http(code)
        loads = self.ctx.state.loads
        for load in loads:
            self.metrics.set_engine(load.name, outstanding=load.outstanding)
            self.metrics.set_engine_up(load.name, load.healthy)
        self.metrics.set_queue_depth(self._held_n)
        return self.metrics.render()

    def engine_names(self) -> list[str]:
        return [e.name for e in self.engines]


def _simulated(engine: EngineClient) -> bool:
    """Whether `engine` is the simulator (it runs the profile itself)."""
    from wasma.engines.sim_engine import SimEngine

    return isinstance(engine, SimEngine)


def _max_model_len(engine: EngineClient) -> int | None:
    """An engine's context limit, where it says (engines expose it differently)."""
    for owner in (engine, getattr(engine, "config", None), getattr(engine, "profile", None)):
        value = getattr(owner, "max_model_len", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def tenant_of(api_key: str | None) -> str:
    """A short, stable, non-reversible tenant id for an API key ("" when open)."""
    if not api_key:
        return ""
    return hashlib.blake2b(api_key.encode(), digest_size=6).hexdigest()
