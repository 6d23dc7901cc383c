"""The live router: the scheduling core (`scheduler.Dispatcher`) driven by real requests
on the wall clock.

It owns the engines, asks the dispatcher to place each request, streams the engine's
tokens back, and keeps the cluster view current: KV events feed the prefix index, a
background task polls engine health and load (`engine_health.py`), and every request's
start and end moves the load counters. Workflows come from request metadata (live, one
node at a time) or are registered whole ahead of their requests (`workflow_api.py`).

Runs in-process (tests, `--router-in-process`) or as an async Ray actor (`RouterActor`),
whose methods are this class's; nothing here knows which.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from wasma.core.events import KVEvent
from wasma.core.profile import Profile
from wasma.deploy.admission import Admission
from wasma.deploy.cost_feed import CostFeed
from wasma.deploy.engine_health import EngineHealth
from wasma.deploy.engine_runner import EngineRunner
from wasma.deploy.journal import WorkflowJournal
from wasma.deploy.live_request import (
    EngineFault,
    LiveRequest,
    ReportedChunk,
    RouterStream,
)
from wasma.deploy.metrics import WasmaMetrics
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.service_types import (
    ServiceRequest,
    ServiceResult,
)
from wasma.deploy.workflow_api import WorkflowAPI
from wasma.engines.base import EngineClient, TokenChunk
from wasma.scheduler.calibration import CalibrationConfig, CostCalibrator
from wasma.scheduler.dispatch import (
    Closed,
    Dispatcher,
    DispatcherConfig,
)
from wasma.scheduler.pricing import TransferPricer
from wasma.scheduler.registry import PolicyRegistry
from wasma.scheduler.workflow import MAX_PROMPT_TOKENS

log = logging.getLogger(__name__)

# Usage fields naming output tokens: OpenAI's chat and completions, and Responses' and
# Anthropic Messages' (`output_tokens`).
_OUTPUT_KEYS = (b'"completion_tokens":', b'"output_tokens":')


def output_events_in(raw: bytes) -> int:
    """How many events of a passed-through stream's read hold generated output (a
    usage-only or `[DONE]` event does not): each SSE protocol vLLM speaks names it `delta`
    or `text`. Counted per event, not per read: a reader that falls behind gets several
    events in one read, and each is a step of the engine's."""
    if b'"delta"' not in raw and b'"text"' not in raw:
        return 0
    events = raw.count(b"\n\n")
    if events == 0 or (events == 1 and raw.endswith(b"\n\n")):
        return 1  # one event (or part of one), the common read of a stream kept up with
    return sum(1 for event in raw.split(b"\n\n") if b'"delta"' in event or b'"text"' in event)


def output_tokens_in(raw: bytes) -> int:
    """The output-token count of the last usage object in a piece of a passed-through
    answer, or 0. A bytes search, not a JSON parse: it runs on every streamed piece."""
    best = 0
    for key in _OUTPUT_KEYS:
        at = raw.rfind(key)
        if at < 0:
            continue
        i = at + len(key)
        while i < len(raw) and raw[i] in b" \t":
            i += 1
        j = i
        while j < len(raw) and 48 <= raw[j] <= 57:
            j += 1
        if j > i:
            best = max(best, int(raw[i:j]))
    return best


def chunk_outputs(chunk: TokenChunk, streamed: bool) -> int:
    """How many outputs a chunk carries: its token ids, or, for a passed-through stream
    (`streamed`), its bytes' output events."""
    outputs = len(chunk.token_ids)
    if not outputs and chunk.raw and streamed:
        outputs = output_events_in(chunk.raw)
    return outputs


def inter_token_sample(started: bool, gap_s: float, outputs: int) -> tuple[float, int] | None:
    """The inter-token sample of a chunk of `outputs` outputs that came `gap_s` after
    the request's previous output (`started`: there was one): (seconds, count), or None.
    One sample a token after the first, as vLLM's own histogram (one an engine step, a
    token a step without speculative decoding); a chunk of k tokens (a simulated engine's
    closed-form decode stretch, a reader that fell behind) spreads its gap over them;
    tokens that came with the first one came with no gap."""
    if outputs and started:
        return gap_s, outputs
    if outputs > 1:
        return 0.0, outputs - 1
    return None


