"""SimEngine: the simulated vLLM engine on the wall clock, behind EngineClient."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from wasma.core.events import BlockStored, KVEvent
from wasma.core.profile import load_profile
from wasma.core.tokens import hash_token_blocks
from wasma.engines.base import GenerateRequest, TokenChunk
from wasma.engines.sim_engine import SimEngine, sim_output_tokens

PROFILE = load_profile("llama3-8b-h100")
BS = PROFILE.block_size


def _engine(speed: float = 200.0) -> SimEngine:
    # Fast enough that a test's requests finish in milliseconds.
    return SimEngine("e0", PROFILE, speed=speed)


async def _collect(engine: SimEngine, req: GenerateRequest) -> list[TokenChunk]:
    return [c async for c in engine.generate(req)]


async def _until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.005)


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 100_000 + 300 for i in range(n)]


async def test_streams_exactly_max_tokens_then_finishes() -> None:
    engine = _engine()
    try:
        chunks = await _collect(engine, GenerateRequest("r", _prompt(1, 100), 20))
        ids = [t for c in chunks for t in c.token_ids]
        assert len(ids) == 20
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
        assert not any(c.finished for c in chunks[:-1])
        assert chunks[0].num_cached_tokens == 0
        assert ids == sim_output_tokens(_prompt(1, 100), 20, PROFILE.vocab_size)
    finally:
        await engine.close()


async def test_output_is_a_function_of_the_prompt() -> None:
    engine = _engine()
    try:
        a = await _collect(engine, GenerateRequest("a", _prompt(2, 40), 8))
        b = await _collect(engine, GenerateRequest("b", _prompt(2, 40), 8))
        c = await _collect(engine, GenerateRequest("c", _prompt(3, 40), 8))
        ids = [[t for ch in x for t in ch.token_ids] for x in (a, b, c)]
        assert ids[0] == ids[1] != ids[2]
        assert all(16 <= t < PROFILE.vocab_size for t in ids[0])
    finally:
        await engine.close()


async def test_kv_events_use_the_routers_chain_hashes() -> None:
    engine = _engine()
    events: list[KVEvent] = []
    engine.subscribe_kv_events(events.append)
    try:
        prompt = _prompt(4, 5 * BS)
        chunks = await _collect(engine, GenerateRequest("r", prompt, 2 * BS))
        out = [t for c in chunks for t in c.token_ids]
        stored = [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]
        # Every full block of prompt + output, hashed as the router hashes real tokens.
        expected = hash_token_blocks(prompt + out, BS)
        assert set(hash_token_blocks(prompt, BS)) <= set(stored)
        assert set(stored) <= set(expected)
    finally:
        await engine.close()


async def test_a_child_extending_its_parents_context_hits_the_prefix_cache() -> None:
    engine = _engine()
    try:
        parent = _prompt(5, 3 * BS + 5)
        out = [
            t for c in await _collect(engine, GenerateRequest("p", parent, BS)) for t in c.token_ids
        ]
        child = parent + out + _prompt(6, 20)
        chunks = await _collect(engine, GenerateRequest("c", child, 4))
        cached = chunks[0].num_cached_tokens
        assert cached is not None
        # Parent context = 4 full blocks + 5 tokens: the 4 full blocks are reused.
        assert cached == ((len(parent) + len(out)) // BS) * BS
        stats = await engine.stats()
        assert stats.prefix_cache_hits_tokens >= cached
    finally:
        await engine.close()


async def test_leaving_early_aborts_the_request() -> None:
    engine = _engine(speed=1.0)  # real speed: 500 decode steps take seconds
    try:
        gen: Any = engine.generate(GenerateRequest("long", _prompt(7, 64), 500))
        first = await gen.__anext__()
        assert first.token_ids
        await gen.aclose()
        await _until(lambda: not engine.core.has_work())
        stats = await engine.stats()
        assert stats.num_running == 0 and stats.num_waiting == 0
        # The engine still serves requests afterwards.
        chunks = await _collect(engine, GenerateRequest("next", _prompt(8, 32), 3))
        assert sum(len(c.token_ids) for c in chunks) == 3
    finally:
        await engine.close()


async def test_concurrent_requests_are_batched_and_all_finish() -> None:
    engine = _engine()
    try:
        reqs = [GenerateRequest(f"r{i}", _prompt(100 + i, 50), 6) for i in range(200)]
        results = await asyncio.gather(*(_collect(engine, r) for r in reqs))
        assert all(sum(len(c.token_ids) for c in chunks) == 6 for chunks in results)
        # Batching: far fewer engine steps than requests x tokens.
        assert engine.core.steps < 200 * 6 / 4
    finally:
        await engine.close()


async def test_bad_requests_raise_value_error() -> None:
    engine = _engine()
    try:
        with pytest.raises(ValueError):
            await _collect(engine, GenerateRequest("big", [300] * 10, PROFILE.max_model_len))
        with pytest.raises(ValueError):
            await _collect(engine, GenerateRequest("zero", [300] * 10, 0))
        assert await engine.healthy()
    finally:
        await engine.close()
    assert not await engine.healthy()


async def test_a_retention_lease_keeps_kv_through_churn_until_it_lapses() -> None:
    """As wasma's retaining vLLM scheduler does (tests/engines/test_vllm_engine.py): KV
    under a lease outlives more fresh prefill than the pool holds; without a lease, once
    it lapses, or once a later request released it by its key, LRU evicts it."""
    from dataclasses import replace

    engine = SimEngine("e0", replace(PROFILE, num_kv_blocks=64), speed=200.0)
    try:
        prompts = {name: _prompt(10 + i, 6 * BS) for i, name in enumerate("KLPR")}
        leases = {"K": 600.0, "L": 0.2, "P": 0.0, "R": 600.0}
        for name, prompt in prompts.items():
            req = GenerateRequest(f"ret-{name}", prompt, 1, retain_s=leases[name])
            await _collect(engine, req)
        await asyncio.sleep(0.3)  # L's lease lapses
        for i in range(64 // 8 + 2):  # one at a time: ordinary free blocks never run out
            release = ("ret-R",) if i == 0 else ()
            req = GenerateRequest(f"churn-{i}", _prompt(100 + i, 8 * BS), 1, release=release)
            await _collect(engine, req)
        hits = {}
        for name, prompt in prompts.items():
            child = GenerateRequest(f"{name}-child", [*prompt, *_prompt(50, BS)], 1)
            hits[name] = (await _collect(engine, child))[0].num_cached_tokens
        assert hits == {"K": 6 * BS, "L": 0, "P": 0, "R": 0}
    finally:
        await engine.close()


async def test_launch_all_closes_the_engines_that_started_when_one_fails() -> None:
    from wasma.engines.base import launch_all

    profile = load_profile("tiny-cpu")
    started = [SimEngine(f"s{i}", profile) for i in range(2)]

    async def up(engine: SimEngine) -> SimEngine:
        return engine

    async def broken() -> SimEngine:
        raise RuntimeError("engine 2 failed to start")

    assert await launch_all(up(e) for e in started) == started
    assert all([await e.healthy() for e in started])
    with pytest.raises(RuntimeError, match="engine 2 failed"):
        await launch_all([up(started[0]), up(started[1]), broken()])
    # No engine is left running behind the failed setup.
    assert not any([await e.healthy() for e in started])


async def test_launch_all_closes_the_engines_that_started_when_it_is_cancelled() -> None:
    from wasma.engines.base import launch_all

    profile = load_profile("tiny-cpu")
    fast = SimEngine("fast", profile)

    async def up() -> SimEngine:
        return fast

    async def slow() -> SimEngine:
        await asyncio.sleep(60)
        raise AssertionError("never reached")

    launching = asyncio.create_task(launch_all([up(), slow()]))
    await asyncio.sleep(0.05)
    assert await fast.healthy()
    launching.cancel()
    with pytest.raises(asyncio.CancelledError):
        await launching
    assert not await fast.healthy()
