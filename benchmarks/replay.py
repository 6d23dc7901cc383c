"""`wasma replay`: drive a live OpenAI-compatible endpoint with a trace.

    wasma replay --trace mapreduce.jsonl --url http://127.0.0.1:8000 --out results/live \\
        [--rate-scale 1.5] [--label wasma] [--vocab-size 2048] [--api-key K]
        [--register-workflows] [--concurrency 256] [--timeout 600] [--no-progress]

Each workflow arrives at its `arrival_s` (divided by `--rate-scale`); a node is sent when
all its parents have finished, and its prompt is the trace's segments with the parents'
*real* outputs inserted (`{"output": n}`, `{"context": n}` use the ids the server
returned). Prompts go as token ids to `/v1/completions`, with `ignore_eos` and
`max_tokens` holding output lengths to the trace's. Every request carries its workflow
identity in each convention a router may read: wasma's headers (deadline included),
`vllm_xargs.agentic_context` (a JSON string) and `x-session-id`, so the same replay
measures wasma and the routers people run today.

Writes `OUT/results.json` in the schema of `wasma bench`; runs already there for other
labels, traces or rates are kept, so several replays fill one table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from wasma.benchmarks.metrics import summarize
from wasma.benchmarks.sim_replay import RequestRecord, RunResult, WorkflowRecord
from wasma.core.tokens import TokenMaterialiser, stream_id
from wasma.engines.openai_engine import sse_events
from wasma.scheduler.trace import load_trace
from wasma.scheduler.workflow import ContextOf, OutputOf, Shared, Unique, Workflow

# The tiny local Llama's vocabulary: the safe default when the server does not say.
DEFAULT_VOCAB = 2048


class ReplayError(RuntimeError):
    pass


@dataclass(slots=True)
class NodeResult:
    prompt: list[int]
    output: list[int]
    engine: str
    kind: str
    submit_s: float
    first_token_s: float
    finish_s: float
    cached_tokens: int
    real_output: bool  # the server returned token ids (else the trace's were assumed)
    # The prompt's length as the server counted it (usage.prompt_tokens; 0 if not
    # said): differs from len(prompt) where the prompt went as text and was re-tokenised.
    server_prompt_tokens: int = 0


@dataclass
class Replayer:
    """One replay of a trace against one endpoint."""

    url: str
    workflows: Sequence[Workflow]
    vocab_size: int
    model: str | None = None
    api_key: str | None = None
    rate_scale: float = 1.0
    concurrency: int = 256
    timeout_s: float = 600.0
    progress: bool = True
    register: bool = False  # POST each DAG to /v1/workflows as it arrives (wasma only)
    results: dict[tuple[str, str], NodeResult] = field(default_factory=dict)
    failures: list[tuple[str, str, str]] = field(default_factory=list)
    wf_finish: dict[str, float] = field(default_factory=dict)
    wf_arrival: dict[str, float] = field(default_factory=dict)
    register_errors: list[str] = field(default_factory=list)
    # The gateway's decision-latency histogram (wasma only) before and after the run.
    decisions: list[dict[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._mat = TokenMaterialiser(self.vocab_size)
        self._t0 = 0.0
        self._sem = asyncio.Semaphore(self.concurrency)
        self._bar: Any = None

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    # -- prompts ---------------------------------------------------------------------
    def prompt_ids(self, wf: Workflow, node_id: str) -> list[int]:
        """The node's prompt: trace segments, parents' real outputs spliced in."""
        out: list[int] = []
        for i, seg in enumerate(wf.nodes[node_id].prompt):
            if isinstance(seg, Shared):
                out += self._stream(stream_id("s", seg.key), seg.tokens)
            elif isinstance(seg, Unique):
                out += self._stream(stream_id("u", wf.workflow_id, node_id, str(i)), seg.tokens)
            elif isinstance(seg, OutputOf):
                out += self.results[(wf.workflow_id, seg.node)].output
            elif isinstance(seg, ContextOf):
                parent = self.results[(wf.workflow_id, seg.node)]
                out += parent.prompt + parent.output
        return out

    def _stream(self, sid: int, n: int) -> list[int]:
        return [int(t) for t in self._mat.stream(sid, n)]

    # -- requests --------------------------------------------------------------------
    def _payload(self, wf: Workflow, node_id: str, prompt: list[int]) -> dict[str, Any]:
        node = wf.nodes[node_id]
        ctx = {
            "program_id": wf.workflow_id,
            "session_id": wf.workflow_id,
            "task_id": node_id,
            "agent_id": node_id,
            "parent_task_ids": list(node.parents),
            "blocks_parent": True,
            "app": wf.app,
            "deadline": wf.deadline_s,
        }
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": node.output_tokens,
            "min_tokens": node.output_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            # vLLM's router needs the context as a JSON *string*.
            "vllm_xargs": {"agentic_context": json.dumps(ctx, separators=(",", ":"))},
        }
        if self.model:
            body["model"] = self.model
        return body

    def _headers(self, wf: Workflow, node_id: str) -> dict[str, str]:
        h = {
            "x-wasma-workflow-id": wf.workflow_id,
            "x-wasma-node-id": node_id,
            "x-wasma-app": wf.app,
            "x-wasma-deadline-ms": str(int(wf.deadline_s * 1000)),
            "x-session-id": wf.workflow_id,
            "x-request-id": f"{wf.workflow_id}.{node_id}",
        }
        if wf.nodes[node_id].parents:
            h["x-wasma-parents"] = ",".join(wf.nodes[node_id].parents)
        if self.api_key:
            h["authorization"] = f"Bearer {self.api_key}"
        return h

    async def _send(self, http: httpx.AsyncClient, wf: Workflow, node_id: str) -> None:
        prompt = self.prompt_ids(wf, node_id)
        async with self._sem:
            submit = self._now()
            first = math.nan
            ids: list[int] = []
            n_out = 0
            cached = 0
            n_prompt = 0
            async with http.stream(
                "POST",
                "/v1/completions",
                json=self._payload(wf, node_id, prompt),
                headers=self._headers(wf, node_id),
            ) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")[:500]
                    raise ReplayError(f"HTTP {resp.status_code}: {text}")
                engine = resp.headers.get("x-wasma-engine", "unknown")
                kind = resp.headers.get("x-wasma-placement", "unknown")
                async for event in sse_events(resp):
                    if "error" in event:
                        raise ReplayError(f"stream error: {event['error']}")
                    usage = event.get("usage")
                    if usage:
                        n_out = int(usage.get("completion_tokens") or n_out)
                        n_prompt = int(usage.get("prompt_tokens") or n_prompt)
                        details = usage.get("prompt_tokens_details") or {}
                        cached = int(details.get("cached_tokens") or 0)
                    for choice in event.get("choices") or ():
                        toks = choice.get("token_ids")
                        if toks:
                            if math.isnan(first):
                                first = self._now()
                            ids.extend(int(t) for t in toks)
                        elif choice.get("text") and math.isnan(first):
                            first = self._now()
            finish = self._now()
        want = wf.nodes[node_id].output_tokens
        real = len(ids) > 0
        if not real:
            # A server that does not return ids: assume the trace's output stream.
            ids = [int(t) for t in self._mat.stream(wf.output_piece(node_id).stream, want)]
        self.results[(wf.workflow_id, node_id)] = NodeResult(
            prompt=prompt,
            output=ids,
            engine=engine,
            kind=kind,
            submit_s=submit,
            first_token_s=finish if math.isnan(first) else first,
            finish_s=finish,
            cached_tokens=min(cached, len(prompt)),
            real_output=real,
            server_prompt_tokens=n_prompt,
        )
        if self._bar is not None:
            self._bar.update(1)

    async def _register(self, http: httpx.AsyncClient, wf: Workflow) -> None:
        dag = wf.to_dict()
        dag.pop("arrival_s", None)
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        resp = await http.post("/v1/workflows", json=dag, headers=headers)
        if resp.status_code >= 400 and not self.register_errors:
            # Routers other than wasma have no such endpoint: say so once, replay anyway.
            self.register_errors.append(f"{wf.workflow_id}: HTTP {resp.status_code}")

    async def _run_workflow(self, http: httpx.AsyncClient, wf: Workflow) -> None:
        delay = wf.arrival_s / self.rate_scale - self._now()
        if delay > 0:
            await asyncio.sleep(delay)
        self.wf_arrival[wf.workflow_id] = self._now()
        if self.register:
            await self._register(http, wf)
        done: dict[str, asyncio.Event] = {n: asyncio.Event() for n in wf.nodes}
        failed: list[str] = []

        async def node(nid: str) -> None:
            try:
                for p in wf.nodes[nid].parents:
                    await done[p].wait()
                if any(p in failed for p in wf.nodes[nid].parents):
                    failed.append(nid)  # no parent output: nothing to send
                    return
                at = wf.nodes[nid].arrival_s
                if at is not None:
                    # Its own arrival (a conversation's next turn): not before it.
                    wait = at / self.rate_scale - self._now()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    self.wf_arrival[f"{wf.workflow_id}/{nid}"] = max(
                        self._now(), at / self.rate_scale
                    )
                await self._send(http, wf, nid)
            except (ReplayError, httpx.HTTPError, ValueError) as exc:
                failed.append(nid)
                self.failures.append((wf.workflow_id, nid, f"{type(exc).__name__}: {exc}"))
            finally:
                done[nid].set()

        await asyncio.gather(*(node(n) for n in wf.topo_order()))
        if not failed:
            self.wf_finish[wf.workflow_id] = max(
                self.results[(wf.workflow_id, n)].finish_s for n in wf.nodes
            )

    async def run(self) -> float:
        """Replay every workflow; returns the wall time."""
        limits = httpx.Limits(
            max_connections=self.concurrency, max_keepalive_connections=self.concurrency
        )
        timeout = httpx.Timeout(self.timeout_s, connect=30.0)
        total = sum(len(w) for w in self.workflows)
        if self.progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", desc="replay", dynamic_ncols=True)
        try:
            async with httpx.AsyncClient(base_url=self.url, limits=limits, timeout=timeout) as http:
                self.decisions = [await _decision_buckets(http)]
                self._t0 = time.perf_counter()
                await asyncio.gather(*(self._run_workflow(http, wf) for wf in self.workflows))
                wall = self._now()
                self.decisions.append(await _decision_buckets(http))
                return wall
        finally:
            if self._bar is not None:
                self._bar.close()

    # -- results ---------------------------------------------------------------------
    def run_result(self, label: str, wall_s: float) -> RunResult:
        engines: dict[str, int] = {}
        reqs: list[RequestRecord] = []
        for (wid, nid), r in self.results.items():
            slot = engines.setdefault(r.engine, len(engines))
            reqs.append(
                RequestRecord(
                    workflow_id=wid,
                    node_id=nid,
                    engine=slot,
                    kind=r.kind,
                    submit_s=r.submit_s,
                    first_token_s=r.first_token_s,
                    finish_s=r.finish_s,
                    prompt_tokens=len(r.prompt),
                    output_tokens=len(r.output),
                    cached_tokens=r.cached_tokens,
                    prefill_tokens_computed=len(r.prompt) - r.cached_tokens,
                    preemptions=0,
                    transferred_bytes=0,
                )
            )
        wfs: list[WorkflowRecord] = []
        for w in self.workflows:
            own = {n: v for n, v in w.nodes.items() if v.deadline_s is not None}
            # A node with its own arrival and deadline is a unit of its own, as in the
            # simulator (SimReplay); its clock starts at its arrival.
            for nid, v in own.items():
                done = self.results.get((w.workflow_id, nid))
                key = f"{w.workflow_id}/{nid}"
                if done is not None and key in self.wf_arrival:
                    assert v.arrival_s is not None and v.deadline_s is not None
                    arrival = v.arrival_s / self.rate_scale
                    wfs.append(WorkflowRecord(key, w.app, arrival, v.deadline_s, done.finish_s))
            if len(own) < len(w.nodes) and w.workflow_id in self.wf_finish:
                wfs.append(
                    WorkflowRecord(
                        w.workflow_id,
                        w.app,
                        self.wf_arrival[w.workflow_id],
                        w.deadline_s,
                        self.wf_finish[w.workflow_id],
                    )
                )
        return RunResult(
            decision_us=_decision_us(self.decisions),
            policy=label,
            engines=len([e for e in engines if e not in ("unknown", "none")]) or len(engines),
            profile="live",
            rate_scale=self.rate_scale,
            requests=reqs,
            workflows=wfs,
            wall_s=wall_s,
            engine_steps=0,
        )


async def _decision_buckets(http: httpx.AsyncClient) -> dict[float, float]:
    """Cumulative counts of wasma_decision_latency_seconds by bucket bound (s); empty
    for servers without it (other routers)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = (await http.get("/metrics", timeout=10.0)).text
        out: dict[float, float] = {}
        for fam in text_string_to_metric_families(text):
            for sample in fam.samples:
                if sample.name == "wasma_decision_latency_seconds_bucket":
                    le = float(sample.labels["le"])
                    out[le] = out.get(le, 0.0) + sample.value
        return out
    except (httpx.HTTPError, ValueError, KeyError):
        return {}


