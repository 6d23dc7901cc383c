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
from typing import Any

from wasma.core.events import KVEvent
from wasma.core.profile import Profile
from wasma.core.tokens import hash_token_blocks
from wasma.deploy.engine_health import EngineHealth
from wasma.deploy.journal import WorkflowJournal
from wasma.deploy.live_request import (
    EngineFault,
    LiveRequest,
    RouterStream,
    aclose_quietly,
    empty_stream,
)
from wasma.deploy.metrics import WasmaMetrics
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.service_types import (
    BadRequest,
    Overloaded,
    ServiceError,
    ServiceRequest,
    ServiceResult,
    Unavailable,
)
from wasma.deploy.workflow_api import WorkflowAPI, scoped
from wasma.engines.base import EngineClient, GenerateRequest, TokenChunk
from wasma.scheduler.calibration import CalibrationConfig, CostCalibrator, RequestTiming
from wasma.scheduler.dispatch import (
    ANONYMOUS_PREFIX,
    Closed,
    Dispatch,
    Dispatcher,
    DispatcherConfig,
    HeldQueue,
)
from wasma.scheduler.policy import NoHealthyEngine, RequestInfo
from wasma.scheduler.pricing import TransferPricer
from wasma.scheduler.registry import PolicyRegistry

log = logging.getLogger(__name__)


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
        self._fitted_profile = profile
        self.calibrator: CostCalibrator | None = None
        self.recalibrations = 0
        self.set_calibration(cfg.calibration)
        self._live: dict[str, LiveRequest] = {}
        self.health_check = EngineHealth(
            self.engines, self.dispatch, self.metrics, cfg, self._live, self.now
        )
        self.failovers = 0
        # Registered DAGs and their finished nodes, replayed by a restarted router.
        self.journal = journal
        self._journal_replayed = False
        self.workflows_api = WorkflowAPI(self.dispatch, journal, self.now, self._count_closed)
        # Requests the policy holds at the router (deadline-aware admission): the future
        # that wakes each, most urgent first.
        self._held: HeldQueue[asyncio.Future[None]] = HeldQueue()
        self._held_n = 0
        self._held_ids: set[str] = set()
        self.held_total = 0  # requests that waited at the router before going live
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.completed = 0
        self.failed = 0
        self.cancelled = 0
        for engine in self.engines:
            engine.subscribe_kv_events(self._on_kv_event)

    @property
    def engine_faults(self) -> int:
        return self.health_check.engine_faults

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

    # -- admission and placement -----------------------------------------------------
    def _prepare(self, req: ServiceRequest) -> RequestInfo:
        """Check `req` and enter it in its workflow; what the policy places."""
        held = len(self._live) + self._held_n
        if held >= self.config.max_outstanding:
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
            wkey, node_id = f"{ANONYMOUS_PREFIX}{req.request_id}", "0"
        else:
            wkey = scoped(ident.workflow_id, req.tenant)
            node_id = ident.node_id or req.request_id
        wst = self.dispatch.open_request(wkey, ident.app, ident.deadline_s, now)
        return Dispatcher.request_info(
            req.request_id,
            wkey,
            node_id,
            wst,
            len(req.prompt_token_ids),
            req.max_tokens,
            hash_token_blocks(req.prompt_token_ids, self.block_size),
            now,
            ident.parents,
        )

    def _place(
        self, req: ServiceRequest, info: RequestInfo, force: bool = False
    ) -> tuple[LiveRequest | None, Dispatch]:
        """Ask the dispatcher; the request goes live on its engine, or (no live request)
        the policy holds it at the router for now (deadline-aware admission)."""
        now = self.now()
        try:
            decision = self.dispatch.place(info, now, force)
        except NoHealthyEngine:
            raise Unavailable("no healthy engine can take the request", None, 2.0) from None
        if decision.held:
            return None, decision
        placement = decision.placement
        self.metrics.observe_decision(
            self.policy_name, placement.kind.value, self.router.decision_us[-1] * 1e-6
        )
        live = LiveRequest(req, placement.engine, info.workflow_id, info.node_id, now, info)
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
        return live, decision

    async def _admit(self, req: ServiceRequest) -> tuple[LiveRequest, Dispatch]:
        """Place `req`, waiting at the router while the policy holds it.

        A held request is offered again, most urgent (lowest priority value) first,
        whenever a request finishes and at least every `held_recheck_s`; one admitted
        offers the next in line. Held work is accepted work: it is dispatched at the
        latest when no engine has anything left to run (nothing would free capacity), or
        once it has waited `max_hold_s`."""
        info = self._prepare(req)
        try:
            live, decision = self._place(req, info)
        except BaseException:
            self.dispatch.release(info.workflow_id, self.now())
            raise
        if live is not None:
            return live, decision
        loop = asyncio.get_running_loop()
        held_since = self.now()
        self._held_n += 1
        self._held_ids.add(req.request_id)
        self.metrics.set_queue_depth(self._held_n)
        try:
            while live is None:
                turn = loop.create_future()
                self._held.push(decision.placement, turn)
                try:
                    async with asyncio.timeout(self.config.held_recheck_s):
                        await turn
                except TimeoutError:
                    pass
                finally:
                    turn.cancel()  # a no-op when it came; dropped lazily from the queue
                overdue = self.now() - held_since >= self.config.max_hold_s
                live, decision = self._place(req, info, force=self.dispatch.idle or overdue)
            self.held_total += 1
            self._offer_held()
            return live, decision
        except BaseException:
            # The caller left (or no engine is healthy) while the request waited.
            self.dispatch.release(info.workflow_id, self.now())
            raise
        finally:
            self._held_n -= 1
            self._held_ids.discard(req.request_id)
            self.metrics.set_queue_depth(self._held_n)

    def _offer_held(self) -> None:
        """Capacity freed: wake the most urgent held request to be placed again."""
        while (turn := self._held.pop()) is not None:
            if not turn.done():
                turn.set_result(None)
                return

    # -- running a request -----------------------------------------------------------
    async def open(self, req: ServiceRequest) -> RouterStream:
        """Place `req` and start it; returns once its first chunk is in hand, so a bad
        request or a dead engine is an error status, not a broken stream. An engine that
        fails before the first chunk hands the request to another engine."""
        live, decision = await self._admit(req)
        try:
            try:
                gen, first = await self._start(live, decision)
            except EngineFault as fault:
                gen, first = await self.failover(live, fault)
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

    async def _start(
        self, live: LiveRequest, decision: Dispatch
    ) -> tuple[AsyncIterator[TokenChunk], TokenChunk]:
        """Submit `live` (from the tokens it already has) to its engine; its first chunk.

        A transfer order becomes the engine's `kv_transfer` (its connector loads the prefix
        from the holder's peer server, and recomputes it if that fails); `retain` becomes a
        KV retention lease (`GenerateRequest.retain_s`)."""
        placement = decision.placement
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
            retain_s=placement.lease_s(self.config.retain_lease_s),
            retain_use_s=placement.retain_use_s if placement.retain else None,
            # The router's id: a failover's resubmission is released by it all the same.
            retain_key=req.request_id,
            # Retentions on this engine whose readers have all started ride along.
            release=decision.release,
        )
        self.metrics.observe_retention(engine.name, int(greq.retain_s > 0), len(greq.release))
        try:
            gen = engine.generate(greq)
        except ValueError as exc:
            raise BadRequest(str(exc), "prompt") from None
        except Exception as exc:
            raise EngineFault(live.slot, exc) from None
        try:
            first = await self.next_chunk(live, gen)
        except BaseException:
            await aclose_quietly(gen)
            raise
        return gen, first

    async def next_chunk(self, live: LiveRequest, gen: AsyncIterator[TokenChunk]) -> TokenChunk:
        """The engine's next chunk, or `EngineFault` if it errs, stalls past the request
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
            raise EngineFault(slot, "stalled or found down") from None
        except StopAsyncIteration:
            self.health_check.engine_failed(slot, "ended the request without output")
            raise EngineFault(slot, "ended the request without output") from None
        except ValueError as exc:
            raise BadRequest(str(exc), "prompt") from None
        except (ServiceError, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as exc:
            self.health_check.engine_failed(slot, exc)
            raise EngineFault(slot, exc) from None

    async def failover(
        self, live: LiveRequest, fault: EngineFault
    ) -> tuple[AsyncIterator[TokenChunk], TokenChunk]:
        """Move `live` off a failed engine: placed again (without the engines now down),
        resubmitted with the prompt plus the tokens already sent, max_tokens reduced."""
        rid = live.req.request_id
        while True:
            if live.failovers >= self.config.max_failovers:
                raise Unavailable(
                    f"request {rid} failed on {live.failovers + 1} engines; last: {fault}",
                    None,
                    1.0,
                )
            if len(live.out_ids) >= live.req.max_tokens:
                # Every token was sent; only the engine's closing chunk was lost.
                return empty_stream(), TokenChunk((), True, "length")
            live.failovers += 1
            self.failovers += 1
            # Release the failed engine's charge, then place as if the request were new.
            self.dispatch.on_first_token(rid)
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
                decision = self.dispatch.place(info, self.now(), force=True)
            except NoHealthyEngine:
                raise Unavailable("no healthy engine can take the request", None, 2.0) from None
            log.info(
                "request %s moves from %s to %s after %d tokens",
                rid,
                self.engines[fault.slot].name,
                self.engines[decision.placement.engine].name,
                len(live.out_ids),
            )
            live.slot = decision.placement.engine
            try:
                return await self._start(live, decision)
            except EngineFault as again:
                fault = again

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
            stream.engine, stream.kind, ids, reason, stream.cached_tokens, "".join(text)
        )

    def on_chunk(self, live: LiveRequest, chunk: TokenChunk) -> None:
        if live.first_s is None and (chunk.token_ids or chunk.finished):
            live.first_s = self.now()
            self.dispatch.on_first_token(live.req.request_id)
        # In-process engines report the hit with the first chunk; a remote server only in
        # its final usage: take it whenever it comes.
        if chunk.num_cached_tokens:
            live.cached = chunk.num_cached_tokens
        live.n_out += len(chunk.token_ids)
        live.last_s = self.health_check.progress[live.slot] = self.now()
        if chunk.token_ids:
            live.out_ids.extend(chunk.token_ids)
        if chunk.finished and chunk.finish_reason != "abort":
            self.health_check.engine_ok(live.slot)

    def finish(self, live: LiveRequest) -> None:
        rid = live.req.request_id
        if self._live.pop(rid, None) is None:
            return
        self._offer_held()
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
        )
        if live.failed:
            self.failed += 1
        elif live.cancelled:
            self.cancelled += 1
        else:
            self.completed += 1
            self._calibrate(live, now)
        # A request without workflow metadata is a one-node workflow (DESIGN.md) with
        # no deadline; the request metrics above already describe it, so the workflow
        # series (goodput, attainment) stay about the workflows agents declared.
        self.dispatch.release(live.wkey, now)
        if done.workflow is not None:
            # The registered DAG's last node just finished.
            wst = done.workflow
            self.metrics.observe_workflow(wst.app, now - wst.arrival_s, now <= wst.deadline_s)

    def _calibrate(self, live: LiveRequest, now: float) -> None:
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
        self.dispatch.set_profile(profile)
        self.recalibrations += 1
        if self.calibrator is not None:
            c = self.calibrator.current()
            log.info(
                "cost model recalibrated: prefill x%.2f, step x%.2f, batching x%.2f",
                c.prefill,
                c.step,
                c.seq,
            )

    # -- workflows -------------------------------------------------------------------
    def _count_closed(self, closed: Closed) -> None:
        wst = closed.workflow
        self.metrics.observe_workflow(wst.app, closed.last_s - wst.arrival_s, closed.met)

    async def _sweep_workflows(self) -> None:
        while True:
            await asyncio.sleep(min(self.config.idle_workflow_s / 4, 5.0))
            self.sweep_idle_workflows()

    def sweep_idle_workflows(self) -> int:
        """Close workflows idle for `idle_workflow_s` (`Dispatcher.sweep_idle`) and count
        them. Returns how many closed."""
        closed = self.dispatch.sweep_idle(self.now(), self.config.idle_workflow_s)
        for c in closed:
            if c.workflow.workflow is not None and self.journal is not None:
                self.journal.close_workflow(c.workflow.workflow_id)
            self._count_closed(c)
        return len(closed)

    def register_workflow(self, data: Mapping[str, Any], tenant: str = "") -> dict[str, Any]:
        return self.workflows_api.register(data, tenant)

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
