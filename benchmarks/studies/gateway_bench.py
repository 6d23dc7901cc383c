"""Gateway overhead and throughput with simulated engines.

    python -m wasma.benchmarks.studies.gateway_bench [--engines 8] [--duration 10]
        [--connections 64] [--mode inproc|ray|both] [--out FILE]

1. TTFT overhead: the same sequential requests (1 prompt of 256 token ids, 8 output tokens)
   sent (a) straight to a `SimEngine` in this process and (b) streamed through the gateway
   (HTTP + auth-free edge + router + SSE), each on a fresh engine; overhead = (b) - (a),
   median and p99.
2. Throughput: non-streaming `/v1/completions` (64 token ids in, 4 out) from a lean
   keep-alive HTTP/1.1 client in a separate process, so the figure counts the gateway
   process's work, not the client's; the engines run 1000x faster than the profile so the
   gateway, not the simulated GPU, is the bottleneck.

The gateway runs as `wasma serve` in a subprocess (uvloop + httptools), with the router
either in-process (`--router-in-process`) or in a Ray actor (the default of `wasma serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from wasma.deploy.serve import free_port

PROMPT_TTFT = 256
PROMPT_TPUT = 64
# Prompt ids stay inside the tiny model's vocabulary the sim gateway renders with.
VOCAB_IDS = 1700


def _percentiles(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs, dtype=float) * 1e3
    return {
        "median_ms": round(float(np.median(a)), 3),
        "p99_ms": round(float(np.percentile(a, 99)), 3),
        "n": len(xs),
    }


# -- a lean HTTP/1.1 client (the openai SDK would cost more CPU than the gateway) ------


async def _post(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, data: bytes) -> int:
    """One request on a keep-alive connection; returns the status (body discarded)."""
    writer.write(data)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    low = head.lower()
    i = low.find(b"content-length:")
    if i >= 0:
        await reader.readexactly(int(low[i + 15 : low.find(b"\r\n", i)]))
        return status
    while True:  # chunked
        size = int((await reader.readline()).strip(), 16)
        await reader.readexactly(size + 2)
        if size == 0:
            return status


def _request(host: str, port: int, path: str, payload: dict[str, Any]) -> bytes:
    body = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def _load(host: str, port: int, connections: int, duration_s: float) -> dict[str, Any]:
    # Requests are encoded up front (distinct prompts, so each is hashed, placed and run
    # afresh): the client must spend as little CPU as it can on a shared 2-core machine.
    pool = [
        _request(
            host,
            port,
            "/v1/completions",
            {
                "prompt": [(i * 7919 + j) % VOCAB_IDS + 300 for j in range(PROMPT_TPUT)],
                "max_tokens": 4,
                "ignore_eos": True,
            },
        )
        for i in range(4096)
    ]
    done = 0
    errors = 0
    lat: list[float] = []
    stop_at = time.perf_counter() + duration_s

    async def worker(k: int) -> None:
        nonlocal done, errors
        reader, writer = await asyncio.open_connection(host, port)
        i = k
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            status = await _post(reader, writer, pool[i % len(pool)])
            lat.append(time.perf_counter() - t0)
            if status == 200:
                done += 1
            else:
                errors += 1
            i += connections
        writer.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(connections)))
    wall = time.perf_counter() - t0
    return {
        "requests": done,
        "errors": errors,
        "wall_s": round(wall, 3),
        "req_per_s": round(done / wall, 1),
        "latency": _percentiles(lat),
    }


def _run_uvloop(coro: Any) -> Any:
    """Run `coro` on uvloop when installed (the gateway runs on it too)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _load_proc(host: str, port: int, connections: int, duration_s: float, q: Any) -> None:
    q.put(_run_uvloop(_load(host, port, connections, duration_s)))


# -- TTFT ---------------------------------------------------------------------------


async def _ttft_direct(n: int, speed: float) -> list[float]:
    from wasma.core.profile import load_profile
    from wasma.engines.base import GenerateRequest
    from wasma.engines.sim_engine import SimEngine

    eng = SimEngine("direct", load_profile("llama3-8b-h100"), speed=speed)
    out = []
    for i in range(n):
        prompt = [(i * 131 + j) % VOCAB_IDS + 300 for j in range(PROMPT_TTFT)]
        t0 = time.perf_counter()
        gen: Any = eng.generate(GenerateRequest(f"d{i}", prompt, 8))
        await gen.__anext__()
        out.append(time.perf_counter() - t0)
        await gen.aclose()
        await asyncio.sleep(0.002)
    await eng.close()
    return out


async def _ttft_gateway(host: str, port: int, n: int) -> list[float]:
    reader, writer = await asyncio.open_connection(host, port)
    out = []
    for i in range(n):
        prompt = [(i * 131 + j) % VOCAB_IDS + 300 for j in range(PROMPT_TTFT)]
        data = _request(
            host, port, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "stream": True}
        )
        t0 = time.perf_counter()
        writer.write(data)
        # Headers, then the first chunk of the body: the first SSE event.
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        size = int((await reader.readline()).strip(), 16)
        await reader.readexactly(size + 2)
        out.append(time.perf_counter() - t0)
        while True:  # drain the rest of the stream
            size = int((await reader.readline()).strip(), 16)
            await reader.readexactly(size + 2)
            if size == 0:
                break
        await asyncio.sleep(0.002)
    writer.close()
    return out


