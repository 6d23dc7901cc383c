"""The simulated vLLM engine on the wall clock: `SimEngineCore` behind `EngineClient`.

For demos and load tests without models. One asyncio task per engine plays vLLM's engine
loop: schedule a step, sleep until the profile says it ends, apply it, hand out tokens.
Output token ids are a deterministic function of the prompt (seeded by its hash), so the
block hashes the core caches for a request's output are the hashes a child request gets
when it sends the parent's output back: the router's prefix index and the engine agree,
exactly as with vLLM's own KV events.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import heapq
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import numpy as np

from wasma.core.events import EngineStats, KVEvent
from wasma.core.profile import Profile
from wasma.core.tokens import hash_token_blocks
from wasma.engines.base import EngineClient, GenerateRequest, KVEventSink, TokenChunk
from wasma.engines.sim.core import SimEngineCore, SimRequest, StepOutcome

# Token ids below this are left to special tokens (BOS/EOS/PAD), as TokenMaterialiser does.
_LOW_TOKEN = 16


def sim_output_tokens(prompt: list[int], n: int, vocab_size: int) -> list[int]:
    """The `n` output ids the simulator produces for `prompt`: same prompt, same output."""
    digest = hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=8)
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest.digest(), "little")))
    return [int(t) for t in rng.integers(_LOW_TOKEN, vocab_size, size=n, dtype=np.int64)]


@dataclass(slots=True, eq=False)
class _Pending:
    """One request's output as the driver produces it and `generate` consumes it."""

    req: SimRequest
    output: list[int]
    sent: int = 0  # output tokens emitted so far
    finished: bool = False
    retain_s: float = 0.0  # the KV retention lease the request asked for (wall seconds)
    retain_key: str = ""  # what the router releases that retention by
    # An exception in the queue is the engine failing the request (fault injection).
    queue: asyncio.Queue[TokenChunk | BaseException] = field(default_factory=asyncio.Queue)


