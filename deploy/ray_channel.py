"""Many requests over few Ray calls between the gateway and the router actor.

A Ray actor call costs a few hundred microseconds of CPU on each side, as much as the
gateway's own work per request; one call per request (and one object per streamed chunk)
would halve throughput. So the gateway batches: every request that arrives within one
event-loop tick goes to the actor in one `submit` call, and one long-lived streaming call
per gateway (`results`) brings back everything that happened since its last item
(results, stream openings, token chunks, errors), in order per request.

Messages are `(kind, request_id, payload)` with kind one of
`result` (ServiceResult), `open` ((engine, placement)), `chunk` (TokenChunk),
`end` (None), `error` (a ServiceError), and for direct streams `order`
((order, engine slot, GenerateRequest, placement kind)) and `stop` (order).

Direct streams: a gateway that can reach the engines itself (`ChannelClient(direct=
True)`, engines with an `EngineView`) runs each placed request on its engine and streams
the tokens to its client; the router keeps the books as for any request (admission,
placement, failover, health, metrics) from what the gateway reports: the first chunk
at once, then batches of token ids and counts (`ReportedChunk`) at most every
`REPORT_EVERY_S`, the finish, and faults. The router answers a fault as it answers one
of an engine it drives: placed again, a new `order` from the tokens already sent.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from wasma.deploy.live_request import LiveRequest, ReportedChunk, aclose_quietly
from wasma.deploy.router_service import (
    RouterService,
    chunk_outputs,
    collect_result,
    inter_token_sample,
    output_tokens_in,
)
from wasma.deploy.service_types import ServiceError, ServiceRequest, ServiceResult, Unavailable
from wasma.engines.base import (
    EngineView,
    GenerateRequest,
    RequestRefused,
    StreamingEngine,
    TokenChunk,
)

log = logging.getLogger(__name__)

Message = tuple[str, str, Any]

# A direct stream tells the router of its progress at most this often (and at once of
# its first chunk, its finish and a fault): the router's stall check needs a sign of life
# well within `request_timeout_s`, and its load counters only the start and the end.
REPORT_EVERY_S = 0.5


class ReportedFault(RuntimeError):
    """A gateway's engine failed the request it ran for the router."""


class _Outbox:
    def __init__(self) -> None:
        self.items: list[Message] = []
        self.ready = asyncio.Event()

    def put(self, msg: Message) -> None:
        self.items.append(msg)
        self.ready.set()

    async def drain(self) -> list[Message]:
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items


