"""Mooncake/Azure import and Mooncake export (benchmarks/trace_io.py, `wasma trace`)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from wasma.benchmarks.metrics import prefix_hit_ceiling
from wasma.benchmarks.trace_io import (
    read_azure,
    read_mooncake,
    to_mooncake,
    to_workflows,
    write_mooncake,
)
from wasma.core.profile import load_profile
from wasma.deploy.cli import main
from wasma.scheduler.trace import TraceError, load_trace

SLICE = Path(__file__).parent / "data" / "mooncake_slice.jsonl"
# Mooncake's real conversation trace (FAST'25 release), shipped with the benchmarks.
CONVERSATION = Path(__file__).parents[2] / "benchmarks" / "data" / "mooncake_conversation.jsonl.gz"


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_mooncake_round_trip_is_exact(tmp_path: Path) -> None:
    """The first 200 requests of Mooncake's synthetic trace export back to themselves."""
    prof = load_profile("llama3-8b-h100")
    wfs, dropped = to_workflows(read_mooncake(SLICE), prof)
    assert dropped == 0 and len(wfs) == 200
    out = tmp_path / "back.jsonl"
    write_mooncake(out, to_mooncake(wfs))
    assert _lines(out) == _lines(SLICE)


def test_gzipped_traces_read_as_their_text(tmp_path: Path) -> None:
    packed = tmp_path / "slice.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write(SLICE.read_text())
    assert read_mooncake(packed) == read_mooncake(SLICE)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(packed.read_bytes()[:200])
    with pytest.raises(TraceError, match="not a readable gzip file") as info:
        read_mooncake(cut)
    assert str(info.value).startswith(str(cut))


def test_real_conversation_trace_round_trips() -> None:
    """The bundled real trace: all 12,031 requests import (none too long) and export back
    to the published lines; every prompt starts with the same block (a shared system
    prompt) and later turns extend earlier prompts, so the prefix structure is there."""
    prof = load_profile("llama3-8b-h100")
    reqs = read_mooncake(CONVERSATION)
    wfs, dropped = to_workflows(reqs, prof)
    assert dropped == 0 and len(wfs) == 12_031
    with gzip.open(CONVERSATION, "rt") as f:
        published = [json.loads(line) for line in f if line.strip()]
    assert to_mooncake(wfs) == published
    assert {r.hash_ids[0] for r in reqs} == {0}
    seen: set[tuple[int, ...]] = set()
    turns = 0
    for r in reqs:
        ids = r.hash_ids
        turns += any(ids[:k] in seen for k in range(2, len(ids)))
        seen.add(ids[: r.input_tokens // 512])
    assert turns > 3_000  # 3,975: a third of the requests continue an earlier prompt
    assert 0.3 < prefix_hit_ceiling(wfs, prof.block_size) < 0.45


def test_shared_blocks_share_kv_exactly() -> None:
    """Requests sharing hash ids share exactly those blocks: the unbounded-cache hit
    ceiling of the imported trace equals the one computed from the ids themselves."""
    reqs = read_mooncake(SLICE)
    wfs, _ = to_workflows(reqs, load_profile("llama3-8b-h100"))
    seen: set[int] = set()
    hit = total = 0
    for r in reqs:
        shared = 0
        for h in r.hash_ids:
            if h not in seen:
                break
            shared += 1
        # Blocks of 512 are 32 blocks of 16; vLLM never hits the last prompt token.
        hit += min(shared * 512, (r.input_tokens - 1) // 16 * 16)
        total += r.input_tokens
        seen.update(r.hash_ids)
    assert prefix_hit_ceiling(wfs, 16) == pytest.approx(hit / total)
    assert hit > 0


def test_cli_import_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    wasma_trace = tmp_path / "mc.jsonl"
    src = str(SLICE)
    assert main(["trace", "import", "--format", "mooncake", src, "-o", str(wasma_trace)]) == 0
    wfs = load_trace(wasma_trace)
    assert len(wfs) == 200 and all(w.deadline_s > 0 for w in wfs)
    back = tmp_path / "back.jsonl"
    assert main(["trace", "export", "--format", "mooncake", str(wasma_trace), "-o", str(back)]) == 0
    assert _lines(back) == _lines(SLICE)
    assert "wrote 200 requests" in capsys.readouterr().out


def test_too_long_requests_are_dropped_and_counted(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n'
        '{"timestamp": 5, "input_length": 9000, "output_length": 5}\n'
    )
    wfs, dropped = to_workflows(read_mooncake(f), load_profile("tiny-cpu"))
    assert dropped == 1 and len(wfs) == 1


def test_azure_import(tmp_path: Path) -> None:
    f = tmp_path / "azure.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
    )
    reqs = read_azure(f)
    assert [r.input_tokens for r in reqs] == [374, 396]
    assert reqs[0].arrival_s == 0.0 and reqs[1].arrival_s == pytest.approx(4.314579)
    wfs, _ = to_workflows(reqs, load_profile("llama3-8b-h100"))
    # No content in the trace: nothing is shared.
    assert prefix_hit_ceiling(wfs, 16) == 0.0
    recs = to_mooncake(wfs)
    assert [len(r["hash_ids"]) for r in recs] == [1, 1]


@pytest.mark.parametrize(
    ("line", "msg"),
    [
        ('{"timestamp": 0, "input_length": 10}', "missing field 'output_length'"),
        ('{"timestamp": -1, "input_length": 10, "output_length": 1}', "timestamp must be >= 0"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1}', "input_length must be"),
        (
            '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}',
            "1 hash_ids for input_length 1000",
        ),
        ("[1, 2]", "must be a JSON object"),
        ("{bad", "invalid JSON"),
    ],
)
def test_bad_mooncake_is_a_file_line_error(tmp_path: Path, line: str, msg: str) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(TraceError, match=msg) as info:
        read_mooncake(f)
    assert str(info.value).startswith(f"{f}:1:")


def test_bad_azure_header(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "a.csv"
    f.write_text("time,tokens\n1,2\n")
    assert main(["trace", "import", "--format", "azure", str(f), "-o", str(tmp_path / "o")]) == 2
    assert "header must name TIMESTAMP" in capsys.readouterr().err
