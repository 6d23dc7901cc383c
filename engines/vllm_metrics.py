"""Read a vLLM server's `/metrics` page into the few numbers the router's cluster view needs.

Names follow vLLM v1 (checked against vllm 0.32 `vllm/v1/metrics/loggers.py`). Older
servers exported deprecated names (`vllm:gpu_cache_usage_perc`,
`vllm:gpu_prefix_cache_queries` / `_hits`, v0's `vllm:num_requests_swapped`); each field
falls back to them so a mixed fleet still reports load and KV usage.

A server running data parallelism exports one series per engine index (label `engine`);
counts are summed over them and KV usage is averaged, since each rank has a cache of its own.
With `model_name` given, only that model's series count (one server can serve several).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class VllmMetrics:
    """One scrape of a vLLM server. Counters are cumulative since the server started;
    a field is None when the server exported none of its names."""

    num_requests_running: float | None = None
    num_requests_waiting: float | None = None
    kv_cache_usage_ratio: float | None = None  # 0..1, 1 means every KV block is in use
    prefix_cache_queries_tokens: float | None = None
    prefix_cache_hits_tokens: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    num_preemptions: float | None = None
    requests_finished: float | None = None
    ttft_sum_seconds: float | None = None
    ttft_count: float | None = None
    e2e_sum_seconds: float | None = None
    e2e_count: float | None = None
    block_size_tokens: int | None = None
    num_gpu_blocks: int | None = None

    @property
    def prefix_hit_ratio(self) -> float | None:
        """Lifetime share of queried prompt tokens found in the prefix cache."""
        if not self.prefix_cache_queries_tokens or self.prefix_cache_hits_tokens is None:
            return None
        return self.prefix_cache_hits_tokens / self.prefix_cache_queries_tokens

    @property
    def mean_ttft_seconds(self) -> float | None:
        if not self.ttft_count or self.ttft_sum_seconds is None:
            return None
        return self.ttft_sum_seconds / self.ttft_count


@dataclass(frozen=True)
class _Field:
    """Sample names to try, newest first; `reduce` says how series of DP ranks combine."""

    names: tuple[str, ...]
    reduce: str = "sum"  # "sum" | "mean"


class VllmMetricsParser:
    """Turns `/metrics` text into `VllmMetrics`; holds only the name table, no state."""

    # Sample names as they appear in the exposition (counters carry `_total`). Both the
    # `_total` and bare spelling are listed for counters because old prometheus_client
    # versions exposed counters without the suffix.
    FIELDS: Mapping[str, _Field] = {
        "num_requests_running": _Field(("vllm:num_requests_running",)),
        "num_requests_waiting": _Field(("vllm:num_requests_waiting",)),
        "kv_cache_usage_ratio": _Field(
            ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), reduce="mean"
        ),
        "prefix_cache_queries_tokens": _Field(
            (
                "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_queries",
                "vllm:gpu_prefix_cache_queries_total",
                "vllm:gpu_prefix_cache_queries",
            )
        ),
        "prefix_cache_hits_tokens": _Field(
            (
                "vllm:prefix_cache_hits_total",
                "vllm:prefix_cache_hits",
                "vllm:gpu_prefix_cache_hits_total",
                "vllm:gpu_prefix_cache_hits",
            )
        ),
        "prompt_tokens": _Field(("vllm:prompt_tokens_total", "vllm:prompt_tokens")),
        "generation_tokens": _Field(("vllm:generation_tokens_total", "vllm:generation_tokens")),
        "num_preemptions": _Field(("vllm:num_preemptions_total", "vllm:num_preemptions")),
        "requests_finished": _Field(("vllm:request_success_total", "vllm:request_success")),
        "ttft_sum_seconds": _Field(("vllm:time_to_first_token_seconds_sum",)),
        "ttft_count": _Field(("vllm:time_to_first_token_seconds_count",)),
        "e2e_sum_seconds": _Field(("vllm:e2e_request_latency_seconds_sum",)),
        "e2e_count": _Field(("vllm:e2e_request_latency_seconds_count",)),
    }
    # v0 counted swapped-out requests separately; they still wait for the engine.
    DEPRECATED_WAITING_EXTRA: tuple[str, ...] = ("vllm:num_requests_swapped",)
    CACHE_INFO = "vllm:cache_config_info"

    def __init__(self, model_name: str | None = None) -> None:
        self._model_name = model_name

    def parse(self, text: str) -> VllmMetrics:
        """Parse one `/metrics` page. Raises ValueError on text that is not exposition."""
        samples: dict[str, list[float]] = {}
        cache_info: dict[str, str] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                model = sample.labels.get("model_name")
                if self._model_name is not None and model not in (None, self._model_name):
                    continue
                if sample.name == self.CACHE_INFO:
                    cache_info = dict(sample.labels)
                samples.setdefault(sample.name, []).append(sample.value)

        values: dict[str, float | None] = {
            field: self._lookup(samples, spec) for field, spec in self.FIELDS.items()
        }
        swapped = self._first(samples, self.DEPRECATED_WAITING_EXTRA)
        if swapped is not None and values["num_requests_waiting"] is not None:
            values["num_requests_waiting"] = values["num_requests_waiting"] + sum(swapped)
        return VllmMetrics(
            **values,
            block_size_tokens=self._int_label(cache_info, "block_size"),
            num_gpu_blocks=self._int_label(cache_info, "num_gpu_blocks"),
        )

    @staticmethod
    def _first(samples: Mapping[str, list[float]], names: Iterable[str]) -> list[float] | None:
        for name in names:
            if name in samples:
                return samples[name]
        return None

    def _lookup(self, samples: Mapping[str, list[float]], spec: _Field) -> float | None:
        found = self._first(samples, spec.names)
        if not found:
            return None
        if spec.reduce == "mean":
            return sum(found) / len(found)
        return sum(found)

    @staticmethod
    def _int_label(labels: Mapping[str, str], key: str) -> int | None:
        try:
            return int(labels[key])
        except (KeyError, ValueError):
            return None


def parse_vllm_metrics(text: str, model_name: str | None = None) -> VllmMetrics:
    """Shorthand for `VllmMetricsParser(model_name).parse(text)`."""
    return VllmMetricsParser(model_name).parse(text)


async def scrape_vllm_metrics(
    client: httpx.AsyncClient, base_url: str, model_name: str | None = None
) -> VllmMetrics:
    """GET `{base_url}/metrics` of a vLLM server and parse it."""
    response = await client.get(base_url.rstrip("/") + "/metrics")
    response.raise_for_status()
    return parse_vllm_metrics(response.text, model_name)
