"""Which engine holds which KV blocks, fed by the engines' BlockStored/BlockRemoved events.

Hashes are vLLM-style chain hashes, so holding block i means holding the whole prefix up
to i; an engine's usable hit is its longest contiguous run from block 0, which is what
vLLM's own lookup stops at. Memory is bounded: past `max_blocks` entries the least
recently stored hashes are forgotten (an approximate index only costs hit accuracy).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat

from wasma.core.blockops import BlockOps, block_ops
from wasma.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class PrefixIndex:
    def __init__(
        self, engines: Sequence[str], max_blocks: int = 4_000_000, ops: BlockOps | None = None
    ) -> None:
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
        self._ops = ops if ops is not None else block_ops()

    def __len__(self) -> int:
        return len(self._holders)

    def add_engine(self, name: str) -> None:
        if name not in self._slot:
            self._slot[name] = len(self.engines)
            self.engines.append(name)
            self.blocks_per_engine.append(0)

    def apply(self, event: KVEvent) -> None:
        if isinstance(event, BlockStored):
            self.store(event.engine, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.remove(event.engine, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.remove_engine_blocks(event.engine)

    def store(self, engine: str, hashes: Sequence[int]) -> None:
        """`apply(BlockStored(engine, hashes, ...))`, without the event built (the router
        stores every placed prompt in its in-flight index)."""
        slot = self._slot.get(engine)
        if slot is None:
            return
        bit = 1 << slot
        holders = self._holders
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
        # Insertion order approximates recency: a hash re-enters at the end only
        # after every engine dropped it, which keeps stores O(1) without move_to_end.
        had = self._ops.or_bits(holders, hashes, bit)
        self.blocks_per_engine[slot] += len(hashes) - had
        if len(holders) > self.max_blocks and len(holders) > before:
            self._trim()

    def remove(self, engine: str, hashes: Sequence[int]) -> None:
        """`apply(BlockRemoved(engine, hashes))`, without the event built."""
        slot = self._slot.get(engine)
        if slot is None:
            return
        bit = 1 << slot
        holders = self._holders
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
        self.blocks_per_engine[slot] -= self._ops.clear_bits(holders, hashes, bit)

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
            # Least recent first out, one at a time: an OrderedDict pops its oldest in
            # O(1) and keeps a dict's insertion order (the compiled operations write to
            # it through its own setitem and delitem).
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
        # The running AND of the blocks' holder masks only loses bits: each engine's
        # prefix ends where its bit goes (at most one change per engine).
        set_bits = self._ops.set_bits
        for depth, mask in self._ops.match_runs(self._holders, block_hashes):
            set_bits(out, mask, depth)
        return out

    def masks(self, block_hashes: Sequence[int]) -> list[int]:
        """Each block's holder bitmask (bit i: engine slot i; 0: nobody)."""
        return list(map(self._holders.get, block_hashes, repeat(0)))

    def holders(self, block_hash: int) -> list[int]:
        mask = self._holders.get(block_hash, 0)
        return [i for i in range(len(self.engines)) if mask >> i & 1]
