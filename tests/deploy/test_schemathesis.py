"""Property-based requests from the gateway's own OpenAPI schema (schemathesis): valid
and invalid bodies, parameters and headers on every operation, over real HTTP against a
gateway on simulated engines. Whatever they send, no answer is a 5xx."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from wasma.core.profile import load_profile
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.router_client import LocalRouterClient, RouterClient
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.serve import ServerThread
from wasma.engines.sim_engine import SimEngine
from wasma.engines.tiny_model import VOCAB_SIZE

PROFILE = load_profile("tiny-cpu")


@pytest.fixture(scope="module")
def server(sim_frontend: Any) -> Iterator[ServerThread]:
    async def factory() -> RouterClient:
        service = RouterService(
            [SimEngine("s0", PROFILE, speed=1000.0, vocab_size=VOCAB_SIZE)],
            PROFILE,
            RouterConfig(policy="wasma"),
        )
        await service.start()
        return LocalRouterClient(service)

    # Small generation limits keep each generated request cheap on the simulator.
    cfg = GatewayConfig(max_tokens_limit=64)
    with ServerThread(create_app(factory, sim_frontend, cfg)) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server: ServerThread) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    schema.config.base_url = server.url
    return schema


def test_no_request_from_the_schema_gets_a_5xx(api_schema: schemathesis.BaseSchema) -> None:
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 5
    seen: list[int] = []
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def one(case: schemathesis.Case) -> None:
            response = case.call(timeout=60)
            seen.append(response.status_code)
            assert response.status_code < 500, (
                f"{case.method} {case.formatted_path} -> {response.status_code}: "
                f"{response.text[:300]}"
            )
            ctype = response.headers.get("content-type") or [""]
            if response.status_code >= 400 and ctype[0].startswith("application/json"):
                assert "error" in response.json(), response.text[:300]  # OpenAI's shape

        one()
    print("schemathesis statuses:", sorted(Counter(seen).items()))
    assert len(seen) >= 5 * len(operations) // 2 and any(c >= 400 for c in seen)


def test_the_schema_lists_the_generation_endpoints(server: ServerThread) -> None:
    paths = httpx.get(server.url + "/openapi.json").json()["paths"]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/workflows"} <= set(paths)
