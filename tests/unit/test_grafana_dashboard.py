"""The Grafana dashboard (helm-values/grafana/gpulab-dashboard.json): every panel's PromQL
names only series the gpulab service exposes (`gpulab.hub.service.metrics.SERIES`), every
query uses the dashboard's data source variable, and the panels cover the pool, the queue,
per-person use and idle held GPUs. A real Prometheus runs the same queries against a real
`gpulab up` in tests/app/test_metrics_prometheus.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gpulab.hub.service.metrics import SERIES

DASHBOARD = Path(__file__).resolve().parents[2] / "helm-values" / "grafana" / "gpulab-dashboard.json"

#: PromQL's words that look like names (keywords, aggregation modifiers)
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
            "and", "or", "unless", "inf", "nan"}


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries() -> list[tuple[str, str]]:
    """``(panel title, expr)`` of every query target."""
    out = []
    for p in dashboard()["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def series_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers that are not functions (a
    name before ``(``), keywords, label names (inside ``{}`` or a ``by (...)`` list), label
    values (strings), ranges (``[...]``) or Grafana's ``$`` variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"\$\w+", "", expr)  # $__range_s, $user
    expr = re.sub(r"#.*", "", expr)  # comments
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", expr):
        word = m.group(0)
        rest = expr[m.end():].lstrip()
        if word.lower() in KEYWORDS or rest.startswith("("):
            continue
        names.add(word)
    return names


@pytest.mark.parametrize("title,expr", queries(), ids=[t for t, _ in queries()])
def test_every_query_names_only_series_the_endpoint_exposes(title, expr):
    names = series_names(expr)
    assert names, f"panel {title!r}: no series in {expr!r}"
    assert names <= SERIES, f"panel {title!r} reads series the endpoint never shows: {names - SERIES}"


def test_the_name_parser_sees_what_a_query_reads():
    assert series_names('sum by (le, kind) (rate(gpulab_queue_wait_seconds_bucket{a="x(y)"}[1h]))'
                        ) == {"gpulab_queue_wait_seconds_bucket"}
    assert series_names("a / on (user) b * $__range_s / 3600") == {"a", "b"}


def test_every_panel_uses_the_data_source_variable_and_the_sections_are_there():
    d = dashboard()
    assert d["uid"] and "jupyterhub" in d["tags"]
    names = [v["name"] for v in d["templating"]["list"]]
    assert names[0] == "PROMETHEUS_DS"
    for p in d["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${PROMETHEUS_DS}", p["title"]
        assert p.get("description"), f"panel {p['title']!r} says nothing about itself"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${PROMETHEUS_DS}", p["title"]
    rows = [p["title"] for p in d["panels"] if p["type"] == "row"]
    assert rows == ["GPU pool", "Queue", "Training jobs", "People", "GPU usage"]
    titles = {p["title"] for p in d["panels"]}
    assert {"GPUs by state", "Waiting in the GPU queue", "GPUs held per person",
            "Idle held GPUs"} <= titles
    # the variables' queries read exposed series too
    for v in d["templating"]["list"][1:]:
        m = re.match(r"label_values\((\w+), \w+\)", v["definition"])
        assert m and m.group(1) in SERIES, v["definition"]
