"""KV retention inside vLLM: a scheduler that evicts KV the router asked to keep last.

vLLM keeps freed, cached blocks in one LRU queue and hands its front out first. A
workflow's context that a child request will extend soon is, to that queue, just
another freed request, and under KV pressure it is evicted before the child arrives, so
the child recomputes it. The router knows better (the policy's `Placement.retain`), so it
tags such a request with `vllm_xargs={"wasma_retain_s": S}` (`SamplingParams.extra_args`).

`RetainingScheduler` (and `RetainingAsyncScheduler`, for engines with async scheduling)
is vLLM's scheduler with a second tier in the free-block queue. A tagged request's blocks
are retained from its arrival (the cached prefix it will hit, which its parent left) until
S seconds after it finishes (all of its blocks). Free retained blocks are handed out only
after every ordinary free block, front first, as the simulator's retention tier does
(`engines/sim/kv_cache.py`). Retention is a lease, not a pin: the blocks stay free and
evictable (vLLM never runs short because of it), and a lease that nobody renews lapses on
its own, so a router that dies leaves nothing held.

Engines wasma starts use it (`VLLMEngineConfig.retention`). For a vLLM server of your
own, install wasma beside it and start it with
`--scheduler-cls engines.vllm_retention.WasmaScheduler`; without it the tag is ignored.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from engines.base import MAX_RETAIN_S, RETAIN_ARG

# Under vLLM's logger, so that the engine process prints it with vLLM's own messages.
log = logging.getLogger("vllm.wasma_retention")


def retain_seconds(extra_args: dict[str, Any] | None) -> float:
    """The lease a request asks for, in seconds (0: none; bad values are ignored)."""
    if not extra_args:
        return 0.0
    value = extra_args.get(RETAIN_ARG)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    if not value > 0:  # also rejects NaN
        return 0.0
    return min(float(value), MAX_RETAIN_S)


class TieredFreeQueue:
    """vLLM's free-block queue with a retention tier behind it.

    Same interface as `FreeKVCacheBlockQueue` (what `BlockPool` calls): two of vLLM's own
    queues, the ordinary one first. A block goes to the retention tier when it is
    appended (freed, cached) while `is_retained(block)` holds. Blocks handed out lose
    their retention (`on_reused`): the content they held is gone."""

    def __init__(
        self,
        plain: FreeKVCacheBlockQueue,
        is_retained: Callable[[KVCacheBlock], bool],
        on_reused: Callable[[list[KVCacheBlock]], None],
    ) -> None:
        self.plain = plain
        self.kept = FreeKVCacheBlockQueue([])
        self.kept_ids: set[int] = set()
        self._is_retained = is_retained
        self._on_reused = on_reused

    @property
    def num_free_blocks(self) -> int:
        return self.plain.num_free_blocks + self.kept.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        if self.plain.num_free_blocks:
            block = self.plain.popleft()
        else:
            block = self.kept.popleft()
            self.kept_ids.discard(block.block_id)
        self._on_reused([block])
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        first = min(n, self.plain.num_free_blocks)
        out = self.plain.popleft_n(first)
        if n > first:
            more = self.kept.popleft_n(n - first)
            self.kept_ids.difference_update(b.block_id for b in more)
            out.extend(more)
        self._on_reused(out)
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """A prefix hit takes a free block back into use (`BlockPool.touch`)."""
        if block.block_id in self.kept_ids:
            self.kept_ids.discard(block.block_id)
            self.kept.remove(block)
        else:
            self.plain.remove(block)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        keep = [b for b in blocks if self._is_retained(b)]
        if not keep:
            self.plain.append_n(blocks)
            return
        ids = {b.block_id for b in keep}
        self.plain.append_n([b for b in blocks if b.block_id not in ids])
        self.kept.append_n(keep)
        self.kept_ids |= ids

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        # Content-less blocks, reused first: never retained.
        self.plain.prepend_n(blocks)

    def keep(self, block: KVCacheBlock) -> None:
        """A block just retained: if it is free in the ordinary queue, move it to the back
        of the retention tier (every free block is in one of the two queues)."""
        if block.ref_cnt == 0 and not block.is_null and block.block_id not in self.kept_ids:
            self.plain.remove(block)
            self.kept.append(block)
            self.kept_ids.add(block.block_id)

    def release(self, block: KVCacheBlock) -> None:
        """A lapsed lease: a free retained block rejoins the ordinary queue's back."""
        if block.block_id in self.kept_ids:
            self.kept_ids.discard(block.block_id)
            self.kept.remove(block)
            self.plain.append(block)

    def release_all(self) -> None:
        for block in self.kept.get_all_free_blocks():
            self.release(block)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return self.plain.get_all_free_blocks() + self.kept.get_all_free_blocks()

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order after `cursor` (both tiers, ordinary first)."""
        if cursor is not None and cursor.block_id in self.kept_ids:
            yield from self.kept.iter_blocks_after(cursor)
            return
        yield from self.plain.iter_blocks_after(cursor)
        yield from self.kept.iter_blocks_after(None)


class RetentionLeases:
    """Which blocks are retained: those a request that asked for retention still waits or
    runs on (a hold), and those whose lease has not lapsed (block id -> when it does,
    monotonic seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.until: dict[int, float] = {}
        self._heap: list[tuple[float, int]] = []
        self._clock = clock
        self.held: dict[int, int] = {}  # block id -> requests holding it
        self._holds: dict[str, list[tuple[int, int]]] = {}  # request -> (block id, epoch)
        # A block's epoch moves on when it is reused for other content, so a request's
        # hold on what the block held before is not a hold on what it holds now.
        self._epoch: dict[int, int] = {}

    def hold(self, request_id: str, block_ids: list[int]) -> None:
        """Retain these blocks for as long as the request is in the engine."""
        self.release_hold(request_id)
        epoch = self._epoch
        self._holds[request_id] = [(bid, epoch.get(bid, 0)) for bid in block_ids]
        for bid in block_ids:
            self.held[bid] = self.held.get(bid, 0) + 1

    def release_hold(self, request_id: str) -> list[int]:
        """End the request's hold; returns the block ids no request holds any more."""
        epoch = self._epoch
        dropped: list[int] = []
        for bid, ep in self._holds.pop(request_id, ()):
            if epoch.get(bid, 0) != ep:
                continue
            n = self.held.get(bid, 0) - 1
            if n > 0:
                self.held[bid] = n
            else:
                self.held.pop(bid, None)
                dropped.append(bid)
        return dropped

    def grant(self, block_ids: list[int], seconds: float) -> None:
        until = self._clock() + seconds
        for bid in block_ids:
            if self.until.get(bid, 0.0) < until:
                self.until[bid] = until
                heapq.heappush(self._heap, (until, bid))

    def holds(self, block: KVCacheBlock) -> bool:
        if block.block_id in self.held:
            return True
        until = self.until.get(block.block_id)
        return until is not None and until > self._clock()

    def forget(self, blocks: list[KVCacheBlock]) -> None:
        """These blocks were handed out for new content: nothing retains them now."""
        if self.until or self.held:
            epoch = self._epoch
            for b in blocks:
                bid = b.block_id
                self.until.pop(bid, None)
                if self.held.pop(bid, None) is not None:
                    epoch[bid] = epoch.get(bid, 0) + 1

    def clear(self) -> None:
        self.until.clear()
        self._heap.clear()
        self.held.clear()
        self._holds.clear()
        self._epoch.clear()

    def lapsed(self) -> list[int]:
        """Block ids whose lease has ended since the last call."""
        now = self._clock()
        out: list[int] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            until, bid = heapq.heappop(heap)
            if self.until.get(bid) == until:  # else renewed, or reused since
                del self.until[bid]
                if bid not in self.held:
                    out.append(bid)
        return out


def _lease(request: Request) -> float:
    params = request.sampling_params
    return retain_seconds(params.extra_args if params is not None else None)


class _RetentionMixin:
    """What both retaining schedulers add to vLLM's."""

    kv_cache_manager: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wasma_retention = RetentionLeases()
        pool = self.kv_cache_manager.block_pool
        self.wasma_free_queue = TieredFreeQueue(
            pool.free_block_queue, self.wasma_retention.holds, self.wasma_retention.forget
        )
        pool.free_block_queue = self.wasma_free_queue

    def add_request(self, request: Request) -> None:
        super().add_request(request)  # type: ignore[misc]
        if _lease(request) > 0 and self.kv_cache_manager.block_pool.enable_caching:
            # The prefix it will hit is already cached (its parent's context): keep it
            # while the request waits, as well as after it finishes.
            ids = self._cached_prefix(request)
            self.wasma_retention.hold(request.request_id, ids)
            blocks = self.kv_cache_manager.block_pool.blocks
            for bid in ids:
                self.wasma_free_queue.keep(blocks[bid])

    def _cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the request's longest cached prefix; no side effects (vLLM's own
        lookup would count it in the prefix-cache statistics)."""
        pool = self.kv_cache_manager.block_pool
        groups = list(range(self.kv_cache_manager.num_kv_cache_groups))
        ids: list[int] = []
        for block_hash in request.block_hashes:
            blocks = pool.get_cached_block(block_hash, groups)
            if blocks is None:
                break
            ids.extend(b.block_id for b in blocks)
        return ids

    def _free_blocks(self, request: Request) -> None:
        seconds = _lease(request)
        if seconds > 0 and self.kv_cache_manager.block_pool.enable_caching:
            groups = self.kv_cache_manager.get_block_ids(request.request_id)
            ids = [bid for group in groups for bid in group]
            self.wasma_retention.grant(ids, seconds)
        dropped = self.wasma_retention.release_hold(request.request_id)
        if dropped:  # free ones that nothing retains now rejoin the ordinary queue
            blocks = self.kv_cache_manager.block_pool.blocks
            for bid in dropped:
                if not self.wasma_retention.holds(blocks[bid]):
                    self.wasma_free_queue.release(blocks[bid])
        super()._free_blocks(request)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        lapsed = self.wasma_retention.lapsed()
        if lapsed:
            blocks = self.kv_cache_manager.block_pool.blocks
            for bid in lapsed:
                self.wasma_free_queue.release(blocks[bid])
        return super().schedule(*args, **kwargs)  # type: ignore[misc]

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> bool:
        done = bool(super().reset_prefix_cache(*args, **kwargs))  # type: ignore[misc]
        if done:  # nothing cached is left to keep
            self.wasma_retention.clear()
            self.wasma_free_queue.release_all()
        return done


class RetainingScheduler(_RetentionMixin, Scheduler):
    """vLLM's scheduler with wasma's KV retention tier."""


class RetainingAsyncScheduler(_RetentionMixin, AsyncScheduler):
    """vLLM's async scheduler with wasma's KV retention tier."""


class WasmaScheduler:
    """The one name to give vLLM (`scheduler_cls`, `--scheduler-cls`): it builds a
    `RetainingAsyncScheduler` for an engine that runs async scheduling and a
    `RetainingScheduler` otherwise, as vLLM picks between its own two."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        chosen = (
            RetainingAsyncScheduler
            if config.scheduler_config.async_scheduling
            else RetainingScheduler
        )
        # vLLM warns about any custom scheduler that async scheduling may be lost; say
        # which base this one took so that warning can be read correctly.
        log.info("wasma KV retention on vLLM's %s", chosen.__mro__[2].__name__)
        return chosen(*args, **kwargs)


SCHEDULER_CLS = f"{WasmaScheduler.__module__}.{WasmaScheduler.__qualname__}"
