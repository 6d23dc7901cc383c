"""The JSONL trace format (scheduler/trace.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from wasma.scheduler.trace import TraceError, load_trace, write_trace
from wasma.scheduler.workflow import Workflow


def wf_dict(wid: str, arrival: float = 0.0, **node_kw: Any) -> dict[str, Any]:
    nodes = [
        {"id": "a", "parents": [], "output_tokens": 4, "prompt": [{"shared": "k", "tokens": 8}]},
        {
            "id": "b",
            "parents": ["a"],
            "output_tokens": 3,
            "prompt": [{"context": "a"}, {"unique": 2}],
        },
    ]
    nodes[1].update(node_kw)
    return {"workflow_id": wid, "app": "t", "arrival_s": arrival, "deadline_s": 5.0, "nodes": nodes}


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_round_trip(tmp_path: Path) -> None:
    wfs = [Workflow.from_dict(wf_dict(f"w{i}", arrival=i * 0.5)) for i in range(5)]
    p = tmp_path / "sub" / "t.jsonl"
    write_trace(p, wfs)
    lines = p.read_text().splitlines()
    assert len(lines) == 5
    assert all(json.loads(line)["workflow_id"] == f"w{i}" for i, line in enumerate(lines))
    back = load_trace(p)
    assert [w.to_dict() for w in back] == [w.to_dict() for w in wfs]


def test_sorted_by_arrival_stably(tmp_path: Path) -> None:
    arrivals = [3.0, 1.0, 2.0, 1.0, 0.5]
    p = write_lines(
        tmp_path / "t.jsonl",
        [json.dumps(wf_dict(f"w{i}", arrival=a)) for i, a in enumerate(arrivals)],
    )
    got = load_trace(p)
    assert [w.workflow_id for w in got] == ["w4", "w1", "w3", "w2", "w0"]


def test_blank_lines_skipped_but_counted(tmp_path: Path) -> None:
    p = write_lines(
        tmp_path / "t.jsonl",
        [json.dumps(wf_dict("w0")), "", "   ", json.dumps(wf_dict("w0"))],
    )
    with pytest.raises(TraceError, match=r"t\.jsonl:4: .*'w0' already used on line 1"):
        load_trace(p)


def test_bad_json_names_file_and_line(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "bad.jsonl", [json.dumps(wf_dict("w0")), "{not json"])
    with pytest.raises(TraceError, match=r"bad\.jsonl:2: invalid JSON") as ei:
        load_trace(p)
    assert "\n" not in str(ei.value)


def test_bad_workflow_names_file_line_workflow_and_node(tmp_path: Path) -> None:
    p = write_lines(
        tmp_path / "bad.jsonl",
        [
            json.dumps(wf_dict("w0")),
            json.dumps(wf_dict("w1")),
            json.dumps(wf_dict("w2", parents=["nope"])),
        ],
    )
    with pytest.raises(
        TraceError, match=r"bad\.jsonl:3: workflow 'w2', node 'b'.*unknown parent 'nope'"
    ):
        load_trace(p)


def test_non_object_line(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "bad.jsonl", ["[1, 2, 3]"])
    with pytest.raises(TraceError, match=r"bad\.jsonl:1: .*JSON object"):
        load_trace(p)


def test_duplicate_workflow_id(tmp_path: Path) -> None:
    p = write_lines(
        tmp_path / "dup.jsonl",
        [json.dumps(wf_dict("w0")), json.dumps(wf_dict("w1")), json.dumps(wf_dict("w0"))],
    )
    with pytest.raises(TraceError, match=r"dup\.jsonl:3: workflow id 'w0' already used on line 1"):
        load_trace(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.jsonl: cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")


def test_directory_is_not_a_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path)


def test_empty_trace(tmp_path: Path) -> None:
    p = write_lines(tmp_path / "e.jsonl", ["", ""])
    with pytest.raises(TraceError, match=r"e\.jsonl: trace has no workflows"):
        load_trace(p)


def test_binary_file_is_a_trace_error(tmp_path: Path) -> None:
    p = tmp_path / "bin.jsonl"
    p.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(TraceError, match=r"bin\.jsonl"):
        load_trace(p)


def test_a_key_given_twice_is_an_error_not_a_silent_override(tmp_path: Path) -> None:
    line = json.dumps(wf_dict("w0")).replace('"app": "t"', '"app": "t", "app": "u"')
    p = write_lines(tmp_path / "dup.jsonl", [line])
    with pytest.raises(TraceError, match=r"dup\.jsonl:1: invalid JSON: key 'app' appears twice"):
        load_trace(p)


def test_only_newlines_end_lines(tmp_path: Path) -> None:
    # U+2028 is legal inside a JSON string: it does not end a line (str.splitlines()
    # would split there), so the bad line below is line 2, not line 3.
    # (In a shared key: ids must be printable, and U+2028 is not.)
    wf = wf_dict("w0")
    wf["nodes"][0]["prompt"][0]["shared"] = "k\u2028x"
    first = json.dumps(wf, ensure_ascii=False)
    p = write_lines(tmp_path / "t.jsonl", [first, "{not json"])
    with pytest.raises(TraceError, match=r"t\.jsonl:2: invalid JSON"):
        load_trace(p)
    p = write_lines(tmp_path / "ok.jsonl", [first])
    assert load_trace(p)[0].nodes["a"].prompt[0].key == "k\u2028x"  # type: ignore[union-attr]


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a": ' + "9" * 5000 + "}"])
def test_json_too_deep_or_too_long_is_a_trace_error(tmp_path: Path, text: str) -> None:
    p = write_lines(tmp_path / "t.jsonl", [text])
    with pytest.raises(TraceError, match=r"t\.jsonl:1: invalid JSON") as ei:
        load_trace(p)
    assert "\n" not in str(ei.value)


def test_a_trace_that_cannot_be_written_names_its_path(tmp_path: Path) -> None:
    wfs = [Workflow.from_dict(wf_dict("w0"))]
    (tmp_path / "taken").write_text("a file, not a folder")
    with pytest.raises(TraceError, match=r"taken/t\.jsonl: cannot write trace"):
        write_trace(tmp_path / "taken" / "t.jsonl", wfs)
