"""Shared helpers for the benchmarks: launching local runs, medians, targets, tables, JSON."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import summary
from podsim.model import TINY_MODEL  # noqa: F401  (re-exported: the benchmarks' tiny model)
from training.durable import write_json_atomic
from training.runlog import files as runlog_files
from training.tables import text_table

REPO_ROOT = Path(__file__).resolve().parents[1]
# Overridable so that tests never overwrite the committed results the planner reads.
RESULTS_DIR = Path(os.environ.get("BENCH_RESULTS_DIR", REPO_ROOT / "bench" / "results"))
RUNS_DIR = Path(os.environ.get("BENCH_RUNS_DIR", REPO_ROOT / "runs" / "bench"))


# The hang timeouts of the fault benchmarks (restart, goodput): short fixed ones, so that a hang
# costs seconds here, and calibration on after 10 steps of an attempt (the restart benchmark's
# faults are 20 steps apart), so that a hang is caught after max(2 s, 5 x the step times) by
# the in-process watchdog or the in-job step section; the fixed ones stay as the backstops.
# The hard timeout must leave room for a whole in-process recovery after the soft one: a run
# with soft 5 s / hard 15 s on a loaded 2-core machine had NVRx terminate a rank in the middle
# of recovering from a hang.
HANG_TIMEOUTS: tuple[str, ...] = (
    "--resilience.calibrate_timeouts_after=10",
    "--resilience.soft_timeout_s=8",
    "--resilience.hard_timeout_s=20",
    "--resilience.heartbeat_timeout_s=10",
    "--resilience.step_section_timeout_s=10",
    "--resilience.checkpoint_section_timeout_s=30",
    "--parallel.pg_timeout_s=60",
)

# The corpus every benchmark trains on (the recipes' default ``data.path``).
CORPUS_DIR = REPO_ROOT / "data" / "stdlib"


def ensure_corpus() -> None:
    """Build the local corpus (Python's standard library, tokenized) if it is not there yet,
    so the benchmarks run on a fresh clone without ``make data``."""
    if (CORPUS_DIR / "meta.json").is_file():
        return
    subprocess.run(
        [sys.executable, "-m", "training", "prepare", "--stdlib", "--out", str(CORPUS_DIR)],
        cwd=REPO_ROOT,
        check=True,
    )


def bench_env() -> dict[str, str]:
    """The environment of every launched run: one thread per rank, plain logs, no noise."""
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONWARNINGS="ignore",
        CI="1",
    )
    return env


def machine() -> str:
    """One line naming the machine the numbers come from."""
    import torch

    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{os.cpu_count()}-core {platform.machine()}, {mem_gib:.0f} GiB, "
        f"{'CUDA' if torch.cuda.is_available() else 'CPU only'}, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )


def kill_tree(pid: int, *, marker: str = "") -> None:
    """SIGKILL a launcher, everything under it and every process whose command line holds
    ``marker`` (the run directory): the launchers start each rank in a session of its own, so
    killing the launcher's process group alone leaves the ranks (and their checkpoint workers)
    running. Everything is SIGSTOPped first so that no launcher respawns a rank meanwhile."""
    import psutil

    procs: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        procs[root.pid] = root
        procs.update((c.pid, c) for c in root.children(recursive=True))
    if marker:
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error):
                if marker in " ".join(proc.info["cmdline"] or ()):
                    procs[proc.pid] = proc
                    procs.update((c.pid, c) for c in proc.children(recursive=True))
    procs.pop(os.getpid(), None)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for proc in procs.values():
            with contextlib.suppress(psutil.Error):
                proc.send_signal(sig)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    psutil.wait_procs(list(procs.values()), timeout=10)


def call_logged(
    command: Sequence[str], *, log_path: Path, timeout_s: float, marker: str = ""
) -> int:
    """Run ``command`` in its own session, output to ``log_path``; on timeout kill it and every
    process under it or naming ``marker`` (`kill_tree`) and return 124."""
    with open(log_path, "w") as log:
        log.write("+ " + " ".join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(
            list(command),
            cwd=REPO_ROOT,
            env=bench_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid, marker=marker)
            proc.wait()
            return 124


# --- benchmarks whose measuring runs inside a 2-rank torchrun job (checkpoint, restore, peer) ---


def add_worker_options(parser: argparse.ArgumentParser, **options: int | type[Path]) -> None:
    """The hidden options a benchmark's torchrun ranks are started with (`run_workers`):
    ``--worker``, each of `options` (an int: its default; ``Path``: a path without one), and
    ``--out``, the JSON rank 0 writes."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name, spec in options.items():
        flag = "--" + name.replace("_", "-")
        if spec is Path:
            parser.add_argument(flag, type=Path, help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, type=int, default=spec, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)


def run_workers(module: str, *, log_dir: Path, timeout_s: float, **options: Any) -> dict[str, Any]:
    """``torchrun --standalone --nproc-per-node=2 -m MODULE --worker --NAME=VALUE... --out=...``
    with its output in ``log_dir/torchrun.log``; returns the JSON rank 0 wrote (``raw.json``
    there), or raises with the log's tail when the job failed or wrote nothing."""
    ensure_corpus()  # the workers build a Trainer on the recipe's corpus
    out = log_dir / "raw.json"
    command = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        module,
        "--worker",
        *(f"--{name.replace('_', '-')}={value}" for name, value in options.items()),
        f"--out={out}",
    ]
    log = log_dir / "torchrun.log"
    code = call_logged(command, log_path=log, timeout_s=timeout_s)
    if code != 0 or not out.is_file():
        raise RuntimeError(f"{module} failed (exit {code}):\n{log.read_text()[-3000:]}")
    return json.loads(out.read_text())


