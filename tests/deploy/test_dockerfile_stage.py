"""The Docker-less replay of a Python-based Dockerfile stage (deploy/dockerfile_stage.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from wasma.deploy.dockerfile_stage import (
    StageError,
    _programs,
    instructions,
    main,
    replay,
    stage,
)

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def test_the_gateway_stage_is_read_from_the_dockerfile() -> None:
    st = stage(DOCKERFILE.read_text(), "gateway")
    assert st.base == "python:3.11-slim"
    runs = [i.args for i in st.instructions if i.keyword == "RUN"]
    # The install and its checks are Python commands (replayed); the user setup is not.
    assert [set(_programs(r)) <= {"python3", "true", "wasma"} for r in runs] == [True, False]
    assert "wasma --help" in runs[0] and "import vllm" in runs[0]
    # The slim image drops what only GPUs use.
    assert "triton" in runs[0].split("uninstall", 1)[1]


def test_build_args_reach_the_base_image() -> None:
    text = "ARG PY=python:3.11-slim\nFROM ${PY} AS one\nFROM scratch AS two\n"
    assert stage(text, "one", {"PY": "python:3.12-slim"}).base == "python:3.12-slim"
    with pytest.raises(StageError, match=r"no stage named 'three'.*'one', 'two'"):
        stage(text, "three")


def test_continuations_and_comments() -> None:
    text = "FROM python:3.11-slim AS a\n# c\nRUN python3 -c 1 \\\n    # inside\n    && true\n"
    assert [(i.keyword, i.args) for i in instructions(text)] == [
        ("FROM", "python:3.11-slim AS a"),
        ("RUN", "python3 -c 1 && true"),
    ]
    with pytest.raises(StageError, match="continued"):
        instructions("FROM x\nRUN a \\\n")


def test_programs_respect_quotes_and_redirections() -> None:
    cmd = 'python3 -c "import a; import b" > /dev/null && (pip uninstall -y x || true)'
    assert _programs(cmd) == ["python3", "pip", "true"]


def test_the_engine_stage_is_refused_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["--dockerfile", str(DOCKERFILE), "--target", "engine", "--out", str(tmp_path / "o")]
    )
    assert code == 2
    assert "vllm/vllm-openai" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_a_stage_is_replayed_with_its_env_copies_and_checks(tmp_path: Path) -> None:
    context = tmp_path / "ctx"
    (context / "pkg").mkdir(parents=True)
    (context / "pkg" / "mod.py").write_text("VALUE = 41\n")
    (context / "pkg" / "link.py").symlink_to("mod.py")
    (context / "top.txt").write_text("x")
    (context / "Dockerfile").write_text(
        "ARG BASE=python:3.11-slim\n"
        "FROM ${BASE} AS app\n"
        "ARG GREETING=hello\n"
        "ENV WASMA_T=${GREETING} EMPTY=\n"
        "WORKDIR /opt/app\n"
        "COPY pkg/ pkg/\n"
        "COPY top.txt ./\n"
        "RUN python3 -c \"import os, sys; sys.path.insert(0, 'pkg'); import mod; "
        "assert mod.VALUE == 41; assert os.path.islink('pkg/link.py'); "
        "assert open('top.txt').read() == 'x'; assert os.environ['WASMA_T'] == 'hello'; "
        'assert sys.prefix != sys.base_prefix"\n'
        "RUN useradd someone\n"
        "USER 1000\n"
    )
    result = replay(context / "Dockerfile", "app", tmp_path / "out", context)
    assert result.ok, [s.detail for s in result.steps]
    assert [(s.ran, s.ok) for s in result.steps] == [(True, True)] * 3 + [(False, True)]
    assert "useradd" in result.steps[-1].detail

    # A failing check fails the replay and stops it.
    dockerfile = context / "Dockerfile"
    dockerfile.write_text(
        "FROM python:3.11-slim AS app\nRUN python3 -c 'raise SystemExit(\"no\")'\n"
        "RUN python3 -c 1\n"
    )
    failed = replay(dockerfile, "app", tmp_path / "out2", context)
    assert not failed.ok and len(failed.steps) == 1 and "no" in failed.steps[0].detail
    with pytest.raises(StageError, match="exists"):
        replay(dockerfile, "app", tmp_path / "out2", context)


def test_a_missing_copy_source_is_named(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text("FROM python:3.11-slim AS a\nCOPY nothere/ x/\n")
    with pytest.raises(StageError, match="'nothere/'"):
        replay(tmp_path / "Dockerfile", "a", tmp_path / "out", tmp_path)


def test_runs_as_a_module() -> None:
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "wasma.deploy.dockerfile_stage", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and "--target" in done.stdout
