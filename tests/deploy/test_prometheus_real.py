"""A real Prometheus (Debian's 2.42, `make test` installs it) scraping a gateway on
simulated engines under traffic: every dashboard query returns data, the recording rules
load and evaluate (`promtool check rules`), the exposition passes `promtool check
metrics`, and goodput counts every finished workflow, each app's first included."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from wasma.core.profile import load_profile
from wasma.deploy.gateway import GatewayConfig, create_app
from wasma.deploy.router_client import LocalRouterClient, RouterClient
from wasma.deploy.router_config import RouterConfig
from wasma.deploy.router_service import RouterService
from wasma.deploy.serve import ServerThread, free_port
from wasma.engines.sim_engine import SimEngine
from wasma.engines.tiny_model import VOCAB_SIZE

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"
DASHBOARD = REPO / "deploy" / "grafana" / "wasma-dashboard.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="Debian's prometheus package (make test installs it: apt-get install prometheus)",
)
PROFILE = load_profile("tiny-cpu")
APPS = ("mapreduce", "chat", "firstapp")


def _gateway(sim_frontend: Any) -> ServerThread:
    async def factory() -> RouterClient:
        engines = [
            SimEngine(f"sim{i}", PROFILE, speed=1.0, vocab_size=VOCAB_SIZE) for i in range(2)
        ]
        service = RouterService(engines, PROFILE, RouterConfig(policy="wasma"))
        await service.start()
        return LocalRouterClient(service)

    return ServerThread(create_app(factory, sim_frontend, GatewayConfig()))


def _wait_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {port}")


@pytest.fixture(scope="module")
def stack(sim_frontend: Any) -> Iterator[tuple[ServerThread, str]]:
    tmp = Path(tempfile.mkdtemp(prefix="wasma-prom-"))
    # The same rules, evaluated every second (their windows stay 1m and 5m).
    rules = re.sub(r"interval: \d+s", "interval: 1s", RULES.read_text())
    (tmp / "rules.yaml").write_text(rules)
    port = free_port()
    with _gateway(sim_frontend) as gw:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(tmp / "rules.yaml")],
            "scrape_configs": [
                {
                    "job_name": "wasma-gateway",
                    "static_configs": [{"targets": [f"{gw.host}:{gw.port}"]}],
                }
            ],
        }
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        assert PROMETHEUS is not None
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_port(port)
            prom = f"http://127.0.0.1:{port}"
            _traffic(gw, prom)
            yield gw, prom
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            shutil.rmtree(tmp, ignore_errors=True)


def _query(prom: str, expr: str) -> list[dict[str, Any]]:
    resp = httpx.get(prom + "/api/v1/query", params={"query": expr}, timeout=30)
    body = resp.json()
    assert body["status"] == "success", (expr, body)
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


def _until(prom: str, expr: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        result = _query(prom, expr)
        if result:
            return result
        assert time.monotonic() < deadline, f"no data for {expr}"
        time.sleep(1.0)


def _dag(wid: str, app: str, deadline_s: float) -> dict[str, Any]:
    def node(nid: str, parents: list[str], prompt: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": nid, "parents": parents, "output_tokens": 8, "prompt": prompt}

    return {
        "workflow_id": wid,
        "app": app,
        "deadline_s": deadline_s,
        "nodes": [
            node("plan", [], [{"unique": 64}]),
            node("map0", ["plan"], [{"context": "plan"}, {"unique": 32}]),
            node("map1", ["plan"], [{"context": "plan"}, {"unique": 32}]),
            node("reduce", ["map0", "map1"], [{"output": "map0"}, {"output": "map1"}]),
        ],
    }


def _run_dag(client: httpx.Client, wid: str) -> None:
    for nid, parents in (("plan", ""), ("map0", "plan"), ("map1", "plan"), ("reduce", "map0,map1")):
        headers = {"x-wasma-workflow-id": wid, "x-wasma-node-id": nid}
        if parents:
            headers["x-wasma-parents"] = parents
        body = {"prompt": "a" * 200, "max_tokens": 8, "ignore_eos": True}
        assert client.post("/v1/completions", json=body, headers=headers).status_code == 200


def _traffic(gw: ServerThread, prom: str) -> None:
    with httpx.Client(base_url=gw.url, timeout=60) as client:
        # The first workflow of an app, registered before Prometheus has scraped anything
        # of it: its counters must exist at 0 first, or rate() never counts it.
        assert (
            client.post("/v1/workflows", json=_dag("first-0", "firstapp", 60.0)).status_code == 201
        )
        _until(prom, 'wasma_workflows_completed_total{app="firstapp"}')
        time.sleep(2.0)
        _run_dag(client, "first-0")
        for i in range(4):  # registered DAGs
            assert (
                client.post("/v1/workflows", json=_dag(f"mr-{i}", "mapreduce", 60.0)).status_code
                == 201
            )
            _run_dag(client, f"mr-{i}")
        for i in range(5):  # live workflows (no DAG): known finished once past deadline
            for turn in range(2):
                headers = {
                    "x-wasma-workflow-id": f"chat-{i}",
                    "x-wasma-node-id": f"t{turn}",
                    "x-wasma-app": "chat",
                    "x-wasma-deadline-ms": "1500",
                }
                if turn:
                    headers["x-wasma-parents"] = "t0"
                    if i == 4:
                        # Its deadline passes before its second turn: shed (503), and
                        # the run counts as a miss.
                        time.sleep(1.6)
                body = {"prompt": "hello " * 20, "max_tokens": 4, "stream": bool(turn)}
                resp = client.post("/v1/completions", json=body, headers=headers)
                assert resp.status_code == (503 if i == 4 and turn else 200), resp.text
        for path in ("/v1/models", "/health", "/live", "/ready", "/v1/nothing"):
            client.get(path)
        client.post("/v1/workflows", content=b"{bad")  # a 400
    # Each live workflow closes (and counts) once its deadline passed with nothing in flight.
    _until(prom, 'wasma_workflows_completed_total{app="chat"} >= 5', timeout_s=60)
    time.sleep(3.0)  # a few more scrapes and rule evaluations


def test_promtool_checks_the_rules_and_the_exposition(stack: tuple[ServerThread, str]) -> None:
    gw, _ = stack
    assert PROMTOOL is not None
    rules = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert rules.returncode == 0, rules.stdout + rules.stderr
    exposition = httpx.get(gw.url + "/metrics").text
    check = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def _panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in (("$__rate_interval", "30s"), ("$app", ".*"), ("$engine", ".*"),
                               ("$policy", ".*")):  # fmt: skip
                expr = expr.replace(var, value)
            out.append((panel["title"], expr))
    return out


def test_every_dashboard_query_returns_data(stack: tuple[ServerThread, str]) -> None:
    _, prom = stack
    empty = [(title, expr) for title, expr in _panel_queries() if not _query(prom, expr)]
    assert not empty, empty
    assert len(_panel_queries()) >= 40


def test_goodput_counts_every_finished_workflow_each_apps_first_included(
    stack: tuple[ServerThread, str],
) -> None:
    _, prom = stack
    finished = {
        r["metric"]["app"]: float(r["value"][1])
        for r in _query(prom, "wasma_workflows_completed_total")
    }
    assert finished == {"default": 0.0, "firstapp": 1.0, "mapreduce": 4.0, "chat": 5.0}
    met = {
        r["metric"]["app"]: float(r["value"][1])
        for r in _query(prom, "wasma_workflows_deadline_met_total")
    }
    assert met == {"default": 0.0, "firstapp": 1.0, "mapreduce": 4.0, "chat": 4.0}
    # rate()/increase() see each app's first workflow: its series began at 0.
    first = _query(prom, 'increase(wasma_workflows_completed_total{app="firstapp"}[5m])')
    assert float(first[0]["value"][1]) >= 0.9, first
    goodput = _until(prom, 'app:wasma_workflow_goodput_per_second:rate5m{app="firstapp"} > 0')
    assert float(goodput[0]["value"][1]) > 0


def test_attainment_is_a_number_or_absent_never_nan(stack: tuple[ServerThread, str]) -> None:
    _, prom = stack
    for record in (
        "app:wasma_workflow_deadline_attainment:ratio_rate5m",
        "cluster:wasma_workflow_deadline_attainment:ratio_rate5m",
        "app:wasma_workflow_deadline_attainment:ratio_rate1m",
    ):
        for sample in _query(prom, record):
            assert math.isfinite(float(sample["value"][1])), (record, sample)
    # The idle "default" app has counters at 0: no attainment sample for it, not NaN.
    assert not _query(prom, 'app:wasma_workflow_deadline_attainment:ratio_rate5m{app="default"}')
    idle = _query(prom, "cluster:wasma_workflows_idle:bool5m")
    assert idle and float(idle[0]["value"][1]) == 0.0  # workflows finished: not idle


def test_probes_and_scrapes_are_apart_from_traffic(stack: tuple[ServerThread, str]) -> None:
    _, prom = stack
    by_handler = {
        (r["metric"]["handler"], r["metric"]["code"]): float(r["value"][1])
        for r in _query(prom, "wasma_http_requests_total")
    }
    assert by_handler[("/metrics", "200")] > 0  # scrapes are counted, as their own handler
    assert by_handler[("/v1/completions", "200")] == 4 + 4 * 4 + 9
    assert by_handler[("/v1/completions", "503")] == 1
    assert by_handler[("/v1/workflows", "400")] == 1
    assert ("other", "404") in by_handler
    traffic = _query(prom, "code:wasma_http_requests_per_second:rate5m")
    assert traffic and all(r["metric"].get("handler") is None for r in traffic)
    info = _query(prom, "wasma_engine_info")
    assert {r["metric"]["engine"] for r in info} == {"sim0", "sim1"}
    assert _query(prom, "wasma_build_info")
    assert not _query(prom, 'ALERTS{alertname="WasmaGatewayDown"}')
