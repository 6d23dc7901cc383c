"""wasma: workflow-aware placement, KV reuse and transfer, and slack-ordered priority.

For each request the policy estimates, on every engine, when the request would finish:
the prefill work already queued there, its own prefill of the tokens not already cached
(or moved there), and its decode at that engine's batch. It picks the earliest finish.
What makes that estimate workflow-aware:

- siblings: a request's prompt blocks count as "on the engine" from the moment it is
  placed (an in-flight overlay), so siblings that share a prompt head (map workers over
  one document, debaters over one topic) land together and prefill it once, in the
  same vLLM step, instead of once per engine;
- transfer: if another engine holds a longer prefix, moving it is priced by the transfer
  planner, counting only the part not hidden behind the request's queueing;
- priority: slack = deadline - now - the node's remaining critical path; the engine runs
  the least slack first (vLLM priority scheduling). Workflows that can no longer make
  their deadline drop to the lowest class: they still finish, but never ahead of
  workflows that can;
- retention: nodes whose context descendants will reuse are flagged so engines evict
  that KV last (the simulator's KV cache and wasma's vLLM plugin honour it).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, ClassVar

from scheduler.policy import (
    Placement,
    PlacementKind,
    Policy,
    PolicyContext,
    RequestInfo,
    TransferOrder,
)
from scheduler.workflows import WorkflowState

# Priority classes: vLLM runs lower numbers first.
_HOPELESS = 1_000_000
_PRIORITY_STEP_S = 0.05


class Wasma(Policy):
    name = "wasma"
    params: ClassVar[dict[str, Any]] = {
        "colocate": True,  # in-flight overlay: siblings see each other's prefixes
        "transfer": True,  # move prefixes between engines when it beats recompute
        "priority": True,  # slack-ordered priority
        "load_aware": True,  # count queued work; off = pure cache affinity
        "hopeless": True,  # demote workflows that cannot meet their deadline
        "inflight_ttl_s": 30.0,
        "kv_headroom": 0.92,  # fraction of KV blocks beyond which preemption is likely
        "min_transfer_gain_s": 0.002,
    }

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        prof = ctx.profile
        st = prof.step
        self._bs = prof.block_size
        # Per-token prefill cost with the step overhead amortised over a full chunk.
        self._c_prefill = st.per_prefill_token_s + st.base_s / prof.max_num_batched_tokens
        self._kv_bytes_per_block = prof.kv_bytes_per_token * prof.block_size
        # hash -> (engine bitmask, expiry time): prompts placed but not yet reported.
        self._inflight: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self._cp_cache: dict[str, dict[str, float]] = {}

    # -- estimates -------------------------------------------------------------------
    def _inflight_match(self, hashes: Any, now: float) -> list[int]:
        n = len(self.ctx.state.loads)
        out = [0] * n
        fl = self._inflight
        active, depth = -1, 0
        for h in hashes:
            entry = fl.get(h)
            if entry is None or entry[1] < now:
                break
            mask = entry[0] & active
            if not mask:
                break
            if mask != active and depth:
                _spread(out, active & ~mask, depth)
            active, depth = mask, depth + 1
        if depth:
            _spread(out, active, depth)
        return out

    def _remember(self, hashes: Any, slot: int, now: float) -> None:
        fl = self._inflight
        bit = 1 << slot
        exp = now + self.p["inflight_ttl_s"]
        for h in hashes:
            entry = fl.get(h)
            fl[h] = (bit | (entry[0] if entry and entry[1] >= now else 0), exp)
            fl.move_to_end(h)
        # Expired entries sit at the front (LRU by last placement).
        while fl:
            h, (_m, e) = next(iter(fl.items()))
            if e >= now and len(fl) < 1_000_000:
                break
            fl.popitem(last=False)

    def _remaining_cp(self, wst: WorkflowState | None, node_id: str) -> float | None:
        if wst is None or wst.workflow is None:
            return None
        cp = self._cp_cache.get(wst.workflow_id)
        if cp is None:
            wf = wst.workflow
            prof = self.ctx.profile
            cost = {
                n: prof.request_alone_s(wf.prompt_tokens(n), wf.nodes[n].output_tokens)
                for n in wf.nodes
            }
            cp = wf.remaining_critical_path(cost)
            self._cp_cache[wst.workflow_id] = cp
            if len(self._cp_cache) > 100_000:
                self._cp_cache.pop(next(iter(self._cp_cache)))
        return cp.get(node_id)

    def _priority(self, req: RequestInfo, now: float) -> int:
        if not self.p["priority"]:
            return 0
        wst = self.ctx.workflows.get(req.workflow_id)
        rem = self._remaining_cp(wst, req.node_id)
        if rem is None or req.deadline_s == float("inf"):
            return _HOPELESS // 2
        slack = req.deadline_s - now - rem
        if self.p["hopeless"] and slack < 0:
            return _HOPELESS + int(min(-slack, 1e5) / _PRIORITY_STEP_S)
        return int(min(slack, 1e4) / _PRIORITY_STEP_S)

    # -- placement -------------------------------------------------------------------
    def place(self, req: RequestInfo, now: float) -> Placement:
        ctx = self.ctx
        p = self.p
        bs = self._bs
        prof = ctx.profile
        st = prof.step
        loads = ctx.state.loads
        hashes = req.block_hashes
        hits = ctx.index.match(hashes)
        if p["colocate"]:
            fl = self._inflight_match(hashes, now)
            hits = [max(a, b) for a, b in zip(hits, fl, strict=True)]
        slots = self.healthy_slots()
        best_holder = max(slots, key=lambda s: hits[s])
        max_hit = hits[best_holder]
        n_blocks = len(hashes)
        req_blocks = -(-(req.prompt_tokens + req.max_tokens) // bs)
        load_aware = p["load_aware"]
        headroom = p["kv_headroom"]
        c_pre = self._c_prefill
        best: tuple[float, int, int, TransferOrder | None] | None = None
        for s in slots:
            load = loads[s]
            hit = hits[s]
            transfer: TransferOrder | None = None
            queued = load.pending_prefill_tokens * c_pre if load_aware else 0.0
            uncached = req.prompt_tokens - hit * bs
            if (
                p["transfer"]
                and ctx.pricer is not None
                and max_hit > hit
                and ctx.index.match(hashes)[best_holder] == max_hit
            ):
                extra = max_hit - hit
                nbytes = extra * self._kv_bytes_per_block
                t = ctx.pricer.estimate_s(loads[best_holder].name, [load.name], nbytes)
                exposed = max(0.0, t - queued)
                gain = extra * bs * c_pre
                if gain - exposed > p["min_transfer_gain_s"]:
                    transfer = TransferOrder(best_holder, max_hit, nbytes, t)
                    uncached = req.prompt_tokens - max_hit * bs
                    queued += exposed
            prefill = uncached * c_pre + st.per_prefill_attn_s * uncached * req.prompt_tokens
            if load_aware:
                batch = load.outstanding + 1
                ctx_tokens = load.active_blocks * bs
                step = (
                    st.base_s
                    + st.per_decode_seq_s * batch
                    + st.per_decode_ctx_token_s * (ctx_tokens + req.prompt_tokens)
                )
                cap = load.num_kv_blocks or prof.num_kv_blocks
                if load.active_blocks + req_blocks > headroom * cap:
                    # Likely preemption: the engine recomputes someone; charge a full prefill.
                    queued += req.prompt_tokens * c_pre * 2
            else:
                step = st.base_s
            est = queued + prefill + req.max_tokens * step
            key = (est, s, hit if transfer is None else max_hit, transfer)
            if best is None or (est, load.outstanding) < (best[0], loads[best[1]].outstanding):
                best = key
        assert best is not None
        est, slot, hit, transfer = best
        if p["colocate"]:
            self._remember(hashes, slot, now)
        kind = (
            PlacementKind.TRANSFER
            if transfer is not None
            else (PlacementKind.REUSE if hit > 0 else PlacementKind.RECOMPUTE)
        )
        return Placement(
            engine=slot,
            kind=kind,
            priority=self._priority(req, now),
            hit_blocks=min(hit, n_blocks),
            transfer=transfer,
            estimated_finish_s=now + est,
        )


def _spread(out: list[int], mask: int, depth: int) -> None:
    while mask:
        low = mask & -mask
        out[low.bit_length() - 1] = depth
        mask ^= low
