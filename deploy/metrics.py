"""Prometheus metrics of the wasma gateway and router.

One `WasmaMetrics` object is built in the gateway's lifespan (or the simulator's setup) and
passed to whoever observes: there is no module-level registry and no global state, so tests
and several gateways in one process never share counters.

Process model. The gateway runs as one async process (uvicorn, one worker), so by default the
metrics live in this object's own `CollectorRegistry`. If the gateway is ever run with several
worker processes, set `PROMETHEUS_MULTIPROC_DIR` to an empty, writable directory in the
environment *before* the process starts (prometheus_client picks its value store at import
time); `render()` then aggregates every process's values with the multiprocess collector.
In that mode gauges use the aggregation named in their spec (per-engine state: the most recent
write wins; queue depth: summed over live processes), removed label sets linger until the
directory is cleared, and the sliding-window attainment gauge is the most recent process's
view; the counter-based recording rules (`deploy/prometheus/rules.yaml`) stay exact.

Label values must be bounded so a client cannot blow up the time-series count: engines and
policies come from configuration, placement kinds from a closed set, HTTP codes from
100..599, and application names (sent by clients in `x-wasma-app`) are capped at `max_apps`
distinct values, later ones reported as `other`.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from wasma.engines.vllm_metrics import VllmMetrics

MetricKind = Literal["counter", "gauge", "histogram"]

# The gateway's routes, the values of `wasma_http_requests_total`'s `handler` label
# (bounded: any other path is "other"). Probes and scrapes are handlers of their own, so
# traffic panels and the error-ratio alert leave them out.
HANDLERS: frozenset[str] = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/workflows",
        "/v1/workflows/{workflow_id}",
        "/live",
        "/ready",
        "/health",
        "/metrics",
        "/docs",
        "/openapi.json",
        "other",
    }
)
PROBE_HANDLERS: frozenset[str] = frozenset({"/live", "/ready", "/health", "/metrics"})


def handler_of(path: str) -> str:
    """The `handler` label of a request path."""
    if path in HANDLERS:
        return path
    if path.startswith("/v1/workflows/") and "/" not in path[len("/v1/workflows/") :]:
        return "/v1/workflows/{workflow_id}"
    return "other"


def _version() -> str:
    try:
        return importlib.metadata.version("wasma")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


GaugeMode = Literal["mostrecent", "livesum", "max"]


@dataclass(frozen=True)
class MetricSpec:
    """One exported metric: its full exposition name, type, help text and labels."""

    name: str
    kind: MetricKind
    documentation: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    # How gauges aggregate across processes in multiprocess mode (ignored otherwise).
    gauge_mode: GaugeMode = "mostrecent"

    def series_names(self) -> tuple[str, ...]:
        """Names of the time series this metric produces in the exposition."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count", self.name)
        return (self.name,)


