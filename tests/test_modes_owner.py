"""The restart modes have one owner, ``training/modes.py``: no other product file lists them
or decides by their names.

A list of mode names anywhere else (a tuple, list or set of two or more names, a dict keyed by
two or more, a ``Literal[...]`` of them) is a copy that a new mode would have to find and
extend; derive it from ``training.modes.MODES`` instead (a property of ``ModeSpec``). A
comparison with a mode name (``mode == "injob"``, ``mode in ("inprocess", "reserve")``) is a
decision a new mode silently falls out of, into an ``else``: branch on the row's properties
(``MODES[mode].keeps_nodes``...; the planner's own scenarios are rows of
``planner.tiers.ROWS``). A name used as a label (``restart="nested"``, a dict value, a
scenario name) is not a decision and stays allowed. The Makefile and the manifests' YAML and
scripts carry one mode each (a default), never a list of them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

import pytest

from training import modes

REPO_ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("training", "manifests", "infra", "planner", "facts", "bench", "ops", "podsim")
OWNER = REPO_ROOT / "training" / "modes.py"
NAMES = frozenset(modes.MODES)
DECISION_NAMES = NAMES | {"reserve"}
"""Names no comparison may test: the modes, and the planner's own scenario row
(``planner.tiers.ROWS``)."""
TEXT_FILES = ("Makefile", "manifests/**/*.yaml", "manifests/**/*.sh")
"""Product files that are not Python but may carry mode names."""

ALLOWED: dict[str, str] = {
    "bench/goodput.py": "its scenarios are named after the modes they run (each row names its "
    "``restart``), and ``BEST_OF`` picks among those scenario names",
    "bench/restart.py": "its scenarios are the two restart layers and a cold restart (``cold``), "
    "measured and reported one by one",
    "bench/overhead.py": "its scenarios are each restart layer alone against ``none`` (``nested`` "
    "is both at once), picked by name",
}
"""Files whose mode names are scenario names, not a copy of the modes or of a property."""


def _names(nodes: list[ast.expr | None]) -> set[str]:
    return {
        n.value
        for n in nodes
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in NAMES
    }


def mode_lists(source: str) -> list[tuple[int, tuple[str, ...]]]:
    """``(line, names)`` of every literal in ``source`` that lists two or more mode names."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            names = _names(node.elts)
        elif isinstance(node, ast.Dict):
            names = _names(node.keys)
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Tuple):
            names = _names(node.slice.elts)  # Literal["none", "injob", ...]
        else:
            continue
        if len(names) >= 2:
            found.add((node.lineno, tuple(sorted(names))))
    return sorted(found)


def _is_mode_variable(node: ast.expr) -> bool:
    """A name or attribute that holds a mode: ``mode``, ``restart``, ``args.restart``,
    ``size.restart``, ``r.best`` is not one (named by what it holds, not its meaning)."""
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return "mode" in name.lower() or "restart" in name.lower()


def mode_comparisons(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every comparison of a mode variable with a mode name:
    ``mode == "injob"``, ``restart != "none"``, ``mode in ("inprocess", ...)``."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        if not any(_is_mode_variable(o) for o in operands):
            continue
        for operand in operands:
            elts = (
                operand.elts if isinstance(operand, ast.Tuple | ast.List | ast.Set) else [operand]
            )
            for e in elts:
                if isinstance(e, ast.Constant) and e.value in DECISION_NAMES:
                    found.add((node.lineno, e.value))
    return sorted(found)


def _product_files() -> list[Path]:
    files = [REPO_ROOT / "app.py"]
    for package in PRODUCT:
        files += sorted((REPO_ROOT / package).rglob("*.py"))
    return [f for f in files if f != OWNER]


def test_no_product_file_lists_the_restart_modes_but_their_owner() -> None:
    copies = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {', '.join(names)}"
        for path in _product_files()
        if str(path.relative_to(REPO_ROOT)) not in ALLOWED
        for line, names in mode_lists(path.read_text())
    ]
    assert not copies, (
        "restart modes listed outside training/modes.py (derive them from "
        "training.modes.MODES):\n" + "\n".join(copies)
    )


