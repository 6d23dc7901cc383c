"""Mooncake/Azure import and Mooncake export (benchmarks/trace_io.py, `wasma trace`)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from wasma.benchmarks.metrics import prefix_hit_ceiling
from wasma.benchmarks.trace_io import (
    TraceRequest,
    read_azure,
    read_mooncake,
    session_parents,
    to_mooncake,
    to_workflows,
    write_mooncake,
)
from wasma.core.profile import load_profile
from wasma.deploy.cli import main
from wasma.scheduler.trace import TraceError, load_trace
from wasma.scheduler.workflow import ContextOf, Shared

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


def _req(t: float, n_in: int, n_out: int, ids: list[int]) -> TraceRequest:
    assert len(ids) == -(-n_in // 512)
    return TraceRequest(t, n_in, n_out, tuple(ids))


# Hand-checked session edges. Full-block ids are those of a prompt's complete 512-token
# blocks (a partial last block has an id of its own, which a longer prompt never has).
SESSION_CASES = [
    _req(0, 1300, 100, [0, 1, 2]),  # 0: a first turn; full blocks [0, 1]
    _req(5, 1400, 50, [0, 40, 41]),  # 1: shares only the common first block: no parent
    _req(10, 2000, 200, [0, 1, 10, 11]),  # 2: turn 2 of 0 (2000 > 1300 + 100); full [0,1,10]
    _req(15, 1800, 60, [0, 1, 30, 31]),  # 3: a second branch from 0
    _req(20, 3000, 90, [0, 1, 10, 20, 21, 22]),  # 4: turn 3, of 2 (3 blocks beat 0's 2)
    _req(30, 1350, 10, [0, 1, 50]),  # 5: 0's full blocks, but no room for 0's answer
    _req(40, 1024, 10, [0, 61]),  # 6: block-aligned: every id is a full block's
    _req(50, 1200, 10, [0, 61, 62]),  # 7: continues 6's whole prompt
    _req(60, 1100, 10, [0, 61, 63]),  # 8: of 6: 7 shares [0, 61] too, but 1100 < 1200 + 10
]


def test_session_edges_follow_the_prefix_rule() -> None:
    assert session_parents(SESSION_CASES) == [None, None, 0, 0, 2, None, None, 6, 6]
    # Arrival order decides "earlier", not file order: a turn listed before its parent.
    swapped = [SESSION_CASES[2], SESSION_CASES[0]]
    assert session_parents(swapped) == [1, None]
    # One shared block is no evidence (every prompt of the real trace starts with it);
    # asking for it anyway links request 1 to nothing either (0 has two full blocks).
    assert session_parents(SESSION_CASES, min_blocks=1)[1] is None


def test_sessions_become_workflows_with_turns_at_their_arrivals() -> None:
    prof = load_profile("llama3-8b-h100")
    wfs, dropped = to_workflows(SESSION_CASES, prof, sessions=True)
    assert dropped == 0
    by_id = {w.workflow_id: w for w in wfs}
    assert sorted(by_id) == [f"mooncake-{i}" for i in (0, 1, 5, 6)]
    conv = by_id["mooncake-0"]
    assert sorted(conv.nodes) == ["r0", "r2", "r3", "r4"]
    assert conv.nodes["r4"].parents == ("r2",) and conv.nodes["r2"].parents == ("r0",)
    assert conv.nodes["r3"].parents == ("r0",)
    # A turn reads its parent's whole context, then the rest of its own blocks: 2000 =
    # 0's 1300 + 100, then 600 tokens of blocks 10 (the part from token 1400) and 11.
    assert conv.nodes["r2"].prompt == (
        ContextOf("r0"),
        Shared("mooncake:10", 136),
        Shared("mooncake:11", 464),
    )
    for w in wfs:
        for nid, node in w.nodes.items():
            r = SESSION_CASES[int(nid[1:])]
            assert w.prompt_tokens(nid) == r.input_tokens
            assert node.arrival_s == r.arrival_s and node.deadline_s is not None
            assert node.deadline_s == pytest.approx(
                2 * prof.request_alone_s(r.input_tokens, r.output_tokens), abs=1e-6
            )
    # Each turn's deadline is its own; the workflow's spans the conversation.
    assert conv.deadline_s == pytest.approx(20 + conv.nodes["r4"].deadline_s, abs=1e-5)
    # Turns read their ancestors' KV: a turn's prompt extends its parent's context.
    assert conv.context_readers("r0") == ("r2", "r3")
    span = conv.prompt_span("r4")
    assert span[: len(conv.context_span("r2"))] == conv.context_span("r2")


def test_sessions_export_at_each_turns_time(tmp_path: Path) -> None:
    """Exported, a sessions trace keeps every request's time, lengths and order (the
    parent's answer is now the parent's own output, so its blocks get their own ids)."""
    wfs, _ = to_workflows(SESSION_CASES, load_profile("llama3-8b-h100"), sessions=True)
    recs = to_mooncake(wfs)
    got = [(r["timestamp"], r["input_length"], r["output_length"]) for r in recs]
    want = [(round(r.arrival_s * 1000), r.input_tokens, r.output_tokens) for r in SESSION_CASES]
    assert got == want
    assert [r.get("session_id") for r in recs][:5] == [
        "mooncake-0",
        None,
        "mooncake-0",
        "mooncake-0",
        "mooncake-0",
    ]
    # A turn's ids start with its parent's full blocks, as in the source trace.
    assert recs[2]["hash_ids"][:2] == recs[0]["hash_ids"][:2]
    assert recs[4]["hash_ids"][:3] == recs[2]["hash_ids"][:3]
    out = tmp_path / "mc.jsonl"
    args = ["trace", "import", "--format", "mooncake", "--sessions", str(SLICE), "-o", str(out)]
    assert main(args) == 0
    assert sum(len(w) for w in load_trace(out)) == 200


def test_real_conversation_trace_imports_as_sessions() -> None:
    """All 12,031 requests of the real trace import with sessions, none dropped; each
    keeps its prompt length and arrival, and the turns that continue an earlier
    request's whole context are its children."""
    prof = load_profile("llama3-8b-h100")
    reqs = read_mooncake(CONVERSATION)
    wfs, dropped = to_workflows(reqs, prof, sessions=True)
    assert dropped == 0
    assert sum(len(w) for w in wfs) == 12_031
    parents = session_parents(reqs)
    children = sum(p is not None for p in parents)
    assert len(wfs) == 12_031 - children
    assert 3_500 < children < 4_000  # the others start conversations or share less
    seen = 0
    for w in wfs:
        for nid, node in w.nodes.items():
            i = int(nid[1:])
            seen += 1
            assert w.prompt_tokens(nid) == reqs[i].input_tokens
            assert node.arrival_s == pytest.approx(reqs[i].arrival_s)
            p = parents[i]
            assert node.parents == (() if p is None else (f"r{p}",))
            if p is not None:
                assert reqs[p].arrival_s <= reqs[i].arrival_s
                assert isinstance(node.prompt[0], ContextOf)
    assert seen == 12_031
    assert max(len(w) for w in wfs) > 10  # conversations many turns deep
    # The answers a turn follows are now reused too: the ceiling rises a little.
    plain, _ = to_workflows(reqs, prof)
    assert prefix_hit_ceiling(plain, 16) < prefix_hit_ceiling(wfs, 16) < 0.45
