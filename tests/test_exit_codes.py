"""The CLIs of infra/, planner/, manifests/ and app.py say their exit codes by name
(training/exits.py, the one owner), never as a number: a literal `return 1` in a `main`, a
`sys.exit(2)` or an argparse `self.exit(2, ...)` fails here. (training/ CLIs: not scanned yet.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CLI_PACKAGES = ("infra", "planner", "manifests")


def _cli_files() -> list[Path]:
    files = [REPO_ROOT / "app.py"]
    for package in CLI_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            text = path.read_text()
            if "__main__" in path.name or 'if __name__ == "__main__"' in text:
                files.append(path)
    return files


def _literal_codes(tree: ast.AST) -> list[str]:
    """`sys.exit(<int>)`, `<x>.exit(<int>, ...)` anywhere, and `return <int>` in a `main`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if name == "exit" and isinstance(first, ast.Constant) and type(first.value) is int:
                found.append(f"line {node.lineno}: exit({first.value})")
        if isinstance(node, ast.FunctionDef) and node.name == "main":
            for inner in ast.walk(node):
                value = inner.value if isinstance(inner, ast.Return) else None
                if isinstance(value, ast.IfExp):
                    values = [value.body, value.orelse]
                else:
                    values = [value]
                for v in values:
                    if isinstance(v, ast.Constant) and type(v.value) is int:
                        found.append(f"line {inner.lineno}: return {v.value}")
    return found


def test_the_scan_sees_the_clis_and_finds_a_literal() -> None:
    names = {p.relative_to(REPO_ROOT).as_posix() for p in _cli_files()}
    assert {"app.py", "planner/cli.py", "infra/alert_probe.py"} <= names
    bad = ast.parse("import sys\ndef main():\n    return 1 if x else 0\nsys.exit(2)\n")
    expected = ["line 3: return 0", "line 3: return 1", "line 4: exit(2)"]
    assert sorted(_literal_codes(bad)) == expected


@pytest.mark.parametrize("path", _cli_files(), ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_clis_name_their_exit_codes(path: Path) -> None:
    found = _literal_codes(ast.parse(path.read_text(), filename=str(path)))
    assert found == [], f"{path.relative_to(REPO_ROOT)}: use training.exits names: {found}"
