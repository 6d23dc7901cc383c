"""From `--engines` and friends to a running router service (in-process or a Ray actor).

`ServiceConfig` is plain data, so the same description builds the service in the gateway
process or inside `RouterActor` on any Ray node; engines are created where the router
runs because they live on its event loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from wasma.core.profile import Profile, load_profile
from wasma.deploy.journal import WorkflowJournal
from wasma.deploy.metrics import WasmaMetrics
from wasma.deploy.ray_channel import ChannelServer
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.service_types import ServiceRequest
from wasma.engines.base import DEFAULT_RETAIN_S, EngineClient, launch_all
from wasma.scheduler.pricing import LinkBandwidthPricer, TransferPricer

DEFAULT_SIM_PROFILE = "llama3-8b-h100"


class EngineSpecError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """`sim:N`, `vllm:N` or `openai:URL[,URL...]`."""

    kind: str
    count: int
    urls: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> EngineSpec:
        kind, sep, rest = text.partition(":")
        kind = kind.strip().lower()
        if not sep or not rest.strip():
            raise EngineSpecError(
                f"--engines {text!r}: expected sim:N, vllm:N or openai:URL[,URL...]"
            )
        if kind == "openai":
            urls = tuple(u.strip().rstrip("/") for u in rest.split(",") if u.strip())
            for u in urls:
                if not u.startswith(("http://", "https://")):
                    raise EngineSpecError(f"--engines: {u!r} is not an http(s) URL")
            return cls("openai", len(urls), urls)
        if kind in ("sim", "vllm"):
            try:
                n = int(rest)
            except ValueError:
                raise EngineSpecError(f"--engines {text!r}: N must be an integer") from None
            if not 1 <= n <= 1024:
                raise EngineSpecError(f"--engines {text!r}: N must be in 1..1024")
            return cls(kind, n)
        raise EngineSpecError(f"--engines {text!r}: unknown engine kind {kind!r}")


@dataclass(frozen=True)
class ServiceConfig:
    engines: EngineSpec
    policy: str = "wasma"
    profile: str | None = None
    model: str | None = None
    params: Mapping[str, Any] = field(default_factory=dict)
    sim_speed: float = 1.0
    max_outstanding: int | None = None  # None: sized from the engines (deadline_shedding.py)
    # openai engines: where each server publishes KV events (tcp://host:port), by index.
    kv_events: tuple[str, ...] = ()
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    # vllm engines: run the wasma KV connector so the policy can move a prefix's KV from
    # the engine holding it instead of recomputing it; priced at this many bytes/s (on one
    # host the peers talk over loopback TCP).
    kv_transfer: bool = False
    kv_transfer_Bps: float = 1e9
    # Fault handling (README.md, "Reliability"): the journal of registered workflows that a
    # restarted router replays, engine timeouts, and how often Ray restarts the router.
    journal: str | None = None
    request_timeout_s: float = 60.0
    health_timeout_s: float = 5.0
    max_failovers: int = 3
    router_max_restarts: int = 3
    # The longest a request waits at the router (deadline-aware admission) before it is
    # dispatched anyway.
    max_hold_s: float = 300.0
    # How long engines keep the KV of a request the policy marks `retain` (a lease).
    retain_lease_s: float = DEFAULT_RETAIN_S
    # sim engines: the vocabulary their tokens are drawn from (the gateway's tokenizer's,
    # so vLLM's derenderer can read them); None: the profile's.
    sim_vocab_size: int | None = None


def resolve_profile(cfg: ServiceConfig) -> Profile:
    """The policy's cost model; for real engines the block size is fixed up later from
    the engines themselves."""
    name = cfg.profile
    if name is None:
        name = "tiny-cpu" if cfg.engines.kind != "sim" else DEFAULT_SIM_PROFILE
        try:
            return load_profile(name)
        except ValueError:
            return load_profile(DEFAULT_SIM_PROFILE)
    return load_profile(name)


def openai_engine_names(urls: Sequence[str]) -> list[str]:
    """Names of `openai:` engines from their URLs, not their position, so a URL added to
    the list renames no other engine (metrics, logs, `x-wasma-engine`): the host's first
    DNS label where it is unique (`vllm-0.vllm.llm.svc...` -> `vllm-0`, a StatefulSet
    pod's own name), else host:port, numbered only if a URL is listed twice."""
    parts = [urlsplit(u) for u in urls]
    labels = [
        "" if not p.hostname or _is_ip(p.hostname) else p.hostname.split(".")[0] for p in parts
    ]
    names = [
        label if label and labels.count(label) == 1 else (p.netloc or url)
        for label, p, url in zip(labels, parts, urls, strict=True)
    ]
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}#{seen[name]}")
    return out


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def build_engines(cfg: ServiceConfig, profile: Profile) -> list[EngineClient]:
    spec = cfg.engines
    if spec.kind == "sim":
        from wasma.engines.sim_engine import SimEngine

        return [
            SimEngine(f"sim{i}", profile, speed=cfg.sim_speed, vocab_size=cfg.sim_vocab_size)
            for i in range(spec.count)
        ]
    if spec.kind == "openai":
        from wasma.engines.openai_engine import OpenAIEngine

        names = openai_engine_names(spec.urls)

        async def connect(i: int, url: str) -> EngineClient:
            kv = cfg.kv_events[i] if i < len(cfg.kv_events) else None
            # The router's stall check supervises every stream it opens.
            options = {"supervised": True, **cfg.engine_options}
            eng = OpenAIEngine(names[i], url, kv_events_endpoint=kv, **options)
            await eng.start()
            return eng

        return await launch_all(connect(i, url) for i, url in enumerate(spec.urls))
    if cfg.model is None:
        raise EngineSpecError("--engines vllm:N needs --model DIR")
    return await _build_vllm(cfg)


