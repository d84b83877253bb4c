"""Exporter benchmark: what the run's metrics exporter (training/observe) costs a training step.

Side by side, in one invocation, fault-free local runs of the same job (CPU ranks, gloo, the
tiny model, no checkpoint) at 2 and at 4 ranks, alternating in each round:

- ``plain``: ``--metrics-port=0``, no exporter;
- ``exporter``: the exporter on, scraped by this process every ``SCRAPE_EVERY_S`` (1 s: 30x as
  often as the stack's scraper), so that every scrape reads the lines appended since the last.

Two figures per rank count:

- ``cpu_share``: the exporter process's CPU time per step while the run trains (the rise of its
  own ``process_cpu_seconds_total`` from the first scrape after ``WARMUP`` steps to the last
  scrape, over the steps trained in between), over the plain run's step interval: what it takes
  from the cores the ranks share, an upper bound on its cost per step where cores are scarce
  (the result's ``machine`` names the cores). Goal: under 0.5% (the result's ``targets``,
  bench/results/exporter.json). Its start-up (Python and prometheus_client imports, once per
  pod) is reported apart, as ``startup_cpu_s``. It adds nothing to the step path itself: the
  ranks only write the JSONL lines they write anyway.
- ``interval_ratio``: the steady-state step interval with the exporter over the plain one
  (each mode's fastest round, as bench/overhead.py does): the same cost seen from the step,
  within this VM's run-to-run noise (several %).

    python -m bench.exporter              # 2 and 4 ranks, 2 rounds, ~5 min on 2 cores
    python -m bench.exporter --quick      # 1 round, 30 steps

Writes bench/results/exporter.json.
"""

from __future__ import annotations

import argparse
import re
import sys
import threading
import urllib.request
from typing import Any

from bench.common import (
    RUNS_DIR,
    machine,
    median,
    ratio,
    run_local,
    table,
    target,
    targets_table,
    wait_until_quiet,
    write_result,
)
from bench.overhead import steady_state