class ChannelServer:
    """The actor's side: runs submitted requests on the service, queues what happens."""

    def __init__(self, service: RouterService) -> None:
        self.service = service
        self._boxes: dict[str, _Outbox] = {}
        self._tasks: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._views = [engine.direct_view() for engine in service.engines]
        self._direct: set[str] = set()  # channels whose gateway runs requests itself
        # The order a direct request runs under now, and where its reports go.
        self._orders: dict[tuple[str, str], tuple[int, asyncio.Queue[Any]]] = {}
        self._running: contextvars.ContextVar[tuple[str, _Outbox] | None] = contextvars.ContextVar(
            "wasma_channel", default=None
        )
        self.relayed_chunks = 0  # chunks sent to gateways (direct streams send none)
        self.reports = 0  # reports received from gateways
        service.runner.divert = self._divert

    def _box(self, channel: str) -> _Outbox:
        box = self._boxes.get(channel)
        if box is None:
            box = self._boxes[channel] = _Outbox()
        return box

    def submit(self, channel: str, batch: list[tuple[ServiceRequest, bool]]) -> None:
        box = self._box(channel)
        loop = asyncio.get_running_loop()
        for req, stream in batch:
            key = (channel, req.request_id)
            task = loop.create_task(self._run(channel, box, req, stream))
            self._tasks[key] = task
            task.add_done_callback(self._done_callback(key))

    def _done_callback(self, key: tuple[str, str]) -> Callable[[asyncio.Task[None]], None]:
        def done(_task: asyncio.Task[None]) -> None:
            self._tasks.pop(key, None)

        return done

    def direct_views(self, channel: str) -> list[EngineView | None]:
        """The engines as `channel`'s gateway may reach them itself, by slot (None: its
        requests there stream through the router); from now on it runs them."""
        self._direct.add(channel)
        return list(self._views)

    def report(self, channel: str, items: list[tuple[str, int, Any]]) -> None:
        """A direct stream's progress: (request id, order, ReportedChunk or a fault as
        (kind, message, param)). Reports of an order the router replaced are stale."""
        for rid, order, payload in items:
            self.reports += 1
            current = self._orders.get((channel, rid))
            if current is None:
                continue
            if current[0] != order and not (
                isinstance(payload, ReportedChunk) and payload.finished
            ):
                continue
            # A finish from an order since replaced (the router moved the request as its
            # answer was ending) still ends it: the client has the whole answer, and the
            # gateway, done with the request, ignores the new order.
            current[1].put_nowait(payload)

    def _divert(
        self, live: LiveRequest, greq: GenerateRequest, kind: str
    ) -> AsyncIterator[TokenChunk] | None:
        running = self._running.get()
        if running is None or self._views[live.slot] is None:
            return None
        channel, box = running
        if channel not in self._direct:
            return None
        key = (channel, live.req.request_id)
        order = live.failovers
        reports: asyncio.Queue[Any] = asyncio.Queue()
        self._orders[key] = (order, reports)
        return self._reported(key, order, reports, box, live.slot, greq, kind)

    async def _reported(
        self,
        key: tuple[str, str],
        order: int,
        reports: asyncio.Queue[Any],
        box: _Outbox,
        slot: int,
        greq: GenerateRequest,
        kind: str,
    ) -> AsyncIterator[TokenChunk]:
        """The chunks a gateway reports for one order, as the engine's own stream would
        give them (a fault as the exception the engine would raise)."""
        rid = key[1]
        box.put(("order", rid, (order, slot, greq, kind)))
        finished = False
        try:
            while True:
                payload = await reports.get()
                if isinstance(payload, ReportedChunk):
                    finished = payload.finished
                    yield payload
                    if finished:
                        return
                    continue
                fault, message, param = payload
                if fault == "ended":
                    return  # the engine ended the request without finishing it
                if fault == "refused":
                    raise RequestRefused(message, param)
                raise ReportedFault(message)
        finally:
            if self._orders.get(key, (None,))[0] == order:
                del self._orders[key]
            if not finished:
                # Moved, cancelled or failed here: the gateway stops reading that engine.
                box.put(("stop", rid, order))

    async def _run(self, channel: str, box: _Outbox, req: ServiceRequest, stream: bool) -> None:
        rid = req.request_id
        try:
            if not stream:
                box.put(("result", rid, await self.service.complete(req)))
                return
            self._running.set((channel, box))  # this task's context: `_divert` reads it
            s = await self.service.open(req)
            try:
                box.put(("open", rid, (s.engine, s.kind)))
                async for chunk in s:
                    if isinstance(chunk, ReportedChunk):
                        continue  # the gateway streamed it from the engine itself
                    self.relayed_chunks += 1
                    box.put(("chunk", rid, chunk))
                box.put(("end", rid, None))
            finally:
                await s.aclose()
        except asyncio.CancelledError:
            raise  # the gateway cancelled it: nobody is waiting for an answer
        except ServiceError as exc:
            box.put(("error", rid, exc))
        except Exception as exc:
            log.exception("request %s failed in the router", rid)
            box.put(("error", rid, Unavailable(f"router error: {exc}", None, 1.0)))

    def cancel(self, channel: str, request_ids: list[str]) -> None:
        for rid in request_ids:
            task = self._tasks.get((channel, rid))
            if task is not None:
                task.cancel()

    async def results(self, channel: str) -> AsyncIterator[list[Message]]:
        box = self._box(channel)
        try:
            while True:
                yield await box.drain()
        finally:
            # The gateway went away: stop its requests and forget its channel.
            for (ch, _rid), task in list(self._tasks.items()):
                if ch == channel:
                    task.cancel()
            self._boxes.pop(channel, None)
            self._direct.discard(channel)


