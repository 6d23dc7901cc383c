"""The KV-pressure benchmark (benchmarks/studies/kv_pressure.py): its profiles, rows and table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from wasma.benchmarks.apps import generate
from wasma.benchmarks.bench import RunSpec, run_one
from wasma.benchmarks.studies.kv_pressure import main, pressure_profile, variants
from wasma.core.profile import load_profile
from wasma.scheduler.trace import write_trace

BASE = load_profile("llama3-8b-h100")


def test_pressure_profile_cuts_only_the_pool(tmp_path: Path) -> None:
    path = pressure_profile(BASE, 32768, tmp_path)
    prof = load_profile(str(path))
    assert prof.name == "llama3-8b-h100-kv32k"
    # 2,048 blocks of 16 tokens, plus vLLM's null block.
    assert prof.num_kv_blocks == 32768 // 16 + 1
    # vLLM refuses a max_model_len the pool cannot hold.
    assert prof.max_model_len == 32768
    assert prof.step == BASE.step
    assert prof.block_size == BASE.block_size
    assert prof.max_num_batched_tokens == BASE.max_num_batched_tokens
    assert "kv_pressure" in prof.sources[-1]


def test_pressure_profile_rejects_a_pool_under_two_blocks(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        pressure_profile(BASE, 16, tmp_path)


def test_a_small_pool_preempts_where_the_full_one_does_not(tmp_path: Path) -> None:
    # Eight mapreduce workflows at once on one engine: ~4k-token prompts, 8 workers each.
    trace = tmp_path / "mr.jsonl"
    write_trace(trace, generate("mapreduce", 8, 50.0, 3, BASE))
    small = str(pressure_profile(BASE, 16384, tmp_path))
    full = run_one(RunSpec(str(trace), "least_loaded", 1.0, 1, "llama3-8b-h100"))
    tight = run_one(RunSpec(str(trace), "least_loaded", 1.0, 1, small))
    assert full["preemptions"] == 0
    assert tight["preemptions"] > 0
    assert tight["recomputed_prompt_tokens"] > full["recomputed_prompt_tokens"]


def test_main_writes_a_row_per_app_load_and_variant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "kvp"
    args = ["--out", str(out), "--kv-tokens", "65536", "--loads", "1", "--workflows", "4"]
    assert main([*args, "--workers", "1"]) == 0
    data = json.loads((out / "results.json").read_text())
    rows = data["runs"]
    names = list(variants())
    assert names == [
        "all on",
        "no retain",
        "no hopeless",
        "no priority",
        "no kv_admission",
        "engine priority",
        "retention by lease only",
    ]
    assert [(r["app"], r["variant"]) for r in rows] == [
        (app, name) for app in ("pipeline", "mapreduce", "debate") for name in names
    ]
    for r in rows:
        assert r["kv_tokens"] == 65536 and r["load"] == 1.0
        assert r["profile"] == "llama3-8b-h100-kv64k"
        cap = data["least_loaded_capacity"]["65536"][r["app"]]
        assert r["rate_scale"] == pytest.approx(cap)
        assert r.get("params", {}) == variants()[r["variant"]]
    assert rows[1]["params"] == {"retain": False}
    assert (out / "llama3-8b-h100-kv64k.yaml").is_file()
    table = (out / "table.md").read_text()
    assert table.count("\n| 65,536 | ") == len(rows)
    assert "| 65,536 | pipeline | 1x (" in capsys.readouterr().out


def test_main_rejects_bad_numbers(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--loads: expected"):
        main(["--out", str(tmp_path), "--loads", "1,x"])
    with pytest.raises(SystemExit, match="--kv-tokens: expected positive"):
        main(["--out", str(tmp_path), "--kv-tokens", "-5"])
