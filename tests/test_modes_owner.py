"""The restart modes have one owner, ``training/modes.py``: no other product file lists them.

A list of mode names anywhere else (a tuple, list or set of two or more names, a dict keyed by
two or more, a ``Literal[...]`` of them) is a copy that a new mode would have to find and
extend; derive it from ``training.modes.MODES`` instead (a property of ``ModeSpec``). Comparing
with one name (``mode == "injob"``) is not a list and stays allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from training import modes

REPO_ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("training", "manifests", "infra", "planner", "facts", "bench")
OWNER = REPO_ROOT / "training" / "modes.py"
NAMES = frozenset(modes.MODES)

ALLOWED: dict[str, str] = {
    "bench/goodput.py": "its scenarios are named after the modes they run (each row names its "
    "``restart``), and ``BEST_OF`` picks among those scenario names",
    "bench/restart.py": "its scenarios are the two restart layers and a cold restart (``cold``), "
    "measured and reported one by one",
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
    assert mode_lists((REPO_ROOT / path).read_text()), (
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
    assert not mode_lists('if mode == "injob" or mode in ("inprocess", "reserve"): pass')
    assert not mode_lists('DIAGNOSIS = (("none", "sync"), ("injob", "nvrx"))')


def test_the_table_is_the_literal_in_its_order() -> None:
    """``RestartMode`` (what the config validates and the CLI offers) and the table's rows are
    the same names in the same order: adding a mode is one row plus its name in the Literal."""
    assert tuple(modes.MODES) == get_args(modes.RestartMode)
