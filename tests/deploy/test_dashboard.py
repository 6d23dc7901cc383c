"""The Grafana dashboard and the Prometheus rules only query what wasma exports.

Queries are parsed with a real PromQL parser (promql-parser, the Rust one GreptimeDB uses),
so a typo in a metric name or a broken expression fails here instead of as an empty panel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from wasma.deploy.metrics import WasmaMetrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "wasma-dashboard.json"
RULES = REPO / "deploy" / "prometheus" / "rules.yaml"

# Grafana expands these before Prometheus sees the query; substitute plausible values.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "30s",
    "$__range": "1h",
}
RECORD_NAME = re.compile(r"^[a-z_]+:wasma_[a-z0-9_]+:[a-z0-9_]+$")


def load_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in load_rules() if "record" in rule}


def metric_names_in(expr: str) -> list[str]:
    """Names of every series selector in a PromQL expression (raises on a syntax error)."""
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    names: list[str] = []

    def visit(node: object) -> bool:
        if isinstance(node, promql_parser.VectorSelector) and node.name:
            names.append(node.name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def panels() -> list[dict[str, Any]]:
    dashboard = json.loads(DASHBOARD.read_text())
    flat: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        flat.append(panel)
        flat.extend(panel.get("panels", []))  # panels inside collapsed rows
    return flat


def query_panels() -> list[dict[str, Any]]:
    return [p for p in panels() if p["type"] != "row"]


# ---- the parser really checks -----------------------------------------------------------


def test_metric_extraction_catches_names_and_syntax() -> None:
    assert metric_names_in('sum by (app) (rate(a_total{app=~"$app"}[$__rate_interval]))') == [
        "a_total"
    ]
    assert sorted(metric_names_in("x:y:rate1m / on (app) b > 0.9")) == ["b", "x:y:rate1m"]
    with pytest.raises(ValueError):
        metric_names_in("sum(rate(a_total[1m])")


# ---- recording rules ---------------------------------------------------------------------


def test_rules_reference_only_exported_metrics_or_earlier_records() -> None:
    exported = WasmaMetrics.series_names()
    known: set[str] = {"up"}  # Prometheus's own series of each scrape target
    for rule in load_rules():
        names = metric_names_in(rule["expr"])
        assert names, rule
        for name in names:
            assert name in exported or name in known, (rule.get("record", rule.get("alert")), name)
        if "record" in rule:
            known.add(rule["record"])


def test_rules_are_well_formed() -> None:
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    group_names = [group["name"] for group in doc["groups"]]
    assert len(group_names) == len(set(group_names))
    records = [rule["record"] for rule in load_rules() if "record" in rule]
    assert len(records) == len(set(records))
    for rule in load_rules():
        assert ("record" in rule) != ("alert" in rule), rule
        assert isinstance(rule["expr"], str)
        if "record" in rule:
            # level:metric:operations, and no `for`/annotations, which only alerts take.
            assert RECORD_NAME.match(rule["record"]), rule["record"]
            assert set(rule) <= {"record", "expr", "labels"}
        else:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}


def test_goodput_and_attainment_over_1m_and_5m() -> None:
    exprs = {rule["record"]: rule["expr"] for rule in load_rules() if "record" in rule}
    for window in ("1m", "5m"):
        for level in ("app", "cluster"):
            goodput = exprs[f"{level}:wasma_workflow_goodput_per_second:rate{window}"]
            assert metric_names_in(goodput) == ["wasma_workflows_deadline_met_total"]
            assert f"[{window}]" in goodput
            attainment = exprs[f"{level}:wasma_workflow_deadline_attainment:ratio_rate{window}"]
            assert sorted(metric_names_in(attainment)) == [
                "wasma_workflows_completed_total",
                "wasma_workflows_deadline_met_total",
            ]
            assert attainment.count(f"[{window}]") == 2


# ---- dashboard ---------------------------------------------------------------------------


def test_every_panel_queries_exported_metrics() -> None:
    allowed = WasmaMetrics.series_names() | recorded_names()
    checked = 0
    for panel in query_panels():
        assert panel.get("targets"), panel["title"]
        for target in panel["targets"]:
            names = metric_names_in(target["expr"])
            assert names, (panel["title"], target["expr"])
            for name in names:
                assert name in allowed, (panel["title"], name)
            checked += 1
    assert checked >= 15


def test_template_variables_query_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = WasmaMetrics.series_names()
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"]
        match = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", query)
        assert match, query
        assert match.group(1) in exported
        spec = {s.name: s for s in WasmaMetrics.SPECS}[match.group(1)]
        assert match.group(2) in spec.labels


def test_goodput_and_attainment_lead_the_dashboard() -> None:
    ordered = sorted(query_panels(), key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    top_y = ordered[0]["gridPos"]["y"]
    top_row = [p for p in ordered if p["gridPos"]["y"] == top_y]
    top_names = {n for p in top_row for t in p["targets"] for n in metric_names_in(t["expr"])}
    assert "cluster:wasma_workflow_goodput_per_second:rate1m" in top_names
    assert any("attainment" in name for name in top_names)
    # Then the sections in the order the issue asks for.
    first_use: dict[str, int] = {}
    for index, panel in enumerate(ordered):
        for target in panel["targets"]:
            for name in metric_names_in(target["expr"]):
                first_use.setdefault(name, index)
    sections = [
        "wasma_workflow_latency_seconds_bucket",
        "wasma_engine_outstanding_requests",
        "wasma_engine_kv_usage_ratio",
        "cluster:wasma_prefix_hit:ratio_rate5m",
        "wasma_transfer_bytes_total",
        "wasma_placement_decisions_total",
    ]
    positions = [first_use[name] for name in sections]
    assert positions == sorted(positions)


def test_dashboard_layout_is_sound() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "wasma-overview"
    ids = [p["id"] for p in panels()]
    assert len(ids) == len(set(ids))
    occupied: set[tuple[int, int]] = set()
    for panel in panels():
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & occupied, f"{panel['title']} overlaps another panel"
        occupied |= cells
    for panel in query_panels():
        assert panel["datasource"]["uid"] == "${datasource}"
        assert panel.get("description"), panel["title"]
