"""A closed-loop load of streamed completions on one OpenAI-compatible engine.

Used by the host-contention measurement and by the peers benchmark's engine-speed probe.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx


async def closed_loop(
    url: str,
    model: str,
    clients: int,
    seconds: float,
    prompt: int,
    output: int,
    seed: int,
    vocab: int = 2000,
) -> list[float]:
    """`clients` requests in flight on one engine for `seconds`; each request's latency.
    Prompts are fresh random token ids below `vocab`, so nothing hits the prefix cache."""
    rng = random.Random(seed)
    latencies: list[float] = []
    stop = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            body = {
                "model": model,
                "prompt": [rng.randrange(16, vocab) for _ in range(prompt)],
                "max_tokens": output,
                "ignore_eos": True,
                # Streamed, as agents and the router consume it: the API server's work
                # per token is part of what the engines' host carries.
                "stream": True,
            }
            t0 = time.monotonic()
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for _line in r.aiter_lines():
                    pass
            latencies.append(time.monotonic() - t0)

    async with httpx.AsyncClient(timeout=120.0) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return latencies
