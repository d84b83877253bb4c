"""The run directory's file names and its one JSONL format (append, read). Standard library
only: the launchers, the report and the benchmarks read runs without torch."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
"""One line per optimizer step (rank 0)."""
EVENTS_FILE = "events.jsonl"
"""Run events of every rank and the launcher: faults, restarts and their phases, checkpoints."""
SUMMARY_FILE = "summary.json"
TIMELINE_FILE = "timeline.png"
STRAGGLER_REPORT_EVENT = "straggler_report"
"""The ``events.jsonl`` kind of a straggler report (written by rank 0 for every rank,
``training/resilience/straggler.py``)::

    {"kind": "straggler_report", "rank": 0, "step": 40, "threshold": 0.5,
     "scores": [{"rank": 0, "node": "node-a", "score": 1.0}, {"rank": 1, "node": "node-b",
     "score": 0.13}], "nodes": {...}, "slow_streaks": {...}}

``score`` is a rank's performance relative to the fastest (1 = as fast), None when the rank
timed nothing since the last report; below ``threshold`` the rank counts as slow."""
STRAGGLER_EVICTION_EVENT = "straggler_eviction"
VERDICT_FILE = "verdict.json"
"""Why a rank ended the run, read by the launcher and the pod supervisor to choose the exit code."""


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """One ``write`` with O_APPEND, so lines of concurrent writers (ranks) never interleave."""
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def parse_jsonl(lines: Iterable[str | bytes]) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects among ``lines`` and the count of other non-blank lines (most often the
    torn last line of a killed process)."""
    rows: list[dict[str, Any]] = []
    bad = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(obj, dict):
            rows.append(obj)
        else:
            bad += 1
    return rows, bad


def read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Objects of a JSONL file (a missing file has none) and the count of unreadable lines."""
    if not path.is_file():
        return [], 0
    with path.open("r", encoding="utf-8", errors="replace") as handle:
        return parse_jsonl(handle)
