"""Soak: minutes of `wasma replay` against a gateway over `sim` engines, with engine
faults injected, reporting memory growth (RSS) and p99 drift. A benchmark, not a test.

    python -m wasma.benchmarks.studies.soak --minutes 10 --engines 3 --out out/soak.json

Everything runs in this process (gateway, router, simulated engines, replay client), so
the RSS it reports bounds the server's own. Each window replays a fresh batch of
workflows (new ids: the registry, the prefix index and the metrics must all stay
bounded while ids never repeat); with `--fault-every K`, every K-th window kills one
engine half-way through and revives it at the end. A window reports its request p99,
the process RSS and the router's table sizes; the summary compares the last windows
with the first ones.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from wasma.benchmarks.apps import generate
from wasma.benchmarks.replay import Replayer
from wasma.core.profile import load_profile
from wasma.deploy.build import EngineSpec, ServiceConfig
from wasma.deploy.frontend import Frontend
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.router_client import LocalRouterClient, RouterClient
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.serve import ServerThread, frontend_options
from wasma.engines.sim_engine import SimEngine


class SoakServer:
    """A gateway over sim engines whose router and engines the soak can reach."""

    def __init__(self, engines: int, speed: float, profile_name: str) -> None:
        self.profile = load_profile(profile_name)
        # vLLM's front end over the local tiny model, as `wasma serve --engines sim:N`.
        options = frontend_options(
            ServiceConfig(engines=EngineSpec.parse(f"sim:{engines}")), argparse.Namespace()
        )
        frontend = asyncio.run(Frontend.build(options))
        self.engines = [
            SimEngine(f"sim{i}", self.profile, speed=speed, vocab_size=frontend.vocab_size)
            for i in range(engines)
        ]
        self.loop: asyncio.AbstractEventLoop | None = None
        self.service: RouterService | None = None

        async def factory() -> RouterClient:
            self.loop = asyncio.get_running_loop()
            # Short health timeouts: a killed engine leaves rotation within ~0.5 s.
            self.service = RouterService(
                self.engines,
                self.profile,
                RouterConfig(
                    policy="wasma",
                    stats_interval_s=0.25,
                    health_timeout_s=1.0,
                    request_timeout_s=30.0,
                    idle_workflow_s=10.0,
                ),
            )
            await self.service.start()
            return LocalRouterClient(self.service)

        app = create_app(factory, frontend, GatewayConfig(model_names=("wasma-sim",)))
        self.server = ServerThread(app)

    def call(self, fn: Callable[[], None]) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn)

    def sizes(self) -> dict[str, int]:
        svc = self.service
        assert svc is not None
        return {
            "prefix_index_blocks": len(svc.ctx.index),
            "workflows_active": len(svc.ctx.workflows.active),
            "workflows_finished_kept": len(svc.ctx.workflows.finished),
            "live_workflows": svc.dispatch.open_workflows,
            "requests_in_flight": svc.in_flight,
        }


def _window(srv: SoakServer, idx: int, args: argparse.Namespace, fault: bool) -> dict[str, Any]:
    wfs = generate(args.app, args.workflows, args.rate, seed=idx, profile=srv.profile)
    rep = Replayer(
        url=srv.server.url,
        workflows=wfs,
        vocab_size=srv.profile.vocab_size,
        progress=False,
        timeout_s=120.0,
    )
    timers: list[threading.Timer] = []
    # Each fault takes the next engine in turn.
    victim = srv.engines[(idx // max(args.fault_every, 1)) % len(srv.engines)]
    if fault:
        span = wfs[-1].arrival_s / args.rate_scale if wfs else 1.0
        timers.append(threading.Timer(span / 2, lambda: srv.call(victim.kill)))
        timers[-1].start()
    t0 = time.perf_counter()
    asyncio.run(rep.run())
    wall = time.perf_counter() - t0
    for t in timers:
        t.cancel()
    if fault:
        srv.call(victim.revive)
    lat = [r.finish_s - r.submit_s for r in rep.results.values()]
    gc.collect()
    rss = psutil.Process().memory_info().rss
    svc = srv.service
    assert svc is not None
    return {
        "window": idx,
        "wall_s": round(wall, 2),
        "workflows": len(wfs),
        "requests": len(rep.results),
        "lost_workflows": len(wfs) - len(rep.wf_finish),
        "failed_requests": len(rep.failures),
        "p50_request_s": round(float(np.percentile(lat, 50)), 4) if lat else None,
        "p99_request_s": round(float(np.percentile(lat, 99)), 4) if lat else None,
        "rss_mib": round(rss / 2**20, 1),
        "fault": f"killed {victim.name}" if fault else None,
        "failovers_total": svc.failovers,
        "failures": [f"{w}/{n}: {why[:200]}" for w, n, why in rep.failures[:3]],
        **srv.sizes(),
    }


def soak(args: argparse.Namespace) -> dict[str, Any]:
    srv = SoakServer(args.engines, args.speed, args.profile)
    rows: list[dict[str, Any]] = []
    with srv.server:
        end = time.monotonic() + args.minutes * 60
        idx = 0
        while time.monotonic() < end:
            fault = args.fault_every > 0 and idx % args.fault_every == args.fault_every - 1
            row = _window(srv, idx, args, fault)
            rows.append(row)
            print(json.dumps(row), flush=True)
            idx += 1
    k = max(1, len(rows) // 4)
    head, tail = rows[:k], rows[-k:]

    def mean(rs: list[dict[str, Any]], key: str) -> float:
        vals = [r[key] for r in rs if r[key] is not None]
        return float(np.mean(vals)) if vals else float("nan")

    # The first window warms caches and imports: growth is measured from its end.
    summary = {
        "minutes": args.minutes,
        "windows": len(rows),
        "workflows": sum(r["workflows"] for r in rows),
        "requests": sum(r["requests"] for r in rows),
        "lost_workflows": sum(r["lost_workflows"] for r in rows),
        "failed_requests": sum(r["failed_requests"] for r in rows),
        "faults_injected": sum(1 for r in rows if r["fault"]),
        "failovers": rows[-1]["failovers_total"] if rows else 0,
        "rss_first_mib": rows[0]["rss_mib"] if rows else None,
        "rss_last_mib": rows[-1]["rss_mib"] if rows else None,
        "rss_max_mib": max((r["rss_mib"] for r in rows), default=None),
        "p99_first_quarter_s": round(mean(head, "p99_request_s"), 4),
        "p99_last_quarter_s": round(mean(tail, "p99_request_s"), 4),
        "p99_drift_ratio": round(mean(tail, "p99_request_s") / mean(head, "p99_request_s"), 3)
        if rows
        else None,
        "final_sizes": {k2: rows[-1][k2] for k2 in srv.sizes()} if rows else {},
    }
    return {"summary": summary, "windows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--speed", type=float, default=20.0, help="sim engines' speed-up")
    ap.add_argument("--profile", default="llama3-8b-h100")
    ap.add_argument("--app", default="mapreduce")
    ap.add_argument("--workflows", type=int, default=20, help="workflows per window")
    ap.add_argument("--rate", type=float, default=4.0, help="workflow arrivals per second")
    ap.add_argument("--rate-scale", type=float, default=1.0)
    ap.add_argument("--fault-every", type=int, default=3, help="kill an engine every K windows")
    ap.add_argument("--out", default=None, help="write the JSON report here")
    args = ap.parse_args(argv)
    report = soak(args)
    print(json.dumps(report["summary"], indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
    return 0 if report["summary"]["lost_workflows"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
