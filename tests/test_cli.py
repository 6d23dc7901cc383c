"""The `wasma` command line: `trace gen`, `bench`, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from wasma.deploy.cli import main
from wasma.scheduler.trace import load_trace


def gen(out: Path, app: str = "debate", n: int = 3, seed: int = 1, rate: str = "2") -> int:
    return main(
        [
            "trace",
            "gen",
            "--app",
            app,
            "--workflows",
            str(n),
            "--rate",
            rate,
            "--seed",
            str(seed),
            "-o",
            str(out),
        ]
    )


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = tmp_path_factory.mktemp("cli") / "debate.jsonl"
    assert gen(p) == 0
    return p


def error_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """Run main(argv) expecting exit status 2; return stderr's last line."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse errors
        rc = int(exc.code or 0)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err
    return err.splitlines()[-1]


# -- trace gen -------------------------------------------------------------------------


@pytest.mark.parametrize("app", ["pipeline", "mapreduce", "debate"])
def test_trace_gen_writes_a_valid_deterministic_trace(
    app: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b, c = tmp_path / "a" / "t.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    assert gen(a, app, 4, seed=3) == 0
    assert "wrote 4 workflows" in capsys.readouterr().out
    assert gen(b, app, 4, seed=3) == 0
    assert gen(c, app, 4, seed=4) == 0
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    wfs = load_trace(a)
    assert len(wfs) == 4 and all(w.app == app for w in wfs)
    assert len(a.read_text().splitlines()) == 4


def test_trace_gen_slack_scales_deadlines(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    base = ["trace", "gen", "--app", "mapreduce", "--workflows", "3", "--rate", "1"]
    assert main([*base, "--slack", "2", "-o", str(a)]) == 0
    assert main([*base, "--slack", "4", "-o", str(b)]) == 0
    for x, y in zip(load_trace(a), load_trace(b), strict=True):
        assert y.deadline_s == pytest.approx(2 * x.deadline_s, abs=2e-3)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--app", "chat"], "--app"),
        (["--workflows", "0"], "--workflows"),
        (["--workflows", "x"], "--workflows"),
        (["--rate", "-1"], "--rate"),
        (["--rate", "inf"], "--rate"),
        (["--rate", "1e-320"], "--rate"),
        (["--slack", "0"], "--slack"),
        (["--slack", "1e308"], "--slack"),
        (["--seed", "-1"], "--seed"),
        (["--profile", "nope"], "nope"),
    ],
)
def test_trace_gen_bad_flags(
    args: list[str], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = {"--app": "debate", "--workflows": "2", "--rate": "1", "-o": str(tmp_path / "t")}
    for k, v in zip(args[::2], args[1::2], strict=True):
        argv[k] = v
    flat = ["trace", "gen"] + [x for kv in argv.items() for x in kv]
    line = error_of(capsys, flat)
    assert needle in line
    assert not (tmp_path / "t").exists()


# -- bench -----------------------------------------------------------------------------


def test_bench_writes_results_plots_and_table(
    trace_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    result_fields: dict[str, type],
) -> None:
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            "--trace",
            str(trace_file),
            "--policies",
            "least_loaded,kv_aware",
            "--engines",
            "2",
            "--rates",
            "1,2",
            "--workers",
            "1",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "least_loaded" in printed and "kv_aware" in printed
    res = json.loads((out / "results.json").read_text())
    assert len(res["runs"]) == 4
    for r in res["runs"]:
        missing = [f for f in result_fields if f not in r]
        assert not missing
        assert r["trace"] == "debate.jsonl" and r["engines"] == 2
    assert {(r["policy"], r["rate_scale"]) for r in res["runs"]} == {
        ("least_loaded", 1.0),
        ("least_loaded", 2.0),
        ("kv_aware", 1.0),
        ("kv_aware", 2.0),
    }
    for png in ("goodput.png", "p95_latency.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_bench_defaults_to_rate_one_and_accepts_params(trace_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    rc = main(
        [
            "bench",
            "--trace",
            str(trace_file),
            "--policies",
            "wasma",
            "--engines",
            "2",
            "--workers",
            "1",
            "--param",
            "wasma.transfer=false",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["rate_scale"] == 1.0 and run["params"] == {"transfer": False}


def test_bench_no_dags_replays_requests_only(trace_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    argv = ["bench", "--trace", str(trace_file), "--policies", "wasma", "--engines", "2"]
    assert main([*argv, "--workers", "1", "--no-dags", "--sweep", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["runs"] and all(r["dags"] is False for r in res["runs"])  # sweep runs too
    assert res["capacity"]["debate.jsonl"]["wasma"] > 0


def bench_argv(trace: Path | str, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "bench",
        "--trace",
        str(trace),
        "--engines",
        "2",
        "--workers",
        "1",
        "--out",
        str(tmp_path / "o"),
        *extra,
    ]


def test_bench_unknown_policy(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = error_of(capsys, bench_argv(trace_file, tmp_path, "--policies", "wasma,fastest"))
    assert "--policies" in line and "'fastest'" in line and "least_loaded" in line
    assert not (tmp_path / "o").exists()


def test_bench_on_another_topology(trace_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    argv = ["bench", "--trace", str(trace_file), "--policies", "wasma", "--engines", "2"]
    assert main([*argv, "--workers", "1", "--topology", "preset:pcie-8", "--out", str(out)]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["runs"] and all(r["topology"] == "pcie-8" for r in res["runs"])
    # The default network is not written into rows (results stay as they were).
    default = tmp_path / "d"
    assert main([*argv, "--workers", "1", "--out", str(default)]) == 0
    assert "topology" not in json.loads((default / "results.json").read_text())["runs"][0]


def test_bench_unknown_topology(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = error_of(capsys, bench_argv(trace_file, tmp_path, "--topology", "preset:ring-9"))
    assert "--topology" in line and "'preset:ring-9'" in line and "preset:pcie-8" in line
    assert not (tmp_path / "o").exists()


def test_bench_missing_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = error_of(capsys, bench_argv(tmp_path / "nope.jsonl", tmp_path))
    assert "nope.jsonl" in line and "cannot read" in line


@pytest.mark.parametrize("rates", ["1,x", "0", "-1,2", ",", "inf", "1e-320"])
def test_bench_bad_rates(
    rates: str, trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    line = error_of(capsys, bench_argv(trace_file, tmp_path, "--rates", rates))
    assert "--rates" in line


def test_bench_malformed_trace_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.jsonl"
    assert gen(good, n=2) == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(good.read_text() + '{"workflow_id": "x", "nodes": [}\n')
    capsys.readouterr()
    line = error_of(capsys, bench_argv(bad, tmp_path))
    assert "bad.jsonl:3:" in line and "invalid JSON" in line


def test_bench_invalid_workflow_in_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(
            {
                "workflow_id": "w",
                "nodes": [
                    {"id": "a", "parents": ["ghost"], "output_tokens": 3, "prompt": [{"unique": 4}]}
                ],
            }
        )
        + "\n"
    )
    line = error_of(capsys, bench_argv(bad, tmp_path))
    assert "bad.jsonl:1:" in line and "'ghost'" in line


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--param", "wasma.transfer"], "--param"),
        (["--param", "transfer=false"], "--param"),
        (["--policies", "wasma", "--param", "kv_aware.overlap_score_weight=2"], "kv_aware"),
        (["--profile", "nope"], "nope"),
        (["--engines", "0"], "--engines"),
    ],
)
def test_bench_other_bad_flags(
    extra: list[str],
    needle: str,
    trace_file: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    line = error_of(capsys, bench_argv(trace_file, tmp_path, *extra))
    assert needle in line


def test_bench_unknown_policy_parameter(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = bench_argv(trace_file, tmp_path, "--policies", "wasma", "--param", "wasma.bogus=1")
    assert main(argv) == 2
    assert "bogus" in capsys.readouterr().err


def test_bench_unknown_policy_parameter_fails_fast_on_one_line(
    trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = bench_argv(trace_file, tmp_path, "--policies", "wasma", "--param", "wasma.bogus=1")
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("wasma: error: ") and "bogus" in err
    assert len(err.splitlines()) == 1


def test_error_messages_are_one_line(trace_file: Path, tmp_path: Path) -> None:
    """The console script prints exactly one line for errors it detects itself."""
    proc = subprocess.run(
        [sys.executable, "-m", "wasma.deploy.cli", *bench_argv(tmp_path / "nope.jsonl", tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1
    assert proc.stderr.startswith("wasma: error: ")


def test_flag_errors_are_one_line(trace_file: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "wasma.deploy.cli",
            *bench_argv(trace_file, tmp_path, "--rates", "1,x"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1


def test_bench_request_longer_than_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = tmp_path / "big.jsonl"
    node = {"id": "a", "parents": [], "output_tokens": 5, "prompt": [{"unique": 200_000}]}
    big.write_text(json.dumps({"workflow_id": "w", "nodes": [node]}) + "\n")
    assert main(bench_argv(big, tmp_path, "--policies", "round_robin")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "big.jsonl" in err and "max_model_len" in err


def test_plan_subcommand_forwards_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from wasma.deploy.cli import main

    rc = main(
        [
            "plan",
            "--topology",
            "preset:hgx-h100",
            "--src",
            "n0.gpu0",
            "--dst",
            "n0.gpu1",
            "--bytes",
            "1000000",
            "--json",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["predicted_s"] > 0 and out["algorithm"]
    assert (
        main(["plan", "--topology", "preset:nope", "--src", "a", "--dst", "b", "--bytes", "1"]) == 2
    )


def test_trace_gen_token_scale_fits_a_small_model(tmp_path: Path) -> None:
    from wasma.deploy.cli import main
    from wasma.scheduler.trace import load_trace

    out = tmp_path / "t.jsonl"
    args = [
        "trace",
        "gen",
        "--app",
        "mapreduce",
        "--workflows",
        "3",
        "--rate",
        "1",
        "--profile",
        "tiny-cpu",
        "-o",
        str(out),
    ]
    assert main(args) == 2  # full-size prompts exceed the tiny model's 4k context
    assert main([*args, "--token-scale", "0.3"]) == 0
    wfs = load_trace(out)
    assert max(w.prompt_tokens(n) for w in wfs for n in w.nodes) <= 4096


_POLICY = r"--config params: policy 'wasma'"


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        ({"params": {"host_contention": -1}}, _POLICY + ".*host_contention must be a number >= 0"),
        ({"params": {"bogus": 1}}, _POLICY + r".*unknown parameter\(s\) \['bogus'\]"),
        *(
            ({"retain_lease_s": lease}, r"--config retain_lease_s: expected seconds")
            for lease in (0, -5, "soon", True, 1e6)
        ),
        ({"params": {"transfer": "maybe"}}, _POLICY + ".*transfer must be true or false"),
        ({"params": 5}, r"--config params: expected a mapping"),
        *(
            ({"sim_speed": speed}, r"--config sim_speed: expected a number > 0")
            for speed in (0, -3, "abc", [1], True)
        ),
        *(
            ({"max_outstanding": n}, r"--config max_outstanding: expected an integer >= 1")
            for n in (-5, 1.9, "abc", [1])
        ),
        ({"kv_transfer": "false"}, r"--config kv_transfer: expected true or false"),
        ({"kv_events": [1, 2]}, r"--config kv_events: expected a list of endpoints"),
        ({"gateway": {"admin_port": "abc"}}, r"--config gateway.admin_port: expected a port"),
        ({"gateway": {"max_tokens_limit": "abc"}}, r"--config gateway.max_tokens_limit"),
        ({"gateway": {"protect_metrics": "yes"}}, r"--config gateway.protect_metrics"),
        *(
            ({"reliability": {"max_failovers": n}}, r"--config reliability: max_failovers")
            for n in (-1, 1.9, True)
        ),
    ],
)
def test_serve_bad_config_fails_before_the_server_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, object], pattern: str
) -> None:
    cfg = tmp_path / "serve.json"
    cfg.write_text(json.dumps(config))
    argv = ["serve", "--engines", "sim:1", "--router-in-process", "--config", str(cfg)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("wasma: error: --config ")
    assert len(err.splitlines()) == 1
    assert re.search(pattern, err)


def _models_server(status: int) -> Any:
    """A loopback HTTP server answering every GET with `status` (a stand-in engine)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Answer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'{"data": [{"id": "m"}]}'
            self.send_response(status)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_serve_names_an_openai_engine_that_does_not_answer(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from wasma.deploy.build import free_ports
    from wasma.deploy.serve import ConfigError, check_engines_answer

    up, refusing = _models_server(200), _models_server(401)
    try:
        good = f"http://127.0.0.1:{up.server_address[1]}"
        check_engines_answer([good], None)  # answers: nothing to say
        nobody = f"http://127.0.0.1:{free_ports(1)[0]}"
        for urls, pattern in (
            ([good, nobody], r"engine 1 at http://127\.0\.0\.1:\d+ cannot be reached \(.+\)"),
            (
                [f"http://127.0.0.1:{refusing.server_address[1]}"],
                r"engine 0 at .* answered GET /v1/models with HTTP 401",
            ),
        ):
            # Said in one line naming the engine; no longer fatal to `wasma serve`, which
            # starts and turns ready once the engine answers (tests/deploy/test_lifecycle).
            with pytest.raises(ConfigError) as info:
                check_engines_answer(urls, None)
            assert re.search("^--engines: " + pattern, str(info.value)), info.value
    finally:
        up.shutdown()
        refusing.shutdown()


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"gateway: {a: [1,\n", r"invalid YAML at line \d+, column \d+"),
        (b"sim_speed: \xff\n", "not UTF-8 text"),
        (b"sim_speed: " + b"9" * 5000 + b"\n", "invalid YAML"),
        (b"1: a\nfoo: b\n", r"unknown key\(s\) \[1, 'foo'\]"),
    ],
    ids=["yaml", "utf8", "long-int", "mixed-keys"],
)
def test_serve_unreadable_config_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, pattern: str
) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_bytes(content)
    argv = ["serve", "--engines", "sim:1", "--router-in-process", "--config", str(cfg)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("wasma: error: --config ")
    assert re.search(pattern, err), err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve", "--engines", "sim:1", "--port", "70000"], "--port"),
        (["serve", "--engines", "sim:1", "--port", "-1"], "--port"),
        (["replay", "--url", "ftp://x", "--trace", "t.jsonl", "--out", "o"], "--url"),
        (["replay", "--url", "localhost:8000", "--trace", "t.jsonl", "--out", "o"], "--url"),
    ],
)
def test_serve_and_replay_bad_flags(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert needle in error_of(capsys, argv)


@pytest.mark.parametrize("command", ["bench", "replay"])
def test_an_out_that_is_a_file_fails_before_any_run(
    command: str, trace_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("a file")
    if command == "bench":
        argv = [*bench_argv(trace_file, tmp_path)]
        argv[argv.index("--out") + 1] = str(taken)
    else:  # no server listens on port 1: a run would fail only after trying every request
        argv = ["replay", "--url", "http://127.0.0.1:1", "--trace", str(trace_file)]
        argv += ["--out", str(taken)]
    line = error_of(capsys, argv)
    assert "--out" in line and "not a folder" in line
    assert taken.read_text() == "a file"


def test_bench_sweep_cuts_failing_probes_unless_full_probes(tmp_path: Path) -> None:
    trace = tmp_path / "mr.jsonl"
    gen_argv = ["--app", "mapreduce", "--workflows", "24", "--rate", "2", "--seed", "5"]
    assert main(["trace", "gen", *gen_argv, "-o", str(trace)]) == 0
    argv = ["bench", "--trace", str(trace), "--policies", "least_loaded", "--engines", "2"]
    res = {}
    for flag in ([], ["--full-probes"]):
        out = tmp_path / ("full" if flag else "cut")
        assert main([*argv, "--workers", "1", "--sweep", *flag, "--out", str(out)]) == 0
        res[bool(flag)] = json.loads((out / "results.json").read_text())
    assert res[True]["capacity"] == res[False]["capacity"]
    assert not any(r.get("cut_short") for r in res[True]["runs"])
    assert "cut_short_runs" not in res[True]
    # whole runs only in "runs"; the probes cut short beside them
    assert not any(r.get("cut_short") for r in res[False]["runs"])
    cut = res[False]["cut_short_runs"]
    assert cut and all(r["cut_short"] and "deadline_attainment" not in r for r in cut)
    assert all(r["deadline_attainment_max"] < 0.9 for r in cut)
