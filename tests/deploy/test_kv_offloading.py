"""`wasma serve --kv-offloading-size`: vLLM engines get vLLM's own CPU KV tier."""

from __future__ import annotations

import argparse

import pytest

from wasma.deploy.cli import build_parser
from wasma.deploy.serve import ConfigError, _offloading


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_offloading_size_reaches_the_vllm_engine_options() -> None:
    args = _args("--engines", "vllm:2", "--model", "m", "--kv-offloading-size", "8")
    assert _offloading(args, {"max_model_len": 2048}) == {
        "max_model_len": 2048,
        "kv_offloading_gib": 8.0,
    }
    assert _offloading(_args("--engines", "vllm:2", "--model", "m"), {}) == {}


def test_offloading_needs_vllm_engines_and_no_wasma_connector() -> None:
    with pytest.raises(ConfigError, match="needs --engines vllm:N"):
        _offloading(_args("--engines", "sim:2", "--kv-offloading-size", "8"), {})
    with pytest.raises(ConfigError, match="choose one"):
        _offloading(_args("--engines", "vllm:2", "--kv-transfer", "--kv-offloading-size", "8"), {})
