"""`wasma bench`: replay traces through the simulator under several policies and loads.

Runs are independent, so they go to a process pool (or to Ray tasks when an address is
given, so a user with a Ray cluster sweeps on it). `--sweep` finds each policy's
capacity: the highest arrival-rate scale whose deadline attainment stays >= 0.9, by
doubling from 1 until attainment falls, then bisecting to within 3%. A probe of the
search stops as soon as so many workflows have missed their deadlines that it fails
whatever follows: its row says `"cut_short": true`, carries no metrics (only its
verdict is used) and is written under `"cut_short_runs"` in results.json, beside
`"runs"`, which keeps only whole runs; `cut_short=False` runs every probe to the end.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from tqdm import tqdm

from wasma.core.profile import Profile, load_profile
from wasma.scheduler.trace import load_trace
from wasma.scheduler.workflow import Workflow

CAPACITY_ATTAINMENT = 0.9
DEFAULT_TOPOLOGY = "hgx-h100"


@dataclass(frozen=True)
class RunSpec:
    trace: str  # path
    policy: str
    rate_scale: float
    engines: int
    profile: str
    params: Mapping[str, Any] = field(default_factory=dict)
    # False: the router gets requests only, as from agents that never register their DAG.
    dags: bool = True
    # The machines' network (a topology preset): engines fill its GPUs 8 to a node.
    topology: str = DEFAULT_TOPOLOGY
    # A CPU KV tier of this many GiB on every engine (vLLM's --kv-offloading-size); 0:
    # none (the profile's own `cpu_kv_blocks`, if it sets one, stays).
    cpu_tier_gib: float = 0.0
    # Stop the run once its deadline attainment can no longer reach this (a capacity
    # probe's threshold); its row is then marked `cut_short` and holds no metrics.
    stop_below: float | None = None


def with_cpu_tier(profile: Profile, gib: float) -> Profile:
    """`profile` with a CPU KV tier of `gib` GiB per engine."""
    if gib <= 0:
        return profile
    block_bytes = profile.block_size * profile.kv_bytes_per_token
    return replace(profile, cpu_kv_blocks=max(1, int(gib * 2**30) // block_bytes))


@lru_cache(maxsize=8)
def _parsed_trace(path: str, mtime_ns: int, size: int) -> tuple[Workflow, ...]:
    return tuple(load_trace(path))


def worker_trace(path: str) -> tuple[Workflow, ...]:
    """The trace at `path`, parsed once per process while the file stays the same.

    A sweep sends each worker process the same few traces dozens of times, and parsing
    one (0.15-0.4 s for 200 workflows or 1,000 requests) is a tenth of a probe's cost. A
    run never changes its workflows (their memos are pure: spans, order, prompt lengths),
    so runs in one process can share them. Keyed by the file's identity, so an edited
    trace is read again."""
    st = os.stat(path)
    return _parsed_trace(os.path.realpath(path), st.st_mtime_ns, st.st_size)


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Run one simulation; top-level so process pools and Ray can ship it."""
    from wasma.benchmarks.metrics import summarize
    from wasma.benchmarks.sim_replay import SimReplay, topology_pricer

    profile = with_cpu_tier(load_profile(spec.profile), spec.cpu_tier_gib)
    workflows = worker_trace(spec.trace)
    run = SimReplay(
        workflows,
        spec.policy,
        spec.engines,
        profile,
        spec.rate_scale,
        params=spec.params,
        register_dags=spec.dags,
        pricer=topology_pricer([f"e{i}" for i in range(spec.engines)], spec.topology),
        stop_below=spec.stop_below,
    ).run()
    row = summarize(run, Path(spec.trace).name, profile.kv_bytes_per_token)
    if not run.cut_short:
        # The simulator knows when a request was evicted mid-run to free KV blocks (and
        # recomputed when readmitted); a live replay cannot see it, so only sim rows say.
        row["preemptions"] = sum(r.preemptions for r in run.requests)
    if spec.params:
        row["params"] = dict(spec.params)
    if not spec.dags:
        row["dags"] = False
    if spec.topology != DEFAULT_TOPOLOGY:
        row["topology"] = spec.topology
    if spec.cpu_tier_gib > 0:
        row["cpu_tier_gib"] = spec.cpu_tier_gib
    return row


