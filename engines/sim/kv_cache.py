"""Paged KV blocks with automatic prefix caching, as vLLM v1's BlockPool keeps them.

Blocks have a reference count; a block with count 0 sits in the free queue but keeps its
hash, so a later request with the same prefix can take it back ("touch") until the
block is reused for new content (evicted). Allocation takes from the front of the queue
(least recently freed); a finished request frees its blocks tail first, so a prompt's
shared head outlives its unique tail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

EvictedSink = Callable[[list[int]], None]
StoredSink = Callable[[list[int], int | None], None]


class KVCache:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        on_stored: StoredSink | None = None,
        on_removed: EvictedSink | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("a KV cache needs at least 2 blocks")
        self.block_size = block_size
        # Block 0 is vLLM's null block: never allocated, so usable blocks are one fewer.
        self.num_blocks = num_blocks - 1
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        # Free blocks whose content a pending request will reuse: evicted only after
        # every ordinary free block (the retention tier).
        self.free_retained: OrderedDict[int, None] = OrderedDict()
        self.retained: dict[int, int] = {}  # chain hash -> holders of the retention
        self.on_stored = on_stored
        self.on_removed = on_removed
        # vLLM's prefix-cache counters (tokens), as in its PrefixCacheStats.
        self.queries_tokens = 0
        self.hits_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.free_retained)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def longest_hit(self, block_hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Cached blocks for the longest cached prefix (at most `max_blocks` blocks)."""
        # map() runs the lookups in C; this is the simulator's hottest loop.
        found = list(map(self.cached.get, block_hashes[:max_blocks]))
        try:
            return found[: found.index(None)]  # type: ignore[return-value]
        except ValueError:
            return found  # type: ignore[return-value]

    def count_hit(self, block_hashes: Sequence[int]) -> int:
        cached = self.cached
        found = list(map(cached.__contains__, block_hashes))
        try:
            return found.index(False)
        except ValueError:
            return len(found)

    def can_allocate(self, num_new_blocks: int, hit_blocks: Sequence[int]) -> bool:
        ref = self.ref
        evictable_hits = sum(1 for b in hit_blocks if ref[b] == 0)
        return num_new_blocks <= self.num_free - evictable_hits

    def touch(self, blocks: Sequence[int]) -> None:
        ref, free, kept = self.ref, self.free, self.free_retained
        for b in blocks:
            if ref[b] == 0:
                if b in free:
                    del free[b]
                else:
                    del kept[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks; caller checked `can_allocate`. Evicts their old content."""
        out: list[int] = []
        evicted: list[int] = []
        free, ref, hash_of, cached = self.free, self.ref, self.hash_of, self.cached
        kept = self.free_retained
        for _ in range(n):
            b, _none = free.popitem(last=False) if free else kept.popitem(last=False)
            h = hash_of[b]
            if h is not None:
                hash_of[b] = None
                if cached.get(h) == b:
                    del cached[h]
                    evicted.append(h)
            ref[b] = 1
            out.append(b)
        if evicted and self.on_removed is not None:
            self.on_removed(evicted)
        return out

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Release a request's blocks, tail first (evicted first).

        As vLLM's BlockPool does: freed blocks that hold no cached content (a partial
        last block, a duplicate) go to the *front* of the free queue, to be reused before
        any cached prefix is evicted; cached ones go to the back."""
        ref, free, hash_of = self.ref, self.free, self.hash_of
        retained, kept = self.retained, self.free_retained
        unhashed: list[int] = []
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                h = hash_of[b]
                if h is None:
                    unhashed.append(b)
                elif retained and h in retained:
                    kept[b] = None
                else:
                    free[b] = None
        for b in reversed(unhashed):
            free[b] = None
            free.move_to_end(b, last=False)

    def retain(self, block_hashes: Sequence[int]) -> None:
        """Keep these blocks, once free, behind every ordinary free block."""
        retained, cached, ref = self.retained, self.cached, self.ref
        for h in block_hashes:
            retained[h] = retained.get(h, 0) + 1
            b = cached.get(h)
            if b is not None and ref[b] == 0 and b in self.free:
                del self.free[b]
                self.free_retained[b] = None

    def release(self, block_hashes: Sequence[int]) -> None:
        """Undo one `retain` of these blocks; free ones rejoin the ordinary queue."""
        retained, cached = self.retained, self.cached
        for h in block_hashes:
            n = retained.get(h, 0) - 1
            if n > 0:
                retained[h] = n
                continue
            retained.pop(h, None)
            b = cached.get(h)
            if b is not None and b in self.free_retained:
                del self.free_retained[b]
                self.free[b] = None

    def cache_blocks(
        self, blocks: Sequence[int], block_hashes: Sequence[int], start: int, end: int
    ) -> None:
        """Register blocks [start, end) of a request under their chain hashes."""
        if end <= start:
            return
        hash_of, cached = self.hash_of, self.cached
        hs = block_hashes[start:end]
        bs = blocks[start:end]
        # Same content computed twice concurrently: vLLM keeps both copies and one map
        # entry suffices to serve hits, so only new hashes are registered.
        fresh = [(h, b) for h, b in zip(hs, bs, strict=True) if h not in cached]
        if not fresh:
            return
        for h, b in fresh:
            hash_of[b] = h
        cached.update(fresh)
        if self.on_stored is not None:
            self.on_stored([h for h, _ in fresh], block_hashes[start - 1] if start > 0 else None)

    def seed(self, block_hashes: Sequence[int]) -> int:
        """Install a prefix's KV that arrived from another engine (a transfer).

        The blocks land cached and free at the most-recently-used end. Returns how many
        leading blocks are now cached here."""
        held = self.seed_pinned(block_hashes)
        self.free_blocks(held)
        return len(held)

    def seed_pinned(self, block_hashes: Sequence[int]) -> list[int]:
        """Like `seed`, but the prefix's blocks stay held (ref +1) for the request the
        KV was moved for, as a connector's load holds them in vLLM; the caller frees
        them once that request is admitted."""
        n_have = self.count_hit(block_hashes)
        have = [self.cached[h] for h in block_hashes[:n_have]]
        self.touch(have)  # the prefix being extended must not be evicted to extend it
        todo = list(block_hashes[n_have:])
        todo = todo[: self.num_free]
        blocks = self.allocate(len(todo)) if todo else []
        for b, h in zip(blocks, todo, strict=True):
            self.hash_of[b] = h
            self.cached[h] = b
        if todo and self.on_stored is not None:
            self.on_stored(todo, block_hashes[n_have - 1] if n_have else None)
        return have + blocks

    def reset(self) -> None:
        """Drop every cached hash (vLLM's reset_prefix_cache); only legal when idle."""
        self.cached.clear()
        self.hash_of = [None] * len(self.hash_of)
