"""The host-contention measurement's arithmetic and how it records the result."""

from __future__ import annotations

from pathlib import Path

import pytest

from wasma.benchmarks.studies.host_contention import contention, write_contention
from wasma.core.profile import load_profile


def test_contention_is_the_median_slowdown_never_negative() -> None:
    assert contention([1.0, 1.0, 3.0], [1.5, 1.5, 0.1]) == pytest.approx(0.5)
    assert contention([2.0], [1.0]) == 0.0  # a neighbour cannot speed an engine up
    with pytest.raises(ValueError, match="at least one"):
        contention([], [1.0])


def test_write_keeps_the_profile_and_replaces_the_last_measurement(tmp_path: Path) -> None:
    src = Path(__file__).parents[2] / "core" / "profiles" / "tiny-cpu.yaml"
    path = tmp_path / "p.yaml"
    path.write_text(src.read_text())
    before = load_profile(str(path))
    write_contention(path, 0.61234, "first")
    write_contention(path, 0.7, "second")
    after = load_profile(str(path))
    assert after.host_contention == 0.7
    assert after.step == before.step and after.num_kv_blocks == before.num_kv_blocks
    measured = [s for s in after.sources if "host_contention" in s]
    assert len(measured) == 1 and measured[0].endswith("second")
    assert path.read_text().startswith("#")  # the file's header comments stay