NPROCS = (2, 4)
STEPS = {2: 60, 4: 60}
ROUNDS = 2
WARMUP = 10
SCRAPE_EVERY_S = 1.0
_CPU = re.compile(r"^process_cpu_seconds_total (\S+)$", re.MULTILINE)
_STEPS = re.compile(r"^training_steps_total\{[^}]*\} (\S+)$", re.MULTILINE)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Scraper(threading.Thread):
    """Scrapes ``/metrics`` every ``SCRAPE_EVERY_S`` until stopped; keeps the newest CPU and
    step figures the exporter served."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.stop = threading.Event()
        self.scrapes = 0
        self.samples: list[tuple[float, float]] = []
        """(exporter CPU seconds, steps) at each scrape that saw steps."""
        self.first_cpu_s: float | None = None

    def run(self) -> None:
        while not self.stop.wait(SCRAPE_EVERY_S):
            try:
                with urllib.request.urlopen(self.url, timeout=5) as response:
                    text = response.read().decode()
            except OSError:
                continue  # not up yet, or gone with the run
            self.scrapes += 1
            cpu, steps = _CPU.search(text), _STEPS.search(text)
            if cpu and self.first_cpu_s is None:
                self.first_cpu_s = float(cpu.group(1))
            if cpu and steps:
                self.samples.append((float(cpu.group(1)), float(steps.group(1))))

    def cpu_per_step_s(self, *, after_steps: int) -> float | None:
        """The exporter's CPU seconds per step trained, from the first scrape past
        `after_steps` steps to the last scrape."""
        steady = [(c, s) for c, s in self.samples if s >= after_steps]
        if len(steady) < 2 or steady[-1][1] <= steady[0][1]:
            return None
        (cpu0, steps0), (cpu1, steps1) = steady[0], steady[-1]
        return (cpu1 - cpu0) / (steps1 - steps0)


def _one(*, nproc: int, steps: int, mode: str, round_: int) -> dict[str, Any]:
    run_dir = RUNS_DIR / "exporter" / f"{nproc}ranks_{mode}_{round_}"
    port = _free_port()
    scraper = Scraper(port) if mode == "exporter" else None
    if scraper is not None:
        scraper.start()
    quiet_wait_s = wait_until_quiet()
    done = run_local(
        run_dir=run_dir,
        nproc=nproc,
        overrides=(
            f"--metrics-port={port if mode == 'exporter' else 0}",
            f"--train.steps={steps}",
            "--checkpoint.engine=sync",
            "--checkpoint.interval=0",
            "--checkpoint.save_final=false",
        ),
        timeout_s=300,
    )
    if scraper is not None:
        scraper.stop.set()
        scraper.join(timeout=10)
    stats = steady_state(run_dir, warmup=WARMUP)
    stats.update(returncode=done.returncode, wall_s=done.wall_s, quiet_wait_s=quiet_wait_s)
    if scraper is not None:
        stats.update(
            scrapes=scraper.scrapes,
            startup_cpu_s=scraper.first_cpu_s,
            exporter_cpu_s=scraper.samples[-1][0] if scraper.samples else None,
            exporter_cpu_per_step_s=scraper.cpu_per_step_s(after_steps=WARMUP),
        )
    return stats


def run(*, quick: bool = False, nprocs: tuple[int, ...] = NPROCS) -> dict[str, Any]:
    by_nproc: dict[str, Any] = {}
    targets = []
    for nproc in nprocs:
        steps = 30 if quick else STEPS[nproc]
        rounds = 1 if quick else ROUNDS
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "exporter": []}
        for round_ in range(rounds):
            order = ("plain", "exporter") if round_ % 2 == 0 else ("exporter", "plain")
            for mode in order:
                runs[mode].append(_one(nproc=nproc, steps=steps, mode=mode, round_=round_))
        failed = [r for rs in runs.values() for r in rs if r["interval_s"] is None]
        if failed:
            raise SystemExit(f"a run produced no steady-state steps: see {RUNS_DIR / 'exporter'}")
        plain = min(r["interval_s"] for r in runs["plain"])
        with_exporter = min(r["interval_s"] for r in runs["exporter"])
        cpu_per_step = median(r.get("exporter_cpu_per_step_s") for r in runs["exporter"])
        cpu_share = ratio(cpu_per_step, plain)
        interval_ratio = ratio(with_exporter, plain)
        by_nproc[str(nproc)] = {
            "steps": steps,
            "rounds": rounds,
            "plain_interval_s": plain,
            "exporter_interval_s": with_exporter,
            "interval_ratio": interval_ratio,
            "exporter_cpu_per_step_s": cpu_per_step,
            "startup_cpu_s": median(r.get("startup_cpu_s") for r in runs["exporter"]),
            "cpu_share": cpu_share,
            "runs": runs,
        }
        targets.append(
            target(
                f"{nproc} ranks: exporter CPU per step / step interval",
                cpu_share,
                goal=0.005,
                higher_is_better=False,
            )
        )
    result = {
        "machine": machine(),
        "quick": quick,
        "scrape_every_s": SCRAPE_EVERY_S,
        "warmup_steps": WARMUP,
        "by_nproc": by_nproc,
        "targets": targets,
    }
    print(report(result), flush=True)
    write_result("exporter", result)
    return result


def report(result: dict[str, Any]) -> str:
    rows = [
        (
            f"{n} ranks",
            m["plain_interval_s"],
            m["exporter_interval_s"],
            m["interval_ratio"],
            m["exporter_cpu_per_step_s"],
            m["cpu_share"],
            m["startup_cpu_s"],
        )
        for n, m in result["by_nproc"].items()
    ]
    return "\n".join(
        [
            f"Exporter cost per step ({result['machine']}; scraped every "
            f"{result['scrape_every_s']:g} s)",
            table(
                [
                    "ranks",
                    "plain interval s",
                    "exporter interval s",
                    "ratio",
                    "exporter CPU s/step",
                    "CPU share",
                    "start-up CPU s",
                ],
                rows,
            ),
            targets_table(result["targets"]),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.exporter")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--nprocs", type=int, nargs="+", default=list(NPROCS))
    args = parser.parse_args(argv)
    result = run(quick=args.quick, nprocs=tuple(args.nprocs))
    return (
        0
        if all(
            r["returncode"] == 0
            for m in result["by_nproc"].values()
            for rs in m["runs"].values()
            for r in rs
        )
        else 1
    )


if __name__ == "__main__":
    sys.exit(main())