async def _build_vllm(cfg: ServiceConfig) -> list[EngineClient]:
    """vLLM engines, each in its own Ray actor when the actor proxy is available, else
    in this process (one EngineCore child process each)."""
    from wasma.engines.vllm_engine import VLLMEngineConfig

    assert cfg.model is not None
    vcfg = VLLMEngineConfig(model=cfg.model, **dict(cfg.engine_options))
    count = cfg.engines.count
    configs = [vcfg] * count
    if cfg.kv_transfer:
        # Each engine's worker binds a free port for its KV peer server and reports it.
        configs = [replace(vcfg, kv_peer_port=0)] * count
    try:
        from wasma.engines import vllm_actor
    except ImportError:
        from wasma.engines.vllm_engine import VLLMEngine

        return list(
            await launch_all(VLLMEngine.launch(f"vllm{i}", c) for i, c in enumerate(configs))
        )
    launch = vllm_actor.RayVLLMEngine.launch
    return list(
        await launch_all(
            launch(f"vllm{i}", c, actor_options=_cpu_binding(i)) for i, c in enumerate(configs)
        )
    )


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free TCP ports on `host` (held open together so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def transfer_pricer(cfg: ServiceConfig, engines: Sequence[EngineClient]) -> TransferPricer | None:
    """What the policy prices KV moves with, when the engines can carry them out."""
    if not cfg.kv_transfer or not all(e.kv_peer for e in engines):
        return None
    names = [e.name for e in engines]
    # One host: every pair of engines is one loopback hop apart.
    return LinkBandwidthPricer(
        names,
        gpus_per_node=len(names),
        intra_node_bytes_per_s=cfg.kv_transfer_Bps,
        latency_s=1e-3,
    )


def _cpu_binding(index: int) -> dict[str, Any]:
    """On CPU, vLLM binds every engine's OpenMP threads to the same core unless told
    otherwise; give engine i core i (mod the cores), unless the user chose a binding."""
    if "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    try:
        import torch

        if torch.cuda.is_available():
            return {}
    except ImportError:
        return {}
    core = index % (os.cpu_count() or 1)
    return {"runtime_env": {"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": str(core)}}}