class _Stream:
    """A streamed request as the gateway sees it."""

    def __init__(
        self, client: ChannelClient, rid: str, engine: str, kind: str, q: asyncio.Queue[Message]
    ) -> None:
        self.engine = engine
        self.kind = kind
        self._client = client
        self._rid = rid
        self._q = q
        self._ended = False

    async def _chunks(self) -> AsyncIterator[TokenChunk]:
        while True:
            kind, _rid, payload = await self._q.get()
            if kind == "chunk":
                yield payload
            elif kind == "end":
                self._ended = True
                return
            elif kind == "error":
                self._ended = True
                raise payload

    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self._chunks()

    async def aclose(self) -> None:
        self._client._forget(self._rid, cancel=not self._ended)


class _Progress:
    """What a direct stream's next report tells the router."""

    __slots__ = ("cached", "first", "gaps", "ids", "outputs", "raw", "status", "usage")

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.outputs = 0
        self.usage = 0
        self.raw = False
        self.gaps: list[tuple[float, int]] = []
        self.cached: int | None = None
        self.status = 0
        self.first = True  # nothing of this order reported yet

    def take(self, chunk: TokenChunk, finished: bool) -> ReportedChunk:
        out = ReportedChunk(
            tuple(self.ids),
            finished,
            chunk.finish_reason if finished else None,
            self.cached,
            chunk.stop_reason if finished else None,
            status=self.status,
            outputs=self.outputs,
            usage_tokens=self.usage,
            raw_seen=self.raw,
            gaps=tuple(self.gaps),
        )
        self.ids, self.outputs, self.gaps = [], 0, []
        self.cached, self.status, self.raw, self.first = None, 0, False, False
        return out