def test_no_product_file_decides_by_a_mode_name() -> None:
    decisions = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {name!r}"
        for path in _product_files()
        if str(path.relative_to(REPO_ROOT)) not in ALLOWED
        for line, name in mode_comparisons(path.read_text())
    ]
    assert not decisions, (
        "decisions by mode name (branch on training.modes.MODES[mode]'s properties; the "
        "planner's own rows: planner.tiers.ROWS):\n" + "\n".join(decisions)
    )


def _text_lists(text: str) -> list[tuple[int, tuple[str, ...]]]:
    return [
        (number, found)
        for number, line in enumerate(text.splitlines(), start=1)
        if len(found := tuple(sorted(n for n in NAMES if re.search(rf"\b{n}\b", line)))) >= 2
    ]


def test_no_makefile_or_manifest_lists_the_modes() -> None:
    files = sorted({f for pattern in TEXT_FILES for f in REPO_ROOT.glob(pattern)})
    assert files, "the patterns match nothing: update TEXT_FILES"
    copies = [
        f"{path.relative_to(REPO_ROOT)}:{line}: {', '.join(names)}"
        for path in files
        for line, names in _text_lists(path.read_text())
    ]
    assert not copies, "modes listed outside training/modes.py:\n" + "\n".join(copies)


def test_no_test_spells_out_every_mode_but_the_tables_own() -> None:
    """A test over every mode iterates ``training.modes.MODES``, so a new mode is tested without
    an edit; ``tests/training/test_modes.py`` states the table's answers on purpose."""
    own = {Path(__file__).resolve(), REPO_ROOT / "tests" / "training" / "test_modes.py"}
    copies = [
        f"{path.relative_to(REPO_ROOT)}:{line}"
        for path in sorted((REPO_ROOT / "tests").rglob("*.py"))
        if path not in own
        for line, names in mode_lists(path.read_text())
        if set(names) == NAMES
    ]
    assert not copies, "iterate training.modes.MODES instead:\n" + "\n".join(copies)


@pytest.mark.parametrize("path", sorted(ALLOWED))
def test_every_allowed_file_still_needs_its_exception(path: str) -> None:
    source = (REPO_ROOT / path).read_text()
    assert mode_lists(source) or mode_comparisons(source), (
        f"{path} lists no modes: drop it from ALLOWED"
    )


@pytest.mark.parametrize(
    "source",
    [
        'RestartMode = Literal["none", "inprocess", "injob", "nested"]',  # config.py before
        'RESTART_CHOICES = ("none", "inprocess", "injob", "nested")',  # overrides.py before
        'POD_MEMORY_MODES = ("inprocess", "nested", "injob")',
        'LAUNCHERS = {"none": "torchrun", "injob": "ft_launcher"}',
        'ok = restart not in ["injob", "nested"]',  # an inline subset (planner/overlays.py)
        'IN_PROCESS_MODES = {"inprocess", "nested", "reserve"}',
    ],
)
def test_the_check_finds_the_copies_it_replaced(source: str) -> None:
    assert mode_lists(source), source


def test_single_names_are_not_lists() -> None:
    assert not mode_lists('DIAGNOSIS = (("none", "sync"), ("injob", "nvrx"))')


@pytest.mark.parametrize(
    "source",
    [
        'nested = mode == "nested"',  # training/resilience/layer.py before
        'if mode == "none" or (mode in ("inprocess", "reserve") and lost): pass',  # planner
        'ok = "injob" != config.resilience.restart',
        'style = "--" if mode == "reserve" else "-"',
    ],
)
def test_the_check_finds_decisions_by_name(source: str) -> None:
    assert mode_comparisons(source), source


def test_labels_are_not_decisions() -> None:
    source = 'run(restart="nested"); LABELS = {"a": "injob"}; log(mode="inprocess")'
    assert not mode_comparisons(source)
    assert not mode_comparisons('if kind == "memory": pass')
    assert not mode_comparisons('if value.lower() in ("", "none"): pass')  # infra/config.py


def test_a_text_line_with_two_modes_is_a_list() -> None:
    assert _text_lists("RESTART ?= none\n") == []
    assert _text_lists("MODES := none injob\n") == [(1, ("injob", "none"))]


def test_the_table_is_the_literal_in_its_order() -> None:
    """``RestartMode`` (what the config validates and the CLI offers) and the table's rows are
    the same names in the same order: adding a mode is one row plus its name in the Literal."""
    assert tuple(modes.MODES) == get_args(modes.RestartMode)
