"""Property-based fuzzing of every endpoint: whatever arrives (method, path, headers, raw
or JSON body, DAGs), the gateway never answers 5xx, never dies, and every error has
OpenAI's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from wasma.deploy.build import EngineSpec, ServiceConfig
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.serve import ServerThread, local_router_factory
from wasma.engines.tiny_model import VOCAB_SIZE

KEY = "fuzz-key-0123456789"
ENDPOINTS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/workflows"),
    ("GET", "/v1/workflows/{id}"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]


@pytest.fixture(scope="module")
def server(sim_frontend: Any) -> Iterator[ServerThread]:
    cfg = ServiceConfig(
        engines=EngineSpec.parse("sim:2"),
        policy="wasma",
        sim_speed=200.0,
        sim_vocab_size=VOCAB_SIZE,
    )
    gcfg = GatewayConfig(model_names=("wasma-sim",), api_keys=(KEY,), max_body_bytes=65536)
    with ServerThread(create_app(local_router_factory(cfg), sim_frontend, gcfg)) as srv:
        yield srv


_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=16), inner, max_size=5)
    ),
    max_leaves=16,
)
_fields = st.sampled_from(
    ["prompt", "messages", "max_tokens", "max_completion_tokens", "stream", "n", "model",
     "temperature", "top_p", "metadata", "vllm_xargs", "stream_options", "stop",
     "stop_token_ids", "min_tokens", "ignore_eos", "priority", "return_token_ids",
     "workflow_id", "nodes", "deadline_s", "app"]
)  # fmt: skip
_node = st.fixed_dictionaries(
    {"id": st.text(max_size=6), "parents": st.lists(st.text(max_size=6), max_size=3),
     "output_tokens": st.integers(-2, 70), "prompt": st.lists(_json, max_size=3)}
)  # fmt: skip
_body = st.one_of(
    st.dictionaries(_fields, _json, max_size=7).map(lambda d: json.dumps(d).encode()),
    st.fixed_dictionaries(
        {
            "workflow_id": st.text(max_size=10),
            "deadline_s": _scalars,
            "nodes": st.lists(_node, max_size=4),
        }
    ).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=200),
    st.just(b""),
)
_header_value = st.text(
    alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=40
).map(str.strip)
_headers = st.dictionaries(
    st.sampled_from(
        ["x-wasma-workflow-id", "x-wasma-node-id", "x-wasma-parents", "x-wasma-deadline-ms",
         "x-wasma-app", "x-session-id", "x-claude-code-session-id", "x-request-id",
         "content-type", "content-length"]
    ),
    _header_value,
    max_size=4,
)  # fmt: skip
_auth = st.sampled_from([f"Bearer {KEY}", f"Bearer {KEY}x", "Bearer", "", "Basic abc", KEY])


def _check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    endpoint=st.sampled_from(ENDPOINTS),
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", None]),
    body=_body,
    headers=_headers,
    auth=_auth,
    wid=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=140),
)
def test_every_endpoint_survives_fuzzed_requests(
    server: ServerThread,
    endpoint: tuple[str, str],
    method: str | None,
    body: bytes,
    headers: dict[str, str],
    auth: str,
    wid: str,
) -> None:
    verb, path = endpoint
    # Any printable id, percent-encoded into one path segment (as a client must send it).
    path = path.replace("{id}", quote(wid, safe="") or "x")
    sent: dict[str, Any] = {k: v for k, v in headers.items() if k != "content-length"}
    if auth:
        sent["authorization"] = auth
    try:
        resp = httpx.request(
            method or verb,
            server.url + path,
            content=body if (method or verb) != "GET" else None,
            headers=sent,
            timeout=30,
        )
    except httpx.InvalidURL:
        return  # the client refuses to send it; nothing reached the server
    _check(resp)


def test_the_server_still_serves_after_fuzzing(server: ServerThread) -> None:
    resp = httpx.post(
        server.url + "/v1/completions",
        json={"prompt": "still here", "max_tokens": 3},
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    assert httpx.get(server.url + "/health").json()["failed"] == 0
