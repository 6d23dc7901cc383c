"""Many requests over few Ray calls between the gateway and the router actor.

A Ray actor call costs a few hundred microseconds of CPU on each side, as much as the
gateway's own work per request; one call per request (and one object per streamed chunk)
would halve throughput. So the gateway batches: every request that arrives within one
event-loop tick goes to the actor in one `submit` call, and one long-lived streaming call
per gateway (`results`) brings back everything that happened since its last item
(results, stream openings, token chunks, errors), in order per request.

Messages are `(kind, request_id, payload)` with kind one of
`result` (ServiceResult), `open` ((engine, placement)), `chunk` (TokenChunk),
`end` (None), `error` (a ServiceError).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from wasma.deploy.router_service import RouterService
from wasma.deploy.service_types import ServiceError, ServiceRequest, ServiceResult, Unavailable
from wasma.engines.base import TokenChunk

log = logging.getLogger(__name__)

Message = tuple[str, str, Any]


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
            task = loop.create_task(self._run(box, req, stream))
            self._tasks[key] = task
            task.add_done_callback(self._done_callback(key))

    def _done_callback(self, key: tuple[str, str]) -> Callable[[asyncio.Task[None]], None]:
        def done(_task: asyncio.Task[None]) -> None:
            self._tasks.pop(key, None)

        return done

    async def _run(self, box: _Outbox, req: ServiceRequest, stream: bool) -> None:
        rid = req.request_id
        try:
            if not stream:
                box.put(("result", rid, await self.service.complete(req)))
                return
            s = await self.service.open(req)
            try:
                box.put(("open", rid, (s.engine, s.kind)))
                async for chunk in s:
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


class ChannelClient:
    """The gateway's side of one channel to a `ChannelServer` in a Ray actor."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.channel = uuid.uuid4().hex
        self._waiting: dict[str, asyncio.Future[ServiceResult] | asyncio.Queue[Message]] = {}
        self._batch: list[tuple[ServiceRequest, bool]] = []
        self._cancels: list[str] = []
        self._flush_scheduled = False
        self._listener: asyncio.Task[None] | None = None

    # -- plumbing --------------------------------------------------------------------
    def _ensure_listener(self) -> None:
        if self._listener is None or self._listener.done():
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
        if isinstance(waiter, asyncio.Queue):
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

    async def open(self, req: ServiceRequest) -> _Stream:
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

    async def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._listener
