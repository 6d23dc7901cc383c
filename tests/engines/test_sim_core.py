"""The simulated vLLM v1 engine core, on hand-computed small cases (engines/sim/core.py).

The tiny profile: blocks of 4 tokens, a token budget of 8 per step and a step model where
every step takes exactly 1 s, so step k ends at time k and outcomes can be checked by hand.
"""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from wasma.core.events import KVEvent
from wasma.core.profile import Profile, StepModel, load_profile
from wasma.core.tokens import BlockHasher, Piece
from wasma.engines.sim.core import SimEngineCore, SimRequest
from wasma.scheduler.prefix_index import PrefixIndex

BS = 4


def tiny(
    num_kv_blocks: int = 65,
    budget: int = 8,
    max_num_seqs: int = 16,
    step: StepModel | None = None,
) -> Profile:
    return Profile(
        name="tiny",
        block_size=BS,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=256,
        kv_bytes_per_token=8,
        step=step or StepModel(1.0, 0.0, 0.0, 0.0, 0.0),
    )


def request(
    rid: str, prompt: int, out: int, priority: int = 0, shared: int | None = None
) -> SimRequest:
    """A request whose prompt is stream `shared` (or its own), then its own output."""
    sid = shared if shared is not None else hash(("p", rid)) & (2**62 - 1)
    span = (Piece(sid, 0, prompt), Piece(hash(("o", rid)) & (2**62 - 1), 0, out))
    return SimRequest(rid, BlockHasher(BS).chain(span), prompt, out, priority=priority)


class Driver:
    """A minimal clock for one engine: arrivals, steps and macro-step interrupts."""

    def __init__(self, core: SimEngineCore) -> None:
        self.core = core
        self.tokens: list[tuple[float, str, int]] = []
        self.max_running = 0

    def run(self, arrivals: list[tuple[float, SimRequest]]) -> float:
        core = self.core
        todo = sorted(arrivals, key=lambda a: a[0])
        i, now = 0, 0.0
        while True:
            nxt = todo[i][0] if i < len(todo) else math.inf
            if core.busy and core.step_end <= nxt:
                now = core.step_end
                out = core.complete_step(now)
                self.tokens += [(now, r.request_id, k) for r, k in out.tokens]
                if core.has_work():
                    core.start_step(now)
            elif i < len(todo):
                now, req = todo[i]
                i += 1
                core.add_request(req, now)
                if not core.busy:
                    core.start_step(now)
                else:
                    core.interrupt(now)
            else:
                return now
            self.max_running = max(self.max_running, len(core.running))


def drive(
    arrivals: list[tuple[float, SimRequest]],
    profile: Profile | None = None,
    policy: str = "fcfs",
    fast_forward: bool = False,
) -> tuple[SimEngineCore, Driver]:
    core = SimEngineCore("e0", profile or tiny(), policy, fast_forward=fast_forward)
    d = Driver(core)
    d.run(arrivals)
    return core, d


# -- validation ------------------------------------------------------------------------


def test_bad_scheduling_policy() -> None:
    with pytest.raises(ValueError, match="fcfs"):
        SimEngineCore("e", tiny(), "lifo")


def test_add_request_validation() -> None:
    core = SimEngineCore("e", tiny(), "fcfs")
    with pytest.raises(ValueError, match=r"r0.*empty prompt"):
        core.add_request(SimRequest("r0", [], 0, 3), 0.0)
    with pytest.raises(ValueError, match=r"r1.*max_model_len"):
        core.add_request(request("r1", 250, 10), 0.0)


# -- chunked prefill, first token, decode ----------------------------------------------


def test_chunked_prefill_then_one_token_per_step() -> None:
    r = request("a", 20, 3)
    core, d = drive([(0.0, r)])
    # prefill 20 tokens at 8 per step: steps end at 1, 2, 3; the third emits token 1
    assert r.first_scheduled_time == 0.0
    assert r.first_token_time == 3.0
    assert d.tokens == [(3.0, "a", 1), (4.0, "a", 1), (5.0, "a", 1)]
    assert r.finish_time == 5.0 and r.num_output_tokens == 3
    assert r.prefill_tokens_computed == 20
    assert core.steps == 5
    assert not core.running and core.kv.num_free == core.kv.num_blocks  # all freed


def test_chunked_prefill_progress_per_step() -> None:
    r = request("a", 20, 2)
    core = SimEngineCore("e", tiny(), "fcfs", fast_forward=False)
    core.add_request(r, 0.0)
    seen = []
    now = 0.0
    while core.has_work():
        now = core.start_step(now)
        core.complete_step(now)
        seen.append(r.num_computed_tokens)
    assert seen == [8, 16, 20, 21]


