"""Turn a run's records into the results schema of DESIGN.md."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from wasma.benchmarks.sim_replay import RunResult
from wasma.core.tokens import BlockHasher
from wasma.scheduler.workflow import Workflow


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    return float(np.percentile(np.asarray(values, dtype=float), q))


def prefix_hit_ceiling(workflows: Sequence[Workflow], block_size: int) -> float:
    """The prefix hit ratio no placement can beat on this trace: one infinite cache shared
    by every engine, so each full block is computed once, by the first request that holds
    it, and every later prompt starting with it hits (vLLM's cap of all prompt tokens but
    one included). A block's chain hash folds in every block before it, so the count does
    not depend on the order requests run in."""
    hasher = BlockHasher(block_size)
    seen: set[int] = set()
    hit = total = 0
    for wf in workflows:
        for node in wf.topo_order():
            tokens = wf.prompt_tokens(node)
            chain = hasher.chain(wf.context_span(node))
            prompt = chain[: tokens // block_size]
            cached = sum(map(seen.__contains__, prompt))
            hit += min(cached, (tokens - 1) // block_size) * block_size
            total += tokens
            seen.update(chain)
    return hit / total if total else 0.0


def summarize(run: RunResult, trace: str, kv_bytes_per_token: int = 0) -> dict[str, Any]:
    if run.cut_short:
        return summarize_cut(run, trace)
    wfs = run.workflows
    reqs = run.requests
    if wfs:
        first = min(w.arrival_s for w in wfs)
        last = max(w.finish_s for w in wfs)
        duration = max(last - first, 1e-9)
    else:
        duration = 0.0
    met = sum(1 for w in wfs if w.met)
    lat = [w.latency_s for w in wfs]
    prompt = sum(r.prompt_tokens for r in reqs)
    cached = sum(r.cached_tokens for r in reqs)
    cpu_hit = sum(r.cpu_hit_tokens for r in reqs)
    return {
        **_identity(run, trace),
        "workflows": len(wfs),
        "requests": len(reqs),
        "duration_s": round(duration, 6),
        "goodput_wf_per_s": met / duration if duration else 0.0,
        "deadline_attainment": met / len(wfs) if wfs else 0.0,
        "p50_workflow_s": percentile(lat, 50),
        "p95_workflow_s": percentile(lat, 95),
        "p99_workflow_s": percentile(lat, 99),
        "p95_request_s": percentile([r.finish_s - r.submit_s for r in reqs], 95),
        "p95_ttft_s": percentile([r.first_token_s - r.submit_s for r in reqs], 95),
        "prefix_hit_ratio": cached / prompt if prompt else 0.0,
        # The same hits by KV tier: already in GPU memory, or loaded from the CPU tier.
        "prefix_hits_by_tier": {
            "gpu": (cached - cpu_hit) / prompt if prompt else 0.0,
            "cpu": cpu_hit / prompt if prompt else 0.0,
        },
        "recomputed_prompt_tokens": int(sum(r.prefill_tokens_computed for r in reqs)),
        "transferred_bytes": int(sum(r.transferred_bytes for r in reqs)),
        "decision_p99_us": percentile(run.decision_us, 99),
        "sim_wall_s": round(run.wall_s, 4),
    }


def _identity(run: RunResult, trace: str) -> dict[str, Any]:
    """What names a run in its row, full or cut short."""
    return {
        "trace": trace,
        "policy": run.policy,
        "rate_scale": run.rate_scale,
        "engines": run.engines,
        "profile": run.profile,
    }


def summarize_cut(run: RunResult, trace: str) -> dict[str, Any]:
    """The row of a run stopped once its deadline attainment could no longer reach its
    threshold (`SimReplay(stop_below=...)`): what identifies the run, the verdict's
    evidence, and none of the metrics, which would describe only the part of the trace
    that had finished."""
    return {
        **_identity(run, trace),
        "workflows": run.units,
        "cut_short": True,
        # simulated time of the cut (the same clock as arrivals)
        "cut_at_s": run.cut_at_s,
        # units certain to miss their deadlines by then, finished or not
        "missed_workflows": run.missed,
        # the attainment the full run could at best have reached: below the threshold
        "deadline_attainment_max": (run.units - run.missed) / run.units,
        "requests_finished": len(run.requests),
        "sim_wall_s": round(run.wall_s, 4),
    }
