"""What a test needs from the machine: skipped with one line naming the install where it is
missing, failed instead under CI's ``TESTS_REQUIRE_ALL=1`` (support.requires_tool, conftest.py).

Runs pytest on a generated test file with tests/conftest.py loaded as a plugin (``-p conftest``).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from support import INSTALL, REPO_ROOT, REQUIRE_ALL_ENV, missing_tools, subprocess_env

PYTEST = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rs", "-q"]
NEEDY = """
from support import requires_tool


@requires_tool("no-such-tool-here", "promtool-not-this-one")
def test_needs_a_tool():
    raise AssertionError("ran without its tool")
"""


def _pytest(path: Path, **env: str) -> subprocess.CompletedProcess:
    """The inner run is a developer's unless `env` says CI: this run's own setting (CI sets
    REQUIRE_ALL_ENV for the whole suite) is not inherited."""
    inner = subprocess_env(PYTHONPATH=f"{REPO_ROOT / 'tests'}:{REPO_ROOT}", **env)
    if REQUIRE_ALL_ENV not in env:
        inner.pop(REQUIRE_ALL_ENV, None)
    return subprocess.run(
        [*PYTEST, "--rootdir", str(path.parent), "-c", "/dev/null", str(path)],
        cwd=path.parent,
        env=inner,
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


NEEDY_AT_RUN_TIME = """
import pytest
from support import skip_or_fail


@pytest.fixture
def thing():
    skip_or_fail("no thing here (make thing)")


def test_needs_a_thing(thing):
    raise AssertionError("ran without its thing")
"""


def test_a_need_found_at_run_time_skips_and_fails_in_ci(tmp_path: Path) -> None:
    test = tmp_path / "test_needy_at_run_time.py"
    test.write_text(NEEDY_AT_RUN_TIME)
    local = _pytest(test)
    assert local.returncode == 0 and "1 skipped" in local.stdout, local.stdout
    assert "no thing here (make thing)" in local.stdout
    ci = _pytest(test, **{REQUIRE_ALL_ENV: "1"})
    assert ci.returncode == 1 and "TESTS_REQUIRE_ALL=1 and no thing here" in ci.stdout, ci.stdout
    assert "ran without its thing" not in ci.stdout


SKIPS_WITHOUT_A_GPU = {
    "tests/training/test_gpu_check.py": "torch.cuda.is_available()",
    "tests/training/checkpoint/test_local_checkpoint.py": "refusal is for CPU-only machines",
}
"""The only skips outside support.py/conftest.py: a GPU machine skips these CPU-only checks."""


def test_every_skip_goes_through_the_support_helpers() -> None:
    """A bare pytest.skip / skipif / importorskip would skip silently in CI too: every need
    from the machine goes through support.requires/requires_tool/skip_or_fail instead."""
    bare = re.compile(r"pytest\.(skip\(|mark\.skipif|importorskip)")
    found = []
    for path in sorted((REPO_ROOT / "tests").rglob("*.py")):
        name = str(path.relative_to(REPO_ROOT))
        if name in ("tests/support.py", "tests/conftest.py"):
            continue
        for line in path.read_text().splitlines():
            if bare.search(line) and SKIPS_WITHOUT_A_GPU.get(name, "\0") not in line:
                found.append(f"{name}: {line.strip()}")
    assert found == []


def test_ci_installs_only_debian_packages_and_names_kubectls_install() -> None:
    """kubectl is not a Debian package: with ``set -e`` an apt-get install of it would stop CI
    before ``make test``; .ci/run says how to install it instead (support.INSTALL's line)."""
    ci = (REPO_ROOT / ".ci/run").read_text()
    assert "packages+=(kubectl)" not in ci
    assert INSTALL["kubectl"] in ci
