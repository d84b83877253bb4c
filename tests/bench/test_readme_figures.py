"""The README's benchmark headlines are the figures in ``bench/results/summary.json``, as
written: a rerun benchmark whose figures moved fails here until the README says the new ones.
Every other figure lives in the generated bench/README.md, which the README points to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
FIGURES: dict[str, str] = {
    "checkpoint.nvrx_async_blocking_s": "blocks training for {:.3f} s",
    "restore.pod_memory_vs_storage": "takes {:.2f}x a verified storage load",
    "goodput.ettr_inprocess": "the ETTR is\n{:.3f} with in-process restarts",
}
"""Headline key in summary.json -> the README's words around it (at most three figures)."""


def _results_section() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    return text.split("## Results", 1)[1].split("\n## ", 1)[0]


@pytest.mark.parametrize("key", sorted(FIGURES))
def test_each_readme_headline_is_the_figure_on_file(key: str) -> None:
    headlines = json.loads((REPO_ROOT / "bench" / "results" / "summary.json").read_text())
    expected = FIGURES[key].format(headlines["headlines"][key])
    assert " ".join(expected.split()) in " ".join(_results_section().split()), (
        f"README.md's Results should say {expected!r} ({key} in bench/results/summary.json)"
    )


def test_the_readme_points_to_the_generated_page_and_copies_no_more() -> None:
    section = _results_section()
    assert "bench/README.md" in section
    assert len(FIGURES) <= 3