def test_budget_shared_running_first() -> None:
    """A running request's prefill chunk is scheduled before a new one is admitted."""
    a, b = request("a", 12, 2), request("b", 6, 2)
    drive([(0.0, a), (0.5, b)])
    # step 1 (0-1): a 8 tokens. step 2 (1-2): a 4 + b 4. step 3: a decode + b 2 -> b's 1st
    assert a.first_token_time == 2.0
    assert b.first_scheduled_time == 1.0
    assert b.first_token_time == 3.0


def test_step_time_comes_from_the_profile() -> None:
    step = StepModel(0.5, 0.01, 0.002, 0.0001, 0.00001)
    r = request("a", 8, 2)
    core = SimEngineCore("e", tiny(step=step), "fcfs", fast_forward=False)
    core.add_request(r, 0.0)
    t1 = core.start_step(0.0)
    assert t1 == pytest.approx(0.5 + 8 * 0.01 + 8 * 8 * 0.00001)
    core.complete_step(t1)
    t2 = core.start_step(t1)
    # decode: one sequence whose context is 8 computed + the new token
    assert t2 - t1 == pytest.approx(0.5 + 0.002 + 9 * 0.0001)


def test_single_token_output_finishes_at_prefill() -> None:
    r = request("a", 5, 1)
    drive([(0.0, r)])
    assert r.first_token_time == r.finish_time == 1.0


# -- prefix caching --------------------------------------------------------------------


@pytest.mark.parametrize(("prompt", "hit"), [(10, 8), (12, 8), (13, 12), (4, 0), (3, 0)])
def test_prefix_hit_capped_below_num_tokens(prompt: int, hit: int) -> None:
    """A repeat of a finished prompt hits floor((n-1)/bs)*bs tokens: the last is recomputed."""
    a = request("a", prompt, 2, shared=77)
    b = request("b", prompt, 2, shared=77)
    core, _ = drive([(0.0, a), (10.0, b)])
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == hit == (prompt - 1) // BS * BS
    assert b.prefill_tokens_computed == prompt - hit
    assert core.kv.hits_tokens == hit
    assert core.kv.queries_tokens == 2 * prompt


def test_hit_on_blocks_scheduled_in_the_same_step() -> None:
    """Blocks are cached when the step that fills them is scheduled (vLLM v1)."""
    a = request("a", 8, 2, shared=5)
    b = request("b", 8, 2, shared=5)
    profile = tiny(budget=16)
    drive([(0.0, a), (0.0, b)], profile)
    assert b.num_cached_tokens == 4  # (8 - 1) // 4 blocks of a's, allocated one pass earlier


def test_partial_shared_prefix() -> None:
    a = request("a", 16, 2, shared=9)
    b = request("b", 10, 2, shared=9)  # first 10 tokens of the same stream
    drive([(0.0, a), (10.0, b)])
    assert b.num_cached_tokens == 8


def test_kv_events_mirror_the_cache() -> None:
    """A prefix index fed by the engine's events ends up holding exactly its cached hashes."""
    idx = PrefixIndex(["e0"])
    events: list[KVEvent] = []

    def sink(ev: KVEvent) -> None:
        events.append(ev)
        idx.apply(ev)

    core = SimEngineCore("e0", tiny(num_kv_blocks=12), "fcfs", kv_sink=sink, fast_forward=True)
    rng = random.Random(3)
    arrivals = [
        (
            rng.uniform(0, 40),
            request(
                f"r{i}", rng.randint(3, 30), rng.randint(1, 12), shared=rng.choice([1, 2, None])
            ),
        )
        for i in range(25)
    ]
    Driver(core).run(arrivals)
    assert all(r.finished for _, r in arrivals)
    assert events and len(idx) == len(core.kv.cached)
    assert idx.blocks_per_engine == [len(core.kv.cached)]
    assert all(idx.holders(h) == [0] for h in core.kv.cached)


# -- preemption ------------------------------------------------------------------------


def pressure_pair(policy: str) -> tuple[SimRequest, SimRequest, SimEngineCore, Driver]:
    """4 usable blocks. b (priority 9) arrives first, a (priority 0) second; at t=2 a needs
    a third block and none is free."""
    b = request("b", 6, 8, priority=9)
    a = request("a", 8, 8, priority=0)
    core, d = drive([(0.0, b), (0.5, a)], tiny(num_kv_blocks=5, budget=16), policy)
    return a, b, core, d


