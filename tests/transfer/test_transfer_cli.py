from __future__ import annotations

import json
from pathlib import Path

import pytest

from wasma.transfer import build_preset, plan_main
from wasma.transfer.cli import plan_main as cli_plan_main


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = plan_main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        [
            "--topology",
            "preset:hgx-h100:2",
            "--src",
            "n0.gpu0",
            "--dst",
            "n0.gpu1,n1.gpu0,n1.gpu1",
            "--bytes",
            "1073741824",
            "--json",
        ],
        capsys,
    )
    assert code == 0, err
    data = json.loads(out)
    assert {"algorithm", "predicted_s", "steps"} <= set(data)
    assert (
        data["predicted_s"] > 0 and data["steps"] and all(isinstance(s, str) for s in data["steps"])
    )
    assert data["bytes"] == 1 << 30


def test_text_output_and_units(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(
        ["--topology", "preset:pcie-8", "--src", "n0.gpu0", "--dst", "n0.gpu7", "--bytes", "64MiB"],
        capsys,
    )
    assert code == 0
    assert "predicted" in out and "n0.gpu7" in out


def test_yaml_file_and_algorithm_filter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(build_preset("hgx-h200").to_dict()))
    code, out, _ = run(
        [
            "--topology",
            str(path),
            "--src",
            "n0.gpu0",
            "--dst",
            "n0.gpu1,n0.gpu2,n0.gpu3",
            "--bytes",
            "1000000000",
            "--algorithms",
            "chain",
            "--json",
        ],
        capsys,
    )
    assert code == 0
    assert json.loads(out)["algorithm"] == "chain"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--topology", "preset:nope", "--src", "n0.gpu0", "--dst", "n0.gpu1", "--bytes", "1"],
            "unknown preset",
        ),
        (
            [
                "--topology",
                "preset:hgx-h100",
                "--src",
                "n0.gpu0",
                "--dst",
                "n0.gpu9",
                "--bytes",
                "1",
            ],
            "unknown device 'n0.gpu9'",
        ),
        (
            [
                "--topology",
                "preset:hgx-h100",
                "--src",
                "n0.gpu0",
                "--dst",
                "n0.gpu1",
                "--bytes",
                "lots",
            ],
            "--bytes",
        ),
        (
            [
                "--topology",
                "preset:hgx-h100",
                "--src",
                "n0.gpu0",
                "--dst",
                "n0.gpu1",
                "--bytes",
                "-5",
            ],
            "--bytes",
        ),
        (
            ["--topology", "preset:hgx-h100", "--src", "n0.gpu0", "--dst", ",", "--bytes", "1"],
            "--dst names no device",
        ),
        (["--topology", "preset:hgx-h100", "--src", "n0.gpu0"], "required"),
        (
            ["--topology", "/no/such/file.yaml", "--src", "a", "--dst", "b", "--bytes", "1"],
            "neither a preset",
        ),
        (
            [
                "--topology",
                "preset:hgx-h100",
                "--src",
                "n0.nvswitch",
                "--dst",
                "n0.gpu1",
                "--bytes",
                "1",
            ],
            "not a gpu",
        ),
        (
            [
                "--topology",
                "preset:hgx-h100",
                "--src",
                "n0.gpu0",
                "--dst",
                "n0.gpu1",
                "--bytes",
                "1",
                "--algorithms",
                "teleport",
            ],
            "unknown algorithm",
        ),
    ],
)
def test_errors_are_one_line_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(argv, capsys)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("wasma plan: error: ")
    assert message in err


def test_exported_from_package() -> None:
    assert plan_main is cli_plan_main


def test_closed_reader_ends_quietly() -> None:
    """`wasma plan ... | head`: the reader closes early; no BrokenPipe traceback."""
    import os
    import subprocess
    import sys

    code = (
        "import sys; from wasma.deploy.cli import main; sys.exit(main(["
        "'plan', '--topology', 'preset:hgx-h200:2', '--src', 'n0.gpu0', '--dst', "
        "','.join(f'n1.gpu{g}' for g in range(8)), '--bytes', '1GiB']))"
    )
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    proc = subprocess.run(
        [sys.executable, "-c", code],
        stdout=write,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    os.close(write)
    assert proc.stderr == ""
    assert proc.returncode == 141


def test_bound_and_ratio_in_json_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--topology", "preset:hgx-h200:2", "--src", "n0.gpu0", "--bytes", "1GiB"]
    dsts = ",".join(f"n1.gpu{g}" for g in range(8))
    code, out, err = run([*argv, "--dst", dsts, "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert {"algorithm", "predicted_s", "bound_s", "ratio", "steps"} <= set(data)
    assert data["ratio"] == pytest.approx(data["predicted_s"] / data["bound_s"])
    assert 1.0 <= data["ratio"] <= 1.15
    code, out, _ = run([*argv, "--dst", dsts], capsys)
    assert code == 0 and "bound" in out and "ratio" in out
    # Several holders: each may send.
    code, out, _ = run(
        [
            "--topology",
            "preset:hgx-h200:2",
            "--src",
            "n0.gpu0,n1.gpu0",
            "--dst",
            "n1.gpu1",
            "--bytes",
            "1GiB",
            "--json",
        ],
        capsys,
    )
    assert code == 0 and set(json.loads(out)["holders"]) <= {"n0.gpu0", "n1.gpu0"}


def test_gather_and_scatter_patterns(capsys: pytest.CaptureFixture[str]) -> None:
    rest = ",".join(f"n1.gpu{g}" for g in range(8))
    base = ["--topology", "preset:hgx-h200:2", "--bytes", "64MiB", "--json"]
    code, out, err = run([*base, "--src", "n0.gpu0", "--dst", rest, "--pattern", "scatter"], capsys)
    assert code == 0, err
    scatter = json.loads(out)
    assert scatter["pattern"] == "scatter" and scatter["ratio"] <= 1.15
    assert [w["device"] for w in scatter["wanted"]] == rest.split(",")
    assert sum(w["num_bytes"] for w in scatter["wanted"]) == 64 << 20
    code, out, err = run([*base, "--src", rest, "--dst", "n0.gpu0", "--pattern", "gather"], capsys)
    assert code == 0, err
    gather = json.loads(out)
    assert gather["pattern"] == "gather" and gather["held"] and gather["ratio"] <= 1.15
    text = ["--topology", "preset:hgx-h200:1", "--src", "n0.gpu0", "--bytes", "1MiB"]
    code, out, _ = run([*text, "--dst", "n0.gpu1,n0.gpu2", "--pattern", "scatter"], capsys)
    assert code == 0 and "(scatter)" in out.splitlines()[0] and "ratio" in out
    for argv, message in [
        ([*text, "--dst", "n0.gpu1,n0.gpu2", "--pattern", "gather"], "one --dst"),
        (
            [
                *text[:2],
                "--src",
                "n0.gpu0,n0.gpu3",
                *text[4:],
                "--dst",
                "n0.gpu1",
                "--pattern",
                "scatter",
            ],
            "one --src",
        ),
        ([*text, "--dst", "n0.gpu1", "--pattern", "scatter", "--algorithms", "chain"], "broadcast"),
    ]:
        code, out, err = run(argv, capsys)
        assert code == 2 and message in err and err.count("\n") == 1, err
