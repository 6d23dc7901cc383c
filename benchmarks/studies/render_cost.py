"""What rendering one chat request with vLLM's renderer costs in the gateway's process,
on the renderer's thread pool and inline on the event loop (`Frontend.inline`).

    python -m wasma.benchmarks.studies.render_cost [--model DIR] [--requests 400]
    python -m wasma.benchmarks.studies.render_cost --conversations [--requests 300]

Without `--model` it renders with the tiny model `wasma tiny-model` writes (what
`wasma serve --engines sim:N` uses). Each mode renders `--requests` one-line chats one
after another (after 50 to warm up), twice, alternating; per render: wall and CPU time.
With `--conversations` the chats are `router_latency`'s (eight conversations that grow a
turn a request, 900 to 3,500 prompt tokens), rendered inline with the prompt segments
(`deploy/prompt_segments.py`, each pass from an empty cache) and with vLLM tokenizing
every prompt whole, alternating, twice each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any


def _body(i: int) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"request {i}: the planner reads the plan"}],
        "max_tokens": 16,
        "stream": True,
    }


async def _measure(model: str, requests: int, conversations: bool) -> list[dict[str, Any]]:
    from wasma.deploy.api import render
    from wasma.deploy.frontend import Frontend, FrontendOptions

    fe = await Frontend.build(
        FrontendOptions(
            model=model,
            served_model_name=("tiny",),
            tool_call_parser="hermes",
            enable_auto_tool_choice=True,
        )
    )
    if conversations:
        return await _conversations(fe, requests)
    rows = []
    for mode in ("pool", "inline", "pool", "inline"):
        with fe.inline(0 if mode == "inline" else 1 << 30):
            for i in range(50):
                await render(fe, "chat", _body(i))
            wall, cpu = time.perf_counter(), time.process_time()
            for i in range(requests):
                await render(fe, "chat", _body(i))
            rows.append(
                {
                    "mode": mode,
                    "wall_us": round((time.perf_counter() - wall) / requests * 1e6, 1),
                    "cpu_us": round((time.process_time() - cpu) / requests * 1e6, 1),
                }
            )
    return rows


async def _conversations(fe: Any, requests: int) -> list[dict[str, Any]]:
    from wasma.benchmarks.studies.router_latency import conversations
    from wasma.deploy.api import render

    cache = fe.segments
    if cache is None:
        raise SystemExit("this tokenizer does not allow prompt segments")
    bodies = [
        {"model": "tiny", "messages": messages, "max_tokens": 1}
        for _, messages in conversations(requests)
    ]
    rows = []
    for mode in ("segments", "whole", "segments", "whole"):
        cache.clear()
        cache.enabled = mode == "segments"
        times = []
        cpu = time.process_time()
        with fe.inline(0):
            for body in bodies:
                t0 = time.perf_counter()
                await render(fe, "chat", body)
                times.append(time.perf_counter() - t0)
        times.sort()
        rows.append(
            {
                "mode": mode,
                "wall_us": round(sum(times) / len(times) * 1e6, 1),
                "p50_us": round(times[len(times) // 2] * 1e6, 1),
                "cpu_us": round((time.process_time() - cpu) / len(times) * 1e6, 1),
            }
        )
    cache.enabled = True
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument(
        "--conversations",
        action="store_true",
        help="growing multi-turn chats, with and without the prompt segments",
    )
    args = ap.parse_args()
    if args.requests < 1:
        ap.error("--requests must be at least 1")
    model = args.model
    if model is None:
        from wasma.deploy.serve import SIM_MODEL_DIR
        from wasma.engines.tiny_model import write_tiny_model

        model = str(write_tiny_model(str(Path(SIM_MODEL_DIR).expanduser())))
    rows = asyncio.run(_measure(model, args.requests, args.conversations))
    print("| mode | wall µs / render | CPU µs / render |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['wall_us']} | {r['cpu_us']} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
