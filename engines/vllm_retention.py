"""KV retention inside vLLM: a scheduler that evicts KV the router asked to keep last.

vLLM keeps freed, cached blocks in one LRU queue and hands its front out first. A
workflow's context that a child request will extend soon is, to that queue, just
another freed request, and under KV pressure it is evicted before the child arrives, so
the child recomputes it. The router knows better (the policy's `Placement.retain`), so it
tags such a request with `vllm_xargs={"wasma_retain_s": S}` (`SamplingParams.extra_args`).

`RetainingScheduler` (and `RetainingAsyncScheduler`, for engines with async scheduling)
is vLLM's scheduler with a second tier in the free-block queue. A tagged request's blocks
are retained from its arrival (the cached prefix it will hit, which its parent left) until
S seconds after it finishes (all of its blocks), or until a later request names its key
(`wasma_retain_key`, the router's request id) in `wasma_release`: the router sends that
once every request extending the context has started and holds it. Free retained blocks
are handed out only after every ordinary free block, those wanted latest first
(`wasma_retain_use_s`: seconds until the readers are expected; steps-to-use), as the
simulator's retention tier does (`engines/sim/kv_cache.py`). Retention is a lease, not a
pin: the blocks stay free and evictable (vLLM never runs short because of it), and a
lease that nobody renews lapses on its own, so a router that dies leaves nothing held.

Engines wasma starts use it (`VLLMEngineConfig.retention`). For a vLLM server of your
own, install wasma beside it and start it with
`--scheduler-cls wasma.engines.vllm_retention.WasmaScheduler`; without it the tag is ignored.
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

from wasma.engines.base import (
    MAX_RETAIN_S,
    RELEASE_ARG,
    RETAIN_ARG,
    RETAIN_KEY_ARG,
    RETAIN_USE_ARG,
)

# Under vLLM's logger, so that the engine process prints it with vLLM's own messages.
log = logging.getLogger("vllm.wasma_retention")

_NEVER = float("inf")
_MAX_RELEASE = 1024  # keys read from one request


def _seconds(extra_args: dict[str, Any] | None, key: str) -> float | None:
    """A duration tag: a number >= 0, capped at `MAX_RETAIN_S`; None if absent or bad
    (a bool, a string, a negative number, NaN)."""
    value = (extra_args or {}).get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        return None
    return min(float(value), MAX_RETAIN_S)


def retain_seconds(extra_args: dict[str, Any] | None) -> float:
    """The lease a request asks for, in seconds (0: none; bad values are ignored)."""
    return _seconds(extra_args, RETAIN_ARG) or 0.0


def retain_use_seconds(extra_args: dict[str, Any] | None) -> float:
    """Seconds until the retained KV is expected to be read (inf: unsaid or bad)."""
    use = _seconds(extra_args, RETAIN_USE_ARG)
    return _NEVER if use is None else use


def release_keys(extra_args: dict[str, Any] | None) -> list[str]:
    """Keys of retentions the request says to end (strings only; others ignored)."""
    value = (extra_args or {}).get(RELEASE_ARG)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        return []
    return [k for k in value[:_MAX_RELEASE] if isinstance(k, str)]


class TieredFreeQueue:
    """vLLM's free-block queue with a retention tier behind it.

    Same interface as `FreeKVCacheBlockQueue` (what `BlockPool` calls): vLLM's own queue
    for ordinary blocks, handed out first, then the retention tier, wanted-latest first
    (`use_of(block)`: when the block is next wanted, inf when unsaid; None when nothing
    retains it), equal times in the order queued. A block goes to the tier when it is
    appended (freed, cached) while retained. Blocks handed out lose their retention
    (`on_reused`): the content they held is gone."""

    def __init__(
        self,
        plain: FreeKVCacheBlockQueue,
        use_of: Callable[[KVCacheBlock], float | None],
        on_reused: Callable[[list[KVCacheBlock]], None],
    ) -> None:
        self.plain = plain
        # The retention tier: a heap of (-use, seq, block). Entries are dropped lazily:
        # only the one whose seq `kept_at` records is live.
        self._heap: list[tuple[float, int, KVCacheBlock]] = []
        self.kept_at: dict[int, tuple[int, float]] = {}  # block id -> (seq, use)
        self._seq = 0
        self._use_of = use_of
        self._on_reused = on_reused

    @property
    def num_free_blocks(self) -> int:
        return self.plain.num_free_blocks + len(self.kept_at)

    @property
    def num_kept(self) -> int:
        return len(self.kept_at)

    def _push(self, block: KVCacheBlock, use: float) -> None:
        self._seq += 1
        self.kept_at[block.block_id] = (self._seq, use)
        heapq.heappush(self._heap, (-use, self._seq, block))
        if len(self._heap) > 2 * len(self.kept_at) + 64:
            self._heap = [e for e in self._heap if self._live(e)]
            heapq.heapify(self._heap)

    def _live(self, entry: tuple[float, int, KVCacheBlock]) -> bool:
        at = self.kept_at.get(entry[2].block_id)
        return at is not None and at[0] == entry[1]

    def _pop_kept(self) -> KVCacheBlock:
        while True:
            entry = heapq.heappop(self._heap)
            if self._live(entry):
                del self.kept_at[entry[2].block_id]
                return entry[2]

    def popleft(self) -> KVCacheBlock:
        block = self.plain.popleft() if self.plain.num_free_blocks else self._pop_kept()
        self._on_reused([block])
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        assert self.num_free_blocks >= n
        first = min(n, self.plain.num_free_blocks)
        out = self.plain.popleft_n(first)
        out.extend(self._pop_kept() for _ in range(n - first))
        self._on_reused(out)
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """A prefix hit takes a free block back into use (`BlockPool.touch`)."""
        if self.kept_at.pop(block.block_id, None) is None:
            self.plain.remove(block)

    def append(self, block: KVCacheBlock) -> None:
        self.append_n([block])

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        uses = [self._use_of(b) for b in blocks]
        if all(u is None for u in uses):
            self.plain.append_n(blocks)
            return
        self.plain.append_n([b for b, u in zip(blocks, uses, strict=True) if u is None])
        for b, u in zip(blocks, uses, strict=True):
            if u is not None:
                self._push(b, u)

    def prepend_n(self, blocks: list[KVCacheBlock]) -> None:
        # Content-less blocks, reused first: never retained.
        self.plain.prepend_n(blocks)

    def requeue(self, block: KVCacheBlock) -> None:
        """A block whose retention changed (kept, ended, wanted at another time): if it is
        free, move it where it now belongs. Newly kept: the back of its time in the tier;
        no longer kept: the back of the ordinary queue."""
        if block.ref_cnt or block.is_null:
            return
        use = self._use_of(block)
        at = self.kept_at.get(block.block_id)
        if at is None:
            if use is not None and block.block_hash is not None:
                self.plain.remove(block)
                self._push(block, use)
        elif use is None:
            del self.kept_at[block.block_id]
            self.plain.append(block)
        elif use != at[1]:
            self._push(block, use)  # the old entry is dropped lazily

    def release_all(self) -> None:
        for block in self._kept_in_order():
            del self.kept_at[block.block_id]
            self.plain.append(block)
        self._heap.clear()

    def _kept_in_order(self) -> list[KVCacheBlock]:
        return [e[2] for e in sorted(self._heap) if self._live(e)]

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return self.plain.get_all_free_blocks() + self._kept_in_order()

    def iter_blocks_after(self, cursor: KVCacheBlock | None) -> Iterator[KVCacheBlock]:
        """Free blocks in eviction order after `cursor` (both tiers, ordinary first)."""
        if cursor is not None and cursor.block_id in self.kept_at:
            kept = self._kept_in_order()
            yield from kept[kept.index(cursor) + 1 :]
            return
        yield from self.plain.iter_blocks_after(cursor)
        yield from self._kept_in_order()


class RetentionLeases:
    """What retains which blocks, and until when each is next wanted.

    A claim retains a set of blocks, wanted at one time (monotonic seconds; inf when
    unsaid): a request's hold (its cached prefix, from arrival while it is in the
    engine) or a lease (all of its blocks for some seconds after it finishes, unless the
    router ends it first by its key). A block is retained while any claim on it lasts,
    and wanted at the soonest of their times."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._uses: dict[int, dict[int, float]] = {}  # block id -> claim -> when wanted
        self._blocks: dict[int, list[int]] = {}  # claim -> block ids
        self._hold_of: dict[str, int] = {}  # request id -> its hold
        self._lease_of: dict[str, int] = {}  # key -> its lease
        self._key_of: dict[int, str] = {}  # lease -> its key
        self._ends: list[tuple[float, int]] = []  # (when, lease), soonest first
        self._next = 0

    def now(self) -> float:
        return self._clock()

    def _claim(self, block_ids: list[int], use_at: float) -> tuple[int, list[int]]:
        """A new claim; returns it and the blocks it makes wanted sooner (or at all)."""
        self._next += 1
        claim = self._next
        self._blocks[claim] = list(block_ids)
        changed: list[int] = []
        for bid in block_ids:
            uses = self._uses.setdefault(bid, {})
            if not uses or use_at < min(uses.values()):
                changed.append(bid)
            uses[claim] = use_at
        return claim, changed

    def _drop(self, claim: int) -> list[int]:
        """End a claim; returns the blocks no longer retained or now wanted later."""
        changed: list[int] = []
        for bid in self._blocks.pop(claim, ()):
            uses = self._uses.get(bid)
            if uses is None or claim not in uses:
                continue  # the block was reused for other content since
            soonest = min(uses.values())
            del uses[claim]
            if not uses:
                del self._uses[bid]
                changed.append(bid)
            elif min(uses.values()) != soonest:
                changed.append(bid)
        key = self._key_of.pop(claim, None)
        if key is not None and self._lease_of.get(key) == claim:
            del self._lease_of[key]
        return changed

    def hold(self, request_id: str, block_ids: list[int], use_at: float = _NEVER) -> list[int]:
        """Retain these blocks for as long as the request is in the engine."""
        changed = self.release_hold(request_id)
        claim, sooner = self._claim(block_ids, use_at)
        self._hold_of[request_id] = claim
        return changed + sooner

    def release_hold(self, request_id: str) -> list[int]:
        """End the request's hold; returns the blocks whose retention changed."""
        claim = self._hold_of.pop(request_id, None)
        return [] if claim is None else self._drop(claim)

    def grant(
        self, block_ids: list[int], seconds: float, use_at: float = _NEVER, key: str | None = None
    ) -> list[int]:
        """Retain these blocks for `seconds`, or until `end(key)`; a lease under the same
        key replaces the earlier one. Returns the blocks whose retention changed."""
        changed = self.end(key) if key is not None else []
        claim, sooner = self._claim(block_ids, use_at)
        heapq.heappush(self._ends, (self._clock() + seconds, claim))
        if key is not None:
            self._lease_of[key] = claim
            self._key_of[claim] = key
        return changed + sooner

    def end(self, key: str) -> list[int]:
        """The router says the lease `key` is no longer wanted (its readers started)."""
        claim = self._lease_of.get(key)
        return [] if claim is None else self._drop(claim)

    def use_of(self, block: KVCacheBlock) -> float | None:
        uses = self._uses.get(block.block_id)
        return min(uses.values()) if uses else None

    def holds(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._uses

    def forget(self, blocks: list[KVCacheBlock]) -> None:
        """These blocks were handed out for new content: nothing retains them now."""
        if self._uses:
            for b in blocks:
                self._uses.pop(b.block_id, None)

    def clear(self) -> None:
        self._uses.clear()
        self._blocks.clear()
        self._hold_of.clear()
        self._lease_of.clear()
        self._key_of.clear()
        self._ends.clear()

    def lapsed(self) -> list[int]:
        """End the leases past their time; returns the blocks whose retention changed."""
        now = self._clock()
        out: list[int] = []
        ends = self._ends
        while ends and ends[0][0] <= now:
            _, claim = heapq.heappop(ends)
            out += self._drop(claim)
        return out


def _extra(request: Request) -> dict[str, Any] | None:
    params = request.sampling_params
    return params.extra_args if params is not None else None


class _RetentionMixin:
    """What both retaining schedulers add to vLLM's."""

    kv_cache_manager: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wasma_retention = RetentionLeases()
        pool = self.kv_cache_manager.block_pool
        self.wasma_free_queue = TieredFreeQueue(
            pool.free_block_queue, self.wasma_retention.use_of, self.wasma_retention.forget
        )
        pool.free_block_queue = self.wasma_free_queue
        # request id -> (lease seconds, when wanted, key) for requests that asked
        self._wasma_asked: dict[str, tuple[float, float, str | None]] = {}

    def _requeue(self, block_ids: list[int]) -> None:
        blocks = self.kv_cache_manager.block_pool.blocks
        for bid in block_ids:
            self.wasma_free_queue.requeue(blocks[bid])

    def add_request(self, request: Request) -> None:
        extra = _extra(request)
        for key in release_keys(extra):  # retentions whose readers have started
            self._requeue(self.wasma_retention.end(key))
        super().add_request(request)  # type: ignore[misc]
        seconds = retain_seconds(extra)
        if seconds > 0 and self.kv_cache_manager.block_pool.enable_caching:
            use_at = self.wasma_retention.now() + retain_use_seconds(extra)
            named = (extra or {}).get(RETAIN_KEY_ARG)
            self._wasma_asked[request.request_id] = (
                seconds,
                use_at,
                named if isinstance(named, str) else None,
            )
            # The prefix it will hit is already cached (its parent's context): keep it
            # while the request waits, as well as after it finishes.
            ids = self._cached_prefix(request)
            self._requeue(self.wasma_retention.hold(request.request_id, ids, use_at))

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
        asked = self._wasma_asked.pop(request.request_id, None)
        if asked is not None:
            seconds, use_at, key = asked
            groups = self.kv_cache_manager.get_block_ids(request.request_id)
            ids = [bid for group in groups for bid in group]
            # Its blocks are still held (ref > 0): they take their place when freed below.
            self._requeue(self.wasma_retention.grant(ids, seconds, use_at, key))
        self._requeue(self.wasma_retention.release_hold(request.request_id))
        super()._free_blocks(request)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        lapsed = self.wasma_retention.lapsed()
        if lapsed:
            self._requeue(lapsed)
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