def test_fcfs_preempts_the_last_running() -> None:
    a, b, _, _ = pressure_pair("fcfs")
    assert a.num_preemptions >= 1 and b.num_preemptions == 0
    assert a.finished and b.finished
    assert b.finish_time < a.finish_time
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8


def test_priority_preempts_the_lowest_priority() -> None:
    a, b, _, _ = pressure_pair("priority")
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert a.finished and b.finished
    assert a.finish_time < b.finish_time
    assert b.num_output_tokens == 8


def test_preempted_request_recomputes() -> None:
    a, _, _, _ = pressure_pair("fcfs")
    # a's prompt plus what it had generated is prefetched again (less any cache hit)
    assert a.prefill_tokens_computed > 8


def test_no_admission_in_a_step_that_preempted() -> None:
    """At t=2 the priority engine preempts b; c (top priority, fits in the freed block)
    still waits for the next step."""
    b = request("b", 6, 8, priority=9)
    a = request("a", 8, 8, priority=0)
    c = request("c", 2, 1, priority=-5)
    drive([(0.0, b), (0.5, a), (1.5, c)], tiny(num_kv_blocks=5, budget=16), "priority")
    assert b.num_preemptions == 1
    assert c.first_scheduled_time == 3.0


def test_preemption_victim_stays_ahead_in_fcfs_queue() -> None:
    """A preempted request goes back to the head of the waiting queue."""
    b = request("b", 6, 8)
    a = request("a", 8, 8)
    c = request("c", 4, 2)
    drive([(0.0, b), (0.5, a), (2.5, c)], tiny(num_kv_blocks=5, budget=16), "fcfs")
    assert a.num_preemptions >= 1
    assert a.first_scheduled_time < c.first_scheduled_time
    assert all(r.finished for r in (a, b, c))


def test_self_preemption_does_not_stall_the_engine() -> None:
    a = request("a", 11, 4, priority=5)
    b = request("b", 4, 4, priority=0)
    drive([(0.0, a), (0.5, b)], tiny(num_kv_blocks=5, budget=16), "priority")
    assert a.finished and b.finished


def test_moved_in_kv_of_waiting_requests_cannot_deadlock_the_queue() -> None:
    # 8 usable blocks of 4 tokens. Two low-priority requests wait holding moved-in KV (3
    # blocks each, pinned until admission); the head of the queue needs 3 blocks for its
    # prompt and only 2 are free, and nothing runs that could free more.
    core = SimEngineCore("e0", tiny(num_kv_blocks=9, budget=16), "priority")
    head = request("head", 12, 4, priority=0)
    held = [request(f"held{i}", 12, 4, priority=5) for i in range(2)]
    for r in held:
        r.pinned_blocks = core.kv.seed_pinned(r.block_hashes[:3])
        core.add_request(r, 0.0)
    core.add_request(head, 0.0)
    assert core.kv.num_free == 2
    d = Driver(core)
    assert core.start_step(0.0) > 0  # not idle: the held KV goes back to the cache
    d.run([])
    assert head.finished and all(r.finished for r in held)
    assert head.first_token_time == 1.0  # admitted in the first step, ahead of them


# -- queues and seats ------------------------------------------------------------------


def test_priority_queue_orders_waiting() -> None:
    first = request("first", 4, 3)
    lo, hi, mid, hi2 = (
        request("lo", 4, 1, priority=5),
        request("hi", 4, 1, priority=1),
        request("mid", 4, 1, priority=3),
        request("hi2", 4, 1, priority=1),
    )
    drive(
        [(0.0, first), (0.1, lo), (0.2, hi), (0.3, mid), (0.4, hi2)],
        tiny(max_num_seqs=1),
        "priority",
    )
    order = sorted([lo, hi, mid, hi2], key=lambda r: r.first_scheduled_time)
    assert [r.request_id for r in order] == ["hi", "hi2", "mid", "lo"]


def test_fcfs_queue_ignores_priority() -> None:
    first = request("first", 4, 3)
    lo, hi = request("lo", 4, 1, priority=5), request("hi", 4, 1, priority=1)
    drive([(0.0, first), (0.1, lo), (0.2, hi)], tiny(max_num_seqs=1), "fcfs")
    assert lo.first_scheduled_time < hi.first_scheduled_time


