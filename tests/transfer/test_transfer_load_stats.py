"""The wasma connector's load stats, as vLLM moves them from its worker to the loggers."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from wasma.transfer.vllm_connector import WasmaLoadStats, WasmaPeerConnector


def test_stats_travel_as_their_dict_and_merge_across_workers() -> None:
    a = WasmaLoadStats({"loads": [[1000, 0.5, True]]})
    # vLLM sends `to_dict()` and rebuilds the stats with the connector's class method.
    b = WasmaPeerConnector.build_kv_connector_stats(
        WasmaLoadStats({"loads": [[7, 0.1, False]]}).to_dict()
    )
    assert isinstance(b, WasmaLoadStats)
    merged = a.aggregate(b)
    assert merged.to_dict() == {"loads": [[1000, 0.5, True], [7, 0.1, False]]}
    assert merged.reduce() == {
        "loads": 1,
        "failed_loads": 1,
        "loaded_bytes": 1000,
        "load_seconds": 0.5,
    }
    assert not merged.is_empty()
    merged.reset()
    assert merged.is_empty() and merged.reduce()["loads"] == 0


def test_stats_built_from_nothing_are_empty() -> None:
    stats = WasmaPeerConnector.build_kv_connector_stats(None)
    assert stats is not None and stats.is_empty()
