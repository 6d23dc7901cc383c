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
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from deploy.metadata import WorkflowIdentity
from deploy.metrics import WasmaMetrics
from engines.base import EngineClient, GenerateRequest, KVEvent, TokenChunk
from engines.sim.profile import Profile
from scheduler.policy import NoHealthyEngine, PolicyContext, RequestInfo, TransferPricer
from scheduler.prefix_index import PrefixIndex
from scheduler.registry import PolicyRegistry, default_registry
from scheduler.router import Router
from scheduler.state import ClusterState
from scheduler.tokens import hash_token_blocks
from scheduler.workflow import Workflow, WorkflowError
from scheduler.workflows import WorkflowRegistry, WorkflowState

log = logging.getLogger(__name__)


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


@dataclass(slots=True)
class ServiceResult:
    """A finished non-streamed request."""

    engine: str
    kind: str
    token_ids: list[int]
    finish_reason: str | None
    cached_tokens: int
    text: str = ""


@dataclass(slots=True)
class _Live:
    """A request between dispatch and finish."""

    req: ServiceRequest
    slot: int
    wkey: str
    node_id: str
    start_s: float
    first_s: float | None = None
    cached: int = 0
    n_out: int = 0
    failed: bool = False
    cancelled: bool = False  # the caller left before the engine finished


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
        self._gen = gen
        self._first: TokenChunk | None = first
        self._done = first.finished
        self._closed = False

    def __aiter__(self) -> RouterStream:
        return self

    async def __anext__(self) -> TokenChunk:
        if self._first is not None:
            chunk, self._first = self._first, None
            return chunk
        if self._done:
            raise StopAsyncIteration
        try:
            chunk = await self._gen.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            self._live.failed = True
            self._service._engine_failed(self._live.slot, exc)
            raise Unavailable(f"engine {self.engine} failed mid-request: {exc}", None, 1) from None
        self._service._on_chunk(self._live, chunk)
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
            aclose = getattr(self._gen, "aclose", None)
            if aclose is not None:
                await aclose()  # aborts the engine's work if the client left early
        finally:
            self._service._finish(self._live)


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
        state = ClusterState(names, num_kv_blocks=profile.num_kv_blocks)
        # No transfer executor runs on the live path yet, so without a pricer the
        # policies never order a KV move they could not carry out.
        self.ctx = PolicyContext(
            state=state,
            index=PrefixIndex(names),
            workflows=WorkflowRegistry(keep_finished=10_000),
            profile=profile,
            pricer=pricer,
            params=dict(params or {}),
        )
        self.router = Router(self.ctx, (registry or default_registry()).create(policy, self.ctx))
        self.max_outstanding = max_outstanding
        self.stats_interval_s = stats_interval_s
        self.idle_workflow_s = idle_workflow_s
        self._live: dict[str, _Live] = {}
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
        await self._refresh_engines()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
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
            try:
                ok = await asyncio.wait_for(engine.healthy(), timeout=5.0)
                stats = await asyncio.wait_for(engine.stats(), timeout=5.0) if ok else None
            except Exception as exc:  # an engine's failure must not stop the poller
                log.warning("engine %s: health/stats failed: %s", engine.name, exc)
                ok, stats = False, None
            was = state.loads[slot].healthy
            state.set_healthy(slot, ok)
            if was and not ok:
                # Its cache is unreachable (or gone): stop steering prefixes to it.
                self.ctx.index.remove_engine_blocks(engine.name)
            if stats is not None:
                state.on_stats(slot, stats)
            load = state.loads[slot]
            self.metrics.set_engine(
                engine.name,
                outstanding=load.outstanding,
                running=None if stats is None else stats.num_running,
                waiting=None if stats is None else stats.num_waiting,
                kv_usage=None if stats is None else min(max(stats.kv_usage, 0.0), 1.0),
            )

        await asyncio.gather(*(one(i, e) for i, e in enumerate(self.engines)))

    async def _poll_engines(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval_s)
            await self._refresh_engines()

    def _engine_failed(self, slot: int, exc: BaseException) -> None:
        log.warning("engine %s failed a request: %s", self.engines[slot].name, exc)
        # Out of rotation until the next health check says it is back.
        self.ctx.state.set_healthy(slot, False)

    # -- placement -------------------------------------------------------------------
    def _scoped(self, workflow_id: str, tenant: str) -> str:
        return f"{tenant}/{workflow_id}" if tenant else workflow_id

    def _place(self, req: ServiceRequest) -> tuple[_Live, Any]:
        if len(self._live) >= self.max_outstanding:
            self.metrics.observe_admission_rejected()
            raise Overloaded(
                f"the router holds {len(self._live)} requests, its limit; retry shortly",
                None,
                1.0,
            )
        if req.request_id in self._live:
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
        if wst.workflow is None:
            entry = self._open_wf.setdefault(wkey, [0, now])
            entry[0] += 1
            entry[1] = now
        info = RequestInfo(
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
        )
        try:
            placement = self.router.route(info, now)
        except NoHealthyEngine:
            self._release_open(wkey, now)
            raise Unavailable("no healthy engine can take the request", None, 2.0) from None
        self.metrics.observe_decision(
            self.policy_name, placement.kind.value, self.router.decision_us[-1] * 1e-6
        )
        live = _Live(req, placement.engine, wkey, node_id, now)
        self._live[req.request_id] = live
        return live, placement

    async def open(self, req: ServiceRequest) -> RouterStream:
        """Place `req` and start it; returns once its first chunk is in hand, so a bad
        request or a dead engine is an error status, not a broken stream."""
        live, placement = self._place(req)
        engine = self.engines[live.slot]
        prio = placement.priority
        if not prio and req.identity.priority is not None:
            prio = req.identity.priority  # the client's hint when the policy has none
        greq = GenerateRequest(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            max_tokens=req.max_tokens,
            priority=prio,
            ignore_eos=req.ignore_eos,
            temperature=req.temperature,
            extra=req.extra,
        )
        gen = engine.generate(greq)
        try:
            first = await gen.__anext__()
        except BaseException as exc:
            live.failed = True
            with contextlib.suppress(Exception):
                aclose = getattr(gen, "aclose", None)
                if aclose is not None:
                    await aclose()
            self._finish(live)
            if isinstance(exc, ValueError):
                raise BadRequest(str(exc), "prompt") from None
            if isinstance(exc, StopAsyncIteration):
                raise Unavailable(
                    f"engine {engine.name} ended the request without output"
                ) from None
            if isinstance(exc, Exception) and not isinstance(exc, ServiceError):
                self._engine_failed(live.slot, exc)
                raise Unavailable(f"engine {engine.name} failed: {exc}", None, 1.0) from None
            raise
        self._on_chunk(live, first)
        return RouterStream(self, live, engine.name, placement.kind.value, gen, first)

    async def complete(self, req: ServiceRequest) -> ServiceResult:
        """Run `req` to the end (the non-streaming path: one call, one answer)."""
        stream = await self.open(req)
        ids: list[int] = []
        text: list[str] = []
        reason: str | None = None
        try:
            async for chunk in stream:
                ids.extend(chunk.token_ids)
                if chunk.text:
                    text.append(chunk.text)
                if chunk.finished:
                    reason = chunk.finish_reason
        finally:
            await stream.aclose()
        return ServiceResult(
            stream.engine, stream.kind, ids, reason, stream._live.cached, "".join(text)
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

    def _finish(self, live: _Live) -> None:
        rid = live.req.request_id
        if self._live.pop(rid, None) is None:
            return
        now = self.now()
        if live.first_s is None:
            self.router.on_first_token(rid)
        self.router.on_finish(rid, live.wkey, live.node_id, now)
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

    def _release_open(self, wkey: str, now: float) -> None:
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
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
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
        self.metrics.set_queue_depth(0)
        return self.metrics.render()

    def engine_names(self) -> list[str]:
        return [e.name for e in self.engines]


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