def test_max_num_seqs_respected() -> None:
    reqs = [request(f"r{i}", 4, 5) for i in range(5)]
    _, d = drive([(0.0, r) for r in reqs], tiny(max_num_seqs=2, budget=64))
    assert d.max_running == 2
    assert all(r.finished for r in reqs)
    firsts = sorted(r.first_scheduled_time for r in reqs)
    finishes = sorted(r.finish_time for r in reqs)
    assert firsts[2] >= finishes[0]


def test_stats_report_queues_and_usage() -> None:
    core = SimEngineCore("e", tiny(max_num_seqs=1), "fcfs")
    for i in range(3):
        core.add_request(request(f"r{i}", 8, 4), 0.0)
    assert core.stats().num_waiting == 3
    core.complete_step(core.start_step(0.0))
    s = core.stats()
    assert (s.num_running, s.num_waiting) == (1, 2)
    assert s.num_kv_blocks == 64 and 0 < s.kv_usage < 1


def test_abort_waiting_and_running() -> None:
    core = SimEngineCore("e", tiny(max_num_seqs=1), "fcfs", fast_forward=False)
    a, b = request("a", 4, 50), request("b", 4, 5)
    core.add_request(a, 0.0)
    core.add_request(b, 0.0)
    core.abort("b")
    assert core.num_waiting == 1  # only a is left
    t = core.start_step(0.0)
    core.abort("a")
    out = core.complete_step(t)
    assert out.finished == [a] and not core.has_work()


# -- macro steps -----------------------------------------------------------------------


def test_macro_step_covers_a_decode_stretch() -> None:
    r = request("a", 4, 10)
    core, d = drive([(0.0, r)], fast_forward=True)
    assert r.first_token_time == 1.0 and r.finish_time == 10.0
    assert core.steps == 2  # one prefill step, one macro step of 9 decodes
    assert d.tokens == [(1.0, "a", 1), (10.0, "a", 9)]


def test_macro_step_time_matches_step_by_step_with_growing_context() -> None:
    step = StepModel(0.01, 0.001, 0.0005, 0.0003, 0.00001)
    rs = [request(f"r{i}", 5 + 3 * i, 12 + i) for i in range(3)]
    slow = [dataclasses.replace(r) for r in rs]
    drive([(0.0, r) for r in rs], tiny(step=step, budget=64), fast_forward=True)
    drive([(0.0, r) for r in slow], tiny(step=step, budget=64), fast_forward=False)
    for f, s in zip(rs, slow, strict=True):
        assert f.first_token_time == pytest.approx(s.first_token_time, abs=1e-12)
        assert f.finish_time == pytest.approx(s.finish_time, abs=1e-12)


def test_interrupt_truncates_at_the_substep_in_flight() -> None:
    core = SimEngineCore("e", tiny(), "fcfs", fast_forward=True)
    a = request("a", 4, 10)
    core.add_request(a, 0.0)
    t = core.start_step(0.0)
    core.complete_step(t)
    end = core.start_step(1.0)
    assert end == 10.0  # 9 decode sub-steps ending at 2, 3, ..., 10
    assert core.interrupt(3.5) == 4.0  # sub-step 3.0-4.0 is in flight
    b = request("b", 4, 2)
    core.add_request(b, 3.5)
    out = core.complete_step(4.0)
    assert out.tokens == [(a, 3)] and a.num_output_tokens == 4
    assert core.start_step(4.0) == 5.0  # b admitted: a normal step again
    assert core.interrupt(4.5) is None  # not a macro


def test_interrupt_in_last_substep_keeps_the_end() -> None:
    core = SimEngineCore("e", tiny(), "fcfs", fast_forward=True)
    core.add_request(request("a", 4, 10), 0.0)
    core.complete_step(core.start_step(0.0))
    assert core.start_step(1.0) == 10.0
    assert core.interrupt(9.5) is None
    assert core.step_end == 10.0


def test_interrupted_run_equals_step_by_step() -> None:
    def arrivals() -> list[tuple[float, SimRequest]]:
        return [(0.0, request("a", 4, 20)), (3.5, request("b", 9, 6)), (7.25, request("c", 3, 9))]

    fa, fs = arrivals(), arrivals()
    drive(fa, fast_forward=True)
    drive(fs, fast_forward=False)
    for (_, f), (_, s) in zip(fa, fs, strict=True):
        assert (f.first_token_time, f.finish_time) == (s.first_token_time, s.finish_time)


