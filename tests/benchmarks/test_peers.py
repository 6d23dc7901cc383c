"""The peers benchmark's pure parts: commands, run plan, trace sizes, aggregation.

No engine, router or network: these only check what the script would start and how
it folds results."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest

from wasma.benchmarks.studies.peers import (
    SIM_MODELS,
    estimate_s,
    main,
    parse_args,
    plan_runs,
    settled_speed,
)
from wasma.benchmarks.studies.peers_procs import (
    EngineEndpoint,
    EngineOptions,
    RouterConfig,
    default_routers,
    engine_command,
    engine_env,
    router_command,
)
from wasma.benchmarks.studies.peers_report import (
    aggregate,
    capacity_table,
    markdown_table,
    prefix_counter_delta,
    sim_table,
    spread,
    targets_table,
)
from wasma.benchmarks.studies.peers_traces import generate_small, small_apps
from wasma.core.profile import load_profile

OPTS = EngineOptions(model="/m/tiny", block_size=64)
EPS = [EngineEndpoint(8001, "/t/kv0.sock", 5557), EngineEndpoint(8002, "/t/kv1.sock", 5558)]


def _router(name: str) -> RouterConfig:
    return next(r for r in default_routers() if r.name == name)


def _cmd(name: str) -> list[str]:
    return router_command(_router(name), "/venv/bin", "/venv/bin/python", 9000, EPS, OPTS, 9100)


def _after(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_engine_command_has_caching_events_priority_and_loopback() -> None:
    cmd = engine_command("/py", OPTS, EPS[1])
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert _after(cmd, "--host") == "127.0.0.1"
    assert _after(cmd, "--port") == "8002"
    assert _after(cmd, "--block-size") == "64"
    assert _after(cmd, "--scheduling-policy") == "priority"
    assert "--enable-prefix-caching" in cmd and "--enforce-eager" in cmd
    events = json.loads(_after(cmd, "--kv-events-config"))
    assert events == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "ipc:///t/kv1.sock",
    }


def test_engine_env_enables_reset_endpoint_and_pins_distinct_cores() -> None:
    a = engine_env({"PATH": "/bin"}, OPTS, 0)
    b = engine_env({"PATH": "/bin"}, OPTS, 1)
    assert a["VLLM_SERVER_DEV_MODE"] == "1"
    assert a["PATH"] == "/bin"
    assert (a["VLLM_CPU_OMP_THREADS_BIND"], b["VLLM_CPU_OMP_THREADS_BIND"]) == ("0", "1")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in engine_env({}, OPTS, None)


def test_vllm_router_kv_aware_gets_every_event_source_and_the_engines_block_size() -> None:
    cmd = _cmd("vllm-router kv_aware")
    assert cmd[0] == "/venv/bin/vllm-router"
    assert _after(cmd, "--policy") == "kv_aware"
    sources = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kv-event-source"]
    assert sources == [
        "http://127.0.0.1:8001=tcp://127.0.0.1:5557",
        "http://127.0.0.1:8002=tcp://127.0.0.1:5558",
    ]
    assert _after(cmd, "--kv-event-block-size") == "64"
    assert _after(cmd, "--kv-event-model") == "/m/tiny"
    assert "--enable-program-scheduling" not in cmd
    assert _after(cmd, "--prometheus-port") == "9100"
    assert _after(cmd, "--host") == "127.0.0.1"


def test_program_scheduling_and_cache_aware_variants() -> None:
    prog = _cmd("vllm-router kv_aware+program")
    assert "--enable-program-scheduling" in prog and "--kv-event-source" in prog
    cache = _cmd("vllm-router cache_aware")
    assert _after(cache, "--policy") == "cache_aware"
    assert "--kv-event-source" not in cache
    workers = cache[cache.index("--worker-urls") + 1 : cache.index("--worker-urls") + 3]
    assert workers == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


def test_sglang_router_uses_launch_subcommand_on_loopback() -> None:
    cmd = _cmd("sglang-router cache_aware")
    assert cmd[:2] == ["/venv/bin/sglang-router", "launch"]
    assert _after(cmd, "--host") == "127.0.0.1"
    assert _after(cmd, "--prometheus-host") == "127.0.0.1"
    assert _after(cmd, "--policy") == "cache_aware"


def test_wasma_serve_gets_engines_and_events_in_the_same_order() -> None:
    cmd = _cmd("wasma")
    assert cmd[:4] == ["/venv/bin/python", "-m", "wasma.deploy.cli", "serve"]
    assert _after(cmd, "--engines") == "openai:http://127.0.0.1:8001,http://127.0.0.1:8002"
    assert _after(cmd, "--kv-events") == "tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"
    assert _after(cmd, "--policy") == "wasma"
    assert _after(_cmd("wasma least_loaded"), "--policy") == "least_loaded"


def test_text_prompts_only_for_routers_that_route_on_text() -> None:
    text = {r.name for r in default_routers() if r.text_prompts}
    assert text == {"vllm-router cache_aware", "sglang-router cache_aware"}


def test_unknown_router_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown router kind"):
        router_command(RouterConfig("x", "nginx", "rr"), "/b", "/py", 1, EPS, OPTS, 2)


def test_plan_is_repetition_major_and_complete() -> None:
    routers = default_routers()[:2]
    runs = plan_runs(routers, ["a", "b"], [1.0, 2.0], reps=2)
    assert len(runs) == 2 * 2 * 2 * 2
    assert [r.rep for r in runs[:8]] == [0] * 8
    assert [r.router.name for r in runs[:2]] == [routers[0].name, routers[1].name]
    assert estimate_s(runs, {"a": 10.0, "b": 5.0}) > 90.0


def test_every_simulated_baseline_names_real_routers() -> None:
    names = {r.name for r in default_routers()}
    assert {m for models in SIM_MODELS.values() for m in models} <= names


@pytest.mark.parametrize("app", list(small_apps()))
def test_small_traces_fit_the_tiny_context(app: str) -> None:
    profile = load_profile("tiny-cpu")
    wfs = generate_small(app, 6, 0.5, 0, profile, slack=3.0, hop_s=0.05)
    assert len(wfs) == 6 and wfs[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(wfs))
    for wf in wfs:
        assert wf.deadline_s > 0
        for nid, node in wf.nodes.items():
            # Text prompts re-tokenise to ~15% more tokens: keep a margin below 2048.
            assert wf.prompt_tokens(nid) + node.output_tokens < 1700
    again = generate_small(app, 6, 0.5, 0, profile, slack=3.0, hop_s=0.05)
    assert [w.to_dict() for w in again] == [w.to_dict() for w in wfs]


def test_generate_small_rejects_bad_input() -> None:
    profile = load_profile("tiny-cpu")
    with pytest.raises(ValueError, match="unknown app"):
        generate_small("chat", 1, 1.0, 0, profile, 3.0, 0.0)
    with pytest.raises(ValueError):
        generate_small("debate", 0, 1.0, 0, profile, 3.0, 0.0)


def test_prefix_counter_delta_sums_engines() -> None:
    before = [(100.0, 10.0), (50.0, 0.0)]
    after = [(300.0, 110.0), (150.0, 50.0)]
    assert prefix_counter_delta(before, after) == (300.0, 150.0, 0.5)
    assert prefix_counter_delta(before, before)[2] is None
    with pytest.raises(ValueError):
        prefix_counter_delta(before, after[:1])


def test_spread_ignores_missing_values() -> None:
    assert spread([3.0, None, 1.0, 2.0]) == {"min": 1.0, "median": 2.0, "max": 3.0}
    assert spread([None]) is None


def _row(router: str, rate: float, goodput: float, hits: float | None) -> dict[str, object]:
    return {
        "router": router,
        "app": "debate",
        "rate_scale": rate,
        "goodput_wf_per_s": goodput,
        "deadline_attainment": 1.0,
        "p95_workflow_s": 2.0,
        "engine_prefix_hit_ratio": hits,
        "failed_requests": 1,
    }


def test_aggregate_groups_repeats_and_keeps_order() -> None:
    rows = [
        _row("wasma", 1.0, 0.3, 0.6),
        _row("peer", 1.0, 0.2, 0.5),
        _row("wasma", 1.0, 0.1, 0.7),
        _row("wasma", 1.0, 0.2, None),
        _row("wasma", 2.0, 0.4, 0.6),
    ]
    agg = aggregate(rows)
    assert [(e["router"], e["rate_scale"], e["runs"]) for e in agg] == [
        ("wasma", 1.0, 3),
        ("peer", 1.0, 1),
        ("wasma", 2.0, 1),
    ]
    first = agg[0]
    assert first["goodput_wf_per_s"] == {"min": 0.1, "median": 0.2, "max": 0.3}
    hits = first["engine_prefix_hit_ratio"]
    assert (hits["min"], hits["max"]) == (0.6, 0.7)
    assert hits["median"] == pytest.approx(0.65)
    assert first["failed_requests"] == 3
    table = markdown_table(agg)
    assert "| debate | x1 | wasma | 0.200 (0.100..0.300) |" in table
    assert len(table.splitlines()) == 2 + 3


def _run(router: str, rate: float, goodput: float, att: float, p95: float, dur: float) -> dict:
    return {
        "router": router,
        "app": "mapreduce",
        "rate_scale": rate,
        "goodput_wf_per_s": goodput,
        "deadline_attainment": att,
        "p95_workflow_s": p95,
        "duration_s": dur,
        "engine_prefix_hit_ratio": 0.7,
    }


def test_targets_table_splits_goodput_into_attainment_and_duration() -> None:
    agg = aggregate(
        [
            # 5 workflows a run: goodput = attainment * 5 / duration.
            _run("sglang-router cache_aware", 1.0, 0.9 * 5 / 6.0, 0.9, 1.6, 6.0),
            _run("vllm-router kv_aware", 1.0, 0.8 * 5 / 6.4, 0.8, 1.4, 6.4),
            _run("wasma least_loaded", 1.0, 5 / 4.0, 1.0, 0.5, 4.0),  # not a peer
            _run("wasma", 1.0, 1.0 * 5 / 5.0, 1.0, 1.12, 5.0),
            _run("sglang-router cache_aware", 2.0, 0.5, 0.6, 2.0, 6.0),  # no wasma here
        ]
    )
    lines = targets_table(agg).splitlines()
    assert len(lines) == 3  # header, rule, the one load with both
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[:3] == ["mapreduce", "x1", "sglang-router cache_aware 0.750"]
    assert cells[3] == "0.90"
    # 1.000 / 0.750 = 1.33 = (1.0 / 0.9 = 1.11) x (6.0 / 5.0 = 1.20)
    assert cells[4:7] == ["1.33x", "1.11x", "1.20x"]
    # P95 against the lowest peer P95 (vllm-router's 1.4 s), not the best peer's.
    assert cells[7].startswith("0.80x (vllm-router kv_aware 1.40 s; wasma 1.12 s)")
    assert cells[8] == "1"


def test_capacity_table_reads_the_highest_load_a_peer_still_meets_90_percent() -> None:
    agg = aggregate(
        [
            _run("sglang-router cache_aware", 1.0, 0.8, 1.0, 1.0, 6.0),
            _run("wasma", 1.0, 0.8, 1.0, 0.9, 6.0),
            # A dip: no peer meets 90% at x2, but one does again at x3.
            _run("sglang-router cache_aware", 2.0, 0.5, 0.6, 2.0, 6.0),
            _run("vllm-router kv_aware", 2.0, 0.6, 0.8, 1.8, 6.0),
            _run("wasma", 2.0, 1.2, 1.0, 1.0, 4.0),
            _run("sglang-router cache_aware", 3.0, 1.2, 0.8, 2.5, 4.0),
            _run("vllm-router kv_aware", 3.0, 1.0, 1.0, 2.0, 5.0),
            _run("wasma", 3.0, 1.5, 1.0, 1.2, 3.5),
            _run("sglang-router cache_aware", 4.0, 0.5, 0.4, 4.0, 4.0),
            _run("wasma", 4.0, 1.2, 0.8, 2.0, 3.5),
            _run("sglang-router cache_aware", 5.0, 0.5, 0.2, 5.0, 4.0),
            _run("wasma", 5.0, 1.5, 1.0, 2.2, 3.5),
        ]
    )
    lines = capacity_table(agg).splitlines()
    assert len(lines) == 3
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    assert cells[0] == "mapreduce"
    assert cells[1] == "x3 (vllm-router kv_aware 1.00)"  # the highest load, not the first
    assert cells[2] == "x2 (0.80)"
    # Best peer by goodput at x3 is sglang-router (1.2), the lowest P95 kv_aware (2.0).
    assert cells[3] == "1.25x (sglang-router cache_aware)"
    assert cells[4] == "0.60x (vllm-router kv_aware)"
    # wasma met 90% at the highest load tested, a lower bound on its capacity ratio; it
    # dipped at x4, so the strict reading stops at x3 (1.00x the peers' point).
    assert cells[5:] == ["x5", "x4 (0.80)", "1.00x .. >= 1.67x"]


def test_capacity_table_reads_a_subject_without_dips_as_one_ratio() -> None:
    agg = aggregate(
        [
            _run("sglang-router cache_aware", 1.0, 0.8, 1.0, 1.0, 6.0),
            _run("wasma", 1.0, 0.8, 1.0, 0.9, 6.0),
            _run("sglang-router cache_aware", 2.0, 0.5, 0.6, 2.0, 6.0),
            _run("wasma", 2.0, 1.2, 1.0, 1.0, 4.0),
            _run("sglang-router cache_aware", 3.0, 0.5, 0.4, 2.0, 6.0),
            _run("wasma", 3.0, 1.2, 0.5, 1.0, 4.0),
        ]
    )
    cells = [c.strip() for c in capacity_table(agg).splitlines()[2].strip("|").split("|")]
    assert cells[1] == "x1 (sglang-router cache_aware 1.00)"
    assert cells[5:] == ["x2", "none", "2.00x"]


def test_capacity_table_skips_apps_where_no_peer_meets_the_threshold() -> None:
    agg = aggregate(
        [
            _run("sglang-router cache_aware", 1.0, 0.3, 0.6, 2.0, 6.0),
            _run("wasma", 1.0, 0.8, 1.0, 1.0, 6.0),
        ]
    )
    assert len(capacity_table(agg).splitlines()) == 2


def _readings(*slowdowns: float | Exception) -> Any:
    """A probe that returns these readings in turn (or raises the exceptions)."""
    left = list(slowdowns)
    taken: list[float | Exception] = []

    def read() -> dict[str, float]:
        value = left.pop(0)
        taken.append(value)
        if isinstance(value, Exception):
            raise value
        return {"slowdown": value, "median_s": 0.1, "profile_s": 0.1 / value, "requests": 9}

    read.taken = taken  # type: ignore[attr-defined]
    return read


def test_settled_speed_reads_once_while_the_speed_holds() -> None:
    read = _readings(3.9, 99.0)
    assert [r["slowdown"] for r in settled_speed(read, last_scale=3.0)] == [3.9]
    assert read.taken == [3.9]


def test_settled_speed_reads_a_jump_again_in_either_direction() -> None:
    # A stall: 10.13x between cells at ~3x; the second reading says 3.1x.
    read = _readings(10.13, 3.1)
    assert [r["slowdown"] for r in settled_speed(read, last_scale=3.0)] == [10.13, 3.1]
    # A real slowdown reads slow twice; the faster of the two is still slow.
    read = _readings(7.0, 6.5)
    assert [r["slowdown"] for r in settled_speed(read, last_scale=3.0)] == [7.0, 6.5]
    read = _readings(1.2, 1.4)
    assert len(settled_speed(read, last_scale=3.0)) == 2


def test_settled_speed_keeps_the_first_reading_if_the_second_fails() -> None:
    read = _readings(10.0, RuntimeError("no request finished"))
    assert [r["slowdown"] for r in settled_speed(read, last_scale=3.0)] == [10.0]


def test_report_only_pools_earlier_outputs(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    for d, rows in (
        (
            a,
            [
                _run("wasma", 1.0, 1.0, 1.0, 1.0, 5.0),
                _run("sglang-router cache_aware", 1.0, 0.5, 0.5, 2.0, 5.0),
            ],
        ),
        (b, [_run("wasma", 1.0, 0.8, 0.8, 1.2, 5.0)]),
    ):
        d.mkdir()
        speed = {"requests": 9, "median_s": 0.239, "profile_s": 0.128, "slowdown": 1.87}
        faster = {"requests": 9, "median_s": 0.198, "profile_s": 0.128, "slowdown": 1.55}
        # An older output has its first reading only; a newer one every cell's.
        meta = {"engine_speed": speed} if d == a else {"engine_speeds": [faster, speed]}
        (d / "results.json").write_text(
            json.dumps({"runs": rows, "sim_baselines": [], "meta": meta})
        )
    assert main(["--out", str(a), "--report-only", "--pool", str(b)]) == 0
    pooled = json.loads((a / "results_pooled.json").read_text())
    assert len(pooled["runs"]) == 3
    wasma = next(e for e in pooled["summary"] if e["router"] == "wasma")
    assert wasma["runs"] == 2
    # The output's own results stay its own.
    assert len(json.loads((a / "results.json").read_text())["runs"]) == 2
    table = (a / "table.md").read_text()
    assert "| mapreduce | x1 | wasma | 0.900 (0.800..1.000) |" in table
    assert table.startswith("Engine speed, a 512+32-token request alone")
    assert table.splitlines()[0].endswith(": 198-239 ms (1.55-1.87x), 3 readings")
    with pytest.raises(SystemExit, match="not found"):
        main(["--out", str(a), "--report-only", "--pool", str(tmp_path / "missing")])
    with pytest.raises(SystemExit):
        parse_args(["--pool", str(b)])  # only with --report-only


def test_sim_table_reports_gap_in_points() -> None:
    agg = aggregate([_row("vllm-router kv_aware", 1.0, 0.2, 0.5)])
    sim = [
        {
            "app": "debate",
            "rate_scale": 1.0,
            "policy": "kv_aware",
            "models": ["vllm-router kv_aware", "vllm-router kv_aware+program"],
            "prefix_hit_ratio": 0.58,
        }
    ]
    lines = sim_table(sim, agg).splitlines()
    assert lines[2].endswith("| vllm-router kv_aware | 0.50 | +8.0 |")
    assert lines[3].endswith("| n/a | n/a |")


def test_parse_args_defaults_and_validation(tmp_path: Path) -> None:
    args = parse_args(["--out", str(tmp_path)])
    assert args.engines == 2 and args.rates == [0.5, 1.0, 2.0] and args.reps == 3
    assert args.apps == ["pipeline", "mapreduce", "debate"]
    assert args.slack == 2.0 and args.deadline_scale == "auto"
    assert parse_args(["--deadline-scale", "1.5"]).deadline_scale == 1.5
    for bad in (["--deadline-scale", "fast"], ["--deadline-scale", "0"], ["--slack", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    with pytest.raises(SystemExit):
        parse_args(["--rates", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--reps", "0"])


def test_kv_event_relay_forwards_ipc_to_loopback_tcp(tmp_path: Path) -> None:
    import time

    import zmq

    from wasma.benchmarks.studies.peers_procs import KVEventRelay, free_port

    ep = EngineEndpoint(0, str(tmp_path / "kv.sock"), free_port())
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(ep.publish_endpoint)  # what vLLM does with an ipc:// endpoint
    relay = KVEventRelay([ep])
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 200)
    sub.connect(ep.kv_endpoint)
    try:
        got = None
        for _ in range(50):  # subscriptions propagate asynchronously (slow joiner)
            pub.send_multipart([b"", b"\x00" * 8, b"payload"])
            try:
                got = sub.recv_multipart()
                break
            except zmq.Again:
                time.sleep(0.05)
        assert got == [b"", b"\x00" * 8, b"payload"]
    finally:
        sub.close(linger=0)
        pub.close(linger=0)
        relay.close()
        ctx.term()


def test_kv_event_relay_that_cannot_bind_stops_the_proxies_it_started(tmp_path: Path) -> None:
    import socket
    import threading

    import zmq

    from wasma.benchmarks.studies.peers_procs import KVEventRelay, free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ok = EngineEndpoint(0, str(tmp_path / "kv0.sock"), free_port())
        clash = EngineEndpoint(1, str(tmp_path / "kv1.sock"), taken.getsockname()[1])
        with pytest.raises(zmq.ZMQError):
            KVEventRelay([ok, clash])
    # The first engine's proxy was running; it is stopped, not left to block the
    # context's teardown (and the process) forever.
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-relay-")]


def test_wasma_ablations_pass_params_in_a_config_file() -> None:
    from wasma.benchmarks.studies.peers_procs import diagnostic_routers, wasma_config_text

    rc = diagnostic_routers()[0]
    assert json.loads(wasma_config_text(rc) or "") == {"params": {"priority": False}}
    assert wasma_config_text(_router("wasma")) is None
    cmd = router_command(rc, "/b", "/py", 1, EPS, OPTS, 2, "/tmp/c.yaml")
    assert _after(cmd, "--config") == "/tmp/c.yaml"
    assert "--config" not in _cmd("wasma")


def test_frozen_source_holds_every_package_wasma_serve_imports() -> None:
    import shutil

    from wasma.benchmarks.studies.peers import freeze_source

    snap = Path(freeze_source())
    try:
        for f in (
            "wasma/deploy/cli.py",
            "wasma/scheduler/router.py",
            "wasma/core/profiles/tiny-cpu.yaml",
        ):
            assert (snap / f).is_file()
        assert not list(snap.rglob("__pycache__"))
    finally:
        shutil.rmtree(snap)


def test_stop_lets_the_groups_children_finish_their_cleanup(tmp_path: Path) -> None:
    """vLLM's API server exits on SIGTERM before its engine core has unlinked its
    shared-memory queues; stop() must not kill the child mid-cleanup."""
    import sys

    from wasma.benchmarks.studies.peers_procs import ManagedProcess, group_alive

    done = tmp_path / "cleaned"
    child = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        "    time.sleep(1.0)  # the cleanup\n"
        f"    open({str(done)!r}, 'w').write('ok')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        f"open({str(tmp_path / 'ready')!r}, 'w').write('ok')\n"
        "while True: time.sleep(0.1)\n"
    )
    leader = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', {child!r}])\n"
        "while True: time.sleep(0.1)\n"  # SIGTERM's default action ends it at once
    )
    mp = ManagedProcess("group", [sys.executable, "-c", leader], tmp_path / "log").start()
    assert mp.proc is not None
    pgid = mp.proc.pid
    for _ in range(200):
        if (tmp_path / "ready").exists():
            break
        time.sleep(0.05)
    assert group_alive(pgid)
    mp.stop(grace_s=10.0)
    assert done.read_text() == "ok"
    assert not group_alive(pgid)
