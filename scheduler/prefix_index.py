"""Which engine holds which KV blocks, fed by the engines' BlockStored/BlockRemoved events.

Hashes are vLLM-style chain hashes, so holding block i means holding the whole prefix up
to i; an engine's usable hit is its longest contiguous run from block 0, which is what
vLLM's own lookup stops at. Memory is bounded: past `max_blocks` entries the least
recently stored hashes are forgotten (an approximate index only costs hit accuracy).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from itertools import accumulate, compress, repeat
from operator import and_, neg, not_

from wasma.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class PrefixIndex:
    def __init__(self, engines: Sequence[str], max_blocks: int = 4_000_000) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.engines = list(engines)
        self._slot = {name: i for i, name in enumerate(self.engines)}
        self.max_blocks = max_blocks
        # hash -> bitmask of engine slots holding it; LRU order by last store. A plain
        # dict keeps the same insertion order and is faster; it becomes an OrderedDict
        # (same order) the first time the cap is hit, for popping the oldest in O(1).
        self._holders: dict[int, int] = {}
        self.blocks_per_engine = [0] * len(self.engines)

    def __len__(self) -> int:
        return len(self._holders)

    def add_engine(self, name: str) -> None:
        if name not in self._slot:
            self._slot[name] = len(self.engines)
            self.engines.append(name)
            self.blocks_per_engine.append(0)

    def apply(self, event: KVEvent) -> None:
        slot = self._slot.get(event.engine)
        if slot is None:
            return
        bit = 1 << slot
        holders = self._holders
        if isinstance(event, BlockStored):
            hashes = event.block_hashes
            if len(hashes) == 1:  # a decode step filled one block: skip the bulk setup
                h = hashes[0]
                mask = holders.get(h, 0)
                if not mask & bit:
                    holders[h] = mask | bit
                    self.blocks_per_engine[slot] += 1
                    if not mask and len(holders) > self.max_blocks:
                        self._trim()
                return
            before = len(holders)
            # map() keeps the per-block work in C. Insertion order approximates recency:
            # a hash re-enters at the end only after every engine dropped it, which keeps
            # stores O(1) without move_to_end.
            masks = list(map(holders.get, hashes, repeat(0)))
            if any(masks):
                had = sum(map(bit.__and__, masks)) // bit
                holders.update(zip(hashes, map(bit.__or__, masks), strict=True))
            else:  # new content (the common case): no engine held any of it
                had = 0
                holders.update(zip(hashes, repeat(bit)))
            self.blocks_per_engine[slot] += len(hashes) - had
            if len(holders) > self.max_blocks and len(holders) > before:
                self._trim()
        elif isinstance(event, BlockRemoved):
            hashes = event.block_hashes
            if len(hashes) == 1:
                h = hashes[0]
                held = holders.get(h)
                if held is not None and held & bit:
                    held &= ~bit
                    if held:
                        holders[h] = held
                    else:
                        del holders[h]
                    self.blocks_per_engine[slot] -= 1
                return
            masks = list(map(holders.get, hashes, repeat(0)))
            if masks.count(bit) == len(masks):
                # Evicted content only this engine held (the common case): drop it.
                before = len(holders)
                try:
                    for h in hashes:
                        del holders[h]
                except KeyError:  # a hash listed twice
                    for h in hashes:
                        holders.pop(h, None)
                self.blocks_per_engine[slot] -= before - len(holders)
                return
            if len(set(hashes)) == len(hashes):
                # Shared content (or a router-side in-flight index): clear this engine's
                # bit in bulk, keeping every entry's place, then drop emptied entries.
                with_bit = list(map(bit.__and__, masks))
                gone = list(compress(hashes, with_bit))
                left = list(map((~bit).__and__, compress(masks, with_bit)))
                holders.update(zip(gone, left, strict=True))
                if 0 in left:
                    for h in compress(gone, map(not_, left)):
                        del holders[h]
                self.blocks_per_engine[slot] -= len(gone)
                return
            removed = 0
            for h in hashes:
                held = holders.get(h)
                if held is None or not held & bit:
                    continue
                removed += 1
                held &= ~bit
                if held:
                    holders[h] = held
                else:
                    del holders[h]
            self.blocks_per_engine[slot] -= removed
        elif isinstance(event, AllBlocksCleared):
            self.remove_engine_blocks(event.engine)

    def remove_engine_blocks(self, engine: str) -> None:
        """Forget everything an engine held (it died or reset its cache)."""
        slot = self._slot.get(engine)
        if slot is None:
            return
        bit = 1 << slot
        for h in [h for h, m in self._holders.items() if m & bit]:
            m = self._holders[h] & ~bit
            if m:
                self._holders[h] = m
            else:
                del self._holders[h]
        self.blocks_per_engine[slot] = 0

    def _trim(self) -> None:
        holders = self._holders
        if not isinstance(holders, OrderedDict):
            holders = self._holders = OrderedDict(holders)
        while len(holders) > self.max_blocks:
            _h, mask = holders.popitem(last=False)
            while mask:
                low = mask & -mask
                self.blocks_per_engine[low.bit_length() - 1] -= 1
                mask ^= low

    def match(self, block_hashes: Sequence[int]) -> list[int]:
        """Longest cached prefix, in blocks, for every engine (index = engine slot).

        O(matched blocks), with the per-block work in C: look up every block's holder
        mask, AND them cumulatively, and record each engine at the depth its bit
        disappears. Lookups go in chunks that double in size and stop at the first
        block no engine holds, so a long prompt with a short shared head costs little."""
        out = [0] * len(self.engines)
        get = self._holders.get
        n = len(block_hashes)
        acc: list[int] = []
        i, step, held = 0, 64, -1  # -1: every engine (all bits set)
        while i < n:
            part = list(map(get, block_hashes[i : i + step]))
            cut = _index_or_len(part, None)
            part_acc = list(accumulate(part[:cut], and_, initial=held))[1:]
            stop = _index_or_len(part_acc, 0)
            acc += part_acc[:stop]
            if cut < len(part) or stop < len(part_acc):
                break
            held = part_acc[-1]
            i += step
            step *= 2
        if not acc:
            return out
        # The running AND only loses bits, so it never increases: each distinct value is
        # one contiguous run, found by binary search (at most one run per engine).
        n = len(acc)
        d = 0
        while d < n:
            mask = acc[d]
            end = bisect_right(acc, -mask, d, n, key=neg)
            self._record(out, mask & ~acc[end] if end < n else mask, end)
            d = end
        return out

    @staticmethod
    def _record(out: list[int], mask: int, depth: int) -> None:
        while mask:
            low = mask & -mask
            out[low.bit_length() - 1] = depth
            mask ^= low

    def masks(self, block_hashes: Sequence[int]) -> list[int]:
        """Each block's holder bitmask (bit i: engine slot i; 0: nobody)."""
        return list(map(self._holders.get, block_hashes, repeat(0)))

    def holders(self, block_hash: int) -> list[int]:
        mask = self._holders.get(block_hash, 0)
        return [i for i in range(len(self.engines)) if mask >> i & 1]


def _index_or_len(items: list[int | None] | list[int], value: int | None) -> int:
    """Position of the first `value` in `items`, or its length (list.index runs in C)."""
    try:
        return items.index(value)  # type: ignore[arg-type]
    except ValueError:
        return len(items)
