"""The alert rules (observability/alerts.yaml) with Prometheus' own tool: `promtool check rules` and
`promtool test rules` on tests/observability/alerts_test.yaml (a stalled run fires, a healthy or
finished run does not, a restart storm fires, spread-out restarts do not, XID and ECC errors
fire, a straggler, an overdue checkpoint and a replica group out for 5 minutes fire), and every
metric they name exists.

    .venv/bin/pytest tests/observability/test_alerts.py -q     # needs Debian's `prometheus`

Skipped, with the reason, where promtool is not installed (`apt-get install prometheus`).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from promql_names import REPO_ROOT, metric_names, unknown_metrics
from support import requires_tool

RULES = REPO_ROOT / "observability" / "alerts.yaml"
RULE_TESTS = Path(__file__).with_name("alerts_test.yaml")
PROMTOOL = shutil.which("promtool")
needs_promtool = requires_tool("promtool")


def _promtool(*args: str | Path) -> subprocess.CompletedProcess:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=60)


def _rules() -> list[dict]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


@needs_promtool
def test_the_rule_file_is_valid() -> None:
    result = _promtool("check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_the_alert_rules_pass_their_unit_tests() -> None:
    result = _promtool("test", "rules", RULE_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("> 3\n", "> 4\n"),  # a storm of 4 no longer fires
        ("for: 1m", "for: 30m"),  # the stall fires later than the test expects
        ("unless on (training_job) training_run_active", ""),  # a finished run "vanishes"
        # a replica group out for 5 minutes no longer fires
        (
            "training_replica_waiting_since_timestamp_seconds > 300",
            "training_replica_waiting_since_timestamp_seconds > 1800",
        ),
        ("(max(node_fencer_halted) > 0)", "(max(node_fencer_halted) > 1)"),  # halt never fires
        ("node_fencer_nodes[10m]", "node_fencer_nodes[30m]"),  # a dead fencer noticed late
    ],
)
def test_the_unit_tests_catch_a_changed_rule(tmp_path: Path, old: str, new: str) -> None:
    """The same tests against a copy of the rules with one change must fail."""
    text = RULES.read_text()
    assert old in text
    (tmp_path / "observability").mkdir()
    (tmp_path / "observability" / "alerts.yaml").write_text(text.replace(old, new, 1))
    tests_dir = tmp_path / "tests" / "observability"
    tests_dir.mkdir(parents=True)
    (tests_dir / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    result = _promtool("test", "rules", tests_dir / RULE_TESTS.name)
    assert result.returncode != 0, result.stdout


def test_every_metric_the_rules_name_exists() -> None:
    problems = unknown_metrics((f"alert {r['alert']}", r["expr"]) for r in _rules())
    assert problems == [], "\n".join(problems)


def test_every_alert_has_a_severity_and_a_summary() -> None:
    for rule in _rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]


def test_the_rules_read_the_exporter_and_dcgm() -> None:
    names = set().union(*(metric_names(r["expr"]) for r in _rules()))
    assert {
        "training_last_progress_timestamp_seconds",
        "training_stall_threshold_seconds",
        "training_restarts_total",
        "training_straggler_flagged",
        "training_checkpoint_last_commit_step",
        "training_replica_waiting_since_timestamp_seconds",
        "DCGM_FI_DEV_XID_ERRORS",
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    } <= names
