"""The set-up's install command: ``make setup`` runs this with the venv's Python.

    .venv/bin/python tools/pip_install.py [extra pip install args]
    python3 tools/pip_install.py --check     # only: can this machine install the lock?

It installs the project with every pin of ``requirements.lock``, in two steps:

1. torch alone, at the lock's pin (the CPU build, ``+cpu``, which PyPI does not carry), with
   ``--no-deps`` from PyTorch's CPU index as the only index (PyTorch's "Start Locally": ``pip3
   install torch --index-url https://download.pytorch.org/whl/cpu``). Where that index is out of
   reach, from a wheel on disk only (``--no-index``: pip's own ``find-links``).
2. the project and its extras under the lock, from the ordinary index alone: torch is installed
   and pinned, so nothing else resolves across two indexes (an extra index for the whole resolve
   lets a same-named package on either index win: PyTorch's torchtriton advisory, Dec 2022).

The index is probed once by pip itself (so pip's proxy, certificate, trusted-host and credential
settings apply), with one try, a short timeout and a wall-clock bound that covers DNS. Extra
arguments go to step 2's ``pip install`` (tests/test_setup_install.py adds ``--dry-run
--report``).

Refused in one line: a Python pip cannot find every pinned wheel for (``SUPPORTED_PYTHONS``),
and a machine other than Linux x86_64 (PyTorch names its aarch64 and macOS CPU wheels without
``+cpu``, so the lock's pin has no build there). Standard library only.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
EXTRAS = "train,infra,dev"
TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_INDEX_ENV = "TORCH_INDEX_URL"
"""Overrides `TORCH_INDEX` (a mirror of PyTorch's CPU index; the test's stand-in)."""
PROBE_TIMEOUT_S = 5
PROBE_WALL_S = 30.0
"""pip's ``--timeout`` bounds each socket wait, not name resolution: this bounds the probe."""
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
SUPPORTED_PYTHONS = ((3, 11), (3, 12))
"""Every pin has a wheel for these (checked against PyPI with ``pip install --dry-run
--python-version``); 3.13 has none of nvidia-resiliency-ext 0.4.1."""


def torch_pin(lock: Path = LOCK) -> str:
    """The lock's torch version (the CPU build, ``+cpu``): the lock is its one owner."""
    for line in lock.read_text().splitlines():
        name, _, version = line.strip().partition("==")
        if name.lower() == "torch" and version:
            return version
    raise SystemExit(f"error: {lock} pins no torch (a line torch==<version>): run make lock")


def refusal() -> str | None:
    """Why this machine cannot install the lock, in one line; None when it can."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return (
            f"the local set-up needs Linux x86_64, this is {sys.platform} {platform.machine()}: "
            f"requirements.lock pins torch=={torch_pin()}, which PyTorch builds for x86_64 only "
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


def probe_command(index: str) -> list[str]:
    return [*PIP, "index", "versions", "torch", "--index-url", index]


def serves_pin(index: str, pin: str) -> bool:
    """Whether `index` lists torch `pin`, asked once through pip with pip's own configuration.
    pip's find-links and extra indexes are blanked for the probe (pip drops an empty setting
    but splits a blank one into none: pip/_internal/cli/parser.py) so only `index` answers."""
    command = [*probe_command(index), "--timeout", str(PROBE_TIMEOUT_S), "--retries", "0"]
    env = {**os.environ, "PIP_FIND_LINKS": " ", "PIP_EXTRA_INDEX_URL": " "}
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=PROBE_WALL_S
        )
    except subprocess.TimeoutExpired:
        return False
    versions = [line for line in done.stdout.splitlines() if line.startswith("Available versions:")]
    return done.returncode == 0 and any(pin in line.split(": ")[1].split(", ") for line in versions)


def torch_command(*, pin: str, index: str | None) -> list[str]:
    """Step 1: torch alone, from `index` only, or (None) from a wheel pip finds on disk."""
    source = ["--index-url", index] if index is not None else ["--no-index"]
    return [*PIP, "install", "-q", "--no-deps", *source, f"torch=={pin}"]


def project_command(*, extra: list[str]) -> list[str]:
    """Step 2: the project and its extras under the lock's pins, from the ordinary index."""
    return [*PIP, "install", "-c", str(LOCK), *extra, "-e", f"{REPO}[{EXTRAS}]"]


def _run(command: list[str]) -> int:
    print("+ " + " ".join(command), flush=True)
    return subprocess.call(command, cwd=REPO)


def main(argv: list[str]) -> int:
    reason = refusal()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    if argv == ["--check"]:  # make runs this before it creates the venv
        return 0
    pin, index = torch_pin(), torch_index()
    reachable = serves_pin(index, pin)
    if not reachable:
        print(
            f"note: {index} ({TORCH_INDEX_ENV}) is out of reach or lists no torch {pin}: "
            "installing it from a wheel on disk only (pip's find-links)",
            file=sys.stderr,
        )
    code = _run(torch_command(pin=pin, index=index if reachable else None))
    if code:
        print(
            f"error: torch=={pin} could not be installed: {index} is "
            f"{'reachable but pip failed' if reachable else 'out of reach'}; set "
            f"{TORCH_INDEX_ENV} to a reachable mirror of it (or a proxy: HTTPS_PROXY), or put "
            f"torch-{pin}-cp3XX-...-x86_64.whl in a directory and set PIP_FIND_LINKS to it",
            file=sys.stderr,
        )
        return code
    return _run(project_command(extra=argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
