"""Paged KV blocks with automatic prefix caching, as vLLM v1's BlockPool keeps them.

Blocks have a reference count; a block with count 0 sits in the free queue but keeps its
hash, so a later request with the same prefix can take it back ("touch") until the
block is reused for new content (evicted). Allocation takes from the front of the queue
(least recently freed); a finished request frees its blocks tail first, so a prompt's
shared head outlives its unique tail.

The free queue is kept as runs, not blocks: the blocks one `free_blocks` call queues
stay together until evicted or touched, and both of those take whole slices of a run
(eviction takes a run's front, the deepest blocks of a chain; a prefix hit takes its
back, the chain's head). So the per-block work is C-level list slicing and dict updates,
not one OrderedDict operation per block, with the same order as a per-block queue.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from itertools import compress, groupby
from operator import itemgetter, not_

from wasma.core.blockops import BlockOps, block_ops

_NEVER = float("inf")

EvictedSink = Callable[[list[int]], None]
StoredSink = Callable[[list[int], int | None], None]


class _Run(list[int]):
    """Free blocks queued together, stored *reversed*: the last item is evicted first.

    Reversed storage puts a freed chain in chain order (head first), so eviction pops
    from the list's end and a prefix hit removes the list's head."""


class _KeptRun(_Run):
    """A run in the retention tier (evicted after every ordinary free block).

    `use_at` is when its blocks are next wanted (the soonest pending use among their
    holders; infinity when no holder said): the tier evicts the run wanted last first."""

    use_at: float = _NEVER


def _neg_use(run: _Run) -> float:
    return -run.use_at  # type: ignore[attr-defined]


class KVCache:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        on_stored: StoredSink | None = None,
        on_removed: EvictedSink | None = None,
        ops: BlockOps | None = None,
        block_ids: Sequence[int] | None = None,
    ) -> None:
        """`block_ids`, if given, is `range(num_blocks)` as a list that several caches
        share: the ids in every queue are then the same int objects (a million-block
        cluster holds each id once, not once an engine)."""
        if num_blocks < 2:
            raise ValueError("a KV cache needs at least 2 blocks")
        if block_ids is not None and (
            len(block_ids) != num_blocks or block_ids[0] != 0 or block_ids[-1] != num_blocks - 1
        ):
            raise ValueError("block_ids must be range(num_blocks)")
        self.block_size = block_size
        self._ops = ops if ops is not None else block_ops()
        # Block 0 is vLLM's null block: never allocated, so usable blocks are one fewer.
        self.num_blocks = num_blocks - 1
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # chain hash -> block id
        first = _Run(range(num_blocks - 1, 0, -1) if block_ids is None else block_ids[:0:-1])
        self._runs: deque[_Run] = deque([first])  # ordinary free blocks, front first
        # Free blocks whose content a pending request will reuse: evicted only after
        # every ordinary free block (the retention tier), latest next use first.
        self._kept: deque[_Run] = deque()
        # The run each free block sits in (meaningful only while its ref count is 0).
        self._run_of: list[_Run | None] = [None] + [first] * (num_blocks - 1)
        self._num_plain = num_blocks - 1
        self._num_kept = 0
        # Blocks whose hash a transfer re-cached on another block (`seed_pinned`): they
        # keep their queue place as hashed blocks, but evicting them removes nothing.
        self._stale: set[int] = set()
        # chain hash -> when each holder of its retention next wants it, soonest first
        # (infinity: unsaid)
        self.retained: dict[int, list[float]] = {}
        self.on_stored = on_stored
        self.on_removed = on_removed
        # vLLM's prefix-cache counters (tokens), as in its PrefixCacheStats.
        self.queries_tokens = 0
        self.hits_tokens = 0

    @property
    def num_free(self) -> int:
        return self._num_plain + self._num_kept

    @property
    def usage(self) -> float:
        return 1.0 - (self._num_plain + self._num_kept) / self.num_blocks

    @property
    def free(self) -> list[int]:
        """The ordinary free queue, front (next evicted) first."""
        return [b for run in self._runs for b in reversed(run)]

    @property
    def free_retained(self) -> list[int]:
        """The retention tier, front first."""
        return [b for run in self._kept for b in reversed(run)]

    # -- lookups ---------------------------------------------------------------------
    def longest_hit(self, block_hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Cached blocks for the longest cached prefix (at most `max_blocks` blocks)."""
        return self._ops.prefix_get(self.cached, block_hashes, max_blocks)

    def count_hit(self, block_hashes: Sequence[int]) -> int:
        return self._ops.prefix_len(self.cached, block_hashes)

    def can_allocate(self, num_new_blocks: int, hit_blocks: Sequence[int]) -> bool:
        evictable_hits = list(map(self.ref.__getitem__, hit_blocks)).count(0)
        return num_new_blocks <= self._num_plain + self._num_kept - evictable_hits

    # -- reference counts and the free queue -----------------------------------------
    def take_hits(self, hit_blocks: list[int], num_new_blocks: int) -> bool:
        """`can_allocate` then `touch`, reading the hits' counts once: False (and nothing
        done) if `num_new_blocks` more would not fit beside the hits."""
        ref = self.ref
        refs = list(map(ref.__getitem__, hit_blocks))
        evictable = refs.count(0)
        if num_new_blocks > 0 and num_new_blocks > self._num_plain + self._num_kept - evictable:
            return False
        if evictable:
            self._unqueue(list(compress(hit_blocks, map(not_, refs))))
        self._ops.add_at(ref, hit_blocks, 1)
        return True

    def touch(self, blocks: Sequence[int]) -> None:
        ref = self.ref
        refs = list(map(ref.__getitem__, blocks))
        if 0 in refs:
            self._unqueue(list(compress(blocks, map(not_, refs))))
        self._ops.add_at(ref, blocks, 1)

    def _unqueue(self, blocks: list[int]) -> None:
        """Take free blocks (given in chain order) out of the queue, keeping the order
        of the rest. A prefix hit takes the head of each run it meets (one run, unless
        the prefix was freed by several requests), which is a C-level slice delete."""
        run_of = self._run_of
        first = run_of[blocks[0]]
        k = len(blocks)
        if first is not None and first[:k] == blocks:
            # All of them head one run (a free block sits in one run only): the common
            # case, without the grouping below.
            del first[:k]
            if type(first) is _KeptRun:
                self._num_kept -= k
            else:
                self._num_plain -= k
            return
        for run, group in groupby(blocks, run_of.__getitem__):
            assert run is not None
            seg = list(group)
            k = len(seg)
            if run[:k] == seg:
                del run[:k]
            else:  # not a run's head (a block re-cached elsewhere, a retain): filter
                drop = set(seg)
                run[:] = [b for b in run if b not in drop]
            if type(run) is _KeptRun:
                self._num_kept -= k
            else:
                self._num_plain -= k

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks; caller checked `can_allocate`. Evicts their old content."""
        if n <= 0:
            return []
        if n == 1:
            return [self.allocate_one()]  # a decode step crossing a block boundary
        out: list[int] = []
        left = n
        # Ordinary blocks first, then the retention tier; each from its front.
        take_plain = min(left, self._num_plain)
        for runs, want in ((self._runs, take_plain), (self._kept, left - take_plain)):
            while want:
                run = runs[0]
                m = len(run)
                if m <= want:
                    runs.popleft()
                    out += reversed(run)
                    want -= m
                else:
                    out += run[: -want - 1 : -1]
                    del run[-want:]
                    want = 0
        self._num_plain -= take_plain
        self._num_kept -= n - take_plain
        ref, hash_of, ops, cached = self.ref, self.hash_of, self._ops, self.cached
        if self._stale:
            hs = list(map(hash_of.__getitem__, out))
            ops.fill(ref, out, 1)
            if hs.count(None) == n:
                return out
            ops.fill(hash_of, out, None)
            # Only a block that still holds its hash's map entry evicts it.
            evicted = [
                h for h, b in zip(hs, out, strict=True) if h is not None and cached.get(h) == b
            ]
            self._stale.difference_update(out)
            ops.del_keys(cached, evicted)
        else:
            evicted = ops.evict(ref, hash_of, cached, out)
        if evicted and self.on_removed is not None:
            self.on_removed(evicted)
        return out

    def allocate_one(self) -> int:
        """`allocate(1)` without the bulk machinery (decode needs one block at a time)."""
        if self._num_plain:
            runs = self._runs
            self._num_plain -= 1
        else:
            runs = self._kept
            self._num_kept -= 1
        run = runs[0]
        while not run:
            runs.popleft()
            run = runs[0]
        b = run.pop()
        if not run:
            runs.popleft()
        self.ref[b] = 1
        h = self.hash_of[b]
        if h is not None:
            self.hash_of[b] = None
            cached = self.cached
            if not self._stale or cached.get(h) == b:
                del cached[h]
                if self.on_removed is not None:
                    self.on_removed([h])
            self._stale.discard(b)
        return b

    def free_blocks(self, blocks: Sequence[int]) -> None:
        """Release a request's blocks, tail first (evicted first).

        As vLLM's BlockPool does: freed blocks that hold no cached content (a partial
        last block, a duplicate) go to the *front* of the free queue, to be reused before
        any cached prefix is evicted; cached ones go to the back."""
        zero = self._ops.release(self.ref, blocks)  # blocks now free, tail first (queue order)
        if not zero:
            return
        hs = list(map(self.hash_of.__getitem__, zero))
        unhashed = hs.count(None)
        if unhashed == len(zero):
            self._queue_front(zero)
            return
        front: list[int] = []
        if unhashed:
            if hs[:unhashed].count(None) == unhashed:
                # Only the tail is content-less (a partial last block): split it off.
                front, zero, hs = zero[:unhashed], zero[unhashed:], hs[unhashed:]
            else:  # content-less blocks in the middle (duplicates): filter
                front = [b for b, h in zip(zero, hs, strict=True) if h is None]
                pairs = [(b, h) for b, h in zip(zero, hs, strict=True) if h is not None]
                zero, hs = [b for b, _ in pairs], [h for _, h in pairs]
        retained = self.retained
        inr = list(map(retained.__contains__, hs)) if retained else []
        n_kept = inr.count(True)
        if n_kept == 0:
            self._queue_back(zero)
        elif n_kept == len(zero):
            self._queue_kept(zero)
        else:
            self._queue_back(list(compress(zero, map(not_, inr))))
            self._queue_kept(list(compress(zero, inr)))
        if front:
            self._queue_front(front)

    def _queue_kept(self, blocks: list[int]) -> None:
        """Queue free retained blocks (in queue order): a run for each stretch wanted at
        the same time, placed behind the runs wanted later and any wanted as soon."""
        retained = self.retained
        # A hash's use times are kept sorted: the first is when it is next wanted.
        whens = [retained[h][0] for h in map(self.hash_of.__getitem__, blocks)]  # type: ignore[index]
        if whens.count(whens[0]) == len(whens):
            self._queue_back(blocks, kept_tier=True, use_at=whens[0])
            return
        for when, group in groupby(zip(whens, blocks, strict=True), itemgetter(0)):
            self._queue_back([b for _, b in group], kept_tier=True, use_at=when)

    def _queue_back(
        self, blocks: list[int], kept_tier: bool = False, use_at: float = _NEVER
    ) -> None:
        """Append blocks (in queue order) at the back of a tier; in the retention tier, at
        the back of the runs next wanted at `use_at` or later."""
        run: _Run = _KeptRun(reversed(blocks)) if kept_tier else _Run(reversed(blocks))
        self._ops.fill(self._run_of, blocks, run)
        if kept_tier:
            run.use_at = use_at  # type: ignore[attr-defined]
            kept = self._kept
            if not kept or kept[-1].use_at >= use_at:  # type: ignore[attr-defined]
                kept.append(run)  # the common case: no later use queued behind
            else:
                kept.insert(bisect_right(kept, -use_at, key=_neg_use), run)
            self._num_kept += len(blocks)
        else:
            runs = self._runs
            runs.append(run)
            self._num_plain += len(blocks)
            if len(runs) > 2 * self._num_plain + 64:
                # Touches emptied runs in the middle of the queue: drop them.
                self._runs = deque(r for r in runs if r)
        if kept_tier and len(self._kept) > 2 * self._num_kept + 64:
            self._kept = deque(r for r in self._kept if r)

    def _queue_front(self, blocks: list[int]) -> None:
        """Put blocks (in queue order) at the front of the ordinary tier."""
        run = _Run(reversed(blocks))
        self._ops.fill(self._run_of, blocks, run)
        self._runs.appendleft(run)
        self._num_plain += len(blocks)

    # -- retention -------------------------------------------------------------------
    def retain(self, block_hashes: Sequence[int], use_at: float = _NEVER) -> None:
        """Keep these blocks, once free, behind every ordinary free block, until
        `release`. `use_at` is when the holder next wants them (steps-to-use): among
        retained blocks, those wanted latest are evicted first."""
        # Retained already and now wanted sooner: queued anew.
        sooner = self._ops.retain_uses(self.retained, block_hashes, use_at)
        move = self._free_cached(block_hashes, kept_tier=False, also_kept=sooner)
        if move:
            self._unqueue(move)
            self._queue_kept(move)

    def release(self, block_hashes: Sequence[int], use_at: float = _NEVER) -> None:
        """Undo one `retain(block_hashes, use_at)`: free blocks nothing retains now rejoin
        the ordinary queue; the rest take their next holder's use time."""
        gone, moved = self._ops.release_uses(self.retained, block_hashes, use_at)
        move = self._free_cached(gone, kept_tier=True)
        if move:
            self._unqueue(move)
            self._queue_back(move)
        if moved:
            move = self._free_cached(moved, kept_tier=True)
            if move:
                self._unqueue(move)
                self._queue_kept(move)

    def _free_cached(
        self, hashes: Sequence[int], kept_tier: bool, also_kept: set[int] | None = None
    ) -> list[int]:
        """The free blocks in one tier holding these hashes, in hash order (with
        `also_kept`, those of these hashes in the retention tier as well), each once."""
        want = _KeptRun if kept_tier else _Run
        return self._ops.free_cached(
            self.cached, self.ref, self._run_of, hashes, want, _KeptRun, also_kept
        )

    # -- content ---------------------------------------------------------------------
    def cache_blocks(
        self,
        blocks: Sequence[int],
        block_hashes: Sequence[int],
        start: int,
        end: int,
        known_cached: int = 0,
    ) -> None:
        """Register blocks [start, end) of a request under their chain hashes.

        The first `known_cached` of them are a prefix hit the caller just took (cached
        under these very hashes): they are skipped without looking them up."""
        if end <= start:
            return
        hash_of, cached = self.hash_of, self.cached
        skip = start + known_cached
        if end - skip == 1:
            self.cache_one(blocks[skip], block_hashes[skip], start, block_hashes)
            return
        hi = min(end, len(block_hashes))
        if hi <= skip:
            return
        # One lookup a block: setdefault registers new hashes and returns the block
        # already registered for the others; if all are new, they are registered.
        got = self._ops.register(cached, hash_of, blocks, block_hashes, skip, hi)
        if got is None:
            fresh = block_hashes[skip:hi]
            if self.on_stored is not None:
                parent = block_hashes[start - 1] if start > 0 else None
                self.on_stored(fresh if type(fresh) is list else list(fresh), parent)
            return
        hs = block_hashes[skip:hi]
        bs = blocks[skip:hi]
        # Same content computed twice concurrently: vLLM keeps both copies and one
        # map entry suffices to serve hits, so only new hashes are registered. A
        # block re-registered under the hash it already holds is not new either.
        stale = self._stale
        pairs = [
            (h, b)
            for h, g, b in zip(hs, got, bs, strict=True)
            if g == b and (hash_of[b] != h or b in stale)
        ]
        if not pairs:
            return
        fresh_h = [h for h, _ in pairs]
        fresh_b = [b for _, b in pairs]
        if stale:
            stale.difference_update(fresh_b)  # they hold their hash's entry again
        self._ops.scatter(hash_of, fresh_b, fresh_h)
        if self.on_stored is not None:
            self.on_stored(list(fresh_h), block_hashes[start - 1] if start > 0 else None)

    def cache_one(self, b: int, h: int, start: int, block_hashes: Sequence[int]) -> None:
        """`cache_blocks` of one block (decode fills one block at a time)."""
        if self.cached.setdefault(h, b) != b:
            return  # another block holds this content already
        stale = self._stale
        if self.hash_of[b] == h and b not in stale:
            return  # registered already
        self.hash_of[b] = h
        if stale:
            stale.discard(b)
        if self.on_stored is not None:
            self.on_stored([h], block_hashes[start - 1] if start > 0 else None)

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
        # One lookup pass finds the cached prefix and its blocks.
        have = self.longest_hit(block_hashes, len(block_hashes))
        n_have = len(have)
        self.touch(have)  # the prefix being extended must not be evicted to extend it
        todo = list(block_hashes[n_have : n_have + self.num_free])
        if not todo:
            return have
        blocks = self.allocate(len(todo))
        cached, hash_of = self.cached, self.hash_of
        if not cached.keys().isdisjoint(todo):
            # A later block of the chain is still cached elsewhere (its prefix was
            # evicted): the new copy takes the map entry, the old one keeps its hash.
            self._stale.update(cached[h] for h in todo if h in cached)
        self._ops.scatter(hash_of, blocks, todo)
        cached.update(zip(todo, blocks, strict=True))
        if self.on_stored is not None:
            self.on_stored(todo, block_hashes[n_have - 1] if n_have else None)
        return have + blocks

    def reset(self) -> None:
        """Drop every cached hash (vLLM's reset_prefix_cache); only legal when idle."""
        self.cached.clear()
        self.hash_of = [None] * len(self.hash_of)
        self._stale.clear()
