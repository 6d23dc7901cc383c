"""wasma: workflow-aware placement, KV reuse and transfer, and slack-ordered priority.

For each request the policy estimates, on every engine, when the request would finish:
the prefill work already queued there, its own prefill of the tokens not already cached
(or moved there), and its decode at that engine's batch, plus the delay it imposes on
the requests already there. It picks the lowest. What makes that estimate workflow-aware:

- siblings: a request's prompt blocks count as "on the engine" from the moment it is
  placed (an in-flight overlay) where no engine holds them yet, so siblings that share
  a prompt head (debaters over one topic) land together and prefill it once, in the
  same vLLM step, instead of once per engine;
- transfer: if another engine holds a longer prefix, moving it is priced by the transfer
  planner, counting only the part not hidden behind the request's queueing. A copy waits
  for those already on the holder's link (`ctx.copies`); siblings that spread from one
  holder ride one broadcast of their prefix where engines can relay (the simulated
  GPUs: each joins as a pipelined chain's new tail), and the prefix comes from whichever
  holder's link is free first;
- priority: slack = deadline - now - the node's remaining critical path (from the DAG, or
  the app's learned shape); held work leaves the router least slack first, and with
  `engine_priority` the engine runs it that way too (vLLM priority scheduling; off by
  default, since vLLM then preempts by it). Workflows that can no longer make their
  deadline drop to the lowest class: they still finish, but never ahead of workflows
  that can;
- admission: where the driver can hold requests, a new workflow whose predicted finish
  under the current load is past its deadline waits at the router (admitting it would
  only slow those admitted before it), and requests already hopeless wait for a quiet
  engine; a new workflow also waits while its best engine's KV is spoken for (what the
  engine reports in use plus the prompts and outputs still to come there), since vLLM
  would otherwise admit it and preempt when running requests outgrow the pool; held
  work is offered again, most urgent first, whenever a request finishes;
- retention: nodes whose context descendants will extend are flagged so the engine
  evicts that KV last (the simulator's KV cache; in vLLM, wasma's retention scheduler,
  engines/vllm_retention.py, under a lease the router asks for); among retained KV, what
  is wanted latest goes first (steps-to-use: the node's estimated finish, when its
  readers can start), and a retention ends once its readers have started;
- shared hosts: engines whose compute is one host's CPU cores slow each other while
  both are busy (`Profile.host_contention`), so waking an idle engine beside a busy one
  is priced as what it costs both, not as free parallelism;
- CPU tier: loading a prefix from an engine's CPU tier is priced against recomputing it
  (the load hidden behind the queue with prefetch); where tiers are full, an engine that
  would copy a prefix another engine already holds (recompute or move it) is charged for
  the tier blocks that copy pushes out (`tier_copy_cost`): every duplicate leaves the
  cluster's tiers fewer distinct prefixes to hit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar

from wasma.scheduler.policy import (
    Placement,
    PlacementKind,
    Policy,
    PolicyContext,
    RequestInfo,
    TransferOrder,
)
from wasma.scheduler.tier_index import tiered_match
from wasma.scheduler.workflows import WorkflowState

# Priority classes: vLLM runs lower numbers first.
_HOPELESS = 1_000_000
_PRIORITY_STEP_S = 0.05


# A retention lease lasts twice the node's remaining critical path alone (the deadline
# slack the apps use): long enough for the descendants that reuse its context to start
# under load, short enough that a finished workflow's KV does not outlive its use and push
# other cached prefixes out first. A lease never ends before a second or after ten minutes.
_LEASE_PER_REMAINING = 2.0
_LEASE_MIN_S, _LEASE_MAX_S = 1.0, 600.0


def _lease_s(remaining: float | None) -> float | None:
    """How long after a node finishes its KV is worth keeping (None: unknown)."""
    if remaining is None:
        return None
    return min(max(_LEASE_PER_REMAINING * remaining, _LEASE_MIN_S), _LEASE_MAX_S)


class Wasma(Policy):
    name = "wasma"
    reads_inflight = True
    uses_cost_model = True
    # Skip pricing moves to engines that cannot win (a bound; decisions are unchanged).
    prune: ClassVar[bool] = True
    params: ClassVar[dict[str, Any]] = {
        "colocate": True,  # count placed-but-not-started prompts as on their engine
        "transfer": True,  # move prefixes between engines when it beats recompute
        # Siblings spreading from one holder ride one broadcast of their prefix (a
        # pipelined chain) where engines can relay; off: each copy queues on the holder's
        # link behind the last.
        "broadcast": True,
        "priority": True,  # slack-ordered priority
        # Send the slack order to the engine too (vLLM priority scheduling). Off: the
        # router releases held work by slack and the engine runs what it gets in arrival
        # order. vLLM's priority scheduler preempts the lowest-priority running request
        # however far it has got, so where KV runs short the slack order on the engine
        # turns into recomputation (benchmarks/studies/kv_pressure.py: mapreduce at 32k KV
        # tokens an engine meets 87% of deadlines with it, 98% without); with KV to
        # spare it changes nothing measurable, since vLLM then admits every request.
        "engine_priority": False,
        "load_aware": True,  # count queued work; off = pure cache affinity
        "hopeless": True,  # demote workflows that cannot meet their deadline
        "retain": True,  # ask engines to keep context that descendants will reuse
        # ...ordered by when it is next wanted (steps-to-use), and only until the requests
        # that extend it have started; off: until the lease ends, first kept first evicted.
        "retain_by_use": True,
        # Weight of the delay a placement imposes on requests already on the engine: its
        # prefill stalls their decodes, its decode slows their steps. 0 = selfish.
        "externality": 1.0,
        "kv_headroom": 0.92,  # fraction of KV blocks beyond which preemption is likely
        # KV-aware admission. vLLM admits a request once its prompt fits and preempts
        # when running requests outgrow the pool; every preemption recomputes a prompt.
        # On: an engine's KV need is projected from what it reports in use plus the
        # prompt and output tokens still to come on it (shared prefixes counted once, as
        # the engine holds them); placement avoids engines it would push past
        # `kv_headroom`, and a new workflow whose best engine it would push past waits
        # at the router until requests finish.
        "kv_admission": True,
        "min_transfer_gain_s": 0.002,
        # Above this many engines, score the prefix holders plus a rotating sample of
        # this many others (power-of-d choices) so a decision stays O(d), not O(N).
        "max_candidates": 64,
        # Deadline-aware admission. vLLM admits every request it has KV for, so under
        # overload the running batch (and every step) grows until nobody meets a
        # deadline. A new workflow is held at the router while its predicted finish (its
        # remaining critical path slowed by the load on its best engine) would exceed
        # `admission_margin` x its time to deadline: it would miss anyway, and admitting
        # it slows everyone admitted before it.
        "admission": True,
        "admission_margin": 1.0,
        # Scale the predicted slowdown by how much longer than estimated recent requests
        # took (`ctx.estimates`; only ever up). A load that is rising when a wave of
        # workflows arrives makes each estimate short by the same factor, and without
        # the correction admission lets the whole wave in to miss together. On: far
        # more deadlines met in overload (make bench, 1.5-2x the least_loaded knee), but
        # the workflows it holds back wait longer, so P95 there rises; off by default.
        "admission_bias": False,
        # A request that can no longer make its deadline is held while its best engine's
        # predicted slowdown exceeds this factor, and completed when load allows.
        "hopeless_slowdown": 2.0,
        # Slowdown of an engine per busy neighbour on its host (engines computing on one
        # host's CPU cores); None = the profile's measured `host_contention`.
        "host_contention": None,
        # Engines with a CPU KV tier (vLLM's offloading): price loading a prefix from an
        # engine's CPU tier against recomputing it and against moving it from a peer.
        "cpu_tier": True,
        # ...and have the engine start that load when the request arrives, overlapping
        # its wait in the queue, instead of when it reaches the queue's head.
        "prefetch": True,
        # Retention of a context whose readers have arrivals of their own (the next
        # turns of a conversation, sent when their user sends them): a lease this long,
        # ended as soon as those readers have started. The readers' arrivals are not
        # read, as a router cannot know when a user comes back; the lease the apps get
        # (twice the work left) would end long before a next turn comes.
        "session_lease_s": _LEASE_MAX_S,
        # ...and among such retained contexts, the one kept longest ago is evicted first
        # (its next turn has kept the user longest, the likeliest never to come), not the
        # one wanted latest by steps-to-use: a turn's finish estimate says nothing of when
        # its user answers, and ordering by it evicted the conversation just answered,
        # whose next turn is the likeliest to come soon. Readers still end it on start.
        "session_oldest_first": True,
        # Engines with a full CPU tier: weight, in units of a block's prefill, of each
        # block a placement would copy into an engine's tier that another engine's GPU
        # or tier already holds, counted only where the copy overflows the tier (each
        # pushes out the tier's least recent block, a prefix some later request may
        # need; the tier's size is the profile's `cpu_kv_blocks`, unknown = full).
        # Recomputing a held prefix elsewhere, or moving it, leaves the cluster's tiers
        # holding fewer distinct prefixes; 0 = copies are free.
        "tier_copy_cost": 0.75,
    }
    param_bounds: ClassVar[dict[str, tuple[float, float]]] = {
        "kv_headroom": (0.01, 1.0),
        "max_candidates": (1, math.inf),
        "admission_margin": (0.01, 100.0),
        "hopeless_slowdown": (1.0, math.inf),
        "session_lease_s": (0.0, 86_400.0),
    }

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        prof = ctx.profile
        st = prof.step
        self._bs = prof.block_size
        # Per-token prefill cost with the step overhead amortised over a full chunk.
        self._c_prefill = st.per_prefill_token_s + st.base_s / prof.max_num_batched_tokens
        self._kv_bytes_per_block = prof.kv_bytes_per_token * prof.block_size
        self._cp_cache: dict[str, dict[str, float]] = {}  # workflow -> remaining path
        self._rotate = 0
        kappa = self.p["host_contention"]  # checked: None or a number >= 0
        self._kappa = prof.host_contention if kappa is None else float(kappa)

    def _kv_need(self, s: int) -> float:
        """Blocks engine `s` will hold once its outstanding requests have prefilled and
        decoded: what it reports in use now plus their tokens still to come. Prefixes
        its requests share are in use once, so this does not count them per request as
        `active_blocks` does; output already decoded is counted twice (the router does
        not follow decode progress), which errs towards holding."""
        load = self.ctx.state.loads[s]
        todo = load.pending_prefill_tokens + load.pending_decode_tokens
        return load.reported_kv_usage * self._kv_cap(s) + todo / self._bs

    def _kv_cap(self, s: int) -> int:
        return self.ctx.state.loads[s].num_kv_blocks or self.ctx.profile.num_kv_blocks

    def _kv_over(self, s: int, new_blocks: int) -> bool:
        """Whether `new_blocks` more on engine `s` would take its projected KV need past
        `kv_headroom` of its pool: where vLLM would likely preempt."""
        headroom = float(self.p["kv_headroom"])
        return self._kv_need(s) + new_blocks > headroom * self._kv_cap(s)

    def _busy_s(self, s: int) -> float:
        """How long engine `s` stays busy with the work already on it: its queued
        prefill, then its requests decoding side by side at its current batch. The
        router charges a request's whole output until it finishes (it does not follow
        decode progress), so this is an upper bound."""
        load = self.ctx.state.loads[s]
        if load.outstanding <= 0:
            return 0.0
        step = self.ctx.profile.step.step_s(0, load.outstanding, load.active_blocks * self._bs, 0)
        steps = load.pending_decode_tokens / load.outstanding
        return load.pending_prefill_tokens * self._c_prefill + steps * step

    # -- workflow lookahead ----------------------------------------------------------
    def _lookahead(
        self, wst: WorkflowState | None, req: RequestInfo
    ) -> tuple[float | None, bool, bool]:
        """(this node's remaining critical path, whether descendants reuse its context,
        whether those all have arrivals of their own): from the workflow's DAG when
        registered, else from the app's learned shape."""
        if wst is None or wst.workflow is None:
            shapes = self.ctx.shapes
            return (
                shapes.remaining_s(req.app, req.node_id),
                shapes.context_reused(req.app, req.node_id),
                False,
            )
        wf = wst.workflow
        remaining = self._cp_cache.get(wst.workflow_id)
        if remaining is None:
            prof = self.ctx.profile
            cost = {
                n: prof.request_alone_s(wf.prompt_tokens(n), wf.nodes[n].output_tokens)
                for n in wf.nodes
            }
            remaining = self._cp_cache[wst.workflow_id] = wf.remaining_critical_path(cost)
            if len(self._cp_cache) > 100_000:
                self._cp_cache.pop(next(iter(self._cp_cache)))
        readers = wf.context_readers(req.node_id)
        later = bool(readers) and all(wf.nodes[r].arrival_s is not None for r in readers)
        return remaining.get(req.node_id), bool(readers), later

    def _use_s(self, est: float, reused: bool, later: bool) -> float | None:
        """Steps-to-use of a retention: its readers can start once it finishes, and the
        estimate is when; a session's next turn at an unknown time (infinity: the engine
        keeps such contexts in the order they were kept, the oldest evicted first)."""
        p = self.p
        if not reused or not p["retain_by_use"]:
            return None
        if later and p["session_oldest_first"]:
            return math.inf
        return est

    def _priority(self, req: RequestInfo, rem: float | None, now: float) -> int:
        if not self.p["priority"]:
            return 0
        if rem is None or req.deadline_s == float("inf"):
            # No deadline or no DAG: behind every request that has a deadline to meet.
            return _HOPELESS // 2
        slack = req.deadline_s - now - rem
        if self.p["hopeless"] and slack < 0:
            return _HOPELESS + int(min(-slack, 1e5) / _PRIORITY_STEP_S)
        return int(min(slack, 1e4) / _PRIORITY_STEP_S)

    def _hold(
        self, req: RequestInfo, slot: int, est: float, remaining: float | None, now: float
    ) -> bool:
        """Deadline-aware admission: whether to keep this request at the router for now.

        The slowdown is this request's estimated time on its best engine over its time on
        an idle one; the workflow's remaining critical path is assumed to run that much
        slower. Admission is decided per workflow (at its roots); once admitted, its other
        nodes always go through unless the workflow has become hopeless. Nothing is held
        for an idle engine: there would be nothing to wait for."""
        p = self.p
        if remaining is None or req.deadline_s == float("inf"):
            return False
        if self.ctx.state.loads[slot].outstanding == 0:
            return False
        alone = self.ctx.profile.request_alone_s(req.prompt_tokens, req.max_tokens)
        slowdown = est / alone if alone > 0 else 1.0
        if p["admission_bias"]:
            slowdown *= max(1.0, self.ctx.estimates.ratio)
        left = req.deadline_s - now
        if left < remaining:  # cannot make it even alone: hopeless
            return bool(p["hopeless"]) and slowdown > float(p["hopeless_slowdown"])
        if not p["admission"] or req.parents:
            return False
        return remaining * slowdown > float(p["admission_margin"]) * left

    def _contended(
        self, s: int, own: float, neighbours: list[int], busy_s: dict[int, float]
    ) -> tuple[float, float]:
        """(this request's time on `s` with its host's busy neighbours slowing it, the
        delay it imposes on their requests). Each busy neighbour slows `s` by the factor
        `host_contention` while both run; where this request keeps `s` busy past its
        current work (always, if `s` is idle), that extra stretch slows the neighbour's
        requests by the same factor."""
        kappa = self._kappa
        loads = self.ctx.state.loads
        mine = busy_s.get(s)
        if mine is None:
            mine = busy_s[s] = self._busy_s(s)
        overlap = 0.0
        for j in neighbours:
            lj = loads[j]
            if lj.outstanding <= 0 or not lj.healthy:
                continue
            theirs = busy_s.get(j)
            if theirs is None:
                theirs = busy_s[j] = self._busy_s(j)
            overlap += min(own, theirs)
        slowed = own + kappa * overlap
        added = max(0.0, slowed - mine)
        imposed = 0.0
        if added > 0:
            for j in neighbours:
                lj = loads[j]
                if lj.outstanding > 0 and lj.healthy:
                    imposed += lj.outstanding * kappa * min(added, max(0.0, busy_s[j] - mine))
        return slowed, imposed

    def _source(
        self,
        slots: list[int],
        real: list[int],
        max_real: int,
        hashes: Sequence[int],
        now: float,
        broadcast: bool,
    ) -> int:
        """The engine to move the prefix from, among those holding all `max_real` blocks
        of it: one already broadcasting it, else the one whose link frees first (the
        first such in slot order)."""
        copies = self.ctx.copies
        assert copies is not None
        loads = self.ctx.state.loads
        best, best_wait = slots[0], float("inf")
        for s in [s for s in slots if real[s] == max_real]:
            name = loads[s].name
            if broadcast and copies.joinable(name, hashes, max_real, now):
                return s
            wait = max(0.0, copies.free_s(name) - now)
            if wait < best_wait:
                best, best_wait = s, wait
        return best

    # -- placement -------------------------------------------------------------------
    def place(self, req: RequestInfo, now: float) -> Placement:
        ctx = self.ctx
        p = self.p
        bs = self._bs
        prof = ctx.profile
        st = prof.step
        loads = ctx.state.loads
        hashes = req.block_hashes
        real = ctx.index.match(hashes)
        tier: list[int] | None = None
        # Any engine reporting CPU-tier blocks (vLLM's offloading, or the simulator's
        # tier) has one; loads are priced with the profile's PCIe figures.
        if p["cpu_tier"] and len(ctx.cpu_index):
            tier = tiered_match(ctx.index, ctx.cpu_index, hashes)
        prefetch = bool(p["prefetch"])
        max_hit = (req.prompt_tokens - 1) // bs  # vLLM computes the last prompt token
        slots = self.healthy_slots()
        holder = max(slots, key=real.__getitem__)
        max_real = real[holder]
        copies = ctx.copies
        broadcast = bool(p["broadcast"])
        if copies is not None and max_real > 0 and p["transfer"]:
            holder = self._source(slots, real, max_real, hashes, now, broadcast)
        hits = real
        if p["colocate"]:
            # Prompts placed but not started count where no engine holds the prefix yet
            # (siblings sharing a head that nobody computed): there, going together is
            # the only way to compute it once. Where an engine holds it, a transfer can
            # supply the others and they are free to spread.
            fl = ctx.inflight.match(hashes)
            if max(fl) > max_real:
                hits = [max(a, b) for a, b in zip(real, fl, strict=True)]
        d = p["max_candidates"]
        if len(slots) > d:
            holders = [s for s in slots if hits[s]]
            start = self._rotate % len(slots)
            self._rotate += d
            window = (slots + slots)[start : start + d]
            slots = list(dict.fromkeys(holders + window))
        req_blocks = -(-(req.prompt_tokens + req.max_tokens) // bs)
        load_aware = p["load_aware"]
        kv_gate = bool(p["kv_admission"])
        can_move = p["transfer"] and copies is not None and max_real > 0
        cap_limit = p["kv_headroom"]
        headroom = float(cap_limit)
        min_gain = p["min_transfer_gain_s"]
        kv_bytes_per_block = self._kv_bytes_per_block
        c_pre = self._c_prefill
        attn = st.per_prefill_attn_s * req.prompt_tokens
        ext_w = p["externality"]
        prune = self.prune and ext_w >= 0
        step_inc = st.per_decode_seq_s + st.per_decode_ctx_token_s * req.prompt_tokens
        # Engines sharing a host's cores slow each other while both are busy (CPU
        # engines; `Profile.host_contention`, 0 for engines with a device each).
        kappa = self._kappa if load_aware else 0.0
        neighbours = ctx.state.host_neighbours() if kappa > 0 else None
        busy_s: dict[int, float] = {}
        copy_w = float(p["tier_copy_cost"]) if tier is not None else 0.0
        held_any = min(max(max(tier) if tier is not None else 0, max_real), max_hit)
        tier_cap = prof.cpu_kv_blocks
        tier_used = ctx.cpu_index.blocks_per_engine
        best_key: tuple[float, int, int] | None = None
        best: tuple[float, int, int, TransferOrder | None] = (0.0, slots[0], 0, None)
        order = list(enumerate(slots))
        if can_move and holder in slots:
            # Score the prefix holder first: a good engine found early lets the bound
            # below skip pricing moves to the rest. The key's position term keeps the
            # choice the same as scoring in slot order.
            first = slots.index(holder)
            order.insert(0, order.pop(first))
        for pos, s in order:
            load = loads[s]
            hit = hits[s]
            # A sibling placed here computes the shared head this request would hit: that
            # prefill is this request's own, not extra queue in front of it.
            overlay = (hit - real[s]) * bs
            waiting = load.pending_prefill_tokens - overlay
            # (`max(0, waiting)`, without the call: every engine, every request)
            queued = (waiting if waiting > 0 else 0) * c_pre if load_aware else 0.0
            uncached = req.prompt_tokens - hit * bs
            eff = hit  # blocks it need not compute: GPU hits, then CPU-tier loads
            if tier is not None and min(tier[s], max_hit) > hit:
                extra_cpu = min(tier[s], max_hit) - hit
                t_load = prof.cpu_load_s(extra_cpu)
                # With prefetch the load overlaps the request's wait in the queue.
                shown = max(0.0, t_load - queued) if prefetch else t_load
                if extra_cpu * bs * (c_pre + attn) > shown:
                    eff = hit + extra_cpu
                    uncached = req.prompt_tokens - eff * bs
                    queued += shown
            if load_aware:
                step = (
                    st.base_s
                    + st.per_decode_seq_s * (load.outstanding + 1)
                    + st.per_decode_ctx_token_s * (load.active_blocks * bs + req.prompt_tokens)
                )
            else:
                step = st.base_s
            transfer: TransferOrder | None = None
            if can_move and max_real > eff:
                if best_key is not None and prune:
                    # Pricing a move is the costly part of scoring an engine: skip the
                    # engine where even a free move of the whole prefix would not beat
                    # the best so far (every term below only adds to this bound).
                    floor = (req.prompt_tokens - max_real * bs) * (c_pre + attn)
                    lb = queued + floor + req.max_tokens * step
                    if load_aware:
                        lb += ext_w * load.outstanding * (floor + req.max_tokens * step_inc)
                    if lb > best_key[0]:
                        continue
                extra = max_real - eff
                saved = extra * bs * (c_pre + attn)
                # A move gains at most the prefill of the blocks it brings (the copy's
                # exposed time only subtracts from it): where that is no gain, the move's
                # price cannot change the outcome and is not asked for.
                if saved > min_gain:
                    nbytes = extra * kv_bytes_per_block
                    assert copies is not None
                    t = (
                        copies.quote(
                            loads[holder].name, load.name, hashes, max_real, nbytes, now, broadcast
                        ).ready_s
                        - now
                    )
                    # The copy overlaps the request's wait in the queue; only the rest shows.
                    exposed = max(0.0, t - queued)
                    if saved - exposed > min_gain:
                        transfer = TransferOrder(holder, max_real, nbytes, t, broadcast)
                        uncached = req.prompt_tokens - max_real * bs
                        queued += exposed
            prefill = uncached * (c_pre + attn)
            others = 0.0
            if load_aware:
                if kv_gate:
                    got = max_real if transfer is not None else eff
                    # `_kv_over(s, req_blocks - got)`, inline (every engine, every request).
                    kv_cap = load.num_kv_blocks or prof.num_kv_blocks
                    todo = load.pending_prefill_tokens + load.pending_decode_tokens
                    need = load.reported_kv_usage * kv_cap + todo / bs
                    over = need + (req_blocks - got) > headroom * kv_cap
                else:
                    cap = load.num_kv_blocks or prof.num_kv_blocks
                    over = load.active_blocks + req_blocks > cap_limit * cap
                if over:
                    # Likely preemption: someone's prefill is recomputed; charge it.
                    queued += req.prompt_tokens * c_pre * 2
                # Everyone already there waits for this prefill and decodes a bit slower
                # while this request decodes beside them.
                others = load.outstanding * (prefill + req.max_tokens * step_inc)
            own = queued + prefill + req.max_tokens * step
            if neighbours is not None and neighbours[s]:
                own, shared = self._contended(s, own, neighbours[s], busy_s)
                others += shared
            est = own + ext_w * others
            if copy_w > 0 and tier is not None:
                # Blocks of the prefix held elsewhere that this engine would cache (moved
                # or recomputed) and so store in its tier, past what the tier has free.
                copies_in = held_any - max(real[s], tier[s])
                if copies_in > 0 and tier_cap > 0:
                    copies_in = min(copies_in, tier_used[s] + copies_in - tier_cap)
                if copies_in > 0:
                    est += copy_w * copies_in * bs * c_pre
            key = (est, load.outstanding, pos)
            if best_key is None or key < best_key:
                best_key = key
                best = (own, s, max_real if transfer is not None else eff, transfer)
        est, slot, hit, transfer = best
        # KV-aware admission, per workflow as deadline admission is: a new workflow
        # waits while its best engine's KV is spoken for; an admitted one's later nodes
        # always go through (their context is usually cached there, and holding them
        # would stall workflows half done).
        kv_full = (
            kv_gate
            and not req.parents
            and loads[slot].outstanding > 0
            and self._kv_over(slot, req_blocks - hit)
        )
        remaining, reused, later = self._lookahead(ctx.workflows.get(req.workflow_id), req)
        kind = (
            PlacementKind.TRANSFER
            if transfer is not None
            else (PlacementKind.REUSE if hit > 0 else PlacementKind.RECOMPUTE)
        )
        priority = self._priority(req, remaining, now)
        hold_priority = None
        if not p["engine_priority"]:
            priority, hold_priority = 0, priority
        defer = ctx.can_defer and (kv_full or self._hold(req, slot, est, remaining, now))
        lease = _lease_s(remaining) if reused else None
        if later:
            lease = float(p["session_lease_s"])
        return Placement(
            engine=slot,
            kind=kind,
            priority=priority,
            hold_priority=hold_priority,
            defer=defer,
            hit_blocks=hit,
            transfer=transfer,
            retain=bool(p["retain"]) and reused,
            retain_s=lease,
            retain_use_s=self._use_s(est, reused, later),
            estimated_finish_s=now + est,
            prefetch=tier is not None and prefetch,
        )