def _decision_us(snapshots: list[dict[float, float]]) -> list[float]:
    """The run's decisions as bucket upper bounds (µs), enough for `summarize`'s p99."""
    if len(snapshots) != 2 or not snapshots[1]:
        return []
    before, after = snapshots
    out: list[float] = []
    prev = 0.0
    for le in sorted(after):
        cum = after[le] - before.get(le, 0.0)
        n = round(cum - prev)
        if n > 0 and math.isfinite(le):
            out += [le * 1e6] * n
        prev = cum
    return out


def _vocab_from_server(url: str, api_key: str | None) -> int | None:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=10)
        # wasma says it in a header (its body is vLLM's exactly); some servers put it
        # in the model card.
        vocab = resp.headers.get("x-wasma-vocab-size") or resp.json()["data"][0].get("vocab_size")
        return int(vocab) if vocab else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def summarize_replay(
    rep: Replayer, label: str, wall_s: float, trace_name: str, url: str
) -> dict[str, Any]:
    row = summarize(rep.run_result(label, wall_s), trace_name)
    n_wf = len(rep.workflows)
    met = sum(
        1
        for w in rep.workflows
        if w.workflow_id in rep.wf_finish
        and rep.wf_finish[w.workflow_id] - rep.wf_arrival[w.workflow_id] <= w.deadline_s
    )
    # Failed workflows count against attainment (summarize only sees finished ones).
    row["workflows"] = n_wf
    row["deadline_attainment"] = met / n_wf if n_wf else 0.0
    row["failed_requests"] = len(rep.failures)
    row["failed_workflows"] = n_wf - len(rep.wf_finish)
    row["real_outputs_ratio"] = (
        sum(r.real_output for r in rep.results.values()) / len(rep.results) if rep.results else 0.0
    )
    row["url"] = url
    row["wall_s"] = round(wall_s, 3)
    row.pop("sim_wall_s", None)
    return row


