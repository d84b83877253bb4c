"""The Grafana dashboard (observability/dashboard.json): every metric a panel queries exists in the
exporter's catalog or the DCGM exporter's field list, and the figures the issue asks for are on it.

    .venv/bin/pytest tests/observability/test_dashboard.py -q
"""

from __future__ import annotations

import json

from promql_names import REPO_ROOT, metric_names, unknown_metrics

DASHBOARD = REPO_ROOT / "observability" / "dashboard.json"


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, expr) of every panel target and query variable."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((f"panel {panel['title']!r}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            out.append((f"variable {variable['name']}", variable["definition"]))
    return out


def _label_values_metric(expr: str) -> str:
    # label_values(metric, label): the metric is the first argument
    return expr.removeprefix("label_values(").split(",", 1)[0]


def _exprs(dashboard: dict) -> list[tuple[str, str]]:
    return [
        (where, _label_values_metric(e) if e.startswith("label_values(") else e)
        for where, e in _queries(dashboard)
    ]


def test_every_metric_on_the_dashboard_exists() -> None:
    problems = unknown_metrics(_exprs(json.loads(DASHBOARD.read_text())))
    assert problems == [], "\n".join(problems)


def test_an_unknown_metric_is_named_in_one_line() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"][1]["targets"][0]["expr"] = "rate(training_step_seconds_typo[5m])"
    problems = unknown_metrics(_exprs(dashboard))
    title = dashboard["panels"][1]["title"]
    assert problems == [f"panel {title!r}: unknown metric training_step_seconds_typo"]


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    names = set().union(*(metric_names(e) for _, e in _exprs(dashboard)))
    assert {
        "training_step_duration_seconds",
        "training_tokens_per_second",
        "training_mfu_ratio",
        "training_ettr_ratio",
        "training_restarts_total",
        "training_checkpoint_commit_seconds",
        "training_checkpoint_restore_seconds",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_POWER_USAGE",
        "DCGM_FI_DEV_XID_ERRORS",
        "efa_transmitted_bytes_total",
        "efa_received_bytes_total",
    } <= names


def test_panels_have_unique_ids_and_a_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_name_reader_skips_functions_labels_and_numbers() -> None:
    expr = (
        'sum by (layer, cause) (increase(training_restarts_total{training_job="$job"}[1h]))'
        " > 2.5e0 * on (training_job) group_left training_checkpoint_interval_steps offset 1h"
    )
    assert metric_names(expr) == {"training_restarts_total", "training_checkpoint_interval_steps"}
