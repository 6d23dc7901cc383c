"""Which engine holds which KV blocks, fed by the engines' BlockStored/BlockRemoved events.

Hashes are vLLM-style chain hashes, so holding block i means holding the whole prefix up
to i; an engine's usable hit is its longest contiguous run from block 0, which is what
vLLM's own lookup stops at. Memory is bounded: past `max_blocks` entries the least
recently stored hashes are forgotten (an approximate index only costs hit accuracy).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

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
            added = 0
            for h in event.block_hashes:
                mask = holders.get(h)
                if mask is None:
                    holders[h] = bit
                    added += 1
                else:
                    if not mask & bit:
                        added += 1
                    holders[h] = mask | bit
                    holders.move_to_end(h)
            self.blocks_per_engine[slot] += added
            if len(holders) > self.max_blocks:
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

        O(prompt blocks): walks the chain once, narrowing the set of engines that still
        match (a bitmask AND per block)."""
        out = [0] * len(self.engines)
        holders = self._holders
        active = -1
        depth = 0
        for h in block_hashes:
            mask = holders.get(h, 0) & active
            if mask != active and depth:
                self._record(out, active & ~mask, depth)
            if not mask:
                return out
            active = mask
            depth += 1
        if depth:
            self._record(out, active, depth)
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
