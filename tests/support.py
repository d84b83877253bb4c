"""Helpers shared by the test modules (imported as ``support``; fixtures live in conftest.py).

Not a test module: it only builds corpora, starts real training jobs and reads their output.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# Re-exported to the tests; their owners are the pod emulation's package (podsim/), which
# bench/ imports too.
from podsim.machine import (  # noqa: F401
    INSTALL,
    KUBECTL_INSTALL,
    VENV_BIN,
    missing_tools,
    root_reason,
    which,
)
from podsim.model import TINY_MODEL  # noqa: F401
from podsim.state import assert_identical, committed_checkpoints, final_state, flatten  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port free right now on this host (for a test's own store)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_learnable_text(path: Path, *, lines: int = 1500, seed: int = 0) -> None:
    """Eight words in cyclic order, starting at a random word: easy to learn, not trivial."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    text = []
    for _ in range(lines):
        k = rng.randrange(len(words))
        text.append(" ".join(words[(k + j) % len(words)] for j in range(len(words))) + ".")
    path.write_text("\n".join(text) + "\n")


def subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # torch's import of pynvml warns on stderr; keep CLI stderr to our own messages.
        PYTHONWARNINGS="ignore::FutureWarning",
        CI="1",  # plain log lines, never a progress bar
        # No TensorBoard tailer in the many short local runs (1-2 s of CPU each on 2 cores);
        # tests/training/runlog/test_tensorboard.py and the emulated pods run it.
        TRAINING_TENSORBOARD="0",
    )
    env.update(extra)
    return env


@dataclass(frozen=True)
class RunResult:
    returncode: int
    output: str  # stdout and stderr together
    run_dir: Path


def run_torchrun(
    *, nproc: int, run_dir: Path, args: list[str] | tuple[str, ...], timeout: float = 150
) -> RunResult:
    """``torchrun --standalone --nproc-per-node N -m training train --run-dir DIR ARGS``."""
    command = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "training",
        "train",
        "--run-dir",
        str(run_dir),
        *args,
    ]
    proc = run_in_repo(command, timeout=timeout)
    return RunResult(returncode=proc.returncode, output=proc.stdout, run_dir=run_dir)