class Runner:
    """Submits RunSpecs to local processes or Ray and collects their results."""

    def __init__(self, workers: int | None = None, ray_address: str | None = None) -> None:
        self.workers = workers or max(1, os.cpu_count() or 1)
        self.ray_address = ray_address
        self._pool: ProcessPoolExecutor | None = None
        self._ray_fn: Any = None

    def __enter__(self) -> Runner:
        if self.ray_address:
            import ray

            ray.init(address=self.ray_address, ignore_reinit_error=True, log_to_driver=False)
            self._ray_fn = ray.remote(run_one)
        elif self.workers > 1:
            self._pool = ProcessPoolExecutor(max_workers=self.workers)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)

    def submit(self, spec: RunSpec) -> Any:
        if self._ray_fn is not None:
            return self._ray_fn.remote(spec)
        if self._pool is not None:
            return self._pool.submit(run_one, spec)
        fut: Future[dict[str, Any]] = Future()
        fut.set_result(run_one(spec))
        return fut

    def wait_any(self, handles: list[Any]) -> tuple[list[Any], list[Any]]:
        """(done, pending) among handles."""
        if self._ray_fn is not None:
            import ray

            done, pending = ray.wait(handles, num_returns=1)
            return list(done), list(pending)
        d, p = wait(handles, return_when=FIRST_COMPLETED)
        return list(d), list(p)

    def result(self, handle: Any) -> dict[str, Any]:
        if self._ray_fn is not None:
            import ray

            out: dict[str, Any] = ray.get(handle)
            return out
        res: dict[str, Any] = handle.result()
        return res

    def run_all(
        self, specs: Iterable[RunSpec], progress: Callable[[dict[str, Any]], None]
    ) -> list[dict[str, Any]]:
        """Every spec's row, in the order of `specs` (reports and results files do not
        depend on which parallel run finished first); `progress` sees each as it ends."""
        handles = [self.submit(s) for s in specs]
        position = {h: i for i, h in enumerate(handles)}
        out: list[dict[str, Any] | None] = [None] * len(handles)
        pending = handles
        while pending:
            done, pending = self.wait_any(pending)
            for h in done:
                row = self.result(h)
                out[position[h]] = row
                progress(row)
        return [row for row in out if row is not None]


@dataclass
class CapacitySearch:
    """Doubling then bisection on the rate scale for one (trace, policy)."""

    trace: str
    policy: str
    lo: float = 0.0  # highest scale known to pass
    hi: float | None = None  # lowest scale known to fail
    tol: float = 0.03
    next_scale: float | None = 1.0

    def report(self, scale: float, attainment: float) -> None:
        if attainment >= CAPACITY_ATTAINMENT:
            self.lo = max(self.lo, scale)
        else:
            self.hi = scale if self.hi is None else min(self.hi, scale)
        if self.hi is None:
            self.next_scale = self.lo * 2 if self.lo < 64 else None
        elif self.lo == 0.0:
            self.next_scale = self.hi / 2 if self.hi > 1 / 64 else None
        elif self.hi / self.lo <= 1 + self.tol:
            self.next_scale = None
        else:
            self.next_scale = (self.lo * self.hi) ** 0.5


def attainment_bound(row: dict[str, Any]) -> float:
    """A row's deadline attainment, or for a run cut short the most it could have
    reached (below the threshold it was cut at, so the verdict is the full run's)."""
    if row.get("cut_short"):
        bound: float = row["deadline_attainment_max"]
        return bound
    full: float = row["deadline_attainment"]
    return full