# -- orchestration ------------------------------------------------------------------


def _start_gateway(
    engines: int, speed: float, inproc: bool, extra: list[str] | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "wasma.deploy.cli", "serve", "--engines", f"sim:{engines}",
        "--policy", "wasma", "--port", str(port), "--sim-speed", str(speed), *(extra or []),
    ]  # fmt: skip
    if inproc:
        cmd.append("--router-in-process")
    env = {k: v for k, v in os.environ.items() if k != "WASMA_API_KEYS"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    import httpx

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited: {proc.stderr.read().decode()[-2000:]}")  # type: ignore[union-attr]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise TimeoutError("gateway did not come up")


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children, from /proc."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    except OSError:
        pass
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    inproc = mode == "inproc"
    out: dict[str, Any] = {"mode": mode}
    # TTFT with engines 1000x the profile's speed (a 256-token prefill step takes ~11 us),
    # so what remains is the event loop's wake-up, plus, through the gateway, HTTP,
    # routing and SSE: the overhead.
    proc, port = _start_gateway(1, 1000.0, inproc)
    try:
        asyncio.run(_ttft_gateway("127.0.0.1", port, 20))  # warm up
        gw = asyncio.run(_ttft_gateway("127.0.0.1", port, args.ttft_requests))
    finally:
        _stop(proc)
    direct = _run_uvloop(_ttft_direct(args.ttft_requests, 1000.0))
    d, g = _percentiles(direct), _percentiles(gw)
    out["ttft_direct"] = d
    out["ttft_gateway"] = g
    out["ttft_overhead_ms"] = {
        "median": round(g["median_ms"] - d["median_ms"], 3),
        "p99": round(g["p99_ms"] - d["p99_ms"], 3),
    }
    proc, port = _start_gateway(args.engines, 1000.0, inproc)
    try:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        warm = ctx.Process(target=_load_proc, args=("127.0.0.1", port, args.connections, 2.0, q))
        warm.start()
        q.get()
        warm.join()
        p = ctx.Process(
            target=_load_proc, args=("127.0.0.1", port, args.connections, args.duration, q)
        )
        cpu0 = _cpu_s(proc.pid)
        p.start()
        tput = q.get()
        cpu = _cpu_s(proc.pid) - cpu0
        p.join()
        # The gateway's own CPU per request: what one core could sustain without the client.
        tput["gateway_cpu_s"] = round(cpu, 3)
        tput["gateway_cpu_us_per_req"] = round(cpu / max(tput["requests"], 1) * 1e6, 1)
        tput["req_per_s_per_gateway_core"] = round(tput["requests"] / max(cpu, 1e-9), 1)
        out["throughput"] = tput
    finally:
        _stop(proc)
    return out


def run_shared(gateways: int, args: argparse.Namespace) -> dict[str, Any]:
    """Throughput through `gateways` gateway processes over one shared router actor
    (one Ray cluster), the client's connections split evenly among them."""
    import ray

    # The cluster is this process's (as tests/deploy/test_shared_router.py starts it):
    # both gateways join it by its GCS address.
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    procs: list[tuple[subprocess.Popen[bytes], int]] = []
    try:
        for _ in range(gateways):
            procs.append(
                _start_gateway(
                    args.engines,
                    1000.0,
                    False,
                    ["--address", address, "--shared-router", "wasma-bench"],
                )
            )
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        per = max(1, args.connections // gateways)
        # Warm up every gateway first (its channel to the router, the renderer).
        warm = [
            ctx.Process(target=_load_proc, args=("127.0.0.1", port, per, 2.0, q))
            for _, port in procs
        ]
        for p in warm:
            p.start()
        for _ in warm:
            q.get()
        for p in warm:
            p.join()
        loads = [
            ctx.Process(target=_load_proc, args=("127.0.0.1", port, per, args.duration, q))
            for _, port in procs
        ]
        for p in loads:
            p.start()
        parts = [q.get() for _ in loads]
        for p in loads:
            p.join()
        total = sum(r["requests"] for r in parts)
        wall = max(r["wall_s"] for r in parts)
        return {
            "gateways": gateways,
            "requests": total,
            "errors": sum(r["errors"] for r in parts),
            "req_per_s": round(total / wall, 1),
        }
    finally:
        for proc, _ in procs:
            _stop(proc)
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--connections", type=int, default=64)
    ap.add_argument("--ttft-requests", type=int, default=300)
    ap.add_argument("--mode", choices=["inproc", "ray", "both"], default="both")
    ap.add_argument(
        "--gateways",
        type=int,
        default=0,
        help="also measure throughput through this many gateway processes sharing one "
        "router (--shared-router on one Ray cluster)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    modes = ["inproc", "ray"] if args.mode == "both" else [args.mode]
    # The machine may be shared: the load average says how much the figures are worth.
    results: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()}
    results["runs"] = [run_mode(m, args) for m in modes]
    if args.gateways:
        results["shared"] = [run_shared(n, args) for n in sorted({1, args.gateways})]
    results["loadavg_after"] = os.getloadavg()
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
