"""Prefix hits across an engine's KV tiers: its GPU pool and its CPU offloading tier."""

from __future__ import annotations

from collections.abc import Sequence

from wasma.scheduler.prefix_index import PrefixIndex


def tiered_match(gpu: PrefixIndex, cpu: PrefixIndex, block_hashes: Sequence[int]) -> list[int]:
    """For every engine, the longest prefix (in blocks) each of whose blocks is in its GPU
    pool or its CPU tier. vLLM evicts a chain's deepest blocks first, so an engine often
    holds a prefix's head on GPU and its tail only on CPU; either index alone would stop
    at the first block it lacks."""
    n = len(gpu.engines)
    out = [0] * n
    if not len(cpu):
        return gpu.match(block_hashes)
    acc = (1 << n) - 1
    depth = 0
    step = 64
    while depth < len(block_hashes) and acc:
        part = block_hashes[depth : depth + step]
        for a, b in zip(gpu.masks(part), cpu.masks(part), strict=True):
            m = acc & (a | b)
            lost = acc & ~m
            while lost:
                low = lost & -lost
                out[low.bit_length() - 1] = depth
                lost ^= low
            acc = m
            if not acc:
                break
            depth += 1
        step *= 2
    while acc:
        low = acc & -acc
        out[low.bit_length() - 1] = depth
        acc ^= low
    return out
