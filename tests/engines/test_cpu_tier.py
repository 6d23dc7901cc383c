"""The CPU KV tier (engines/sim/cpu_tier.py) and its hook in the simulated engine."""

from __future__ import annotations

import dataclasses

import pytest

from wasma.core.events import BlockRemoved, BlockStored, KVEvent
from wasma.core.profile import Profile, ProfileError, load_profile, profile_from_dict
from wasma.engines.sim.core import SimEngineCore
from wasma.engines.sim.cpu_tier import CpuTier

from .test_sim_core import Driver, request, tiny


def test_lru_store_load_and_landing_times() -> None:
    gone: list[int] = []
    t = CpuTier(
        3,
        100,
        h2d_bytes_per_s=1000,
        d2h_bytes_per_s=100,
        load_latency_s=0.5,
        on_removed=gone.extend,
    )
    t.store([1, 2], now=0.0)  # 200 B at 100 B/s: lands at 2.0
    assert t.loadable([1, 2], 0, 2, now=1.9) == 0
    assert t.loadable([1, 2], 0, 2, now=2.0) == 2
    t.store([3], now=0.0)  # queues behind the first copy: lands at 3.0
    assert t.loadable([3], 0, 1, now=2.5) == 0 and t.loadable([3], 0, 1, now=3.0) == 1
    t.store([1], now=4.0)  # refreshes 1: 2 is now the least recent
    t.store([4], now=4.0)
    assert gone == [2] and set(t.blocks) == {1, 3, 4}
    # A load of 2 blocks (200 B at 1000 B/s) plus the fixed cost; the next queues behind.
    assert t.load([1, 3], now=10.0) == pytest.approx(10.7)
    assert t.load([4], now=10.0) == pytest.approx(10.8)
    # A contiguous run only: block 5 is missing, so 4 after it does not count.
    assert t.loadable([1, 5, 4], 0, 3, now=20.0) == 1


def test_kept_blocks_are_evicted_last() -> None:
    keep = {1}
    gone: list[int] = []
    t = CpuTier(2, 1, 1e9, 1e9, 0.0, on_removed=gone.extend, keep=keep.__contains__)
    t.store([1, 2], 0.0)
    t.store([3], 0.0)  # 1 is the least recent but kept: 2 goes instead
    assert gone == [2] and set(t.blocks) == {1, 3}


def _profile(cpu_blocks: int) -> Profile:
    # 9 GPU blocks (8 usable): one 16-token prompt and its output fit, two do not.
    return dataclasses.replace(
        tiny(num_kv_blocks=9),
        cpu_kv_blocks=cpu_blocks,
        cpu_h2d_bytes_per_s=32.0,
        cpu_load_latency_s=0.25,
    )


@pytest.mark.parametrize("cpu_blocks", [0, 64])
def test_prefix_evicted_from_gpu_is_loaded_from_cpu(cpu_blocks: int) -> None:
    events: list[KVEvent] = []
    prof = _profile(cpu_blocks)
    core = SimEngineCore("e0", prof, "fcfs", kv_sink=events.append)
    a = request("a", 16, 2, shared=7)
    b = request("b", 24, 2)  # its blocks push a's out of the GPU pool
    c = request("c", 16, 2, shared=7)  # a's prompt again
    Driver(core).run([(0.0, a), (10.0, b), (20.0, c)])
    if cpu_blocks == 0:
        # Only a's head block outlived b on the GPU.
        assert c.num_cached_tokens == 4 and c.num_cpu_hit_tokens == 0
        assert not any(getattr(e, "medium", None) == "CPU" for e in events)
        return
    # 15 of 16 tokens can hit (vLLM computes the last one): 3 full blocks of 4, the
    # head still on GPU, the next two loaded from the CPU tier.
    assert c.num_cached_tokens == 12 and c.num_cpu_hit_tokens == 8
    # The load: 2 blocks x 4 tokens x 8 B at 32 B/s = 2 s, plus 0.25 s, before its first
    # step; c then prefills 4 tokens in one 1 s step.
    assert c.first_scheduled_time == pytest.approx(22.25)
    assert c.first_token_time == pytest.approx(23.25)
    cpu_stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert cpu_stored and all(e.engine == "e0" for e in cpu_stored)
    gpu_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium is None]
    assert gpu_removed  # a's blocks did leave the GPU


def test_an_arrival_ends_a_wait_for_loads() -> None:
    """An engine waiting only for a load schedules a new arrival at once."""
    core = SimEngineCore("e0", _profile(64), "fcfs")
    a = request("a", 16, 2, shared=7)
    b = request("b", 24, 2)
    c = request("c", 16, 2, shared=7)
    d = request("d", 4, 1)
    Driver(core).run([(0.0, a), (10.0, b), (20.0, c), (21.0, d)])
    assert d.first_scheduled_time == pytest.approx(21.0)
    assert c.num_cpu_hit_tokens == 8


def test_profile_cpu_fields_checked() -> None:
    base = {
        "name": "x",
        "block_size": 16,
        "num_kv_blocks": 100,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 4,
        "max_model_len": 512,
        "kv_bytes_per_token": 2,
        "step": {
            "base_s": 0.01,
            "per_prefill_token_s": 0,
            "per_decode_seq_s": 0,
            "per_decode_ctx_token_s": 0,
            "per_prefill_attn_s": 0,
        },
    }
    p = profile_from_dict({**base, "cpu_kv_blocks": 10, "cpu_h2d_bytes_per_s": 3.2e10}, "t")
    assert p.cpu_kv_blocks == 10 and p.cpu_load_s(2) == pytest.approx(
        p.cpu_load_latency_s + 2 * 16 * 2 / 3.2e10
    )
    with pytest.raises(ProfileError, match="cpu_h2d_bytes_per_s must be a finite number > 0"):
        profile_from_dict({**base, "cpu_h2d_bytes_per_s": 0}, "t")
    with pytest.raises(ProfileError, match="cpu_kv_blocks must be a non-negative integer"):
        profile_from_dict({**base, "cpu_kv_blocks": -1}, "t")
    assert load_profile("llama3-8b-h100").cpu_kv_blocks == 0
