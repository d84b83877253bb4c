"""The set-up's install command: ``make setup`` runs this with the venv's Python.

    .venv/bin/python tools/pip_install.py [extra pip install args]
    python3 tools/pip_install.py --check     # only: can this machine install the lock?

It installs the project with every pin of ``requirements.lock``. The lock pins the CPU build of
torch (``torch==2.13.0+cpu``), which PyPI does not carry: PyTorch serves it from its CPU index,
added beside the ordinary index as PyTorch documents for pip ("Start Locally": ``pip3 install
torch --index-url https://download.pytorch.org/whl/cpu``; ``--extra-index-url`` keeps PyPI for
the rest). The index is probed once, with a short timeout: where it cannot be reached (offline,
a wheel on disk that pip's own ``find-links`` names) it is left out, so pip never retries
against it for each of the ~90 packages. Extra arguments go to ``pip install``
(tests/test_setup_install.py adds ``--dry-run --report``).

Refused in one line: a Python pip cannot find every pinned wheel for (``SUPPORTED_PYTHONS``),
and a machine other than Linux x86_64 (PyTorch names its aarch64 and macOS CPU wheels without
``+cpu``, so the lock's pin has no build there). Standard library only.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
EXTRAS = "train,infra,dev"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_INDEX_ENV = "TORCH_INDEX_URL"
"""Overrides `TORCH_INDEX` (a mirror of PyTorch's CPU index; the test's stand-in)."""
PROBE_TIMEOUT_S = 5.0
SUPPORTED_PYTHONS = ((3, 11), (3, 12))
"""Every pin has a wheel for these (checked against PyPI with ``pip install --dry-run
--python-version``); 3.13 has none of nvidia-resiliency-ext 0.4.1."""


def refusal() -> str | None:
    """Why this machine cannot install the lock, in one line; None when it can."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return (
            f"the local set-up needs Linux x86_64, this is {sys.platform} {platform.machine()}: "
            "requirements.lock pins torch==2.13.0+cpu, which PyTorch builds for x86_64 only "
            "(its aarch64 and macOS CPU wheels carry no +cpu); use an x86_64 Linux machine or VM"
        )
    if sys.version_info[:2] not in SUPPORTED_PYTHONS:
        found = ".".join(map(str, sys.version_info[:2]))
        wanted = " or ".join(f"{major}.{minor}" for major, minor in SUPPORTED_PYTHONS)
        return (
            f"Python {found} has no wheels for every pin (nvidia-resiliency-ext 0.4.1: "
            f"3.11, 3.12); install Python {wanted} (apt-get install python3.11-venv, or "
            "uv python install 3.11) and run: rm -rf .venv; make setup PYTHON=python3.11"
        )
    return None


def torch_index() -> str:
    return os.environ.get(TORCH_INDEX_ENV, TORCH_INDEX).rstrip("/")


def reachable(index: str, *, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the index answers for torch within `timeout` (one request, no retries)."""
    try:
        with urllib.request.urlopen(f"{index}/torch/", timeout=timeout) as response:
            return response.status == 200
    except (OSError, ValueError):  # URLError, timeouts and HTTP errors are OSErrors
        return False


def install_command(*, index: str | None, extra: list[str]) -> list[str]:
    """The pip command line: the project and its extras under the lock's pins."""
    command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check"]
    command += ["-c", str(LOCK)]
    if index is not None:
        command += ["--extra-index-url", index]
    return [*command, *extra, "-e", f"{REPO}[{EXTRAS}]"]


def main(argv: list[str]) -> int:
    reason = refusal()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    if argv == ["--check"]:  # make runs this with $(PYTHON) before it creates the venv
        return 0
    index = probed = torch_index()
    if not reachable(index):
        print(
            f"note: {probed} is out of reach; torch==2.13.0+cpu must come from a wheel pip "
            "finds itself (PIP_FIND_LINKS=/dir/with/the/wheel, or pip.conf)",
            file=sys.stderr,
        )
        index = None
    command = install_command(index=index, extra=argv)
    print("+ " + " ".join(command), flush=True)
    code = subprocess.call(command, cwd=REPO)
    if code and index is None:
        print(
            f"error: pip failed with {probed} out of reach: reach it (a proxy: "
            "HTTPS_PROXY), or put torch-2.13.0+cpu-cp3XX-...-x86_64.whl in a directory "
            "and set PIP_FIND_LINKS to it",
            file=sys.stderr,
        )
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
