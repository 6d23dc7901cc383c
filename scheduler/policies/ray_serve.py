"""Ray Serve's request routers (ray 2.60), as placements under the one scheduling core.

- ray_pow2: `PowerOfTwoChoicesRequestRouter`. Two distinct replicas drawn uniformly at
  random (with two replicas: both, in random order); the one with the shorter queue wins,
  the first drawn on a tie. Serve's queue length is the replica's ongoing requests, which
  is `EngineLoad.outstanding` here.
- ray_prefix_affinity: `PrefixCacheAffinityRouter`
  (`ray/llm/_internal/serve/routing_policies/prefix_aware/`). If the spread of queue
  lengths exceeds `imbalanced_threshold` (Ray's default: infinite, so never), power of
  two. Otherwise the longest prefix match in a router-side tree shared by every ingress
  (Ray's `PrefixTreeActor`): if the matched share of the prompt reaches
  `match_rate_threshold` (0.1), the replicas that hold that longest match; else the
  replicas whose tree is smallest (`get_smallest_tenants`); the shortest queue among
  those wins. The prompt is inserted for the chosen replica after routing; the tree is
  never told of engine evictions and, by Ray's default (`do_eviction=False`), never
  trimmed.

Ray matches on characters of the prompt's text (message contents concatenated, roles
and the chat template left out). The simulator has token blocks, not text: the tree here
holds chain block hashes, the match rate is matched blocks x block size / prompt tokens
(a partial last block counts as unmatched, as text past the last shared character
would), and a replica's tree size is its distinct blocks, standing for its characters.
Requests with the same text prefix share token blocks, so the choices agree wherever a
shared prefix spans whole blocks; they differ only by less than one block of a match.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any, ClassVar

from wasma.scheduler.policy import Placement, Policy, PolicyContext, RequestInfo, kind_for


class _Pow2:
    """Serve's power-of-two draw, seeded so a simulated run repeats."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def choose(self, slots: Sequence[int], outstanding: Sequence[int]) -> int:
        n = len(slots)
        if n == 1:
            return slots[0]
        if n == 2:
            a, b = (slots[0], slots[1]) if self.rng.getrandbits(1) else (slots[1], slots[0])
        else:
            i = self.rng.randrange(n)
            j = self.rng.randrange(n - 1)
            if j >= i:
                j += 1
            a, b = slots[i], slots[j]
        # Serve keeps the lowest queue; strict `<`, so the first drawn wins a tie.
        return b if outstanding[b] < outstanding[a] else a


class RayPow2(Policy):
    name = "ray_pow2"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._draw = _Pow2(ctx.seed)

    def place(self, req: RequestInfo, now: float) -> Placement:
        outstanding = [load.outstanding for load in self.ctx.state.loads]
        slot = self._draw.choose(self.healthy_slots(), outstanding)
        hit = self.ctx.index.match(req.block_hashes)[slot]
        return Placement(slot, kind_for(hit), hit_blocks=hit)


class RayPrefixAffinity(Policy):
    name = "ray_prefix_affinity"
    params: ClassVar[dict[str, Any]] = {
        "imbalanced_threshold": math.inf,
        "match_rate_threshold": 0.1,
    }
    param_bounds: ClassVar[dict[str, tuple[float, float]]] = {
        "imbalanced_threshold": (0.0, math.inf),
        "match_rate_threshold": (0.0, 1.0),
    }

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._draw = _Pow2(ctx.seed)
        # Router-side tree: block hash -> bitmask of replicas it was routed to.
        self._tree: dict[int, int] = {}
        self._size = [0] * len(ctx.state.loads)

    def place(self, req: RequestInfo, now: float) -> Placement:
        loads = self.ctx.state.loads
        slots = self.healthy_slots()
        outstanding = [load.outstanding for load in loads]
        queues = [outstanding[s] for s in slots]
        slot: int | None = None
        if max(queues) - min(queues) <= self.p["imbalanced_threshold"]:
            chosen = self._affine(req, slots)
            if chosen:
                slot = min(chosen, key=lambda s: outstanding[s])
        if slot is None:
            slot = self._draw.choose(slots, outstanding)
        self._insert(req.block_hashes, slot)
        hit = self.ctx.index.match(req.block_hashes)[slot]
        return Placement(slot, kind_for(hit), hit_blocks=hit)

    def _affine(self, req: RequestInfo, slots: list[int]) -> list[int]:
        """The replicas Ray's prefix step ranks first (empty: fall back to pow2)."""
        active = 0
        for s in slots:
            active |= 1 << s
        depth = 0
        tree = self._tree
        for h in req.block_hashes:
            mask = tree.get(h, 0) & active
            if not mask:
                break
            active, depth = mask, depth + 1
        rate = depth * self.ctx.block_size / max(req.prompt_tokens, 1)
        if depth and rate >= self.p["match_rate_threshold"]:
            return [s for s in slots if active >> s & 1]
        # No match worth following: Ray's smallest tenants (its tree drops a replica
        # that died, so those are the live ones).
        smallest = min(self._size[s] for s in slots)
        return [s for s in slots if self._size[s] == smallest]

    def _insert(self, hashes: Sequence[int], slot: int) -> None:
        tree, bit = self._tree, 1 << slot
        for h in hashes:
            mask = tree.get(h, 0)
            if not mask & bit:
                self._size[slot] += 1
                tree[h] = mask | bit