class WasmaMetrics:
    """Owns the `wasma_*` metrics and the methods the gateway and router call to feed them."""

    # Workflows of LLM agents last from a fraction of a second (one short call) to minutes
    # (debates, map-reduce over long documents); log-spaced 0.1 s .. 600 s.
    WORKFLOW_BUCKETS_S: tuple[float, ...] = (
        0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
        90.0, 120.0, 180.0, 300.0, 450.0, 600.0,
    )  # fmt: skip
    # A request's TTFT can be a few ms (cached prefix, idle engine); its end-to-end time can
    # reach minutes for long generations behind a queue: 5 ms .. 300 s.
    REQUEST_BUCKETS_S: tuple[float, ...] = (
        0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
        1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0,
    )  # fmt: skip
    # A placement decision must stay far below a TTFT: 1 µs .. 100 ms.
    DECISION_BUCKETS_S: tuple[float, ...] = (
        1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4,
        1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
    )  # fmt: skip
    # Moving a prefix's KV between engines: sub-ms over NVLink to seconds over slow NICs.
    TRANSFER_BUCKETS_S: tuple[float, ...] = (
        1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    )  # fmt: skip

    # Between two tokens of one stream: a decode step, 1 ms .. 2 s.
    ITL_BUCKETS_S: tuple[float, ...] = (
        0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
        0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0,
    )  # fmt: skip

    PLACEMENT_KINDS: frozenset[str] = frozenset({"reuse", "transfer", "recompute"})
    OTHER_APP = "other"

    SPECS: tuple[MetricSpec, ...] = (
        MetricSpec("wasma_workflows_completed_total", "counter",
                   "Workflows finished (deadline met or not, failed ones included).", ("app",)),
        MetricSpec("wasma_workflows_deadline_met_total", "counter",
                   "Workflows finished within their deadline; its rate is the goodput.",
                   ("app",)),
        MetricSpec("wasma_workflow_deadline_attainment_ratio", "gauge",
                   "Share of workflows finished within their deadline over a sliding window.",
                   ("app",)),
        MetricSpec("wasma_workflow_latency_seconds", "histogram",
                   "Workflow latency: first request's arrival to the last node's last token.",
                   ("app",), WORKFLOW_BUCKETS_S),
        MetricSpec("wasma_request_ttft_seconds", "histogram",
                   "Time to first token of a request, as seen by the gateway.",
                   ("engine",), REQUEST_BUCKETS_S),
        MetricSpec("wasma_request_e2e_seconds", "histogram",
                   "End-to-end latency of a request, as seen by the gateway.",
                   ("engine",), REQUEST_BUCKETS_S),
        MetricSpec("wasma_prompt_tokens_total", "counter",
                   "Prompt tokens sent to an engine.", ("engine",)),
        MetricSpec("wasma_prefix_hit_tokens_total", "counter",
                   "Prompt tokens served from KV already on the engine (or moved there).",
                   ("engine",)),
        MetricSpec("wasma_engine_outstanding_requests", "gauge",
                   "Requests the router has sent to an engine that have not finished.",
                   ("engine",)),
        MetricSpec("wasma_engine_up", "gauge",
                   "1 while the engine is in the router's rotation, 0 while it is out "
                   "(failed health check or request failures).", ("engine",)),
        MetricSpec("wasma_engine_running_requests", "gauge",
                   "Requests in the engine's running batch (engine-reported).", ("engine",)),
        MetricSpec("wasma_engine_waiting_requests", "gauge",
                   "Requests queued inside the engine (engine-reported).", ("engine",)),
        MetricSpec("wasma_engine_kv_usage_ratio", "gauge",
                   "Fraction of the engine's KV cache blocks in use, 0..1.", ("engine",)),
        MetricSpec("wasma_transfer_bytes_total", "counter",
                   "Bytes of prefix KV moved between engines."),
        MetricSpec("wasma_transfer_seconds", "histogram",
                   "Duration of one KV transfer.", (), TRANSFER_BUCKETS_S),
        MetricSpec("wasma_placement_decisions_total", "counter",
                   "Placement decisions by policy and kind (reuse, transfer, recompute).",
                   ("policy", "kind")),
        MetricSpec("wasma_decision_latency_seconds", "histogram",
                   "Time the policy took to place one request.", ("policy",),
                   DECISION_BUCKETS_S),
        MetricSpec("wasma_http_requests_total", "counter",
                   "HTTP responses of the gateway by route (handler) and status code; "
                   "probes and scrapes are their own handlers (/live, /ready, /health, "
                   "/metrics), unknown paths 'other'.", ("handler", "code")),
        MetricSpec("wasma_output_tokens_total", "counter",
                   "Output tokens engines generated for the gateway's requests.", ("engine",)),
        MetricSpec("wasma_request_inter_token_seconds", "histogram",
                   "Time between two consecutive output tokens of a request, one sample a "
                   "token after the first (as vLLM's inter_token_latency_seconds; a chunk "
                   "of several tokens shares its gap; a passed-through stream: one a read).",
                   ("engine",),
                   ITL_BUCKETS_S),
        MetricSpec("wasma_engine_preemptions_total", "counter",
                   "Requests the engine preempted (engine-reported; vLLM's num_preemptions).",
                   ("engine",)),
        MetricSpec("wasma_router_hold_seconds", "histogram",
                   "Time a request waited at the router before it was placed (only "
                   "requests the policy held).", (), REQUEST_BUCKETS_S),
        MetricSpec("wasma_failovers_total", "counter",
                   "Requests moved to another engine after theirs failed."),
        MetricSpec("wasma_engine_faults_total", "counter",
                   "Requests that failed by the engine's fault (error, stall, early end).",
                   ("engine",)),
        MetricSpec("wasma_requests_failed_total", "counter",
                   "Requests that ended in an error after they were placed."),
        MetricSpec("wasma_requests_cancelled_total", "counter",
                   "Requests whose client left before they finished."),
        MetricSpec("wasma_build_info", "gauge",
                   "Always 1; the labels say which wasma and Python this process runs.",
                   ("version", "python")),
        MetricSpec("wasma_engine_info", "gauge",
                   "Always 1; maps each engine label to the URL (and pod) it stands for.",
                   ("engine", "url", "pod")),
        MetricSpec("wasma_router_queue_depth", "gauge",
                   "Requests waiting in the router for a placement or a parent.",
                   gauge_mode="livesum"),
        MetricSpec("wasma_estimate_slowdown_ratio", "gauge",
                   "Recent requests' time taken over the time their placement estimated "
                   "(moving mean; above 1 the load rises faster than placements priced; "
                   "admission_bias scales deadline admission by it)."),
        MetricSpec("wasma_admission_rejected_total", "counter",
                   "Requests rejected by admission control (overload, deadline unreachable)."),
        MetricSpec("wasma_retention_leases_total", "counter",
                   "KV retention leases asked of an engine (context later requests extend).",
                   ("engine",)),
        MetricSpec("wasma_retention_released_total", "counter",
                   "KV retentions ended early: every request extending the context started.",
                   ("engine",)),
    )  # fmt: skip

    def __init__(
        self,
        *,
        attainment_window_s: float = 300.0,
        max_apps: int = 64,
        max_window_samples: int = 100_000,
        clock: Callable[[], float] = time.monotonic,
        multiprocess_dir: str | None = None,
    ) -> None:
        """Build the metrics in a registry owned by this object.

        `clock` is injectable so tests move the attainment window without sleeping;
        `multiprocess_dir` defaults to `PROMETHEUS_MULTIPROC_DIR` (see the module docstring).
        """
        if attainment_window_s <= 0:
            raise ValueError("attainment_window_s must be positive")
        self.registry = CollectorRegistry(auto_describe=True)
        self._window_s = attainment_window_s
        self._max_apps = max_apps
        self._max_window_samples = max_window_samples
        self._clock = clock
        self._multiprocess_dir = (
            multiprocess_dir
            if multiprocess_dir is not None
            else os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        )
        # Per app: (finish time on `clock`, met) of workflows inside the window.
        self._window: dict[str, deque[tuple[float, bool]]] = {}
        self._apps: set[str] = set()
        self._counters: dict[str, Counter] = {}
        self._gauges: dict[str, Gauge] = {}
        self._histograms: dict[str, Histogram] = {}
        for spec in self.SPECS:
            self._build(spec)
        # The inter-token histogram's child per engine: it is observed once a streamed
        # token, and `labels()` (a lock, a tuple, two lookups) cost as much as the
        # observation. Histogram children are never removed, so a kept one stays live.
        self._inter_token: dict[str, Histogram] = {}
        self._gauges["wasma_build_info"].labels(_version(), platform.python_version()).set(1)
        self._app_label("default")  # the app of workflows that name none

    def _build(self, spec: MetricSpec) -> None:
        if spec.kind == "counter":
            self._counters[spec.name] = Counter(
                spec.name, spec.documentation, spec.labels, registry=self.registry
            )
        elif spec.kind == "gauge":
            self._gauges[spec.name] = Gauge(
                spec.name,
                spec.documentation,
                spec.labels,
                registry=self.registry,
                multiprocess_mode=spec.gauge_mode,
            )
        else:
            self._histograms[spec.name] = Histogram(
                spec.name,
                spec.documentation,
                spec.labels,
                registry=self.registry,
                buckets=spec.buckets,
            )

    # ---- names, for the dashboard and recording-rule tests -----------------------------

    @classmethod
    def metric_names(cls) -> list[str]:
        """Exposition names of every metric (counters with their `_total`)."""
        return [spec.name for spec in cls.SPECS]

    @classmethod
    def series_names(cls) -> set[str]:
        """Every time-series name a query may use (histograms' `_bucket/_sum/_count` too)."""
        return {name for spec in cls.SPECS for name in spec.series_names()}

    # ---- label hygiene -----------------------------------------------------------------

    def _app_label(self, app: str | None) -> str:
        app = app or "default"
        if app in self._apps:
            return app
        if len(self._apps - {"default", self.OTHER_APP}) >= self._max_apps:
            app = self.OTHER_APP
            if app in self._apps:
                return app
        self._apps.add(app)
        # Each app's counters exist from 0 before its first workflow ends: rate() and
        # increase() need a sample before the first increment to count it.
        for name in ("wasma_workflows_completed_total", "wasma_workflows_deadline_met_total"):
            self._counters[name].labels(app)
        self._histograms["wasma_workflow_latency_seconds"].labels(app)
        return app

    @staticmethod
    def _code_label(code: int) -> str:
        return str(code) if 100 <= code <= 599 else "other"

    @staticmethod
    def _non_negative(value: float, what: str) -> float:
        if value < 0 or math.isnan(value):
            raise ValueError(f"{what} must be a non-negative number, got {value!r}")
        return value

    # ---- what the gateway and router call ----------------------------------------------

    def register_engine(self, engine: str, url: str = "") -> None:
        """An engine of the router: its info series, and its counters at 0. `url` is
        where it answers (empty for in-process engines); `pod` is the URL's first DNS
        label, a StatefulSet pod's name behind a headless Service."""
        host = urlsplit(url).hostname or ""
        pod = "" if not host or host.replace(".", "").isdigit() else host.split(".")[0]
        self._gauges["wasma_engine_info"].labels(engine, url, pod).set(1)
        for name in (
            "wasma_prompt_tokens_total",
            "wasma_prefix_hit_tokens_total",
            "wasma_output_tokens_total",
            "wasma_engine_preemptions_total",
            "wasma_engine_faults_total",
            "wasma_retention_leases_total",
            "wasma_retention_released_total",
        ):
            self._counters[name].labels(engine)

    def observe_workflow_started(self, app: str | None) -> None:
        """A workflow began: its app's goodput counters exist (at 0) from now on."""
        self._app_label(app)

    def observe_request(
        self,
        engine: str,
        ttft_s: float | None,
        e2e_s: float,
        prompt_tokens: int,
        cached_tokens: int,
        output_tokens: int = 0,
    ) -> None:
        """A request finished on `engine`. `ttft_s` is None when no token was produced, or
        when the gateway cannot know when the first one was (a passed-through whole answer)."""
        if cached_tokens > prompt_tokens:
            raise ValueError("cached_tokens cannot exceed prompt_tokens")
        if ttft_s is not None:
            self._histograms["wasma_request_ttft_seconds"].labels(engine).observe(
                self._non_negative(ttft_s, "ttft_s")
            )
        self._histograms["wasma_request_e2e_seconds"].labels(engine).observe(
            self._non_negative(e2e_s, "e2e_s")
        )
        self._counters["wasma_prompt_tokens_total"].labels(engine).inc(
            self._non_negative(prompt_tokens, "prompt_tokens")
        )
        self._counters["wasma_prefix_hit_tokens_total"].labels(engine).inc(
            self._non_negative(cached_tokens, "cached_tokens")
        )
        if output_tokens:
            self._counters["wasma_output_tokens_total"].labels(engine).inc(
                self._non_negative(output_tokens, "output_tokens")
            )

    def observe_inter_token(self, engine: str, seconds: float, tokens: int = 1) -> None:
        """`engine` produced a request's next `tokens` output tokens `seconds` after its
        previous output: `tokens` samples of an equal share of the gap."""
        hist = self._inter_token.get(engine)
        if hist is None:
            hist = self._histograms["wasma_request_inter_token_seconds"].labels(engine)
            self._inter_token[engine] = hist
        each = max(seconds, 0.0) / tokens
        for _ in range(tokens):
            hist.observe(each)

    def observe_preemptions(self, engine: str, count: int) -> None:
        if count > 0:
            self._counters["wasma_engine_preemptions_total"].labels(engine).inc(count)

    def observe_hold(self, seconds: float) -> None:
        """A request the policy held at the router was placed after `seconds`."""
        self._histograms["wasma_router_hold_seconds"].observe(max(seconds, 0.0))

    def observe_failover(self) -> None:
        self._counters["wasma_failovers_total"].inc()

    def observe_engine_fault(self, engine: str) -> None:
        self._counters["wasma_engine_faults_total"].labels(engine).inc()

    def observe_request_end(self, failed: bool, cancelled: bool) -> None:
        if failed:
            self._counters["wasma_requests_failed_total"].inc()
        elif cancelled:
            self._counters["wasma_requests_cancelled_total"].inc()

    def observe_workflow(self, app: str | None, latency_s: float, met: bool) -> None:
        """A workflow finished; `met` says whether within its deadline.

        Call it with `met=False` for workflows that failed or were abandoned too, so the
        attainment ratio counts them as misses instead of forgetting them.
        """
        label = self._app_label(app)
        self._counters["wasma_workflows_completed_total"].labels(label).inc()
        if met:
            self._counters["wasma_workflows_deadline_met_total"].labels(label).inc()
        self._histograms["wasma_workflow_latency_seconds"].labels(label).observe(
            self._non_negative(latency_s, "latency_s")
        )
        window = self._window.setdefault(label, deque(maxlen=self._max_window_samples))
        window.append((self._clock(), met))
        self._refresh_attainment(label)

    def observe_decision(self, policy: str, kind: str, seconds: float) -> None:
        """The policy placed a request: `kind` is reuse, transfer or recompute."""
        if kind not in self.PLACEMENT_KINDS:
            raise ValueError(f"unknown placement kind {kind!r}")
        self._counters["wasma_placement_decisions_total"].labels(policy, kind).inc()
        self._histograms["wasma_decision_latency_seconds"].labels(policy).observe(
            self._non_negative(seconds, "seconds")
        )

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        """One KV transfer between engines finished."""
        self._counters["wasma_transfer_bytes_total"].inc(self._non_negative(nbytes, "nbytes"))
        self._histograms["wasma_transfer_seconds"].observe(self._non_negative(seconds, "seconds"))

    def set_engine(
        self,
        engine: str,
        outstanding: int,
        running: int | None = None,
        waiting: int | None = None,
        kv_usage: float | None = None,
    ) -> None:
        """Current load of `engine`; None leaves an engine-reported value unchanged."""
        # Checked before anything is set: a bad report changes nothing.
        if kv_usage is not None and not 0.0 <= kv_usage <= 1.0:
            raise ValueError(f"kv_usage is a ratio in [0, 1], got {kv_usage!r}")
        self._gauges["wasma_engine_outstanding_requests"].labels(engine).set(outstanding)
        if running is not None:
            self._gauges["wasma_engine_running_requests"].labels(engine).set(running)
        if waiting is not None:
            self._gauges["wasma_engine_waiting_requests"].labels(engine).set(waiting)
        if kv_usage is not None:
            self._gauges["wasma_engine_kv_usage_ratio"].labels(engine).set(kv_usage)

    def set_engine_up(self, engine: str, up: bool) -> None:
        """Whether `engine` is in the router's rotation."""
        self._gauges["wasma_engine_up"].labels(engine).set(1.0 if up else 0.0)

    def forget_engine_reports(self, engine: str) -> None:
        """Drop what `engine` last reported of itself (batch, queue, KV usage). An engine
        out of rotation cannot report, and its last values would otherwise stay on the
        dashboard as if current; the next stats it sends put them back."""
        for name in (
            "wasma_engine_running_requests",
            "wasma_engine_waiting_requests",
            "wasma_engine_kv_usage_ratio",
        ):
            gauge = self._gauges[name]
            if (engine,) in self._label_sets(gauge):
                gauge.remove(engine)

    def observe_http(self, code: int, handler: str = "other", count: int = 1) -> None:
        """The gateway answered `count` requests of route `handler` with status `code`."""
        if handler not in HANDLERS:
            handler = "other"
        self._counters["wasma_http_requests_total"].labels(handler, self._code_label(code)).inc(
            count
        )

    def set_queue_depth(self, depth: int) -> None:
        """Requests waiting in the router (for a parent to finish or for a placement)."""
        self._gauges["wasma_router_queue_depth"].set(depth)

    def set_estimate_ratio(self, ratio: float) -> None:
        """The policy's running ratio of actual to estimated request time."""
        self._gauges["wasma_estimate_slowdown_ratio"].set(self._non_negative(ratio, "ratio"))

    def observe_retention(self, engine: str, leases: int, released: int) -> None:
        """A request sent to `engine` asked for `leases` retention leases (0 or 1) and
        carried `released` keys of retentions to end."""
        if leases:
            self._counters["wasma_retention_leases_total"].labels(engine).inc(leases)
        if released:
            self._counters["wasma_retention_released_total"].labels(engine).inc(released)

    def observe_admission_rejected(self, count: int = 1) -> None:
        """Admission control turned `count` requests away."""
        self._counters["wasma_admission_rejected_total"].inc(count)

    # ---- attainment window -------------------------------------------------------------

    def _refresh_attainment(self, label: str) -> None:
        window = self._window.get(label)
        gauge = self._gauges["wasma_workflow_deadline_attainment_ratio"]
        if window is None:
            return
        horizon = self._clock() - self._window_s
        while window and window[0][0] < horizon:
            window.popleft()
        if window:
            gauge.labels(label).set(sum(met for _, met in window) / len(window))
        else:
            # No workflow finished in the window: no ratio rather than a stale one.
            del self._window[label]
            if (label,) in self._label_sets(gauge):
                gauge.remove(label)

    @staticmethod
    def _label_sets(metric: Counter | Gauge | Histogram) -> Sequence[tuple[str, ...]]:
        # prometheus_client has no public "has labels" query; reading the children keys
        # avoids the KeyError `remove` raises for label sets never set.
        return [tuple(key) for key in metric._metrics]

    # ---- exposition --------------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The `/metrics` body and its content type."""
        for label in list(self._window):
            self._refresh_attainment(label)
        if self._multiprocess_dir:
            # A fresh registry per scrape, as prometheus_client's multiprocess docs require:
            # the collector reads every process's files; our own registry would double count.
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=self._multiprocess_dir)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def fold_into(metrics: WasmaMetrics, engine: str, scraped: VllmMetrics, outstanding: int) -> None:
    """Publish one engine's scrape in the cluster view (`wasma_engine_*` gauges).

    `outstanding` is the router's own count: it includes requests still in flight to the
    engine, which the engine's running/waiting gauges do not see yet.
    """
    kv = scraped.kv_cache_usage_ratio
    metrics.set_engine(
        engine,
        outstanding=outstanding,
        running=None if scraped.num_requests_running is None else int(scraped.num_requests_running),
        waiting=None if scraped.num_requests_waiting is None else int(scraped.num_requests_waiting),
        # vLLM can report a hair above 1.0 from float rounding; the gauge is a ratio.
        kv_usage=None if kv is None else min(max(kv, 0.0), 1.0),
    )
