"""A request between dispatch and finish, and the token stream the gateway reads.

A stream that loses its engine mid-answer continues on another one from the tokens
already sent (`RouterService._failover`): the client sees one stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wasma.deploy.service_types import ServiceError, ServiceRequest, Unavailable
from wasma.engines.base import TokenChunk
from wasma.scheduler.policy import RequestInfo

if TYPE_CHECKING:
    from wasma.deploy.router_service import RouterService


@dataclass(frozen=True, slots=True)
class ReportedChunk(TokenChunk):
    """What a gateway that streams a request from its engine itself tells the router
    of the chunks it relayed since its last report: their token ids (a stream cut
    short continues elsewhere from them), finish and cache hit as in a `TokenChunk`,
    and, in place of a passed-through answer's bytes, what the router reads from them:
    how many events held output, the usage count seen, and the inter-token samples the
    gateway took as the router takes them from the chunks it relays (seconds, count)."""

    outputs: int = 0
    usage_tokens: int = 0
    raw_seen: bool = False
    gaps: tuple[tuple[float, int], ...] = ()


class StallWatch:
    """How the stall check ends one task's wait for its engine: it cancels the task, as
    an expiring `asyncio.timeout` would, and the waiter turns that cancellation into an
    engine fault. One per request and task, not a timeout object per chunk: a streamed
    answer waits once a token, on the gateway's hot path."""

    __slots__ = ("cancelling", "fired", "task")

    def __init__(self, task: asyncio.Task[object]) -> None:
        self.task = task
        self.fired = False
        self.cancelling = 0  # the task's pending cancellations before this one

    def fire(self) -> None:
        if not self.fired:
            self.fired = True
            self.cancelling = self.task.cancelling()
            self.task.cancel()

    def caught(self) -> bool:
        """Called with the `CancelledError` the waiter got: True where it was this
        watch's alone (the waiter raises its fault), False where it is another
        cancellation's (the client left, shutdown), which goes on."""
        if not self.fired:
            return False
        self.fired = False
        return self.task.uncancel() <= self.cancelling


class EngineFault(Exception):
    """An engine failed a request by its own fault (died, hung, errored): the request may
    move to another engine. Never raised for the client's own mistakes."""

    def __init__(self, slot: int, cause: BaseException | str) -> None:
        super().__init__(str(cause))
        self.slot = slot
        self.cause = cause


@dataclass(slots=True)
class LiveRequest:
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
    # Set while the request's task waits for its engine's next chunk: the stall check
    # fires it to pull the request off an engine the health check found dead or hung.
    waiting: StallWatch | None = None
    stall: StallWatch | None = None  # the last one made, reused while the task is the same
    # Its engine's load when it was placed, excluding itself (prefill tokens queued
    # ahead, requests, KV tokens): what cost calibration compares the timings against.
    load_at_dispatch: tuple[int, int, int] = (0, 0, 0)
    busy_neighbours: int = 0  # other engines busy on its engine's host, at dispatch


class RouterStream:
    """A placed request's token stream; `aclose()` (always called) settles the books."""

    def __init__(
        self,
        service: RouterService,
        live: LiveRequest,
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

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine served from its prefix cache (as it reported them)."""
        return self._live.cached

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
                chunk = await service.runner.next_chunk(live, self._gen)
                break
            except EngineFault as fault:
                if live.failed or (live.req.call is not None and live.raw_sent):
                    # A passed-through answer half sent cannot be continued elsewhere:
                    # its bytes are the engine's own, not tokens to resume from.
                    live.failed = True
                    raise Unavailable(str(fault), None, 1.0) from None
                # Continue on another engine from the tokens already sent: the client
                # sees one stream, whatever happened behind it.
                await aclose_quietly(self._gen)
                try:
                    self._gen, chunk = await service.runner.failover(live, fault)
                except ServiceError:
                    live.failed = True
                    raise
                self.engine = service.engines[live.slot].name
                self.resumed += 1
                break
        service.on_chunk(live, chunk)
        if chunk.finished:
            self._done = True
        return chunk

    async def relay(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        """The rest of a passed-through stream whose first bytes were sent: each read of
        the engine's bytes written as it comes, with no iterator layers between the
        engine's reader and the client's writer (a proxied stream's hot path). Such a
        stream is never continued elsewhere (its bytes are the engine's own answer, not
        tokens to resume from), so a fault ends it, as in `__anext__`."""
        service, live = self._service, self._live
        next_chunk, on_chunk = service.runner.next_chunk, service.on_chunk
        while not self._done:
            try:
                chunk = await next_chunk(live, self._gen)
            except EngineFault as fault:
                live.failed = True
                raise Unavailable(str(fault), None, 1.0) from None
            on_chunk(live, chunk)
            if chunk.finished:
                self._done = True
            if chunk.raw:
                await write(chunk.raw)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self._done:
            self._live.cancelled = True
        try:
            await aclose_quietly(self._gen)  # aborts the engine's work if the client left early
        finally:
            self._service.finish(self._live)


async def empty_stream() -> AsyncIterator[TokenChunk]:
    return
    yield  # an async generator with nothing in it


def expire(live: LiveRequest) -> None:
    """End `live`'s wait for its engine now (it moves to another engine)."""
    waiting = live.waiting
    if waiting is not None:
        waiting.fire()


async def aclose_quietly(gen: AsyncIterator[TokenChunk]) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
