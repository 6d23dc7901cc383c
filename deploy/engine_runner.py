"""Running a placed request on its engine: submission, the chunk wait, and failover.

An engine that fails a request (dies, hangs, errs by its own fault) hands it to another
engine, placed again by the dispatcher and resubmitted with the prompt plus the tokens
already sent, so the client sees one stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace

from wasma.core.tokens import hash_token_blocks
from wasma.deploy.engine_health import EngineHealth
from wasma.deploy.live_request import (
    EngineFault,
    LiveRequest,
    StallWatch,
    aclose_quietly,
    empty_stream,
)
from wasma.deploy.metrics import WasmaMetrics
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.service_types import BadRequest, ServiceError, Unavailable
from wasma.engines.base import EngineClient, GenerateRequest, TokenChunk
from wasma.scheduler.dispatch import Dispatch, Dispatcher
from wasma.scheduler.policy import NoHealthyEngine

log = logging.getLogger(__name__)


class EngineRunner:
    def __init__(
        self,
        engines: Sequence[EngineClient],
        dispatch: Dispatcher,
        health: EngineHealth,
        metrics: WasmaMetrics,
        config: RouterConfig,
        now: Callable[[], float],
    ) -> None:
        self.engines = engines
        self.dispatch = dispatch
        self.health_check = health
        self.metrics = metrics
        self.config = config
        self.now = now
        self.block_size = dispatch.ctx.block_size
        self.failovers = 0  # requests moved to another engine mid-request
        # Where a request runs on its engine from another process (a gateway streaming
        # from the engine itself, deploy/ray_channel.py): the chunks it reports, in
        # place of the engine's own stream; None (or returning None): here. Told the
        # placement's kind, which the gateway's response headers name.
        self.divert: (
            Callable[[LiveRequest, GenerateRequest, str], AsyncIterator[TokenChunk] | None] | None
        ) = None

    async def start(
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
            call=req.call,
        )
        self.metrics.observe_retention(engine.name, int(greq.retain_s > 0), len(greq.release))
        try:
            gen = None
            if self.divert is not None:
                gen = self.divert(live, greq, placement.kind.value)
            if gen is None:
                gen = engine.generate(greq)
        except ValueError as exc:
            raise BadRequest(str(exc), getattr(exc, "param", None) or "prompt") from None
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
        task = asyncio.current_task()
        watch = live.stall
        if watch is None or watch.task is not task:
            assert task is not None
            watch = live.stall = StallWatch(task)
        try:
            # No timer per chunk: the poller's stall check (_check_stalls) and the
            # health check end this wait, through the watch, when the engine stops
            # making progress.
            live.waiting = watch
            try:
                return await gen.__anext__()
            except asyncio.CancelledError:
                if watch.caught():
                    raise TimeoutError from None
                raise
            finally:
                live.waiting = None  # before the handlers below, which may mark engines down
        except TimeoutError:
            raise EngineFault(slot, "stalled or found down") from None
        except StopAsyncIteration:
            self.health_check.engine_failed(slot, "ended the request without output")
            raise EngineFault(slot, "ended the request without output") from None
        except ValueError as exc:
            raise BadRequest(str(exc), getattr(exc, "param", None) or "prompt") from None
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
        if live.info is not None and live.info.pinned is not None:
            raise Unavailable(
                f"request {rid} can run only on {self.engines[live.info.pinned].name}, "
                f"which failed: {fault}",
                None,
                1.0,
            )
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
            self.metrics.observe_failover()
            # Release the failed engine's charge, then place as if the request were new.
            self.dispatch.on_first_token(rid)
            self.dispatch.ctx.state.on_finish(rid)
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
                return await self.start(live, decision)
            except EngineFault as again:
                fault = again
