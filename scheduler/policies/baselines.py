"""The placements production routers make, each as its system does it.

- round_robin: the next engine in turn.
- least_loaded: shortest queue, the fewest outstanding requests (ties rotate).
- prefix_aware: SGLang's cache-aware router. If load is imbalanced (max - min >
  balance_abs_threshold and max > min * balance_rel_threshold) go to the least loaded;
  else to the engine with the longest prefix match in the router's own approximate tree
  if the match rate exceeds cache_threshold, else to the engine whose tree is smallest.
  The tree is updated at routing time (the router never sees engine evictions; it ages
  entries out), so it is the router's belief, not the engines' truth.
- kv_aware: NVIDIA Dynamo's KV router. Overlap comes from the engines' KV events (exact);
  cost = overlap_score_weight * prefill blocks + decode blocks, where prefill blocks are
  the new request's uncached blocks plus the engine's in-flight prefill, and decode blocks
  the engine's active blocks plus the request's; lowest cost wins (temperature 0).
- session: consistent hashing of the workflow id onto a ring of virtual nodes.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import OrderedDict
from typing import Any, ClassVar

from wasma.scheduler.policy import Placement, Policy, PolicyContext, RequestInfo, kind_for


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._next = 0

    def place(self, req: RequestInfo, now: float) -> Placement:
        slots = self.healthy_slots()
        slot = slots[self._next % len(slots)]
        self._next += 1
        hit = self.ctx.index.match(req.block_hashes)[slot]
        return Placement(slot, kind_for(hit), hit_blocks=hit)


class LeastLoaded(Policy):
    name = "least_loaded"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._rotate = 0

    def place(self, req: RequestInfo, now: float) -> Placement:
        loads = self.ctx.state.loads
        slots = self.healthy_slots()
        n = len(slots)
        start = self._rotate % n
        self._rotate += 1
        # The least outstanding, the first in rotation order on ties (as min() picks).
        order = slots[start:] + slots[:start]
        outstanding = [loads[s].outstanding for s in order]
        best = order[outstanding.index(min(outstanding))]
        hit = self.ctx.index.match(req.block_hashes)[best]
        return Placement(best, kind_for(hit), hit_blocks=hit)


class PrefixAware(Policy):
    name = "prefix_aware"
    params: ClassVar[dict[str, Any]] = {
        "cache_threshold": 0.3,
        "balance_abs_threshold": 64,
        "balance_rel_threshold": 1.5,
        "max_tree_blocks": 1 << 22,
    }
    param_bounds: ClassVar[dict[str, tuple[float, float]]] = {
        "cache_threshold": (0.0, 1.0),
        "max_tree_blocks": (1, math.inf),
    }

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        n = len(ctx.state.loads)
        # Router-side approximate tree: block hash -> engines it was routed to, LRU-aged.
        self._tree: OrderedDict[int, int] = OrderedDict()
        self._size = [0] * n

    def place(self, req: RequestInfo, now: float) -> Placement:
        loads = self.ctx.state.loads
        slots = self.healthy_slots()
        load = {s: loads[s].outstanding for s in slots}
        lo = min(load.values())
        hi = max(load.values())
        p = self.p
        if hi - lo > p["balance_abs_threshold"] and hi > lo * p["balance_rel_threshold"]:
            slot = min(slots, key=lambda s: load[s])
        else:
            depth, holder = self._match(req.block_hashes, slots)
            rate = depth / max(len(req.block_hashes), 1)
            if holder is not None and rate > p["cache_threshold"]:
                slot = holder
            else:
                slot = min(slots, key=lambda s: (self._size[s], load[s]))
        self._insert(req.block_hashes, slot)
        hit = self.ctx.index.match(req.block_hashes)[slot]
        return Placement(slot, kind_for(hit), hit_blocks=hit)

    def _match(self, hashes: Any, slots: list[int]) -> tuple[int, int | None]:
        allowed = 0
        for s in slots:
            allowed |= 1 << s
        active, depth = allowed, 0
        tree = self._tree
        for h in hashes:
            mask = tree.get(h, 0) & active
            if not mask:
                break
            active, depth = mask, depth + 1
        if depth == 0:
            return 0, None
        # Among engines sharing the longest match, SGLang takes the least loaded.
        loads = self.ctx.state.loads
        cands = [s for s in slots if active >> s & 1]
        return depth, min(cands, key=lambda s: loads[s].outstanding)

    def _insert(self, hashes: Any, slot: int) -> None:
        tree, bit = self._tree, 1 << slot
        for h in hashes:
            mask = tree.get(h, 0)
            if not mask & bit:
                self._size[slot] += 1
            tree[h] = mask | bit
            tree.move_to_end(h)
        while len(tree) > self.p["max_tree_blocks"]:
            _h, mask = tree.popitem(last=False)
            while mask:
                low = mask & -mask
                self._size[low.bit_length() - 1] -= 1
                mask ^= low


class KVAware(Policy):
    name = "kv_aware"
    params: ClassVar[dict[str, Any]] = {"overlap_score_weight": 1.0}

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._rotate = 0

    def place(self, req: RequestInfo, now: float) -> Placement:
        ctx = self.ctx
        bs = ctx.block_size
        loads = ctx.state.loads
        overlap = ctx.index.match(req.block_hashes)
        w = self.p["overlap_score_weight"]
        req_blocks = -(-(req.prompt_tokens + req.max_tokens) // bs)
        slots = self.healthy_slots()
        n = len(slots)
        start = self._rotate % n  # ties broken by rotation, not always the first engine
        self._rotate += 1
        best, best_cost = slots[start], float("inf")
        for i in range(n):
            s = slots[(start + i) % n]
            load = loads[s]
            new_prefill = req.prompt_tokens - overlap[s] * bs
            prefill_blocks = (load.pending_prefill_tokens + new_prefill) / bs
            decode_blocks = load.active_blocks + req_blocks
            cost = w * prefill_blocks + decode_blocks
            if cost < best_cost:
                best, best_cost = s, cost
        return Placement(best, kind_for(overlap[best]), hit_blocks=overlap[best])


class Session(Policy):
    name = "session"
    params: ClassVar[dict[str, Any]] = {"virtual_nodes": 64}
    param_bounds: ClassVar[dict[str, tuple[float, float]]] = {"virtual_nodes": (1, 4096)}

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        ring: list[tuple[int, int]] = []
        for slot, load in enumerate(ctx.state.loads):
            for v in range(self.p["virtual_nodes"]):
                ring.append((_h64(f"{load.name}#{v}"), slot))
        ring.sort()
        self._points = [p for p, _ in ring]
        self._owners = [s for _, s in ring]

    def place(self, req: RequestInfo, now: float) -> Placement:
        loads = self.ctx.state.loads
        i = bisect.bisect(self._points, _h64(req.workflow_id or req.request_id))
        n = len(self._points)
        # Walk the ring past unhealthy engines, as consistent-hash routers do.
        for k in range(n):
            slot = self._owners[(i + k) % n]
            if loads[slot].healthy:
                hit = self.ctx.index.match(req.block_hashes)[slot]
                return Placement(slot, kind_for(hit), hit_blocks=hit)
        self.healthy_slots()  # raises NoHealthyEngine
        raise AssertionError("unreachable")


def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