class ResultStream(Protocol):
    engine: str
    kind: str

    @property
    def cached_tokens(self) -> int: ...

    def __aiter__(self) -> AsyncIterator[TokenChunk]: ...

    async def aclose(self) -> None: ...


async def collect_result(stream: ResultStream) -> ServiceResult:
    """A whole answer from an opened stream (closed at the end)."""
    ids: list[int] = []
    text: list[str] = []
    raw: list[bytes] = []
    status = 0
    reason: str | None = None
    stop: int | str | None = None
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
                reason, stop = chunk.finish_reason, chunk.stop_reason
    finally:
        await stream.aclose()
    return ServiceResult(
        stream.engine,
        stream.kind,
        ids,
        reason,
        stream.cached_tokens,
        "".join(text),
        b"".join(raw),
        status,
        stop,
    )


class RouterService:
    """Places requests on engines with a policy and tracks them to the end."""

    def __init__(
        self,
        engines: Sequence[EngineClient],
        profile: Profile,
        config: RouterConfig | None = None,
        *,
        metrics: WasmaMetrics | None = None,
        registry: PolicyRegistry | None = None,
        pricer: TransferPricer | None = None,
        journal: WorkflowJournal | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        cfg = config or RouterConfig()
        self.config = cfg
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
        self.policy_name = cfg.policy
        self.metrics = metrics or WasmaMetrics()
        self._clock = clock
        self._t0 = clock()
        # Policies order KV moves only when given a pricer, and `build_service` gives one
        # only when every engine runs the wasma connector (`--kv-transfer`) and so can
        # carry a move out.
        self.dispatch = Dispatcher(
            names,
            profile,
            DispatcherConfig(
                policy=cfg.policy,
                params=dict(cfg.params),
                num_kv_blocks=profile.num_kv_blocks,
                hosts=[e.shared_host for e in engines],
                keep_finished=10_000,
            ),
            registry=registry,
            pricer=pricer,
        )
        self.ctx = self.dispatch.ctx
        self.router = self.dispatch.router
        self.costs = CostFeed(self.dispatch, profile, all(map(_simulated, self.engines)))
        self.costs.set_calibration(cfg.calibration)
        self._live: dict[str, LiveRequest] = {}
        self.health_check = EngineHealth(
            self.engines, self.dispatch, self.metrics, cfg, self._live, self.now
        )
        self.admission = Admission(
            self.dispatch,
            self.metrics,
            cfg,
            self._live,
            self.costs,
            self.now,
            self.max_model_len,
        )
        self.runner = EngineRunner(
            self.engines, self.dispatch, self.health_check, self.metrics, cfg, self.now
        )
        # Registered DAGs and their finished nodes, replayed by a restarted router.
        self.journal = journal
        self._journal_replayed = False
        self.workflows_api = WorkflowAPI(
            self.dispatch,
            journal,
            self.now,
            self._count_closed,
            self.max_model_len or MAX_PROMPT_TOKENS,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        for engine in self.engines:
            engine.subscribe_kv_events(self._on_kv_event)
            self.metrics.register_engine(engine.name, str(getattr(engine, "base_url", "") or ""))

    @property
    def engine_faults(self) -> int:
        return self.health_check.engine_faults

    @property
    def held_total(self) -> int:
        return self.admission.held_total

    @property
    def failovers(self) -> int:
        return self.runner.failovers

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        if not self._tasks:
            self._tasks = [
                self._loop.create_task(self.health_check.poll()),
                self._loop.create_task(self._sweep_workflows()),
            ]
        if self.journal is not None and not self._journal_replayed:
            self._journal_replayed = True
            self.workflows_api.replay_journal(len(self.engines))
        await self.health_check.refresh()

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

    def _on_kv_event(self, event: KVEvent) -> None:
        # Engines may publish from their own threads (ZMQ, Ray); the index is not locked.
        if self._loop is not None and threading.get_ident() != self._loop_thread:
            self._loop.call_soon_threadsafe(self.dispatch.on_kv_event, event)
        else:
            self.dispatch.on_kv_event(event)

    # -- running a request -----------------------------------------------------------
    async def open(self, req: ServiceRequest) -> RouterStream:
        """Place `req` and start it; returns once its first chunk is in hand, so a bad
        request or a dead engine is an error status, not a broken stream. An engine that
        fails before the first chunk hands the request to another engine."""
        live, decision = await self.admission.admit(req)
        try:
            try:
                gen, first = await self.runner.start(live, decision)
            except EngineFault as fault:
                gen, first = await self.runner.failover(live, fault)
        except BaseException:
            live.failed = True
            self.finish(live)
            raise
        self.on_chunk(live, first)
        stream = RouterStream(
            self, live, self.engines[live.slot].name, decision.placement.kind.value, gen, first
        )
        stream.resumed = live.failovers
        return stream

    async def complete(self, req: ServiceRequest) -> ServiceResult:
        """Run `req` to the end (the non-streaming path: one call, one answer)."""
        return await collect_result(await self.open(req))

    def on_chunk(self, live: LiveRequest, chunk: TokenChunk) -> None:
        call = live.req.call
        now = self.now()
        if (
            chunk.raw
            and not chunk.token_ids
            and live.first_s is not None
            and type(chunk) is TokenChunk
        ):
            # The next read of a passed-through answer under way, a proxied stream's
            # every event: what the general path below does for it, without the checks
            # that cannot apply (no token ids, no report, the first output seen).
            slot = live.slot
            if call is not None and call.stream:
                outputs = output_events_in(chunk.raw)
                if outputs:
                    engine = self.engines[slot].name
                    self.metrics.observe_inter_token(engine, now - live.last_s, outputs)
            if chunk.num_cached_tokens:
                live.cached = chunk.num_cached_tokens
            live.last_s = self.health_check.progress[slot] = now
            live.raw_sent = True
            live.n_out = max(live.n_out, output_tokens_in(chunk.raw))
            if chunk.finished and chunk.finish_reason != "abort":
                self.health_check.engine_ok(slot)
            return
        engine = self.engines[live.slot].name
        reported = chunk if isinstance(chunk, ReportedChunk) else None
        raw = bool(chunk.raw) or (reported is not None and reported.raw_seen)
        # Inter-token samples (`inter_token_sample`); a gateway's report brings those it
        # took itself, as it took them.
        if reported is not None:
            for gap, count in reported.gaps:
                self.metrics.observe_inter_token(engine, gap, count)
        else:
            streamed = call is not None and call.stream
            sample = inter_token_sample(
                live.first_s is not None, now - live.last_s, chunk_outputs(chunk, streamed)
            )
            if sample is not None:
                self.metrics.observe_inter_token(engine, *sample)
        if live.first_s is None and (
            chunk.token_ids
            # A passed-through stream's first bytes come with its first output; a
            # passed-through whole answer says nothing of when its first token came.
            or (raw and call is not None and call.stream)
            or (chunk.finished and not raw and not live.raw_sent)
        ):
            live.first_s = now
            self.dispatch.on_first_token(live.req.request_id)
        # In-process engines report the hit with the first chunk; a remote server only in
        # its final usage: take it whenever it comes.
        if chunk.num_cached_tokens:
            live.cached = chunk.num_cached_tokens
        live.n_out += len(chunk.token_ids)
        live.last_s = self.health_check.progress[live.slot] = now
        if chunk.token_ids:
            live.out_ids.extend(chunk.token_ids)
        if raw:
            live.raw_sent = True
            # The server's own count, where its answer carries usage (a whole answer, a
            # stream with include_usage): the output-token metrics and calibration.
            usage = reported.usage_tokens if reported is not None else output_tokens_in(chunk.raw)
            live.n_out = max(live.n_out, usage)
        if chunk.finished and chunk.finish_reason != "abort":
            self.health_check.engine_ok(live.slot)

    def finish(self, live: LiveRequest) -> None:
        rid = live.req.request_id
        if self._live.pop(rid, None) is None:
            return
        self.admission.offer_held()
        now = self.now()
        if live.first_s is None:
            self.dispatch.on_first_token(rid)
        done = self.dispatch.finish(rid, live.wkey, live.node_id, now)
        self.metrics.set_estimate_ratio(self.ctx.estimates.ratio)
        if done.registered and self.journal is not None:
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
            live.n_out,
        )
        self.metrics.observe_request_end(live.failed, live.cancelled)
        if live.failed:
            self.failed += 1
        elif live.cancelled:
            self.cancelled += 1
        else:
            self.completed += 1
            self.costs.observe(live, now)
        # A request without workflow metadata is a one-node workflow (DESIGN.md) with
        # no deadline; the request metrics above already describe it, so the workflow
        # series (goodput, attainment) stay about the workflows agents declared.
        self.dispatch.release(live.wkey, now)
        if done.workflow is not None:
            # The registered DAG's last node just finished.
            wst = done.workflow
            self.metrics.observe_workflow(wst.app, now - wst.arrival_s, now <= wst.deadline_s)

    @property
    def calibrator(self) -> CostCalibrator | None:
        return self.costs.calibrator

    @property
    def recalibrations(self) -> int:
        return self.costs.recalibrations

    def set_calibration(self, calibration: CalibrationConfig | bool | None) -> None:
        self.costs.set_calibration(calibration)

    def set_profile(self, profile: Profile) -> None:
        self.costs.set_profile(profile)

    # -- workflows -------------------------------------------------------------------
    def _count_closed(self, closed: Closed) -> None:
        wst = closed.workflow
        self.metrics.observe_workflow(wst.app, closed.last_s - wst.arrival_s, closed.met)

    async def _sweep_workflows(self) -> None:
        while True:
            await asyncio.sleep(min(self.config.idle_workflow_s / 4, 1.0))
            self.sweep_idle_workflows()

    def sweep_idle_workflows(self) -> int:
        """Close workflows idle for `idle_workflow_s` (`Dispatcher.sweep_idle`) and count
        them. Returns how many closed."""
        cfg = self.config
        closed = self.dispatch.sweep_idle(self.now(), cfg.idle_workflow_s, cfg.settle_workflow_s)
        for c in closed:
            if c.workflow.workflow is not None and self.journal is not None:
                self.journal.close_workflow(c.workflow.workflow_id)
            self._count_closed(c)
        return len(closed)

    def register_workflow(self, data: Mapping[str, Any], tenant: str = "") -> dict[str, Any]:
        status = self.workflows_api.register(data, tenant)
        self.metrics.observe_workflow_started(str(status["app"]))
        return status

    def workflow_status(self, workflow_id: str, tenant: str = "") -> dict[str, Any]:
        return self.workflows_api.status(workflow_id, tenant)

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
            "held": self.admission.held_now,
            "held_total": self.admission.held_total,
            "completed": self.completed,
            "failed": self.failed,
            "cancelled": self.cancelled,
            "failovers": self.failovers,
            "engine_faults": self.engine_faults,
            "calibration": None
            if self.calibrator is None
            else {**self.calibrator.snapshot(), "recalibrations": self.recalibrations},
        }

    def render_metrics(self, http_codes: Mapping[Any, int] | None = None) -> tuple[bytes, str]:
        """The /metrics page; `http_codes` are the gateway's counts since the last scrape,
        by (handler, status) or by status alone (the gateway counts locally so requests
        never wait on metrics)."""
        for key, count in (http_codes or {}).items():
            handler, code = key if isinstance(key, tuple) else ("other", key)
            self.metrics.observe_http(int(code), str(handler), count)
        loads = self.ctx.state.loads
        for load in loads:
            self.metrics.set_engine(load.name, outstanding=load.outstanding)
            self.metrics.set_engine_up(load.name, load.healthy)
        self.metrics.set_queue_depth(self.admission.held_now)
        return self.metrics.render()

    def engine_names(self) -> list[str]:
        return [e.name for e in self.engines]

    @property
    def in_flight(self) -> int:
        return len(self._live)


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
