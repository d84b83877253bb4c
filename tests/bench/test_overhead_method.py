"""bench.overhead's method on known inputs: the rounds' spread, the verdict it allows, and the
within-run split of the gaps between steps (a run directory written as the ranks write it).
Run: .venv/bin/pytest tests/bench/test_overhead_method.py -q
"""

from __future__ import annotations

import itertools
from pathlib import Path

from bench import overhead
from training.runlog.files import EVENTS_FILE, METRICS_FILE, STRAGGLER_REPORT_EVENT, append_jsonl


def test_the_spread_is_the_median_iqr_and_a_bootstrap_interval() -> None:
    values = [0.01, 0.012, 0.009, 0.011, 0.010, 0.013, 0.008]
    s = overhead.spread(values)
    assert s["median"] == 0.010 and s["n"] == 7
    low, high = s["ci"]
    assert min(values) <= low <= s["median"] <= high <= max(values)
    assert s["iqr"][0] <= s["median"] <= s["iqr"][1]


def test_a_verdict_needs_the_whole_interval_on_one_side_and_enough_rounds() -> None:
    def o(ci, n=overhead.MIN_ROUNDS):
        return {"ci": ci, "n": n}

    assert overhead.verdict(o([0.001, 0.015])) == "PASS"
    assert overhead.verdict(o([0.025, 0.05])) == "MISS"
    assert overhead.verdict(o([-0.1, 0.3])) == "UNRESOLVED"
    assert overhead.verdict(o([0.001, 0.015], n=overhead.MIN_ROUNDS - 1)) == "n/a"


def test_the_gaps_after_a_snapshot_and_a_report_are_told_apart(tmp_path: Path) -> None:
    """Steps of 100 ms; 1 ms between plain steps, +50 ms after the snapshot of step 10,
    +50 + 20 ms after step 20 (a snapshot and a straggler report)."""
    t = 0.0
    for step in range(1, 25):
        gap = 0.001 + (0.05 if step - 1 in (10, 20) else 0.0) + (0.02 if step - 1 == 20 else 0.0)
        t += gap + 0.1
        append_jsonl(tmp_path / METRICS_FILE, {"time": t, "step": step, "step_time_s": 0.1})
    for step in (10, 20):
        append_jsonl(tmp_path / EVENTS_FILE, {"kind": "memory_snapshot", "step": step, "rank": 0})
    append_jsonl(tmp_path / EVENTS_FILE, {"kind": STRAGGLER_REPORT_EVENT, "step": 20, "rank": 0})
    stats = overhead.steady_state(tmp_path, warmup=8)
    split = stats["between_ms"]
    assert abs(split["plain"] - 1.0) < 1e-6
    assert abs(split["snapshot"] - 50.0) < 1e-6 and abs(split["report"] - 20.0) < 1e-6
    floor = [{"interval_s": 0.101, "between_ms": {"plain": 1.0}}]
    share = overhead.attribution([stats], floor)
    assert abs(share["pod_memory_snapshot"] - 50e-3 / overhead.SNAPSHOT_EVERY / 0.101) < 1e-9
    assert abs(share["per_step_hooks"]) < 1e-9
    assert list(itertools.islice(share, 3)) == [
        "per_step_hooks",
        "pod_memory_snapshot",
        "straggler_report",
    ]
