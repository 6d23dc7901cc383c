"""Admission at the live router: checks, workflow opening, placement, and the held queue.

A request the policy holds (deadline-aware admission) waits here, offered again most
urgent first whenever a request finishes and at least every `held_recheck_s`; held work
is accepted work, dispatched at the latest when no engine has anything left to run or
once it has waited `max_hold_s`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from wasma.core.tokens import hash_token_blocks
from wasma.deploy.cost_feed import CostFeed
from wasma.deploy.deadline_shedding import deadline_refusal, default_limit
from wasma.deploy.live_request import LiveRequest
from wasma.deploy.metrics import WasmaMetrics
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.service_types import BadRequest, Overloaded, ServiceRequest, Unavailable
from wasma.deploy.workflow_api import scoped
from wasma.scheduler.dispatch import ANONYMOUS_PREFIX, Dispatch, Dispatcher, HeldQueue
from wasma.scheduler.policy import NoHealthyEngine, RequestInfo
from wasma.scheduler.workflows import WorkflowState


class Admission:
    def __init__(
        self,
        dispatch: Dispatcher,
        metrics: WasmaMetrics,
        config: RouterConfig,
        live: dict[str, LiveRequest],
        costs: CostFeed,
        now: Callable[[], float],
        max_model_len: int | None,
    ) -> None:
        self.dispatch = dispatch
        self.metrics = metrics
        self.config = config
        self._live = live  # the service's requests in flight, by id; placed ones join it
        self.costs = costs
        self.now = now
        self.max_model_len = max_model_len
        limit = config.max_outstanding
        # None: what the engines can run and queue, not a fixed number.
        self.max_outstanding = (
            limit
            if limit is not None
            else default_limit(len(dispatch.ctx.state.loads), dispatch.ctx.profile)
        )
        self.block_size = dispatch.ctx.block_size
        # Requests the policy holds at the router: the future that wakes each.
        self._held: HeldQueue[asyncio.Future[None]] = HeldQueue()
        self.held_now = 0
        self._held_ids: set[str] = set()
        self.held_total = 0  # requests that waited at the router before going live

    def prepare(self, req: ServiceRequest) -> RequestInfo:
        """Check `req` and enter it in its workflow; what the policy places."""
        held = len(self._live) + self.held_now
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
            wkey, node_id = f"{ANONYMOUS_PREFIX}{req.request_id}", "0"
        else:
            wkey = scoped(ident.workflow_id, req.tenant)
            node_id = ident.node_id or req.request_id
        if (why := self.dispatch.parent_error(wkey, node_id, ident.parents)) is not None:
            raise BadRequest(why, "x-wasma-parents")
        running = self.dispatch.current_run(wkey)
        self._shed_by_deadline(req, running, now)
        wst = self.dispatch.open_request(wkey, ident.app, ident.deadline_s, now)
        if ident.workflow_id is not None and running is None:
            self.metrics.observe_workflow_started(wst.app)
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
            self._pinned_slot(req),
        )

    def _pinned_slot(self, req: ServiceRequest) -> int | None:
        if req.pin_engine is None:
            return None
        engines = self.dispatch.ctx.state.engines
        if req.pin_engine in engines:
            return engines.index(req.pin_engine)
        raise BadRequest(
            f"the engine that holds this request's state ({req.pin_engine}) is gone",
            "previous_response_id",
        )

    def place(
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
            self.config.policy, placement.kind.value, self.dispatch.decision_us[-1] * 1e-6
        )
        live = LiveRequest(req, placement.engine, info.workflow_id, info.node_id, now, info)
        self.costs.at_dispatch(live, placement)
        self._live[req.request_id] = live
        return live, decision

    def _shed_by_deadline(self, req: ServiceRequest, wst: WorkflowState | None, now: float) -> None:
        """503 + Retry-After now for a request whose workflow's deadline is out of reach
        even on the least loaded engine (deploy/deadline_shedding.py), rather than a wait
        that ends past it; before a new workflow is entered, so a refusal leaves nothing."""
        if not self.config.shed_past_deadline:
            return
        if wst is not None:
            deadline = wst.deadline_s
        elif req.identity.deadline_s is not None:
            deadline = now + req.identity.deadline_s
        else:
            return
        ctx = self.dispatch.ctx
        why = deadline_refusal(
            now, deadline, ctx.state.loads, ctx.profile, len(req.prompt_token_ids), req.max_tokens
        )
        if why is not None:
            self.metrics.observe_admission_rejected()
            if wst is not None:
                # Active now, past its deadline: the sweep counts the run as a miss.
                self.dispatch.touch(wst.workflow_id, now)
            raise Unavailable(why.message, None, why.retry_after_s)

    async def admit(self, req: ServiceRequest) -> tuple[LiveRequest, Dispatch]:
        """Place `req`, waiting at the router while the policy holds it.

        A held request is offered again, most urgent (lowest priority value) first,
        whenever a request finishes and at least every `held_recheck_s`; one admitted
        offers the next in line. Held work is accepted work: it is dispatched at the
        latest when no engine has anything left to run (nothing would free capacity), or
        once it has waited `max_hold_s`."""
        info = self.prepare(req)
        try:
            live, decision = self.place(req, info)
        except BaseException:
            self.dispatch.release(info.workflow_id, self.now())
            raise
        if live is not None:
            return live, decision
        loop = asyncio.get_running_loop()
        held_since = self.now()
        self.held_now += 1
        self._held_ids.add(req.request_id)
        self.metrics.set_queue_depth(self.held_now)
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
                live, decision = self.place(req, info, force=self.dispatch.idle or overdue)
            self.held_total += 1
            self.metrics.observe_hold(self.now() - held_since)
            self.offer_held()
            return live, decision
        except BaseException:
            # The caller left (or no engine is healthy) while the request waited.
            self.dispatch.release(info.workflow_id, self.now())
            raise
        finally:
            self.held_now -= 1
            self._held_ids.discard(req.request_id)
            self.metrics.set_queue_depth(self.held_now)

    def offer_held(self) -> None:
        """Capacity freed: wake the most urgent held request to be placed again."""
        while (turn := self._held.pop()) is not None:
            if not turn.done():
                turn.set_result(None)
                return
