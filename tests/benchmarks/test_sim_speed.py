"""The simulator-speed benchmark (benchmarks/studies/sim_speed.py)."""

from __future__ import annotations

import pytest

from wasma.benchmarks.studies.sim_speed import main, measure


def test_measure_reports_requests_per_cpu_second_at_a_token_scale() -> None:
    full = measure("mapreduce", 4, 2.0, 2, "least_loaded")
    small = measure("mapreduce", 4, 2.0, 2, "least_loaded", token_scale=0.1)
    assert full["requests"] == small["requests"] > 0  # the same workflows, shorter
    assert small["token_scale"] == 0.1 and full["token_scale"] == 1.0
    for row in (full, small):
        assert row["requests_per_cpu_s"] > 0 and row["engine_steps"] > 0


def test_a_streamed_measure_replays_the_same_workflows() -> None:
    listed = measure("mapreduce", 4, 2.0, 2, "least_loaded", token_scale=0.1)
    streamed = measure("mapreduce", 4, 2.0, 2, "least_loaded", token_scale=0.1, stream=True)
    assert streamed["stream"] and not listed["stream"]
    for key in ("requests", "engine_steps", "engine_steps_per_request"):
        assert streamed[key] == listed[key]


def test_a_token_scale_out_of_range_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--token-scale", "0"])
    assert exc.value.code == 2
    assert "--token-scale must be in (0, 100]" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--wide-workflows", "--large-workflows", "--repeat"])
def test_a_count_below_one_is_a_usage_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([flag, "0"])
    assert exc.value.code == 2
    assert f"{flag} must be a positive integer" in capsys.readouterr().err