class _DirectStream:
    """A request this gateway runs on its engine for the router: the tokens go from
    the engine to the client here; the router hears of them in reports (module doc)."""

    def __init__(self, client: ChannelClient, rid: str, streamed: bool, prompt_len: int) -> None:
        self.engine = ""
        self.kind = ""
        self.cached_tokens = 0
        self._client = client
        self._rid = rid
        self._streamed = streamed  # the client asked for a stream (SSE events count)
        self._control: collections.deque[Message] = collections.deque()
        self._signal: asyncio.Future[None] | None = None
        self._wait: asyncio.Timeout | None = None
        self._gen: AsyncIterator[TokenChunk] | None = None
        self._order = -1
        self._next: tuple[int, str] = (0, "")  # the current order's engine and placement
        self._pending: collections.deque[TokenChunk] = collections.deque()
        self._ended = False
        self._sent_output = False  # an output went to the client (inter-token samples)
        self._last_output = 0.0  # when (on any of its engines)
        self._progress = _Progress()
        self._last_report = 0.0
        self._prompt_len = prompt_len
        self._sent: list[int] = []  # token ids from the engines so far (to the client)

    # -- control from the router -----------------------------------------------------
    def put(self, msg: Message) -> None:
        self._control.append(msg)
        if self._signal is not None and not self._signal.done():
            self._signal.set_result(None)
        # Interrupting a read cancels the engine's stream for good (an async generator
        # that a cancellation passes through is finished): only for word that ends it.
        kind = msg[0]
        ends = kind in ("order", "error") or (kind == "stop" and msg[2] == self._order)
        if ends and self._wait is not None and not self._wait.expired():
            self._wait.reschedule(asyncio.get_running_loop().time())

    async def _next_control(self) -> Message:
        while not self._control:
            self._signal = asyncio.get_running_loop().create_future()
            try:
                await self._signal
            finally:
                self._signal = None
        return self._control.popleft()

    async def _handle(self, msg: Message) -> None:
        kind, _rid, payload = msg
        if kind == "order":
            await self._start(*payload)
        elif kind == "stop":
            if payload == self._order:
                await self._drop_engine()
        elif kind == "open":
            # The router's word that the request opened; a direct stream already knows.
            if not self.engine:
                self.engine, self.kind = payload
        elif kind == "chunk":
            self._pending.append(payload)  # an engine only the router reaches
        elif kind == "end":
            self._ended = True
        elif kind == "error":
            self._ended = True
            raise payload

    async def opening(self) -> None:
        """Until the request's first chunk is in hand from the engine the router ordered
        it to (the router opens it once that chunk is reported; the client need not wait
        for the word: the order named the engine and the placement)."""
        while not self.engine:
            if self._control:
                await self._handle(self._control.popleft())
            elif self._gen is not None and self._progress.first:
                # Read until the order's first chunk (the router waits for it to open).
                first = await self._read()
                if first is not None:
                    self._pending.append(first)
                    slot, kind = self._next
                    name = self._client.engine_name(slot)
                    if name:  # else (the router just restarted) its word will come
                        self.engine, self.kind = name, kind
            else:
                await self._handle(await self._next_control())

    # -- the engine ------------------------------------------------------------------
    async def _start(self, order: int, slot: int, greq: GenerateRequest, kind: str) -> None:
        await self._drop_engine()
        self._order = order
        self._progress = _Progress()
        self._next = (slot, kind)
        # A router that moved the request on its own (its health check) continues it
        # from the tokens reported so far; those sent since go on the prompt here, and
        # to the router with this order's first report.
        known = len(greq.prompt_token_ids) - self._prompt_len
        extra = self._sent[known:] if 0 <= known < len(self._sent) else []
        if extra:
            self._progress.ids.extend(extra)
            left = greq.max_tokens - len(extra)
            if left <= 0:  # every token was out; only the finish was not
                self._pending.append(TokenChunk((), True, "length"))
                self._report(self._progress.take(self._pending[-1], True))
                return
            greq = replace(greq, prompt_token_ids=[*greq.prompt_token_ids, *extra], max_tokens=left)
        try:
            engine = await self._client.engine(slot)
            self._gen = engine.generate(greq)
        except Exception as exc:
            self._fault(exc)
        # The reading loops (`opening`, `_chunks`) take it from here.

    async def _drop_engine(self) -> None:
        gen, self._gen = self._gen, None
        if gen is not None:
            await aclose_quietly(gen)

    async def _read(self) -> TokenChunk | None:
        """The engine's next chunk; None when the router's word came first or the engine
        failed (reported: the router answers with a new order or an error)."""
        gen = self._gen
        assert gen is not None
        waiting = asyncio.timeout(None)
        try:
            async with waiting:
                self._wait = waiting
                chunk = await gen.__anext__()
        except TimeoutError as exc:
            if waiting.expired():
                return None
            self._fault(exc)
            return None
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as exc:
            self._fault(exc)
            return None
        finally:
            self._wait = None
        self._account(chunk)
        return chunk

    def _fault(self, exc: BaseException) -> None:
        gen, self._gen = self._gen, None
        if gen is not None:
            self._client.later(aclose_quietly(gen))
        if isinstance(exc, StopAsyncIteration):
            fault: tuple[str, str, str | None] = ("ended", "", None)
        elif isinstance(exc, ValueError):  # the request's own fault (RequestRefused)
            fault = ("refused", str(exc), getattr(exc, "param", None))
        else:
            fault = ("engine", f"{type(exc).__name__}: {exc}", None)
        if self._progress.ids or self._progress.outputs or self._progress.raw:
            self._report(self._progress.take(TokenChunk((), False), False))
        self._client.report(self._rid, self._order, fault)

    def _account(self, chunk: TokenChunk) -> None:
        p = self._progress
        now = time.monotonic()
        outputs = chunk_outputs(chunk, self._streamed)
        if chunk.raw:
            p.raw = True
            p.usage = max(p.usage, output_tokens_in(chunk.raw))
        # As the router samples the chunks it relays.
        sample = inter_token_sample(self._sent_output, now - self._last_output, outputs)
        if sample is not None:
            p.gaps.append(sample)
        if outputs:
            self._sent_output = True
            self._last_output = now
        p.ids.extend(chunk.token_ids)
        self._sent.extend(chunk.token_ids)
        p.outputs += outputs
        if chunk.num_cached_tokens:
            p.cached = chunk.num_cached_tokens
            self.cached_tokens = chunk.num_cached_tokens
        if chunk.status:
            p.status = chunk.status
        if p.first or chunk.finished or now - self._last_report >= REPORT_EVERY_S:
            self._report(p.take(chunk, chunk.finished))

    def _report(self, chunk: ReportedChunk) -> None:
        self._last_report = time.monotonic()
        self._client.report(self._rid, self._order, chunk)

    # -- the client's side -----------------------------------------------------------
    def __aiter__(self) -> AsyncIterator[TokenChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[TokenChunk]:
        while True:
            if self._pending:
                chunk = self._pending.popleft()
                if chunk.finished:
                    self._ended = True
                yield chunk
                if self._ended and not self._pending:
                    return
                continue
            if self._ended:
                return
            if self._control:
                await self._handle(self._control.popleft())
                continue
            if self._gen is None:
                await self._handle(await self._next_control())
                continue
            read = await self._read()
            if read is not None:
                self._pending.append(read)

    async def aclose(self) -> None:
        await self._drop_engine()
        self._client._forget(self._rid, cancel=not self._ended)


class ChannelClient:
    """The gateway's side of one channel to a `ChannelServer` in a Ray actor."""

    def __init__(self, handle: Any, direct: bool = False) -> None:
        self.handle = handle
        self.channel = uuid.uuid4().hex
        self._waiting: dict[
            str, asyncio.Future[ServiceResult] | asyncio.Queue[Message] | _DirectStream
        ] = {}
        self._batch: list[tuple[ServiceRequest, bool]] = []
        self._cancels: list[str] = []
        self._reports: list[tuple[str, int, Any]] = []
        self._flush_scheduled = False
        self._listener: asyncio.Task[None] | None = None
        # Direct streams: the engines as the router lets this gateway reach them.
        self.direct = direct
        self._views: asyncio.Future[list[EngineView | None]] | None = None
        self._engines: dict[int, asyncio.Future[StreamingEngine]] = {}
        self._background: set[asyncio.Future[None]] = set()

    # -- plumbing --------------------------------------------------------------------
    def _ensure_listener(self) -> None:
        if self._listener is None or self._listener.done():
            if self._listener is not None:
                # The router restarted: it knows this channel no more, and its engines
                # may be new ones; ask again and reconnect.
                self._views = None
                for engine in self._forget_engines():
                    self.later(engine.close())
            self._listener = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        gen = self.handle.results.options(num_returns="streaming").remote(self.channel)
        try:
            async for ref in gen:
                for msg in await ref:
                    self._deliver(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("router channel lost: %s", exc)
        # The actor died or restarted: nothing in flight will be answered.
        self._fail_all(Unavailable("the router restarted; retry the request", None, 1.0))

    def _deliver(self, msg: Message) -> None:
        waiter = self._waiting.get(msg[1])
        if waiter is None:
            return
        if isinstance(waiter, _DirectStream):
            waiter.put(msg)
        elif isinstance(waiter, asyncio.Queue):
            waiter.put_nowait(msg)
        elif not waiter.done():
            if msg[0] == "result":
                waiter.set_result(msg[2])
            else:
                waiter.set_exception(msg[2])

    def _fail_all(self, exc: ServiceError) -> None:
        for rid in list(self._waiting):
            self._deliver(("error", rid, exc))

    def _schedule(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            # Everything queued during this loop tick leaves in one call.
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._batch:
            batch, self._batch = self._batch, []
            ref = self.handle.submit.remote(self.channel, batch)
            asyncio.get_running_loop().create_task(
                self._watch_submit(ref, [r.request_id for r, _ in batch])
            )
        if self._cancels:
            cancels, self._cancels = self._cancels, []
            self.handle.cancel.remote(self.channel, cancels)
        if self._reports:
            reports, self._reports = self._reports, []
            self.handle.report.remote(self.channel, reports)

    def later(self, work: Awaitable[None]) -> None:
        """Run `work` in the background (kept referenced until it is done)."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def report(self, rid: str, order: int, payload: Any) -> None:
        """Tell the router of a direct stream's progress (leaves with this tick's batch)."""
        self._reports.append((rid, order, payload))
        self._schedule()

    async def _direct_views(self) -> list[EngineView | None]:
        if self._views is None:
            self._views = asyncio.ensure_future(self.handle.direct_views.remote(self.channel))
        return await asyncio.shield(self._views)

    def _forget_engines(self) -> list[StreamingEngine]:
        """Drop this gateway's engine clients; the connected ones, to close."""
        futures, self._engines = self._engines, {}
        return [
            f.result()
            for f in futures.values()
            if f.done() and not f.cancelled() and f.exception() is None
        ]

    def engine_name(self, slot: int) -> str:
        """The name of the engine in `slot`, as the router's views say ("" unknown)."""
        views = self._views
        if views is None or not views.done() or views.exception() is not None:
            return ""
        known = views.result()
        view = known[slot] if slot < len(known) else None
        return view.name if view is not None else ""

    async def engine(self, slot: int) -> StreamingEngine:
        """This gateway's client of the engine in `slot` (connected once)."""
        future = self._engines.get(slot)
        if future is None or (future.done() and future.exception() is not None):
            views = await self._direct_views()
            view = views[slot]
            if view is None:
                raise RuntimeError(f"engine slot {slot} is not reachable from the gateway")
            future = self._engines[slot] = asyncio.ensure_future(view.connect())
        return await asyncio.shield(future)

    async def _watch_submit(self, ref: Any, rids: list[str]) -> None:
        try:
            await ref
        except Exception as exc:
            err = Unavailable(f"the router did not take the request: {exc}", None, 1.0)
            for rid in rids:
                self._deliver(("error", rid, err))

    def _forget(self, rid: str, cancel: bool) -> None:
        self._waiting.pop(rid, None)
        if cancel:
            self._cancels.append(rid)
            self._schedule()

    # -- calls -----------------------------------------------------------------------
    async def complete(self, req: ServiceRequest) -> ServiceResult:
        if self.direct:
            # Run here as a stream; the whole answer is gathered from the engine's chunks.
            return await collect_result(await self._open_direct(req))
        self._ensure_listener()
        fut: asyncio.Future[ServiceResult] = asyncio.get_running_loop().create_future()
        self._waiting[req.request_id] = fut
        self._batch.append((req, False))
        self._schedule()
        try:
            return await fut
        except asyncio.CancelledError:
            self._forget(req.request_id, cancel=True)  # the actor stops its work too
            raise
        finally:
            self._waiting.pop(req.request_id, None)

    async def open(self, req: ServiceRequest) -> _Stream | _DirectStream:
        if self.direct:
            return await self._open_direct(req)
        self._ensure_listener()
        q: asyncio.Queue[Message] = asyncio.Queue()
        self._waiting[req.request_id] = q
        self._batch.append((req, True))
        self._schedule()
        try:
            kind, _rid, payload = await q.get()
        except BaseException:
            self._forget(req.request_id, cancel=True)
            raise
        if kind == "error":
            self._waiting.pop(req.request_id, None)
            raise payload
        engine, placement = payload
        return _Stream(self, req.request_id, engine, placement, q)

    async def _open_direct(self, req: ServiceRequest) -> _DirectStream:
        self._ensure_listener()
        await self._direct_views()  # from now on the router sends this channel orders
        call = req.call
        stream = _DirectStream(
            self, req.request_id, call is None or call.stream, len(req.prompt_token_ids)
        )
        self._waiting[req.request_id] = stream
        self._batch.append((req, True))
        self._schedule()
        try:
            await stream.opening()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def close(self) -> None:
        for engine in self._forget_engines():
            with contextlib.suppress(Exception):
                await engine.close()
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
