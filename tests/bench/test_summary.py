"""bench/README.md is the output of `python -m bench.summary --markdown` over the results on
file: a rerun benchmark that is not followed by `--write` fails here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench import summary

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_committed_page_is_the_commands_output() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "bench.summary", "--markdown"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (REPO_ROOT / "bench" / "README.md").read_text() == printed, (
        "bench/README.md is stale: run `python -m bench.summary --markdown --write`"
    )


def test_a_result_shows_its_figures_cases_and_targets(tmp_path: Path) -> None:
    (tmp_path / "restore.json").write_text(
        json.dumps(
            {
                "machine": "test box",
                "pod_memory_s": 0.15034,
                "nested": {"not": "a figure"},
                "cases": {"injob/spare": {"restart_p50_s": 20.2, "runs": 1, "list": [1]}},
                "targets": [
                    {"target": "a | b", "value": 0.3257, "goal": "<= 0.5", "verdict": "PASS"}
                ],
            }
        )
    )
    page = summary.markdown(tmp_path)
    assert "## restore" in page and "Measured on: test box." in page
    assert "| pod_memory_s | 0.1503 |" in page and "not" not in page.split("## restore")[1]
    assert "| case | restart_p50_s | runs |" in page and "| injob/spare | 20.2 | 1 |" in page
    assert "| a \\| b | 0.3257 | <= 0.5 | PASS |" in page


def test_writing_a_result_rewrites_the_page(tmp_path: Path, monkeypatch) -> None:
    """Every benchmark writes through ``bench.common.write_result`` (``make bench`` and a script
    run on its own alike): the page follows, so `make test` passes after `make bench`."""
    from bench import common

    results = tmp_path / "results"
    page = tmp_path / "README.md"
    monkeypatch.setattr(common, "RESULTS_DIR", results)
    monkeypatch.setattr(summary, "RESULTS_DIR", results)
    monkeypatch.setattr(summary, "PAGE", page)
    monkeypatch.setattr(summary.write_page, "__defaults__", (results, page))
    common.write_result("restore", {"machine": "test box", "pod_memory_s": 0.25})
    assert page.read_text() == summary.markdown(results)
    assert "pod_memory_s" in page.read_text()