def sweep_capacity(
    runner: Runner,
    pairs: list[tuple[str, str]],
    engines: int,
    profile: str,
    params: Mapping[str, Mapping[str, Any]],
    on_row: Callable[[dict[str, Any]], None],
    dags: bool = True,
    topology: str = DEFAULT_TOPOLOGY,
    cpu_tier_gib: float = 0.0,
    cut_short: bool = True,
) -> tuple[dict[tuple[str, str], float], list[dict[str, Any]]]:
    """Capacity of each (trace, policy): the searches run side by side, each submitting
    its next rate as soon as its last result is in. With `cut_short`, a probe stops once
    it is certain to fail (the capacities found are the same either way)."""
    searches = {pair: CapacitySearch(*pair) for pair in pairs}
    rows: list[dict[str, Any]] = []
    inflight: dict[Any, CapacitySearch] = {}

    def launch(s: CapacitySearch) -> None:
        assert s.next_scale is not None
        pp = dict(params.get(s.policy, {}))
        spec = RunSpec(
            s.trace,
            s.policy,
            s.next_scale,
            engines,
            profile,
            pp,
            dags,
            topology,
            cpu_tier_gib,
            stop_below=CAPACITY_ATTAINMENT if cut_short else None,
        )
        inflight[runner.submit(spec)] = s

    for s in searches.values():
        launch(s)
    while inflight:
        done, _ = runner.wait_any(list(inflight))
        for h in done:
            s = inflight.pop(h)
            row = runner.result(h)
            row["sweep"] = True
            rows.append(row)
            on_row(row)
            s.report(row["rate_scale"], attainment_bound(row))
            if s.next_scale is not None:
                launch(s)
    return {pair: s.lo for pair, s in searches.items()}, rows


def bench(
    traces: list[str],
    policies: list[str],
    engines: int,
    profile: str,
    rates: list[float] | None,
    sweep: bool,
    out_dir: str,
    workers: int | None = None,
    ray_address: str | None = None,
    params: Mapping[str, Mapping[str, Any]] | None = None,
    show_progress: bool = True,
    dags: bool = True,
    topology: str = DEFAULT_TOPOLOGY,
    cpu_tier_gib: float = 0.0,
    cut_short: bool = True,
) -> dict[str, Any]:
    """Run the grid (and sweeps), write results.json and plots; return the results."""
    params = params or {}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    capacity: dict[str, dict[str, float]] = {}
    grid = [
        RunSpec(t, p, r, engines, profile, dict(params.get(p, {})), dags, topology, cpu_tier_gib)
        for t in traces
        for p in policies
        for r in (rates or [])
    ]
    bar = tqdm(
        total=len(grid) + (len(traces) * len(policies) * 8 if sweep else 0),
        desc="wasma bench",
        unit="run",
        disable=not show_progress,
    )

    def tick(row: dict[str, Any]) -> None:
        bar.set_postfix_str(f"{row['trace']} {row['policy']} x{row['rate_scale']:.3g}")
        bar.update(1)

    with Runner(workers, ray_address) as runner:
        runs.extend(runner.run_all(grid, tick))
        if sweep:
            found, rows = sweep_capacity(
                runner,
                [(t, p) for t in traces for p in policies],
                engines,
                profile,
                params,
                tick,
                dags,
                topology,
                cpu_tier_gib,
                cut_short,
            )
            runs.extend(rows)
            for (trace, policy), scale in found.items():
                capacity.setdefault(Path(trace).name, {})[policy] = scale
    bar.close()
    runs.sort(key=lambda r: (r["trace"], r["policy"], r["rate_scale"]))
    # "runs" holds whole runs only, each with every metric of the results format; the
    # probes cut short (evidence for the sweep's verdicts, no metrics) go beside them.
    results: dict[str, Any] = {"runs": [r for r in runs if not r.get("cut_short")]}
    cut = [r for r in runs if r.get("cut_short")]
    if cut:
        results["cut_short_runs"] = cut
    if sweep:
        results["capacity"] = capacity
    (out / "results.json").write_text(json.dumps(results, indent=2))
    from wasma.benchmarks.report import plot_results

    plot_results(results, out)
    return results


def spec_dict(spec: RunSpec) -> dict[str, Any]:
    return asdict(spec)
