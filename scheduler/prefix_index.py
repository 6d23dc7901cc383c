"""Which engine holds which KV blocks, fed by the engines' BlockStored/BlockRemoved events.

Hashes are vLLM-style chain hashes, so holding block i means holding the whole prefix up
to i; an engine's usable hit is its longest contiguous run from block 0, which is what
vLLM's own lookup stops at. Memory is bounded: past `max_blocks` entries the least
recently stored hashes are forgotten (an approximate index only costs hit accuracy).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import accumulate, repeat
from operator import and_

from engines.base import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class PrefixIndex:
    def __init__(self, engines: Sequence[str], max_blocks: int = 4_000_000) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.engines = list(engines)
        self._slot = {name: i for i, name in enumerate(self.engines)}
        self.max_blocks = max_blocks
        # hash -> bitmask of engine slots holding it; LRU order by last store.
        self._holders: OrderedDict[int, int] = OrderedDict()
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
            before = len(holders)
            # map() keeps the per-block work in C. Insertion order approximates recency:
            # a hash re-enters at the end only after every engine dropped it, which keeps
            # stores O(1) without move_to_end.
            masks = list(map(holders.get, hashes, repeat(0)))
            had = sum(map(bit.__and__, masks)) // bit
            holders.update(zip(hashes, map(bit.__or__, masks), strict=True))
            self.blocks_per_engine[slot] += len(hashes) - had
            if len(holders) > self.max_blocks and len(holders) > before:
                self._trim()
        elif isinstance(event, BlockRemoved):
            removed = 0
            for h in event.block_hashes:
                mask = holders.get(h)
                if mask is None or not mask & bit:
                    continue
                removed += 1
                mask &= ~bit
                if mask:
                    holders[h] = mask
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
        while len(holders) > self.max_blocks:
            _h, mask = holders.popitem(last=False)
            while mask:
                low = mask & -mask
                self.blocks_per_engine[low.bit_length() - 1] -= 1
                mask ^= low

    def match(self, block_hashes: Sequence[int]) -> list[int]:
        """Longest cached prefix, in blocks, for every engine (index = engine slot).

        O(prompt blocks), with the per-block work in C: look up every block's holder
        mask, AND them cumulatively, and record each engine at the depth its bit
        disappears."""
        out = [0] * len(self.engines)
        masks = list(map(self._holders.get, block_hashes))
        masks = masks[: _index_or_len(masks, None)]
        acc = list(accumulate(masks, and_))
        acc = acc[: _index_or_len(acc, 0)]
        if not acc:
            return out
        last = len(acc) - 1
        # Depths where the set of matching engines shrinks.
        for d in [i for i in range(last) if acc[i] != acc[i + 1]]:
            self._record(out, acc[d] & ~acc[d + 1], d + 1)
        self._record(out, acc[last], last + 1)
        return out

    @staticmethod
    def _record(out: list[int], mask: int, depth: int) -> None:
        while mask:
            low = mask & -mask
            out[low.bit_length() - 1] = depth
            mask ^= low

    def holders(self, block_hash: int) -> list[int]:
        mask = self._holders.get(block_hash, 0)
        return [i for i in range(len(self.engines)) if mask >> i & 1]


def _index_or_len(items: list[int | None] | list[int], value: int | None) -> int:
    """Position of the first `value` in `items`, or its length (list.index runs in C)."""
    try:
        return items.index(value)  # type: ignore[arg-type]
    except ValueError:
        return len(items)