def write_results(out_dir: str | Path, row: dict[str, Any]) -> Path:
    """Add `row` to OUT/results.json, replacing a run with the same trace/label/rate."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    runs: list[dict[str, Any]] = []
    if path.is_file():
        try:
            runs = list(json.loads(path.read_text()).get("runs", []))
        except (ValueError, AttributeError):
            runs = []
    key = (row["trace"], row["policy"], row["rate_scale"])
    runs = [r for r in runs if (r.get("trace"), r.get("policy"), r.get("rate_scale")) != key]
    runs.append(row)
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    return path


def replay_main(args: argparse.Namespace) -> int:
    workflows = load_trace(args.trace)
    url = args.url.rstrip("/")
    vocab = args.vocab_size or _vocab_from_server(url, args.api_key) or DEFAULT_VOCAB
    rep = Replayer(
        url=url,
        workflows=workflows,
        vocab_size=vocab,
        model=args.model,
        api_key=args.api_key,
        rate_scale=args.rate_scale,
        concurrency=getattr(args, "concurrency", 256),
        timeout_s=getattr(args, "timeout", 600.0),
        progress=not getattr(args, "no_progress", False),
        register=getattr(args, "register_workflows", False),
    )
    wall = asyncio.run(rep.run())
    row = summarize_replay(rep, args.label, wall, Path(args.trace).name, url)
    path = write_results(args.out, row)
    print(
        f"{row['policy']}: {row['workflows']} workflows, {row['requests']} requests in "
        f"{wall:.1f} s; goodput {row['goodput_wf_per_s']:.3f} wf/s, attainment "
        f"{row['deadline_attainment']:.2f}, p95 workflow {row['p95_workflow_s']:.2f} s, "
        f"prefix hits {row['prefix_hit_ratio']:.2f}, failed {row['failed_requests']}"
    )
    if rep.register_errors:
        print(f"  could not register workflows ({rep.register_errors[0]}); replayed without")
    for wid, nid, err in rep.failures[:5]:
        print(f"  failed {wid}/{nid}: {err}")
    print(f"results: {path}")
    return 0 if not rep.failures else 1
