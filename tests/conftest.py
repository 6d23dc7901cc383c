"""Suite-wide settings."""

import os

import pytest
from hypothesis import settings

# Property tests explore the same examples on every run (CI must not flake on a lucky
# draw); a failure found once stays found. `HYPOTHESIS_PROFILE=explore` draws afresh.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


@pytest.fixture
def result_fields() -> dict[str, type]:
    """DESIGN.md, "Results": every field of a run and its type (written here, apart from
    the code, so the tests check the code against the contract)."""
    return {
        "trace": str,
        "policy": str,
        "rate_scale": float,
        "engines": int,
        "profile": str,
        "workflows": int,
        "requests": int,
        "duration_s": float,
        "goodput_wf_per_s": float,
        "deadline_attainment": float,
        "p50_workflow_s": float,
        "p95_workflow_s": float,
        "p99_workflow_s": float,
        "p95_request_s": float,
        "p95_ttft_s": float,
        "prefix_hit_ratio": float,
        "recomputed_prompt_tokens": int,
        "transferred_bytes": int,
        "decision_p99_us": float,
    }
