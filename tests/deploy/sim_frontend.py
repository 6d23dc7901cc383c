"""vLLM's front end over the tiny model, built once per test process, for the gateway
tests that build their own apps outside fixtures (a cache, not shared state: it is
read-only once built)."""

from __future__ import annotations

import asyncio
import functools
import tempfile

from wasma.deploy.frontend import Frontend, FrontendOptions


@functools.cache
def sim_frontend() -> Frontend:
    from wasma.engines.tiny_model import write_tiny_model

    model = write_tiny_model(tempfile.mkdtemp(prefix="wasma-tiny-") + "/tiny")
    options = FrontendOptions(
        model=str(model),
        served_model_name=("wasma-sim",),
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    return asyncio.run(Frontend.build(options))
