"""The KV tier in the router: CPU-medium events from vLLM's own event classes, the
tiered prefix match, and wasma pricing a load from an engine's CPU tier."""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_events import BlockRemoved as VBlockRemoved
from vllm.distributed.kv_events import BlockStored as VBlockStored

from wasma.core.events import BlockStored
from wasma.core.profile import load_profile
from wasma.core.tokens import hash_token_blocks
from wasma.engines.kv_events import KVEventTranslator
from wasma.scheduler.policy import PolicyContext, RequestInfo
from wasma.scheduler.prefix_index import PrefixIndex
from wasma.scheduler.registry import default_registry
from wasma.scheduler.router import Router
from wasma.scheduler.state import ClusterState
from wasma.scheduler.tier_index import tiered_match
from wasma.scheduler.workflows import WorkflowRegistry

BS = 16


def _ctx(n: int = 2, cpu_blocks: int = 0, params: dict[str, object] | None = None):
    prof = dataclasses.replace(load_profile("llama3-8b-h100"), cpu_kv_blocks=cpu_blocks)
    names = [f"e{i}" for i in range(n)]
    return PolicyContext(
        state=ClusterState(names, num_kv_blocks=prof.num_kv_blocks - 1),
        index=PrefixIndex(names),
        workflows=WorkflowRegistry(),
        profile=prof,
        params=params or {},
    )


def _vllm_stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str):
    return VBlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def test_tiered_match_joins_gpu_head_and_cpu_tail() -> None:
    gpu, cpu = PrefixIndex(["a", "b"]), PrefixIndex(["a", "b"])
    gpu.apply(BlockStored("a", (1, 2), None))
    cpu.apply(BlockStored("a", (3, 4), None, "CPU"))
    cpu.apply(BlockStored("b", (1, 2, 3), None, "CPU"))
    assert gpu.match([1, 2, 3, 4, 5]) == [2, 0]
    assert tiered_match(gpu, cpu, [1, 2, 3, 4, 5]) == [4, 3]
    assert tiered_match(gpu, PrefixIndex(["a", "b"]), [1, 2, 3]) == [2, 0]


def test_vllm_cpu_events_reach_the_cpu_index_only() -> None:
    """Real vLLM `BlockStored`/`BlockRemoved` with medium "CPU" (what its offloading
    connector publishes) land in the router's CPU index, keyed by wasma's chain hashes;
    the GPU index is untouched, and a GPU removal leaves the CPU copy known."""
    ctx = _ctx()
    router = Router(ctx, default_registry().create("wasma", ctx))
    tr = KVEventTranslator("e1", BS)
    tokens = list(range(3 * BS))
    ours = hash_token_blocks(tokens, BS)
    for ev in tr.translate(_vllm_stored([11, 12, 13], None, tokens, "GPU")):
        router.on_kv_event(ev)
    for ev in tr.translate(_vllm_stored([11, 12, 13], None, tokens, "CPU")):
        router.on_kv_event(ev)
    assert ctx.index.match(ours) == [0, 3] and ctx.cpu_index.match(ours) == [0, 3]
    for ev in tr.translate(VBlockRemoved(block_hashes=[12, 13], medium="GPU")):
        router.on_kv_event(ev)
    assert ctx.index.match(ours) == [0, 1] and ctx.cpu_index.match(ours) == [0, 3]
    assert tiered_match(ctx.index, ctx.cpu_index, ours) == [0, 3]
    # A placeholder CPU event (no tokens) names a block the GPU reported before.
    tr2 = KVEventTranslator("e0", BS)
    for ev in tr2.translate(_vllm_stored([21, 22], None, tokens[: 2 * BS], "GPU")):
        router.on_kv_event(ev)
    placeholder = VBlockStored(
        block_hashes=[21],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    for ev in tr2.translate(placeholder):
        router.on_kv_event(ev)
    assert ctx.cpu_index.match(ours) == [1, 3]
    for ev in tr.translate(VBlockRemoved(block_hashes=[11, 12, 13], medium="CPU")):
        router.on_kv_event(ev)
    assert ctx.cpu_index.match(ours) == [1, 0]


def _request(hashes: list[int]) -> RequestInfo:
    return RequestInfo("r", "w", "n", "app", len(hashes) * BS + 5, 16, hashes, 0.0)


def test_wasma_prices_a_cpu_load_against_recompute() -> None:
    """Engine 1's CPU tier holds a long prefix nobody has on GPU: loading it (~0.1 s for
    4,000 blocks at 40 GB/s) beats recomputing it (seconds), so wasma goes there and
    counts the prefix as a hit; told not to price the tier it cannot tell the engines
    apart and takes the first."""
    hashes = list(range(1, 4001))
    for priced, engine in ((True, 1), (False, 0)):
        ctx = _ctx(params={"cpu_tier": priced})
        ctx.cpu_index.apply(BlockStored("e1", tuple(hashes), None, "CPU"))
        pl = default_registry().create("wasma", ctx).place(_request(hashes), 0.0)
        assert pl.engine == engine
        assert pl.hit_blocks == (4000 if priced else 0)
        assert pl.prefetch is priced


def test_wasma_prefers_gpu_hit_to_cpu_load() -> None:
    hashes = list(range(1, 4001))
    ctx = _ctx()
    ctx.cpu_index.apply(BlockStored("e0", tuple(hashes), None, "CPU"))
    ctx.index.apply(BlockStored("e1", tuple(hashes), None))
    pl = default_registry().create("wasma", ctx).place(_request(hashes), 0.0)
    assert pl.engine == 1 and pl.hit_blocks == 4000


def test_wasma_charges_a_copy_that_overflows_a_full_tier() -> None:
    """Engine 0's CPU tier holds the request's 1,000-block prefix, behind 25,000 queued
    prefill tokens; engine 1 is idle and its tier holds other blocks. Recomputing on
    engine 1 finishes sooner, and wasma goes there while copies are free or while engine
    1's tier has room for the copy; once that tier is full the copy would push out 1,000
    other blocks, and the charge for them keeps the request on the holder."""
    hashes = list(range(1, 1001))
    for cap, weight, engine in ((1000, 0.0, 1), (1000, 0.75, 0), (3000, 0.75, 1)):
        ctx = _ctx(cpu_blocks=cap, params={"tier_copy_cost": weight})
        ctx.cpu_index.apply(BlockStored("e0", tuple(hashes), None, "CPU"))
        ctx.cpu_index.apply(BlockStored("e1", tuple(range(10**6, 10**6 + 1000)), None, "CPU"))
        load = ctx.state.loads[0]
        load.outstanding, load.pending_prefill_tokens, load.pending_decode_tokens = 1, 25_000, 16
        pl = default_registry().create("wasma", ctx).place(_request(hashes), 0.0)
        assert pl.engine == engine
        assert pl.hit_blocks == (1000 if engine == 0 else 0)
