"""Metric names in PromQL expressions, and the names that exist (imported as ``promql_names``).

Not a test module. The known names are the exporter's catalog (training/observe/catalog.py),
the node fencer's (infra/fencer/metrics.py) and the DCGM fields the stack's DCGM exporter
serves (observability/dcgm-counters.csv).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from infra.fencer.metrics import METRICS as FENCER_METRICS
from training.observe.catalog import METRICS

REPO_ROOT = Path(__file__).resolve().parents[2]
DCGM_COUNTERS = REPO_ROOT / "observability" / "dcgm-counters.csv"

_KEYWORDS = frozenset(
    {
        "and",
        "or",
        "unless",
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "offset",
        "bool",
        "inf",
        "nan",
    }
)
_STRIP = (
    re.compile(r'"(?:[^"\\]|\\.)*"'),  # strings (label values)
    re.compile(r"\{[^}]*\}"),  # label matchers
    re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"),  # label lists
    re.compile(r"\[[^\]]*\]"),  # ranges
    re.compile(r"\$\{?\w+\}?"),  # Grafana variables
)
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def dcgm_fields() -> set[str]:
    """The DCGM fields enabled in observability/dcgm-counters.csv (uncommented lines)."""
    names = set()
    for line in DCGM_COUNTERS.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.add(line.split(",", 1)[0].strip())
    return names


def known_metrics() -> set[str]:
    return set(METRICS) | dcgm_fields() | set(FENCER_METRICS)


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (functions, keywords and durations excluded)."""
    for pattern in _STRIP:
        expr = pattern.sub(" ", expr)
    names = set()
    for match in _NAME.finditer(expr):
        rest = expr[match.end() :].lstrip()
        word = match.group()
        if rest.startswith("(") or word.lower() in _KEYWORDS:
            continue  # a function or an aggregation
        if match.start() > 0 and (
            expr[match.start() - 1].isdigit() or expr[match.start() - 1] == "."
        ):
            continue  # part of a number (1e3, 2.5)
        names.add(word)
    return names


def unknown_metrics(exprs: Iterable[tuple[str, str]]) -> list[str]:
    """One line per unknown metric name: ``<where>: unknown metric <name>``."""
    known = known_metrics()
    return [
        f"{where}: unknown metric {name}"
        for where, expr in exprs
        for name in sorted(metric_names(expr) - known)
    ]
