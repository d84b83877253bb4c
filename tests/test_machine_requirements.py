"""What a test needs from the machine: skipped with one line naming the install where it is
missing, failed instead under CI's ``TESTS_REQUIRE_ALL=1`` (support.requires_tool, conftest.py).

Runs pytest on a generated test file with tests/conftest.py loaded as a plugin (``-p conftest``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from support import REPO_ROOT, REQUIRE_ALL_ENV, missing_tools, subprocess_env

PYTEST = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rs", "-q"]
NEEDY = """
from support import requires_tool


@requires_tool("no-such-tool-here", "promtool-not-this-one")
def test_needs_a_tool():
    raise AssertionError("ran without its tool")
"""


def _pytest(path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*PYTEST, "--rootdir", str(path.parent), "-c", "/dev/null", str(path)],
        cwd=path.parent,
        env=subprocess_env(PYTHONPATH=f"{REPO_ROOT / 'tests'}:{REPO_ROOT}", **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_missing_tool_names_its_install() -> None:
    assert missing_tools("sh") is None
    assert missing_tools("amtool-x", "prometheus-x") == (
        "amtool-x, prometheus-x not installed (install amtool-x; install prometheus-x)"
    )
    assert missing_tools("promtool") in (
        None,
        "promtool not installed (apt-get install prometheus)",
    )


def test_a_missing_tool_skips_the_test_and_fails_it_in_ci(tmp_path: Path) -> None:
    test = tmp_path / "test_needy.py"
    test.write_text(NEEDY)
    local = _pytest(test)
    assert local.returncode == 0, local.stdout + local.stderr
    assert "1 skipped" in local.stdout
    assert "no-such-tool-here, promtool-not-this-one not installed" in local.stdout
    ci = _pytest(test, **{REQUIRE_ALL_ENV: "1"})
    assert ci.returncode == 1 and "1 error" in ci.stdout, ci.stdout  # failed in its set-up
    assert "TESTS_REQUIRE_ALL=1 and no-such-tool-here" in ci.stdout
    assert "ran without its tool" not in ci.stdout
