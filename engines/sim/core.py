"""A discrete-event model of one vLLM v1 engine: its scheduler, KV cache and step time.

The scheduling loop follows `vllm/v1/core/sched/scheduler.py`:
1. running requests first, in order, each taking `min(remaining, token budget)` tokens
   (chunked prefill); when KV blocks run out the lowest-priority running request (FCFS:
   the last one) is preempted by recompute and put back at the head of the waiting queue;
2. only when nothing was preempted, waiting requests in queue order (FCFS, or
   (priority, arrival) with priority scheduling) while there is budget and a seat under
   `max_num_seqs`; each looks up its longest prefix-cache hit (at most all tokens but one,
   so the last prompt token is always computed) and is admitted only if its blocks fit.
Blocks become cached when the step that fills them is scheduled; a request emits a token
when a step computes its last known token. Step time comes from the profile.

Decode-only stretches are simulated as one "macro step" of k identical-shape steps (the
state cannot change until a request finishes, because nothing can be admitted), which
makes long decodes cost O(batch) instead of O(batch x tokens). A request that arrives
mid-macro truncates it at the end of the sub-step in flight, so results equal
step-by-step simulation.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from wasma.core.events import BlockRemoved, BlockStored, EngineStats, KVEvent
from wasma.core.profile import Profile
from wasma.engines.sim.cpu_tier import CPU_MEDIUM, CpuTier
from wasma.engines.sim.kv_cache import KVCache

_NEVER = float("inf")


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str
    block_hashes: list[int]  # chain hashes over prompt + full output, full blocks only
    num_prompt_tokens: int
    max_tokens: int
    priority: int = 0
    arrival_time: float = 0.0
    # Engine-side state.
    num_computed_tokens: int = 0
    num_output_tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit when first scheduled
    num_preemptions: int = 0
    prefill_tokens_computed: int = 0  # prompt/recompute tokens actually run through prefill
    pinned_blocks: list[int] = field(default_factory=list)  # moved-in KV held for it
    # Prompt tokens loaded from the engine's CPU tier (part of `num_cached_tokens`).
    num_cpu_hit_tokens: int = 0
    # Look up and load its CPU-tier blocks when it arrives, not when it reaches the
    # head of the queue (the router's prefetch).
    prefetch: bool = False
    first_scheduled_time: float = -1.0
    first_token_time: float = -1.0
    finish_time: float = -1.0
    seq: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def finished(self) -> bool:
        return self.finish_time >= 0


@dataclass(slots=True)
class _Macro:
    """k decode steps of one batch; sub-step j ends at start + (j+1)*a + b*j*(j+1)/2."""

    start: float
    k: int
    a: float
    b: float
    applied: int = 1  # sub-steps whose block allocation has happened (the first: at start)
    # Per scheduled request, the sub-step count from which it next allocates or caches a
    # block (filled on first use): syncs skip the requests with nothing to do.
    due: list[int] = field(default_factory=list)

    def end_of(self, j: int) -> float:
        return self.start + (j + 1) * self.a + self.b * j * (j + 1) / 2


@dataclass(slots=True)
class StepOutcome:
    finished: list[SimRequest]
    first_tokens: list[SimRequest]
    tokens: list[tuple[SimRequest, int]]  # (request, tokens emitted this step)


def _next_due(req: SimRequest, block_size: int) -> int:
    """The first sub-step count of a macro step at which `req` needs a new block (its
    tokens pass its blocks) or caches one (its tokens fill another block)."""
    c0 = req.num_computed_tokens
    grow = len(req.blocks) * block_size - c0 + 1
    fill = (req.num_cached_blocks + 1) * block_size - c0
    return grow if grow < fill else fill  # (min, without the call)


class SimEngineCore:
    """One simulated vLLM engine, advanced by a driver that owns the clock."""

    def __init__(
        self,
        name: str,
        profile: Profile,
        policy: str = "priority",
        kv_sink: Callable[[KVEvent], None] | None = None,
        fast_forward: bool = True,
        block_ids: list[int] | None = None,
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
        self.name = name
        self.num_preemptions = 0  # requests preempted since the start (vLLM counts it too)
        self.profile = profile
        self.policy = policy
        self.block_size = profile.block_size
        self.fast_forward = fast_forward
        self._kv_sink = kv_sink
        self.kv = KVCache(
            profile.num_kv_blocks,
            profile.block_size,
            on_stored=self._emit_stored if kv_sink else None,
            on_removed=self._emit_removed if kv_sink else None,
            block_ids=block_ids,
        )
        # The CPU tier (vLLM's offloading connector), when the profile sizes one: it
        # hears of every block the GPU caches, and waiting requests load from it.
        self.cpu: CpuTier | None = None
        self._loading: list[tuple[float, int, SimRequest]] = []  # (lands, seq, request)
        self._now = 0.0
        if profile.cpu_kv_blocks > 0:
            self.cpu = CpuTier(
                profile.cpu_kv_blocks,
                profile.block_size * profile.kv_bytes_per_token,
                profile.cpu_h2d_bytes_per_s,
                profile.cpu_d2h_bytes_per_s,
                profile.cpu_load_latency_s,
                on_stored=self._emit_cpu_stored if kv_sink else None,
                on_removed=self._emit_cpu_removed if kv_sink else None,
                keep=self.kv.retained.__contains__,
            )
            self.kv.on_stored = self._stored_with_tier
        self.running: list[SimRequest] = []
        self._fcfs: deque[SimRequest] = deque()
        self._heap: list[tuple[int, float, int, SimRequest]] = []
        self._seq = 0
        self._scheduled: list[tuple[SimRequest, int]] = []
        self._macro: _Macro | None = None
        # `sync(now)` applies nothing before this time (infinity: nothing to apply until
        # the next step starts), so a driver can skip it; it is never later than that.
        self.sync_at = _NEVER
        self.step_end = -1.0
        self.busy = False
        self.steps = 0
        self.busy_time = 0.0
        self._aborted: set[str] = set()

    # -- events ----------------------------------------------------------------------
    def _emit_stored(self, hashes: list[int], parent: int | None) -> None:
        assert self._kv_sink is not None
        self._kv_sink(BlockStored(self.name, tuple(hashes), parent))

    def _emit_removed(self, hashes: list[int]) -> None:
        assert self._kv_sink is not None
        self._kv_sink(BlockRemoved(self.name, tuple(hashes)))

    def _stored_with_tier(self, hashes: list[int], parent: int | None) -> None:
        if self._kv_sink is not None:
            self._emit_stored(hashes, parent)
        assert self.cpu is not None
        self.cpu.store(hashes, self._now)

    def _emit_cpu_stored(self, hashes: list[int]) -> None:
        assert self._kv_sink is not None
        self._kv_sink(BlockStored(self.name, tuple(hashes), None, CPU_MEDIUM))

    def _emit_cpu_removed(self, hashes: list[int]) -> None:
        assert self._kv_sink is not None
        self._kv_sink(BlockRemoved(self.name, tuple(hashes), CPU_MEDIUM))

    def _start_load(self, req: SimRequest, hits: list[int], now: float) -> bool:
        """Load the blocks past `hits` that the CPU tier holds into GPU blocks held for
        `req`; True if a load started (the request waits for it off the queue)."""
        cpu = self.cpu
        assert cpu is not None
        start = len(hits)
        n = cpu.loadable(req.block_hashes, start, (req.num_tokens - 1) // self.block_size, now)
        if n <= 0:
            return False
        held = self.kv.seed_pinned(req.block_hashes[: start + n])
        got = len(held) - start
        if got <= 0:  # no GPU block free to load into: compute it instead
            self.kv.free_blocks(held)
            return False
        req.pinned_blocks = held
        req.num_cpu_hit_tokens = got * self.block_size
        lands = cpu.load(req.block_hashes[start : start + got], now)
        heapq.heappush(self._loading, (lands, req.seq, req))
        return True

    def _land_loads(self, now: float) -> None:
        """Requests whose CPU-tier loads have landed rejoin the waiting queue."""
        loading = self._loading
        while loading and loading[0][0] <= now:
            self._push_waiting(heapq.heappop(loading)[2], front=True)

    # -- queue -----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._heap) if self.policy == "priority" else len(self._fcfs)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0 or bool(self._loading)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_usage=self.kv.usage,
            num_kv_blocks=self.kv.num_blocks,
            prefix_cache_queries_tokens=self.kv.queries_tokens,
            prefix_cache_hits_tokens=self.kv.hits_tokens,
            num_preemptions=self.num_preemptions,
        )

    def _push_waiting(self, req: SimRequest, front: bool = False) -> None:
        if self.policy == "priority":
            heapq.heappush(self._heap, (req.priority, req.arrival_time, req.seq, req))
        elif front:
            self._fcfs.appendleft(req)
        else:
            self._fcfs.append(req)

    def _peek_waiting(self) -> SimRequest | None:
        if self.policy == "priority":
            return self._heap[0][3] if self._heap else None
        return self._fcfs[0] if self._fcfs else None

    def _pop_waiting(self) -> None:
        if self.policy == "priority":
            heapq.heappop(self._heap)
        else:
            self._fcfs.popleft()

    def add_request(self, req: SimRequest, now: float) -> None:
        if req.num_prompt_tokens <= 0:
            raise ValueError(f"request {req.request_id}: empty prompt")
        if req.num_prompt_tokens + req.max_tokens > self.profile.max_model_len:
            raise ValueError(
                f"request {req.request_id}: {req.num_prompt_tokens} prompt + {req.max_tokens} "
                f"output tokens exceed max_model_len {self.profile.max_model_len}"
            )
        req.arrival_time = now
        req.seq = self._seq
        self._seq += 1
        if self.cpu is not None and req.prefetch and not req.pinned_blocks:
            self._now = now
            hits = self.kv.longest_hit(req.block_hashes, (req.num_tokens - 1) // self.block_size)
            if self._start_load(req, hits, now):
                return
        self._push_waiting(req)

    def abort(self, request_id: str) -> None:
        """Drop a request; a running one leaves at the end of the step in flight."""
        dropped: SimRequest | None = None
        if self.policy == "priority":
            kept = [e for e in self._heap if e[3].request_id != request_id]
            if len(kept) != len(self._heap):
                dropped = next(e[3] for e in self._heap if e[3].request_id == request_id)
                self._heap = kept
                heapq.heapify(self._heap)
        else:
            for r in self._fcfs:
                if r.request_id == request_id:
                    dropped = r
                    self._fcfs.remove(r)
                    break
        if dropped is not None:
            if dropped.pinned_blocks:
                self.kv.free_blocks(dropped.pinned_blocks)
                dropped.pinned_blocks = []
            return
        if any(r.request_id == request_id for r in self.running):
            self._aborted.add(request_id)

    # -- scheduling ------------------------------------------------------------------
    def _allocate(self, req: SimRequest, num_new: int, hit_blocks: list[int] | None = None) -> bool:
        kv, bs = self.kv, self.block_size
        num_hits = len(hit_blocks) if hit_blocks else 0
        total = req.num_computed_tokens + num_hits * bs + num_new
        need = -(-total // bs) - len(req.blocks) - num_hits
        if hit_blocks:
            if not kv.take_hits(hit_blocks, need):
                return False
            req.blocks.extend(hit_blocks)
        elif need > 0 and need > kv.num_free:
            return False
        if need > 0:
            req.blocks.extend(kv.allocate(need))
        num_tokens = req.num_prompt_tokens + req.num_output_tokens
        full = (total if total < num_tokens else num_tokens) // bs
        if full > req.num_cached_blocks:
            # Hits are the request's first blocks (it held none before): cached already.
            known = num_hits if req.num_cached_blocks == 0 else 0
            kv.cache_blocks(req.blocks, req.block_hashes, req.num_cached_blocks, full, known)
            req.num_cached_blocks = full
        return True

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free_blocks(req.blocks)
        req.blocks = []
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._push_waiting(req, front=True)

    def _unpin_waiting(self, head: SimRequest) -> bool:
        """Release the moved-in KV that waiting requests other than `head` hold; True if
        any was held.

        vLLM allocates a request's blocks for external KV when its scheduler admits the
        request, in queue order. Here moved KV lands when the transfer does and is held
        for its request until admission, so requests still waiting can hold every block
        while nothing runs and the queue's head cannot be admitted: a deadlock vLLM's
        order rules out. The released blocks stay cached (free, evicted in LRU order), so
        their requests can still hit what the head's allocation leaves."""
        waiting = [e[3] for e in self._heap] if self.policy == "priority" else self._fcfs
        released = False
        for req in waiting:
            if req is not head and req.pinned_blocks:
                self.kv.free_blocks(req.pinned_blocks)
                req.pinned_blocks = []
                released = True
        return released

    def _schedule(self, now: float) -> tuple[list[tuple[SimRequest, int]], bool, bool]:
        """One vLLM scheduling pass: (scheduled, preempted any, admitted any)."""
        prof = self.profile
        budget = prof.max_num_batched_tokens
        threshold = prof.long_prefill_token_threshold
        cpu = self.cpu
        if cpu is not None:
            self._now = now
            self._land_loads(now)
        scheduled: list[tuple[SimRequest, int]] = []
        preempted = False
        running = self.running
        bs = self.block_size
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            num_tokens = req.num_prompt_tokens + req.num_output_tokens
            num_new = num_tokens - req.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                i += 1
                continue
            total = req.num_computed_tokens + num_new
            if (
                total <= len(req.blocks) * bs
                and (total if total < num_tokens else num_tokens) // bs <= req.num_cached_blocks
            ):
                # Fits the blocks it holds and fills none (most decode steps): `_allocate`
                # would change nothing.
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
                continue
            ok = True
            while not self._allocate(req, num_new):
                if self.policy == "priority":
                    victim = max(running, key=lambda r: (r.priority, r.arrival_time))
                    vi = running.index(victim)
                    running.pop(vi)
                    # A victim already scheduled this step gives its budget back.
                    for si, (sr, sn) in enumerate(scheduled):
                        if sr is victim:
                            scheduled.pop(si)
                            budget += sn
                            break
                    if vi < i:
                        i -= 1
                else:
                    victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    ok = False
                    break
            if not ok:
                break
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        admitted = False
        if not preempted:
            kv, bs = self.kv, self.block_size
            while budget > 0 and len(running) < prof.max_num_seqs:
                head = self._peek_waiting()
                if head is None:
                    break
                req = head
                hits: list[int] = []
                if req.num_computed_tokens == 0:
                    hits = kv.longest_hit(req.block_hashes, (req.num_tokens - 1) // bs)
                    if (
                        cpu is not None
                        and not req.pinned_blocks
                        and self._start_load(req, hits, now)
                    ):
                        self._pop_waiting()
                        continue
                num_new = req.num_tokens - req.num_computed_tokens - len(hits) * bs
                if 0 < threshold < num_new:
                    num_new = threshold
                if num_new > budget:
                    num_new = budget
                if not self._allocate(req, num_new, hits):
                    if running or not self._unpin_waiting(req):
                        break
                    continue  # the released blocks may let it in: look it up again
                self._pop_waiting()
                if req.pinned_blocks:
                    # The request now holds its moved-in prefix through its own hits.
                    kv.free_blocks(req.pinned_blocks)
                    req.pinned_blocks = []
                if req.num_computed_tokens == 0:
                    kv.queries_tokens += req.num_tokens
                    kv.hits_tokens += len(hits) * bs
                req.num_computed_tokens += len(hits) * bs
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = len(hits) * bs
                    req.first_scheduled_time = now
                running.append(req)
                scheduled.append((req, num_new))
                budget -= num_new
                admitted = True
        return scheduled, preempted, admitted

    def start_step(self, now: float) -> float:
        """Schedule the next step at `now`; returns when it ends."""
        assert not self.busy, f"engine {self.name}: step already in flight"
        self.sync_at = _NEVER
        scheduled, preempted, admitted = self._schedule(now)
        while not scheduled and preempted:
            # The request being scheduled preempted itself (vLLM then schedules the rest
            # in its next iteration, at once): schedule again with the freed blocks.
            scheduled, preempted, admitted = self._schedule(now)
        if not scheduled and self._loading:
            # Only CPU-tier loads in flight: wait for the first to land (an arrival
            # ends the wait early, `interrupt`).
            self._scheduled = []
            self._macro = None
            self.busy = True
            self._step_start = now
            self.step_end = max(self._loading[0][0], now)
            return self.step_end
        if not scheduled:
            # Nothing fits (all blocks held by waiting-only state cannot happen in vLLM);
            # report idle so the driver waits for the next arrival.
            return -1.0
        prefill = decode = decode_ctx = attn = 0
        for req, n in scheduled:
            if n == 1 and req.num_computed_tokens >= req.num_prompt_tokens:
                decode += 1
                decode_ctx += req.num_computed_tokens + 1
            else:
                prefill += n
                attn += n * (req.num_computed_tokens + n)
        step = self.profile.step
        dur = step.step_s(prefill, decode, decode_ctx, attn)
        self._scheduled = scheduled
        self._macro = None
        if (
            self.fast_forward
            and prefill == 0
            and not preempted
            and not admitted
            and len(scheduled) == len(self.running)
            and not self._loading
        ):
            k = self._macro_len()
            if k > 1:
                a = dur
                b = step.per_decode_ctx_token_s * decode
                self._macro = _Macro(now, k, a, b)
                dur = self._macro.end_of(k - 1) - now
                self.sync_at = self._macro.end_of(0)  # sub-step 1 is scheduled then
        self.busy = True
        self._step_start = now
        self.step_end = now + dur
        return self.step_end

    def _macro_len(self) -> int:
        """Decode steps the current batch can take before a request finishes or KV runs
        out (the first step's blocks are already allocated)."""
        kmax = min([r.max_tokens - r.num_output_tokens for r in self.running])
        if kmax <= 1:
            return kmax
        free, bs = self.kv.num_free, self.block_size
        # Tokens each request can still compute in the blocks it holds.
        spare = [len(r.blocks) * bs - r.num_computed_tokens for r in self.running]

        def blocks_needed(k: int) -> int:
            # After k steps a request has computed k more tokens and needs their blocks:
            # ceil((k - spare) / bs) new ones once k passes its spare room.
            return sum([-((s - k) // bs) for s in spare if s < k])

        if blocks_needed(kmax) <= free:
            return kmax
        lo, hi = 1, kmax
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks_needed(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def in_macro(self) -> bool:
        return self._macro is not None and self.busy

    def interrupt(self, now: float) -> float | None:
        """A request arrived mid-step: end a macro step at the sub-step in flight.

        Returns the new step end if it moved, else None."""
        m = self._macro
        if self.busy and not self._scheduled and m is None:
            # Waiting for CPU-tier loads only: end the wait now, so the arrival is
            # scheduled at once.
            self.step_end = now
            return now
        if m is None or not self.busy:
            return None
        # First sub-step whose end is at or after `now`.
        lo, hi = 0, m.k - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if m.end_of(mid) >= now:
                hi = mid
            else:
                lo = mid + 1
        if lo + 1 >= m.k:
            return None
        m.k = lo + 1
        self.step_end = m.end_of(lo)
        self.sync(now)
        return self.step_end

    def sync(self, now: float) -> None:
        self._now = now
        self._sync(now)

    def _sync(self, now: float) -> None:
        """Bring a macro step's KV up to `now`: the sub-steps scheduled by then have
        allocated (evicting) and cached their blocks, as step-by-step they would have, so
        the KV events the router sees are on time."""
        m = self._macro
        if m is None or not self.busy:
            return
        # Sub-step j > 0 is scheduled when sub-step j - 1 ends: nothing to do until the
        # last applied one has ended (the driver syncs before every decision).
        if m.applied >= m.k or m.end_of(m.applied - 1) > now:
            return
        lo, hi = m.applied, m.k - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if m.end_of(mid) > now:
                hi = mid
            else:
                lo = mid + 1
        done = min(lo + 1, m.k)
        if done > m.applied:
            self._apply_substeps(done)
            m.applied = done
        self.sync_at = m.end_of(m.applied - 1) if m.applied < m.k else _NEVER

    def _apply_substeps(self, upto: int) -> None:
        """Allocate and cache the blocks of the macro's first `upto` sub-steps."""
        kv, bs = self.kv, self.block_size
        scheduled = self._scheduled
        m = self._macro
        due = m.due if m is not None else []
        if len(due) != len(scheduled):
            due[:] = [_next_due(r, bs) for r, _n in scheduled]
        # Requests whose next block boundary is past `upto` would do nothing: skip them
        # (the rest keep their order, so allocation and events are unchanged).
        for i in [i for i, d in enumerate(due) if d <= upto]:
            req = scheduled[i][0]
            total = req.num_computed_tokens + upto
            need = -(-total // bs) - len(req.blocks)
            # Most sub-steps cross one block boundary: the one-block calls skip the bulk
            # paths' setup (same blocks, same events).
            if need == 1:
                req.blocks.append(kv.allocate_one())
            elif need > 0:
                req.blocks.extend(kv.allocate(need))
            full = total // bs
            cached = req.num_cached_blocks
            if full > cached:
                if full - cached == 1:
                    kv.cache_one(
                        req.blocks[cached], req.block_hashes[cached], cached, req.block_hashes
                    )
                else:
                    kv.cache_blocks(req.blocks, req.block_hashes, cached, full)
                req.num_cached_blocks = full
            due[i] = _next_due(req, bs)

    def complete_step(self, now: float) -> StepOutcome:
        """Apply the step in flight (it ended at `now`)."""
        assert self.busy
        self._now = now
        self.busy = False
        self.sync_at = _NEVER
        self.steps += 1
        k = self._macro.k if self._macro is not None else 1
        self.busy_time += now - self._step_start
        finished: list[SimRequest] = []
        first: list[SimRequest] = []
        tokens: list[tuple[SimRequest, int]] = []
        kv = self.kv
        if self._macro is not None and self._macro.applied < k:
            self._apply_substeps(k)
        for req, n in self._scheduled:
            if k > 1:
                req.num_computed_tokens += k
                req.num_output_tokens += k
                tokens.append((req, k))
            else:
                if req.num_computed_tokens < req.num_prompt_tokens or n > 1:
                    req.prefill_tokens_computed += n
                req.num_computed_tokens += n
                if req.num_computed_tokens >= req.num_prompt_tokens + req.num_output_tokens:
                    req.num_output_tokens += 1
                    tokens.append((req, 1))
                    if req.first_token_time < 0:
                        req.first_token_time = now
                        first.append(req)
            if req.num_output_tokens >= req.max_tokens or req.request_id in self._aborted:
                req.finish_time = now
                finished.append(req)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
            for r in finished:
                kv.free_blocks(r.blocks)
                r.blocks = []
                self._aborted.discard(r.request_id)
        self._scheduled = []
        self._macro = None
        return StepOutcome(finished, first, tokens)