def random_arrivals(seed: int, n: int = 40) -> list[tuple[float, SimRequest]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        out.append(
            (
                round(rng.uniform(0, 1.5), 3),
                request(
                    f"r{i}",
                    rng.randint(1, 40),
                    rng.randint(1, 25),
                    priority=rng.randint(0, 3),
                    shared=rng.choice([11, 12, None, None]),
                ),
            )
        )
    return out


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fast_forward_equals_step_by_step_on_one_engine(policy: str, seed: int) -> None:
    """Random arrivals under KV pressure (preemptions happen): identical per-request times."""
    step = StepModel(0.02, 0.0004, 0.0003, 0.00002, 0.000001)
    prof = tiny(num_kv_blocks=20, budget=16, max_num_seqs=6, step=step)
    fa, fs = random_arrivals(seed), random_arrivals(seed)
    cf, _ = drive(fa, prof, policy, fast_forward=True)
    cs, _ = drive(fs, prof, policy, fast_forward=False)
    assert sum(r.num_preemptions for _, r in fs) > 0  # the case is not trivial
    for (_, f), (_, s) in zip(fa, fs, strict=True):
        assert f.finished == s.finished
        assert f.first_token_time == pytest.approx(s.first_token_time, abs=1e-9)
        assert f.finish_time == pytest.approx(s.finish_time, abs=1e-9)
        assert f.num_preemptions == s.num_preemptions
        assert f.num_cached_tokens == s.num_cached_tokens
    assert cf.steps <= cs.steps
    assert cf.kv.hits_tokens == cs.kv.hits_tokens


def test_builtin_profile_smoke() -> None:
    prof = load_profile("llama3-8b-h100")
    span = (Piece(1, 0, 1000), Piece(2, 0, 10))
    r = SimRequest("x", BlockHasher(prof.block_size).chain(span), 1000, 10)
    drive([(0.0, r)], prof, "priority", fast_forward=True)
    assert r.finished and 0 < r.first_token_time < r.finish_time < 1.0


def test_fast_forward_emits_evictions_when_step_by_step_would() -> None:
    """p's freed prefix sits in the free queue; a's decode evicts it block by block."""

    def removal_times(fast_forward: bool) -> dict[int, float]:
        clock = [0.0]
        removed: dict[int, float] = {}

        def sink(ev: KVEvent) -> None:
            if type(ev).__name__ == "BlockRemoved":
                for h in ev.block_hashes:  # type: ignore[union-attr]
                    removed.setdefault(h, clock[0])

        core = SimEngineCore(
            "e0", tiny(num_kv_blocks=5), "fcfs", kv_sink=sink, fast_forward=fast_forward
        )
        p, a = request("p", 8, 1), request("a", 4, 12)
        core.add_request(p, 0.0)
        start = 0.0
        t = core.start_step(0.0)
        while True:
            # A driver syncs a macro step before it reads KV state mid-step; probing at
            # every step boundary must see each eviction when step-by-step emits it.
            probe = start + 1.0
            while probe < t:
                clock[0] = probe
                core.sync(probe)
                probe += 1.0
            clock[0] = t
            core.complete_step(t)
            start = t
            if t == 1.0:
                core.add_request(a, 1.0)
            if not core.has_work():
                break
            t = core.start_step(t)
        assert a.finished
        return removed

    slow, fast = removal_times(False), removal_times(True)
    assert slow  # p's blocks are evicted by a's growth
    assert fast == slow


def test_busy_time_counts_every_step() -> None:
    core, _ = drive([(0.0, request("a", 20, 3))], fast_forward=False)
    assert core.busy_time == pytest.approx(5.0)


def test_long_prefill_threshold_caps_a_lone_prompt() -> None:
    prof = dataclasses.replace(tiny(budget=16), long_prefill_token_threshold=4)
    r = request("a", 12, 1)
    drive([(0.0, r)], prof)
    assert r.first_token_time == 3.0  # chunks of 4, 4, 4


def test_long_prefill_threshold_caps_concurrent_prompts() -> None:
    prof = dataclasses.replace(tiny(budget=16), long_prefill_token_threshold=4)
    a, b = request("a", 12, 1), request("b", 12, 1)
    core = SimEngineCore("e", prof, "fcfs", fast_forward=False)
    core.add_request(a, 0.0)
    core.add_request(b, 0.0)
    Driver(core).run([])
    assert core.steps == 0  # nothing started yet: the driver only reacts to arrivals
    now = 0.0
    while core.has_work():
        now = core.start_step(now)
        core.complete_step(now)
    assert a.first_token_time == 3.0 and b.first_token_time == 3.0  # 4 + 4 tokens a step