@dataclass(frozen=True, kw_only=True)
class LocalRun:
    """A finished ``training.launch.local`` run."""

    run_dir: Path
    returncode: int
    wall_s: float


def local_command(
    *,
    run_dir: Path,
    nproc: int,
    restart: str = "none",
    faults: str = "",
    cold_restarts: int = 0,
    overrides: Sequence[str] = (),
) -> list[str]:
    """The ``python -m training.launch.local`` command line of one benchmark run. It trains on
    the recipe's corpus, so that corpus is built here first where a fresh clone lacks it (every
    benchmark, run alone or by ``bench.run_all``, launches its runs through this)."""
    ensure_corpus()
    return [
        sys.executable,
        "-m",
        "training.launch.local",
        f"--nproc={nproc}",
        f"--cold-restarts={cold_restarts}",
        "--no-report",
        "--recipe=debug_cpu",
        f"--run-dir={run_dir}",
        f"--restart={restart}",
        *([f"--faults={faults}"] if faults else []),
        "--train.log_every=1000",
        *overrides,
    ]


def wait_until_quiet(*, busy_below_pct: float = 10.0, timeout_s: float = 60.0) -> float:
    """Flush dirty pages and wait until the CPUs are idle (under ``busy_below_pct`` busy over a
    second): a previous run's processes exiting and its files being written back would slow the
    next run's steps. Returns the seconds waited (``timeout_s`` at most)."""
    import psutil

    started = time.monotonic()
    os.sync()
    while time.monotonic() - started < timeout_s:
        if psutil.cpu_percent(interval=1.0) < busy_below_pct:
            break
    return time.monotonic() - started


def run_local(
    *,
    run_dir: Path,
    nproc: int,
    restart: str = "none",
    faults: str = "",
    cold_restarts: int = 0,
    overrides: Sequence[str] = (),
    timeout_s: float = 600.0,
) -> LocalRun:
    """Run ``python -m training.launch.local`` into a fresh ``run_dir`` (log: launcher.log)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    command = local_command(
        run_dir=run_dir,
        nproc=nproc,
        restart=restart,
        faults=faults,
        cold_restarts=cold_restarts,
        overrides=overrides,
    )
    started = time.monotonic()
    code = call_logged(
        command, log_path=run_dir / "launcher.log", timeout_s=timeout_s, marker=str(run_dir)
    )
    return LocalRun(run_dir=run_dir, returncode=code, wall_s=time.monotonic() - started)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Objects of a JSONL file of a run; a truncated line (a killed process) is skipped."""
    return runlog_files.read_jsonl(path)[0]


def median(values: Iterable[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def target(name: str, value: float | None, *, goal: float, higher_is_better: bool) -> dict:
    """A goal the benchmark reports against (never an assertion): PASS, MISS or n/a."""
    if value is None:
        verdict = "n/a"
    elif higher_is_better:
        verdict = "PASS" if value >= goal else "MISS"
    else:
        verdict = "PASS" if value <= goal else "MISS"
    return {
        "target": name,
        "value": value,
        "goal": f"{'>=' if higher_is_better else '<='} {goal:g}",
        "verdict": verdict,
    }


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:.3g}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table, columns sized to fit."""
    cells = [[fmt(c) for c in row] for row in rows]
    return "\n".join(text_table(cells, headers=[str(h) for h in headers], rule=True))


def targets_table(targets: Sequence[dict]) -> str:
    """One row per target; with an interval column when a target carries one (``ci``)."""
    if any(t.get("ci") for t in targets):
        return table(
            ["target", "measured", "interval", "goal", "verdict"],
            [
                (
                    t["target"],
                    t["value"],
                    f"{t['ci'][0]:.4f}..{t['ci'][1]:.4f}" if t.get("ci") else None,
                    t["goal"],
                    t["verdict"],
                )
                for t in targets
            ],
        )
    return table(
        ["target", "measured", "goal", "verdict"],
        [(t["target"], t["value"], t["goal"], t["verdict"]) for t in targets],
    )


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write bench/results/<name>.json atomically (the planner reads some of its keys), then
    bench/README.md from every result on file (``bench.summary``: a test compares the two).
    Results redirected elsewhere (``BENCH_RESULTS_DIR``: the smoke tests) leave the page alone."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    write_json_atomic(path, payload)
    if RESULTS_DIR.resolve() == summary.RESULTS_DIR.resolve():
        summary.write_page()
    return path
