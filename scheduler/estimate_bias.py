"""How far the policy's own latency estimates fall short of what requests then take.

A placement's estimate (`Placement.estimated_finish_s`) prices the load on the engine at
that moment. Requests placed after it join the same batch and queue, so under a rising
load requests take longer than estimated, and every estimate made in the same moment
errs the same way. Deadline-aware admission built on those estimates then admits a whole
wave of workflows that each looked feasible, and they miss together: wasma with the
registered DAG met 56-81% of pipeline deadlines at 1.5x the least_loaded knee on five
traces (`make bench-seeds`), and 81-90% when admission corrected its estimates by this.

The tracker keeps an exponentially weighted mean of (time the request took) / (time the
policy estimated), over finished requests, so a policy can correct its forecasts by it.
It is one mean for the cluster, not one an engine: a wave lands on every engine the
placement spreads it over, and a per-engine mean would see a handful of finishes each.
It is fed by the router (placed, finished) and, like the rest of `PolicyContext`, read by
policies only.
"""

from __future__ import annotations

from collections import OrderedDict


class EstimateBias:
    # A request the engine lost never finishes; the oldest pending ones are forgotten.
    MAX_PENDING = 100_000
    # One request's ratio is clamped, so a request stuck behind a failover does not
    # swing the mean on its own.
    MAX_RATIO = 5.0

    def __init__(self, alpha: float = 0.05) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        # 0.05: about the last twenty requests, a few engine steps' worth of finishes on a
        # busy cluster, so the mean follows a load change within seconds.
        self.alpha = alpha
        self.ratio = 1.0  # actual / estimated, 1 until a request finished
        self.samples = 0
        self._pending: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def placed(self, request_id: str, now: float, estimated_s: float) -> None:
        """A request went to an engine at `now`, estimated to take `estimated_s`."""
        if estimated_s <= 0:
            return
        self._pending[request_id] = (now, estimated_s)
        self._pending.move_to_end(request_id)
        while len(self._pending) > self.MAX_PENDING:
            self._pending.popitem(last=False)

    def finished(self, request_id: str, now: float) -> None:
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        start, estimated = entry
        r = min(max(now - start, 0.0) / estimated, self.MAX_RATIO)
        self.ratio += self.alpha * (r - self.ratio)
        self.samples += 1

    def __len__(self) -> int:
        return len(self._pending)
