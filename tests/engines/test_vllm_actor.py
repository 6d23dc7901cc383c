"""RayVLLMEngine: a vLLM engine in a Ray actor behind the EngineClient interface."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from wasma.core.events import BlockStored, KVEvent
from wasma.core.tokens import hash_token_blocks
from wasma.engines.base import GenerateRequest

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def ray_engine(tiny_model_dir: Path) -> AsyncIterator[object]:
    ray = pytest.importorskip("ray")
    from wasma.engines.vllm_actor import RayVLLMEngine
    from wasma.engines.vllm_engine import VLLMEngineConfig

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        engine = await RayVLLMEngine.launch("r0", VLLMEngineConfig(model=str(tiny_model_dir)))
        try:
            yield engine
        finally:
            await engine.close()
    finally:
        ray.shutdown()


async def test_ray_engine_streams_hits_and_events(ray_engine: object) -> None:
    from wasma.engines.vllm_actor import RayVLLMEngine

    assert isinstance(ray_engine, RayVLLMEngine)
    assert ray_engine.num_kv_blocks == 2048 and ray_engine.vocab_size == 2048
    events: list[KVEvent] = []
    ray_engine.subscribe_kv_events(events.append)
    bs = ray_engine.block_size
    prompt = list(range(100, 100 + 3 * bs + 5))
    chunks = [c async for c in ray_engine.generate(GenerateRequest("ra-1", prompt, 12))]
    assert sum(len(c.token_ids) for c in chunks) == 12 and chunks[-1].finished
    again = [c async for c in ray_engine.generate(GenerateRequest("ra-2", [*prompt, 7], 2))]
    assert again[0].num_cached_tokens == 3 * bs

    expect = hash_token_blocks(prompt, bs)
    deadline = time.monotonic() + 10
    while not set(expect) <= {
        h for e in events if isinstance(e, BlockStored) for h in e.block_hashes
    }:
        assert time.monotonic() < deadline, events
        await asyncio.sleep(0.05)

    stats = await ray_engine.stats()
    assert stats.num_kv_blocks == 2047 and stats.prefix_cache_hits_tokens >= 3 * bs
    assert await ray_engine.healthy()

    # Stopping early cancels the actor's stream, so vLLM aborts the long request.
    n = 0
    async for _chunk in ray_engine.generate(GenerateRequest("ra-3", prompt, 3000)):
        n += 1
        if n == 2:
            break
    t0 = time.monotonic()
    tail = [c async for c in ray_engine.generate(GenerateRequest("ra-4", prompt, 2))]
    assert tail[-1].finished and time.monotonic() - t0 < 5.0


async def test_a_failed_launch_kills_its_actor(ray_engine: object, tmp_path: Path) -> None:
    import ray

    from wasma.engines.vllm_actor import RayVLLMEngine
    from wasma.engines.vllm_engine import VLLMEngineConfig

    free = ray.available_resources().get("CPU", 0.0)
    broken = VLLMEngineConfig(model=f"{tmp_path}/no-such-model")
    with pytest.raises(Exception) as failed:
        await RayVLLMEngine.launch("broken", broken)
    # The traceback (held here) still references the engine and its actor handle: the
    # actor's CPU comes back only because the failed launch killed it.
    assert failed.value is not None
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0.0) < free:
        assert time.monotonic() < deadline, ray.available_resources()
        await asyncio.sleep(0.1)
