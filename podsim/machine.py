"""What the emulation and the tests need from the machine, and one line saying how to get it.

One owner for "needs X": tests/support.py marks tests with these reasons (skipped, or failed in
CI), ``podsim.cluster.can_run`` says whether pods can be emulated here.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

VENV_BIN = Path(sys.executable).parent

KUBECTL_INSTALL = "install kubectl: https://kubernetes.io/docs/tasks/tools/install-kubectl-linux/"
INSTALL = {
    "make": "apt-get install make",
    "gcc": "apt-get install gcc",
    "promtool": "apt-get install prometheus",
    "prometheus": "apt-get install prometheus",
    "amtool": "apt-get install prometheus-alertmanager",
    "kubectl": KUBECTL_INSTALL,
    "ip": "apt-get install iproute2",
    "unshare": "apt-get install util-linux",
    "node": "install Node.js >= 20: https://nodejs.org/en/download",
    # Never into .venv: botocore pins python-dateutil<3, the pinned kubernetes needs >=3.
    "aws": "pipx install awscli, or AWS CLI v2: https://aws.amazon.com/cli/",
}
"""How to install each tool a test may need (Debian/Ubuntu package names)."""


def which(tool: str) -> str | None:
    """`tool` on PATH or beside this Python (the venv's console scripts: shellcheck, ruff)."""
    local = VENV_BIN / tool
    return shutil.which(tool) or (str(local) if local.exists() else None)


def missing_tools(*tools: str) -> str | None:
    """None when every tool is there, else one line naming what is missing and its install."""
    missing = [tool for tool in tools if which(tool) is None]
    if not missing:
        return None
    installs = "; ".join(dict.fromkeys(INSTALL.get(tool, f"install {tool}") for tool in missing))
    return f"{', '.join(missing)} not installed ({installs})"


def root_reason(what: str) -> str | None:
    """None when running as root, else one line saying `what` needs root and how to run."""
    if os.geteuid() == 0:
        return None
    return f"{what} need root (run as root: sudo .venv/bin/pytest ...)"
