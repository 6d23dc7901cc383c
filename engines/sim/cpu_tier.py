"""A CPU KV tier below one engine's GPU pool, as vLLM's native offloading connector
keeps it (`--kv-offloading-size`, `OffloadingConnector` with the CPU backend).

Semantics followed:
- store on compute: every full block the GPU caches is copied to CPU memory
  asynchronously (device-to-host DMA on its own stream, so it does not slow the step);
  a block becomes loadable when its copy has landed. Copies queue on the D2H link.
- lookup at admission: a waiting request whose prompt continues, past its GPU prefix
  hit, with blocks the tier holds loads them (host-to-device DMA, queued on the H2D
  link, plus a fixed per-load cost) into GPU blocks allocated for it, and waits for the
  load (vLLM's WAITING_FOR_REMOTE_KVS) without holding up the queue behind it.
- LRU within the tier: a store or a load makes a block most recent; past the tier's size
  the least recent go. Optionally (`keep`) blocks a pending request will reuse are
  evicted only after every other block (the workflow-aware part).

The tier reports what it holds as KV events of medium "CPU", as vLLM's offloading
manager does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

CPU_MEDIUM = "CPU"

TierSink = Callable[[list[int]], None]


class CpuTier:
    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        h2d_bytes_per_s: float,
        d2h_bytes_per_s: float,
        load_latency_s: float,
        on_stored: TierSink | None = None,
        on_removed: TierSink | None = None,
        keep: Callable[[int], bool] | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError("a CPU tier needs at least one block")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.h2d = h2d_bytes_per_s
        self.d2h = d2h_bytes_per_s
        self.load_latency_s = load_latency_s
        self.on_stored = on_stored
        self.on_removed = on_removed
        self.keep = keep
        # chain hash -> when its copy lands (loadable from then); LRU order, oldest first.
        self.blocks: OrderedDict[int, float] = OrderedDict()
        self._d2h_free = 0.0
        self._h2d_free = 0.0
        self.stored_blocks = 0
        self.loaded_blocks = 0
        self.evicted_blocks = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def store(self, hashes: Sequence[int], now: float) -> None:
        """The GPU cached these blocks: copy the new ones down, refresh the rest."""
        blocks = self.blocks
        new = [h for h in hashes if h not in blocks]
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
        if not new:
            return
        start = max(self._d2h_free, now)
        done = start + len(new) * self.block_bytes / self.d2h
        self._d2h_free = done
        for h in new:
            blocks[h] = done
        self.stored_blocks += len(new)
        if self.on_stored is not None:
            self.on_stored(new)
        if len(blocks) > self.num_blocks:
            self._evict()

    def _evict(self) -> None:
        blocks = self.blocks
        gone: list[int] = []
        keep = self.keep
        # Kept blocks met at the LRU end go to the MRU end once each; when the tier holds
        # nothing but kept blocks, the oldest of them go.
        spared = 0
        while len(blocks) > self.num_blocks:
            h, landed = blocks.popitem(last=False)
            if keep is not None and spared < len(blocks) and keep(h):
                blocks[h] = landed
                spared += 1
                continue
            gone.append(h)
        self.evicted_blocks += len(gone)
        if gone and self.on_removed is not None:
            self.on_removed(gone)

    def loadable(self, hashes: Sequence[int], start: int, limit: int, now: float) -> int:
        """How many blocks from `hashes[start]` on (at most up to `limit`) the tier can
        load now: a contiguous run whose copies have landed."""
        get = self.blocks.get
        n = 0
        for h in hashes[start:limit]:
            landed = get(h)
            if landed is None or landed > now:
                break
            n += 1
        return n

    def load(self, hashes: Sequence[int], now: float) -> float:
        """Queue a load of these blocks to the GPU; returns when it lands."""
        blocks = self.blocks
        for h in hashes:
            blocks.move_to_end(h)
        start = max(self._h2d_free, now)
        done = start + len(hashes) * self.block_bytes / self.h2d
        self._h2d_free = done
        self.loaded_blocks += len(hashes)
        return done + self.load_latency_s
