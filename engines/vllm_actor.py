"""A vLLM engine in a Ray actor, and the `EngineClient` proxy the router talks to.

`wasma serve --engines vllm:N` starts N `VLLMEngineActor`s (each hosts one `VLLMEngine`,
whose EngineCore is a child process of the actor) and routes through `RayVLLMEngine`s.
Tokens stream back through a Ray streaming generator (one object per chunk); KV events
are long-polled in batches, so an idle engine costs one pending call, not a busy loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from wasma.core.events import EngineStats, KVEvent
from wasma.engines.base import (
    EngineClient,
    EngineView,
    GenerateRequest,
    KVEventSink,
    TokenChunk,
    deliver_kv_events,
    start_or_close,
)
from wasma.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

log = logging.getLogger(__name__)

# Events a poll returns at most; a burst larger than this is drained over several polls.
_POLL_BATCH = 4096


class VLLMEngineActor:
    """Hosts one VLLMEngine. Used as a Ray async actor (`ray.remote(VLLMEngineActor)`);
    plain class here so it can be unit-inspected and typed."""

    def __init__(self, name: str, config: VLLMEngineConfig) -> None:
        self._engine = VLLMEngine(name, config)
        self._events: asyncio.Queue[KVEvent] | None = None

    async def start(self) -> dict[str, Any]:
        # Created here, not in __init__: Ray runs async actor methods on its own loop,
        # and the queue must belong to that loop.
        self._events = asyncio.Queue()
        await self._engine.start()
        if self._engine.config.kv_events:
            self._engine.subscribe_kv_events(self._events.put_nowait)
        return {
            "block_size": self._engine.block_size,
            "vocab_size": self._engine.vocab_size,
            "num_kv_blocks": self._engine.num_kv_blocks,
            "kv_peer": self._engine.kv_peer,
            "shared_host": self._engine.shared_host,
        }

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        # Cancelling the caller's ObjectRefGenerator cancels this task, which cancels
        # VLLMEngine.generate and so aborts the request inside vLLM.
        async for chunk in self._engine.generate(request):
            yield chunk

    async def stats(self) -> EngineStats:
        return await self._engine.stats()

    async def healthy(self) -> bool:
        return await self._engine.healthy()

    async def reset_prefix_cache(self) -> bool:
        return await self._engine.reset_prefix_cache()

    async def poll_kv_events(self, wait_s: float) -> list[KVEvent]:
        """Events since the last poll; waits up to `wait_s` for the first one."""
        q = self._events
        if q is None:
            return []
        out: list[KVEvent] = []
        if q.empty():
            with contextlib.suppress(asyncio.TimeoutError):
                out.append(await asyncio.wait_for(q.get(), timeout=wait_s))
        while not q.empty() and len(out) < _POLL_BATCH:
            out.append(q.get_nowait())
        return out

    async def close(self) -> None:
        await self._engine.close()


async def _actor_stream(actor: Any, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
    """A request's chunks from a `VLLMEngineActor`, one Ray object each."""
    import ray

    gen = actor.generate.options(num_returns="streaming").remote(request)
    finished = False
    try:
        async for ref in gen:
            chunk: TokenChunk = await ref
            finished = chunk.finished
            yield chunk
    finally:
        if not finished:
            # The consumer stopped early (or was cancelled): stop the actor's task so
            # vLLM aborts the request instead of generating into the void.
            ray.cancel(gen)


class RayVLLMView(EngineView):
    """A `VLLMEngineActor` reached from another process of the cluster (its handle
    pickles): the gateway streams a request's chunks from the actor itself."""

    def __init__(self, name: str, actor: Any) -> None:
        self.name = name
        self.actor = actor

    async def connect(self) -> _ActorStreams:
        return _ActorStreams(self.actor)


class _ActorStreams:
    def __init__(self, actor: Any) -> None:
        self._actor = actor

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        return _actor_stream(self._actor, request)

    async def close(self) -> None:
        pass  # the actor is the router's to stop


class RayVLLMEngine(EngineClient):
    """An `EngineClient` whose engine runs in a Ray actor (on any node of the cluster).

    Build with `await RayVLLMEngine.launch(name, config)` after `ray.init()`. Each
    actor reserves `num_cpus` Ray CPUs (vLLM's worker process is not counted by Ray)."""

    def __init__(
        self,
        name: str,
        config: VLLMEngineConfig,
        num_cpus: float = 1.0,
        actor_options: dict[str, Any] | None = None,
        poll_wait_s: float = 0.5,
    ) -> None:
        import ray

        self.name = name
        self.config = config
        self.block_size = config.block_size
        self.vocab_size = 0
        self.num_kv_blocks = 0  # vLLM's pool incl. the null block, as in a Profile
        self._poll_wait_s = poll_wait_s
        opts: dict[str, Any] = {"num_cpus": num_cpus, "max_concurrency": 1000}
        opts.update(actor_options or {})
        actor_cls = ray.remote(VLLMEngineActor)
        # Ray's handle types do not follow the wrapped class's methods; keep it untyped.
        self._actor: Any = actor_cls.options(**opts).remote(name, config)
        self._sinks: list[KVEventSink] = []
        self._poller: asyncio.Task[None] | None = None
        self._started = False

    @classmethod
    async def launch(cls, name: str, config: VLLMEngineConfig, **kwargs: Any) -> RayVLLMEngine:
        engine = cls(name, config, **kwargs)
        # A failed start kills the actor: left to the handle's garbage collection, it
        # would hold its Ray CPUs for as long as the exception's traceback lives.
        await start_or_close(engine, engine.start)
        return engine

    async def start(self) -> None:
        info = await self._actor.start.remote()
        self.block_size = int(info["block_size"])
        self.vocab_size = int(info["vocab_size"])
        self.num_kv_blocks = int(info["num_kv_blocks"])
        self.kv_peer = info.get("kv_peer")
        self.shared_host = str(info.get("shared_host") or "")
        self._started = True
        if self._sinks:
            self._ensure_poller()

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        return _actor_stream(self._actor, request)

    def direct_view(self) -> RayVLLMView:
        return RayVLLMView(self.name, self._actor)

    async def stats(self) -> EngineStats:
        stats: EngineStats = await self._actor.stats.remote()
        return stats

    async def healthy(self) -> bool:
        try:
            return bool(await self._actor.healthy.remote())
        except Exception:
            # A dead actor raises RayActorError: that is an unhealthy engine, not a crash.
            return False

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._actor.reset_prefix_cache.remote())

    def subscribe_kv_events(self, sink: KVEventSink) -> None:
        self._sinks.append(sink)
        if self._started:
            self._ensure_poller()

    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(
                self._poll(), name=f"kv-poll-{self.name}"
            )

    async def _poll(self) -> None:
        failing = False
        while True:
            try:
                events = await self._actor.poll_kv_events.remote(self._poll_wait_s)
            except asyncio.CancelledError:
                raise
            except Exception:
                # A dead actor fails every poll: say so once, not every second.
                if not failing:
                    log.exception("engine %s: polling KV events failed; retrying", self.name)
                failing = True
                await asyncio.sleep(1.0)
                continue
            if failing:
                log.info("engine %s: polling KV events works again", self.name)
                failing = False
            deliver_kv_events(self.name, self._sinks, events)

    async def close(self) -> None:
        import ray

        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._poller
            self._poller = None
        with contextlib.suppress(Exception):
            await self._actor.close.remote()
        ray.kill(self._actor)