class SimEngine(EngineClient):
    """A `SimEngineCore` advanced in real time; `speed` > 1 runs the model faster."""

    def __init__(
        self,
        name: str,
        profile: Profile,
        *,
        policy: str = "priority",
        speed: float = 1.0,
        vocab_size: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if speed <= 0:
            raise ValueError(f"speed must be positive, got {speed!r}")
        self.name = name
        self.block_size = profile.block_size
        self.profile = profile
        self.vocab_size = vocab_size or profile.vocab_size
        self._speed = speed
        self._clock = clock
        self._t0 = clock()
        self._sinks: list[KVEventSink] = []
        self._policy = policy
        self.core = SimEngineCore(name, profile, policy, kv_sink=self._emit)
        # Fault injection for reliability tests: a dead engine refuses and fails requests,
        # a hung one stops producing tokens and never answers a health check.
        self.dead = False
        self.hung = False
        self._pending: dict[str, _Pending] = {}
        self._task: asyncio.Task[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        # KV retention, as wasma's retaining vLLM scheduler keeps it
        # (engines/vllm_retention.py): retention key (the router's request id) -> (its
        # chain, when it is next wanted, the request that asked), from the request's
        # arrival until its lease ends or the router releases it; and the leases,
        # (simulated end, seq, key), soonest first.
        self._kept: dict[str, tuple[list[int], float, str]] = {}
        self._leases: list[tuple[float, int, str]] = []
        self._lease_seq = 0

    # -- clock -----------------------------------------------------------------------
    def _now(self) -> float:
        """Simulated seconds since the engine started."""
        return (self._clock() - self._t0) * self._speed

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _sleep_until(self, sim_t: float | None) -> None:
        """Sleep until simulated time `sim_t` (None: until woken)."""
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = None
        if sim_t is not None:
            delay = (sim_t - self._now()) / self._speed
            if delay <= 0:
                return
            timer = loop.call_later(delay, self._wake)
        try:
            await self._waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    # -- events ----------------------------------------------------------------------
    def _emit(self, event: KVEvent) -> None:
        for sink in self._sinks:
            sink(event)

    def subscribe_kv_events(self, sink: KVEventSink) -> None:
        self._sinks.append(sink)

    # -- driver ----------------------------------------------------------------------
    def _ensure_running(self) -> None:
        if self._closed:
            raise RuntimeError(f"engine {self.name} is closed")
        if self.dead:
            raise ConnectionError(f"engine {self.name} is down")
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        core = self.core
        while True:
            if not core.has_work():
                await self._sleep_until(None)
                continue
            self._end_leases()
            end = core.start_step(self._now())
            if end < 0:
                # Nothing fits this step; wait for an arrival or an abort to change that.
                await self._sleep_until(None)
                continue
            # New arrivals may shorten a macro step (core.interrupt moves step_end). A hung
            # engine (fault injection) holds its step until revived: no tokens come out.
            while self.hung or core.step_end > self._now():
                await self._sleep_until(None if self.hung else core.step_end)
            self._deliver(core.complete_step(core.step_end))

    def _deliver(self, out: StepOutcome) -> None:
        first = {id(r) for r in out.first_tokens}
        for req, n in out.tokens:
            p = self._pending.get(req.request_id)
            if p is None:
                continue
            ids = p.output[p.sent : p.sent + n]
            p.sent += n
            done = req.finished
            cached = max(req.num_cached_tokens, 0) if id(req) in first else None
            p.queue.put_nowait(TokenChunk(tuple(ids), done, "length" if done else None, cached))
            if done:
                p.finished = True
                del self._pending[req.request_id]
                self._lease(p)
        for req in out.finished:
            p = self._pending.pop(req.request_id, None)
            if p is not None and not p.finished:
                # Aborted or finished without a token in this step (an abort mid-prefill).
                p.finished = True
                self._lease(p)
                p.queue.put_nowait(TokenChunk((), True, "abort"))

    def _lease(self, p: _Pending) -> None:
        """The request has left: its retention (from its arrival) ends after its lease."""
        if p.retain_s <= 0:
            return
        end = self._now() + p.retain_s * self._speed
        heapq.heappush(self._leases, (end, self._lease_seq, p.retain_key))
        self._lease_seq += 1
        p.retain_s = 0.0  # once

    def _end_leases(self) -> None:
        now = self._now()
        while self._leases and self._leases[0][0] <= now:
            _, _, key = heapq.heappop(self._leases)
            self._release(key)

    def _release(self, key: str) -> None:
        """End the retention `key` (lapsed, or released by the router) if it still runs
        and its request has left the engine."""
        kept = self._kept.get(key)
        if kept is None or kept[2] in self._pending:
            return
        hashes, use_at, _rid = self._kept.pop(key)
        self.core.sync(self._now())  # a macro step brings its KV up to now first
        self.core.kv.release(hashes, use_at)

    # -- EngineClient ----------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self._ensure_running()
        if request.call is not None and (request.call.needs_model or request.call.needs_api):
            why = request.call.needs_model or request.call.needs_api
            raise ValueError(f"a simulated engine cannot answer this request: {why}")
        prompt = request.prompt_token_ids
        if request.max_tokens <= 0:
            raise ValueError("max_tokens must be positive")
        if request.request_id in self._pending:
            raise ValueError(f"request id {request.request_id!r} is already running")
        output = sim_output_tokens(prompt, request.max_tokens, self.vocab_size)
        # The core caches blocks over prompt + output, as vLLM does while decoding.
        hashes = hash_token_blocks(prompt + output, self.block_size)
        req = SimRequest(
            request.request_id, hashes, len(prompt), request.max_tokens, request.priority
        )
        self.core.add_request(req, self._now())  # raises ValueError past max_model_len
        retain_key = request.retained_as
        pending = _Pending(req, output, retain_s=request.retain_s, retain_key=retain_key)
        self._pending[request.request_id] = pending
        if self.core.busy:
            self.core.interrupt(self._now())
        for key in request.release:
            self._release(key)
        if request.retain_s > 0 and retain_key not in self._kept:
            # As wasma's vLLM scheduler does: from arrival (the cached prefix it will hit)
            # until the lease after it finishes (all of its blocks), kept behind every
            # ordinary free block, wanted at `retain_use_s`. A macro step's KV is brought
            # up to now first.
            now = self._now()
            use = request.retain_use_s
            use_at = float("inf") if use is None else now + use * self._speed
            self.core.sync(now)
            self.core.kv.retain(hashes, use_at)
            self._kept[retain_key] = (hashes, use_at, request.request_id)
        self._wake()
        try:
            while True:
                chunk = await pending.queue.get()
                if isinstance(chunk, BaseException):
                    pending.finished = True
                    raise chunk
                yield chunk
                if chunk.finished:
                    return
        finally:
            if not pending.finished:
                # The consumer went away (client disconnect, cancellation): free the seat.
                self._pending.pop(request.request_id, None)
                self.core.abort(request.request_id)
                self._lease(pending)
                self._wake()

    async def stats(self) -> EngineStats:
        return self.core.stats()

    async def healthy(self) -> bool:
        if self.hung:
            await asyncio.Event().wait()  # a stalled engine never answers
        return not self._closed and not self.dead and (self._task is None or not self._task.done())

    # -- fault injection (tests, chaos benchmarks) -------------------------------------
    def _stop_driver(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def kill(self) -> None:
        """The engine process dies: running requests fail, its KV cache is lost, new
        requests are refused until `revive()`."""
        self.dead = True
        self.hung = False
        self._stop_driver()
        for p in self._pending.values():
            p.queue.put_nowait(ConnectionError(f"engine {self.name} died"))
        self._pending.clear()
        self._leases.clear()
        self._kept.clear()
        self.core = SimEngineCore(self.name, self.profile, self._policy, kv_sink=self._emit)

    def hang(self) -> None:
        """The engine stalls: requests stay queued without tokens, health checks hang."""
        self.hung = True

    def revive(self) -> None:
        """Back in service (after `kill`, with an empty cache; after `hang`, as it was)."""
        self.dead = False
        self.hung = False
        self._wake()

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for p in self._pending.values():
            p.queue.put_nowait(TokenChunk((), True, "abort"))
        self._pending.clear()
