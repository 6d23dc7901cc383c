"""What rendering one chat request with vLLM's renderer costs in the gateway's process,
on the renderer's thread pool and inline on the event loop (`Frontend.inline`).

    python -m wasma.benchmarks.studies.render_cost [--model DIR] [--requests 400]

Without `--model` it renders with the tiny model `wasma tiny-model` writes (what
`wasma serve --engines sim:N` uses). Each mode renders `--requests` one-line chats one
after another (after 50 to warm up), twice, alternating; per render: wall and CPU time.
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


async def _measure(model: str, requests: int) -> list[dict[str, Any]]:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the tiny model)")
    ap.add_argument("--requests", type=int, default=400)
    args = ap.parse_args()
    if args.requests < 1:
        ap.error("--requests must be at least 1")
    model = args.model
    if model is None:
        from wasma.deploy.serve import SIM_MODEL_DIR
        from wasma.engines.tiny_model import write_tiny_model

        model = str(write_tiny_model(str(Path(SIM_MODEL_DIR).expanduser())))
    rows = asyncio.run(_measure(model, args.requests))
    print("| mode | wall µs / render | CPU µs / render |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['wall_us']} | {r['cpu_us']} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
