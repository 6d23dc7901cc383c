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


@pytest.fixture(scope="session")
def sim_frontend(tmp_path_factory: pytest.TempPathFactory) -> object:
    """vLLM's front end over the tiny model (tools-aware template, hermes tool parser),
    served as `wasma-sim`: what `wasma serve --engines sim:N` renders with. Built once
    (loading vLLM's serving layer takes seconds)."""
    pytest.importorskip("vllm")
    import asyncio

    from wasma.deploy.frontend import Frontend, FrontendOptions
    from wasma.engines.tiny_model import write_tiny_model

    model = write_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))
    options = FrontendOptions(
        model=str(model),
        served_model_name=("wasma-sim",),
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    return asyncio.run(Frontend.build(options))
