"""What engines report: KV cache events (vLLM's `BlockStored` / `BlockRemoved` /
`AllBlocksCleared`) and load statistics.

The ground floor's vocabulary: engines emit these, the scheduler's index and cluster
state consume them, and neither needs the other's insides to do so.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks (by chain hash) newly cached on an engine, vLLM's `BlockStored` event."""

    engine: str
    block_hashes: tuple[int, ...]
    parent_hash: int | None
    # Where the blocks live (vLLM's `medium`): None or "GPU" for the engine's own KV
    # pool, "CPU" for its offloading tier.
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from an engine's prefix cache, vLLM's `BlockRemoved` event."""

    engine: str
    block_hashes: tuple[int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    engine: str


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine reports about its load (vLLM's scheduler stats)."""

    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of KV blocks in use, 0..1
    num_kv_blocks: int
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    # The engine's last KV loads from peers (the wasma connector), oldest first, each
    # (sequence number, bytes, seconds): a reader keeps the last number it saw and takes
    # only newer ones, so polls that overlap or go missing neither count twice nor skip.
    kv_loads: tuple[tuple[int, int, float], ...] = ()
    num_preemptions: int = 0  # requests preempted since the engine started (cumulative)