def run_in_repo(
    command: list[str], *, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``command`` from the repository root with the test environment, stdout and stderr
    together in ``.stdout``; a timeout fails the test with the output's tail. The command runs
    in a session of its own, and a timeout kills its whole process group: a launcher's ranks
    (torchrun's workers, a benchmark's) never outlive the test that started them."""
    proc = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        env=subprocess_env() if env is None else env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{Path(command[0]).name} timed out after {timeout}s:\n{output[-4000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout=output)


def processes_of_test(nodeid: str, *, phase: str = "call") -> list[int]:
    """The live processes a test started in one phase: pytest sets ``PYTEST_CURRENT_TEST`` to
    ``<nodeid> (<phase>)`` for each phase, and every process started then inherits it through
    every fork and exec, torch elastic's workers in their own sessions included (pytest's own
    environment block, read from /proc, predates the variable: proc(5))."""
    needle = f"PYTEST_CURRENT_TEST={nodeid} ({phase})".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or a zombie
            continue
    return found


def cfn_lint(path: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """cfn-lint's own runner on one template, parseable output (the CLI ``cfn-lint`` is; its
    entry point run with this Python, so the pinned version in .venv lints)."""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from cfnlint.runner import main; sys.exit(main())",
            "--format",
            "parseable",
            *args,
            "--",
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def prometheus_server(config: Path, *, data_dir: Path) -> Iterator[int]:
    """A real Prometheus (Debian's ``prometheus``) on a free loopback port with ``config`` and its
    own data directory, ready (``/-/ready``) before the port is given; stopped on exit. Its log
    goes to ``data_dir/prometheus.log`` and into the failure message if it never gets ready."""
    import time
    import urllib.request

    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    log_path = data_dir / "prometheus.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={data_dir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                ready = f"http://127.0.0.1:{port}/-/ready"
                with urllib.request.urlopen(ready, timeout=1) as response:
                    if b"Ready" in response.read():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or process.poll() is not None:
                pytest.fail(f"prometheus did not start:\n{tail(log_path)}")
            time.sleep(0.2)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_losses(run_dir: Path) -> list[float]:
    return [record["loss"] for record in read_metrics(run_dir)]


# ---------------------------------------------------------------------------------------------
# local jobs through python -m training.launch.local (torchrun or ft_launcher), with a log file
# ---------------------------------------------------------------------------------------------


def launch_local(
    run_dir: Path, corpus: Path, *args: str, nproc: int = 2, timeout: float = 200
) -> subprocess.CompletedProcess:
    """``python -m training.launch.local`` with output in ``<run_dir>.log`` (``proc.log``)."""
    command = [
        sys.executable,
        "-m",
        "training.launch.local",
        f"--nproc={nproc}",
        "--run-dir",
        str(run_dir),
        f"--data.path={corpus}",
        *args,
    ]
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as handle:
        try:
            proc = subprocess.run(
                command,
                cwd=REPO_ROOT,
                env=subprocess_env(),
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"run timed out after {timeout}s; log tail:\n{tail(log)}")
    proc.log = log  # type: ignore[attr-defined]
    return proc


def tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- what a test needs from the machine ----------------------------------------------------
# One owner for "this test needs X": a test marked with `requires_tool` / `requires_root` is
# skipped, with one line naming the install command, where X is missing; CI (.ci/run) sets
# REQUIRE_ALL_ENV so that a missing X fails there instead (tests/conftest.py applies both).
REQUIRE_ALL_ENV = "TESTS_REQUIRE_ALL"


def requires(reason: str | None) -> pytest.MarkDecorator:
    """Mark a test that needs something from the machine, missing when `reason` (one line,
    naming the fix) is set: skipped, or failed under ``TESTS_REQUIRE_ALL=1``."""
    return pytest.mark.requires(reason=reason)


def skip_or_fail(reason: str) -> None:
    """Inside a test or fixture: what `requires` does, for a need found only at run time."""
    if os.environ.get(REQUIRE_ALL_ENV) == "1":
        pytest.fail(f"{REQUIRE_ALL_ENV}=1 and {reason}", pytrace=False)
    pytest.skip(reason)


def cdk_cli_reason() -> str | None:
    """None when the pinned CDK CLI is installed, else one line saying how to install it."""
    if (REPO_ROOT / "node_modules" / ".bin" / "cdk").exists():
        return None
    return "the pinned CDK CLI is not installed (make setup: npm ci installs node_modules/)"


def requires_tool(*tools: str) -> pytest.MarkDecorator:
    """Mark a test (or module, as ``pytestmark``) that runs `tools`."""
    return requires(missing_tools(*tools))


AWS_CLI_FLOOR = "AWS CLI v2 >= 2.13 or v1 >= 1.29 (botocore >= 1.31)"
"""What the tests need of the AWS CLI (docs/requirements.md; .ci/run installs it where missing)."""


@functools.cache
def aws_cli_reason() -> str | None:
    """None when the AWS CLI can be pointed at a local emulator, else one line naming the install.

    The tests run the product's own `aws` calls (infra/deployed.py, deploy_target.py,
    alert_probe.py) against emulated endpoints on localhost, set by the service-specific endpoint
    variables `AWS_ENDPOINT_URL_<SERVICE>` (AWS SDKs and Tools reference guide, "Service-specific
    endpoints"), which arrived with botocore 1.31 (AWS CLI v1 1.29) and in AWS CLI v2.13: an
    older CLI would ignore them and call AWS."""
    missing = missing_tools("aws")
    if missing is not None:
        return missing
    proc = subprocess.run(
        [which("aws"), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    version = " ".join((proc.stdout + proc.stderr).split())  # older releases: on stderr
    v2 = re.search(r"aws-cli/2\.(\d+)", version)
    v1 = re.search(r"botocore/1\.(\d+)", version)
    if (v2 and int(v2[1]) >= 13) or (not v2 and v1 and int(v1[1]) >= 31):
        return None
    return f"{version or 'aws'} is older than the tests need, {AWS_CLI_FLOOR} ({INSTALL['aws']})"


def requires_aws_cli() -> pytest.MarkDecorator:
    """Mark a test that runs the AWS CLI against emulated AWS endpoints (aws_cli_reason)."""
    return requires(aws_cli_reason())


def node_reason() -> str | None:
    """None when Node.js is at least package.json's ``engines`` (aws-cdk-lib's jsii runtime and
    the CDK CLI run on it), else one line saying what to install."""
    engines = json.loads((REPO_ROOT / "package.json").read_text())["engines"]["node"]
    least = int(re.search(r"\d+", engines).group())
    node = which("node")
    if node is None:
        return f"node not installed ({INSTALL['node']})"
    version = subprocess.run([node, "--version"], capture_output=True, text=True).stdout.strip()
    if int(version.lstrip("v").split(".")[0] or 0) < least:
        return f"node {version} is older than package.json's {engines} ({INSTALL['node']})"
    return None


def requires_root(what: str) -> pytest.MarkDecorator:
    """Mark a test that needs root (network namespaces, mounts)."""
    return requires(root_reason(what))


MAKE_CALLER_VARIABLES = ("MAKEFLAGS", "MFLAGS", "MAKEOVERRIDES", "MAKELEVEL")


def make_command_line_variables(makeflags: str) -> list[str]:
    """The variables set on the calling make's command line: after ``--`` in its MAKEFLAGS,
    spaces in a value escaped (``-- ARGS=-x\\ -q TEST_WORKERS=2``)."""
    try:
        words = shlex.split(makeflags)
    except ValueError:
        return []
    after = words[words.index("--") + 1 :] if "--" in words else []
    return [w.split("=", 1)[0].rstrip(":+?!") for w in after if "=" in w]


def forget_the_calling_make(environ: MutableMapping[str, str]) -> None:
    """A make hands every make below it its options and its command-line variables, both in
    MAKEFLAGS and, the variables, as environment variables of their own (GNU make manual,
    "Communicating Options to a Sub-make" and "Variables from the Environment"). Under ``make
    test ARGS=-x`` the makes the tests run (``make train``, ``make -n``, ``make
    gpu-check``...) would take pytest's ARGS as theirs; they are a user's top-level make."""
    for name in make_command_line_variables(environ.get("MAKEFLAGS", "")):
        environ.pop(name, None)
    for name in MAKE_CALLER_VARIABLES:
        environ.pop(name, None)
