"""Deadline shedding at the router's door: how many requests it may hold, and which it sheds
because their deadline can no longer be met.

A fixed limit (8,192 outstanding) ignores the cluster: two engines with 256 sequences
each cannot start 8,192 requests within any deadline, so a burst was all accepted and
hundreds of clients timed out with no answer. The default limit here is sized from the
engines (`default_limit`), and a request whose estimated finish is past its workflow's
deadline is refused at once with 503 + Retry-After (`deadline_refusal`), so its client
can retry elsewhere or give up, instead of waiting on work that is already late.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from wasma.core.profile import Profile
from wasma.scheduler.state import EngineLoad

# Requests per engine sequence slot the router admits: one running batch and three
# waiting (vLLM queues what does not fit; the policy holds the rest at the router).
SLOTS_PER_SEQUENCE = 4


def default_limit(num_engines: int, profile: Profile) -> int:
    """The admission limit when none is configured: what the engines can run and queue."""
    return max(num_engines, 1) * max(profile.max_num_seqs, 1) * SLOTS_PER_SEQUENCE


@dataclass(frozen=True, slots=True)
class DeadlineRefusal:
    message: str
    retry_after_s: float


def estimated_finish_s(
    loads: Sequence[EngineLoad], profile: Profile, prompt_tokens: int, max_tokens: int
) -> float:
    """A lower bound on how long the request takes from now on the least loaded healthy
    engine: the prefill queued ahead of it, then its own run alone (no batching
    slowdown counted). A bound from below, so shedding on it never refuses a request
    that could have made it."""
    st = profile.step
    per_token = st.per_prefill_token_s + st.base_s / max(profile.max_num_batched_tokens, 1)
    queued = min(
        (load.pending_prefill_tokens * per_token for load in loads if load.healthy),
        default=math.inf,
    )
    return queued + profile.request_alone_s(prompt_tokens, max_tokens)


def deadline_refusal(
    now: float,
    deadline_s: float,
    loads: Sequence[EngineLoad],
    profile: Profile,
    prompt_tokens: int,
    max_tokens: int,
) -> DeadlineRefusal | None:
    """Why the request is shed (its workflow's absolute `deadline_s` is out of reach even
    on the least loaded engine), or None to admit it. No deadline: never shed."""
    if not math.isfinite(deadline_s):
        return None
    need = estimated_finish_s(loads, profile, prompt_tokens, max_tokens)
    if not math.isfinite(need) or now + need <= deadline_s:
        return None
    late = now + need - deadline_s
    return DeadlineRefusal(
        f"the workflow's deadline cannot be met: the request needs at least {need:.2f} s "
        f"and its deadline is {max(deadline_s - now, 0.0):.2f} s away ({late:.2f} s short)",
        retry_after_s=max(1.0, min(need, 60.0)),
    )