async def build_service(cfg: ServiceConfig, metrics: WasmaMetrics | None = None) -> RouterService:
    profile = resolve_profile(cfg)
    engines = await build_engines(cfg, profile)
    kv_blocks = getattr(engines[0], "num_kv_blocks", None)
    if isinstance(kv_blocks, int) and kv_blocks > 0:
        profile = replace(profile, num_kv_blocks=kv_blocks)
    service: RouterService | None = None
    try:
        service = RouterService(
            engines,
            profile,
            RouterConfig(
                policy=cfg.policy,
                params=cfg.params,
                max_outstanding=cfg.max_outstanding,
                request_timeout_s=cfg.request_timeout_s,
                health_timeout_s=cfg.health_timeout_s,
                max_failovers=cfg.max_failovers,
                max_hold_s=cfg.max_hold_s,
                retain_lease_s=cfg.retain_lease_s,
            ),
            metrics=metrics,
            journal=WorkflowJournal(cfg.journal) if cfg.journal else None,
            pricer=transfer_pricer(cfg, engines),
        )
        await service.start()
    except BaseException:
        # The engines are up (processes, KV pools, Ray actors): a service that cannot
        # start around them (an unreadable journal, engines disagreeing on block size)
        # must not leave them running.
        if service is not None:
            await service.close()
        else:
            await asyncio.gather(*(e.close() for e in engines), return_exceptions=True)
        raise
    return service


class RouterActor:
    """The router service as an async Ray actor (`ray.remote(RouterActor)`); requests
    travel in batches over `ChannelServer` (see deploy/ray_channel.py)."""

    def __init__(self, cfg: ServiceConfig) -> None:
        self.cfg = cfg
        self.service: RouterService | None = None
        self.channels: ChannelServer | None = None
        self._starting = asyncio.Lock()  # concurrent first calls build one service

    async def start(self) -> list[str]:
        async with self._starting:
            if self.service is None:
                service = await build_service(self.cfg)
                self.channels = ChannelServer(service)
                self.service = service
                # This actor's process holds the router and its engines for good: as
                # vLLM's servers do, the startup heap is frozen out of the collector's
                # walks.
                from vllm.utils.gc_utils import freeze_gc_heap

                freeze_gc_heap()
        return self.service.engine_names()

    async def _ready(self) -> None:
        # After Ray restarts the actor nobody calls start(): the first call does.
        if self.service is None:
            await self.start()

    def _svc(self) -> RouterService:
        assert self.service is not None, "RouterActor.start() was not called"
        return self.service

    def _chan(self) -> ChannelServer:
        assert self.channels is not None, "RouterActor.start() was not called"
        return self.channels

    async def submit(self, channel: str, batch: list[tuple[ServiceRequest, bool]]) -> None:
        await self._ready()
        self._chan().submit(channel, batch)

    async def cancel(self, channel: str, request_ids: list[str]) -> None:
        await self._ready()
        self._chan().cancel(channel, request_ids)

    async def direct_views(self, channel: str) -> list[Any]:
        await self._ready()
        return self._chan().direct_views(channel)

    async def report(self, channel: str, items: list[tuple[str, int, Any]]) -> None:
        await self._ready()
        self._chan().report(channel, items)

    async def channel_counts(self) -> dict[str, int]:
        """Chunks relayed to gateways and reports received from them."""
        await self._ready()
        chan = self._chan()
        return {"relayed_chunks": chan.relayed_chunks, "reports": chan.reports}

    async def results(self, channel: str) -> AsyncIterator[list[Any]]:
        await self._ready()
        async for batch in self._chan().results(channel):
            yield batch

    async def register_workflow(self, data: dict[str, Any], tenant: str) -> dict[str, Any]:
        await self._ready()
        return self._svc().register_workflow(data, tenant)

    async def workflow_status(self, workflow_id: str, tenant: str) -> dict[str, Any]:
        await self._ready()
        return self._svc().workflow_status(workflow_id, tenant)

    async def health(self) -> dict[str, Any]:
        await self._ready()
        return self._svc().health()

    async def render_metrics(self, http_codes: dict[Any, int]) -> tuple[bytes, str]:
        await self._ready()
        return self._svc().render_metrics(http_codes)

    async def close(self) -> None:
        if self.service is not None:
            await self.service.close()

    def pid(self) -> int:
        return os.getpid()
