"""Launch N local ranks: ``make train`` runs this.

The launcher command comes from ``training.command`` (the function the EKS Job's command
is rendered with): ``--restart none|inprocess`` start the ranks with torchrun (static, no
elastic restarts: the in-process layer restarts inside the processes); ``--restart
injob|nested`` start them with NVRx's ``ft_launcher``, which respawns failed workers within
the job. ``--cold-restarts K`` relaunches
the whole job up to K times after a failure (the baseline the benchmarks compare against).
At the end the run's summary (restarts, lost time, ETTR) is printed and its timeline drawn.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from training import exits
from training.command import COLD_RESTARTS_ENV, LAUNCHERS, Rendezvous, launcher_command
from training.config import JobConfig
from training.exits import ConfigError
from training.launch.reaper import Reaper
from training.modes import snapshot_plan, spec
from training.observe.catalog import METRICS_PORT
from training.observe.launch import exporter_command, start_exporter, stop_exporter
from training.overrides import build_config
from training.replica.launch import group_dir, group_launches, run_groups, start_lighthouse, stop
from training.replica.topology import LIGHTHOUSE_BIN, group_sizes
from training.runlog.metrics import EventLog
from training.runlog.verdict import read_verdict
from training.shards import DataError, open_shards


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bin(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else (shutil.which(name) or name)


def rank_command(*, config: JobConfig, nproc: int, train_args: list[str], port: int) -> list[str]:
    """The launcher command line for one attempt of the whole job (one node, this machine)."""
    launcher = LAUNCHERS[config.resilience.restart]
    return launcher_command(
        config=config,
        trainer_args=train_args,
        nnodes=1,
        nproc_per_node=nproc,
        rdzv=Rendezvous(endpoint=f"127.0.0.1:{port}", run_id=f"local-{port}"),
        launcher_path=_bin(launcher),
    )


def pod_memory_root(*, config: JobConfig, run_id: str) -> Path | None:
    """The ``/dev/shm`` directory the ranks of the job `run_id` keep their snapshots in, if
    they keep any (the one the ranks compute: ``CheckpointManager``)."""
    plan = snapshot_plan(checkpoint=config.checkpoint, restart=config.resilience.restart, nodes=1)
    if plan.tier != "pod_memory":
        return None
    from training.checkpoint.pod_memory import run_identity, run_root

    owner = run_identity(Path(config.checkpoint_dir), launch=run_id)
    return run_root(config.checkpoint.pod_memory_dir, owner)


def report_dirs(config: JobConfig) -> list[Path]:
    """The run directories with a report: the run's, or each replica group's own."""
    if not spec(config.resilience.restart).replica_groups:
        return [Path(config.run_dir)]
    return [group_dir(config.run_dir, g) for g in range(config.resilience.replica_groups)]


def run_replica_groups(
    *, config: JobConfig, nproc: int, train_args: list[str], env: dict[str, str], reaper: Reaper
) -> int:
    """``restart=replica``: the Lighthouse, one in-job launch per group, the Lighthouse stopped
    at the end (training/replica/launch.py)."""
    events = EventLog(run_dir=Path(config.run_dir), rank=-1)
    groups = config.resilience.replica_groups
    lighthouse_port = free_port()
    lighthouse = start_lighthouse(
        min_replicas=config.resilience.replica_min_groups,
        port=lighthouse_port,
        bin_path=_bin(LIGHTHOUSE_BIN),
        log_path=Path(config.run_dir) / "lighthouse.log",
    )
    address = f"http://127.0.0.1:{lighthouse_port}"
    events.emit(
        "replica_lighthouse", state="up", address=address, groups=groups, pid=lighthouse.pid
    )

    def command_of(group_args: list[str], per_group: int, group: int) -> list[str]:
        port = free_port()
        group_config, _ = build_config(group_args)
        shm = pod_memory_root(config=group_config, run_id=f"local-{port}")
        if shm is not None:
            reaper.remove_at_end(shm)
        return rank_command(config=group_config, nproc=per_group, train_args=group_args, port=port)

    try:
        launches = group_launches(
            config=config,
            train_args=train_args,
            nproc=nproc,
            lighthouse=address,
            command_of=command_of,
            env=env,
        )
        return run_groups(launches, log=lambda line: print(line, flush=True))
    finally:
        stop(lighthouse)
        events.emit("replica_lighthouse", state="down", address=address)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.launch.local")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start (CPU processes)")
    parser.add_argument(
        "--cold-restarts",
        type=int,
        default=0,
        help="relaunch the whole job up to K times after a failure",
    )
    parser.add_argument("--no-report", action="store_true", help="skip the summary/timeline")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=METRICS_PORT,
        help="serve the run's Prometheus metrics on 127.0.0.1:PORT/metrics (0: off)",
    )
    args, train_args = parser.parse_known_args(argv)
    try:
        if args.nproc < 1:
            raise ConfigError("--nproc", f"must be >= 1, got {args.nproc}")
        config, _ = build_config(train_args)
        if spec(config.resilience.restart).replica_groups:
            group_sizes(world_size=args.nproc, groups=config.resilience.replica_groups)
        open_shards(
            path=Path(config.data.path),
            seq_len=config.data.seq_len,
            vocab_size=config.model.vocab_size,
        )
    except (ConfigError, DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return exits.USAGE
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    # Before any process starts: every one inherits its mark (training/launch/reaper.py).
    reaper = Reaper()
    try:
        return _launch(args=args, config=config, train_args=train_args, reaper=reaper)
    finally:
        reaper.close()


def _launch(
    *, args: argparse.Namespace, config: JobConfig, train_args: list[str], reaper: Reaper
) -> int:
    run_dir = Path(config.run_dir)
    launcher_events = EventLog(run_dir=run_dir, rank=-1)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    # c10d logs a warning for every 500 ms store poll of NVRx's in-process wrapper: noise here.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    exporter = None
    if args.metrics_port:
        exporter = start_exporter(
            exporter_command(
                config=config,
                job=run_dir.name,
                node=0,
                nproc_per_node=args.nproc,
                reporter=True,
                addr="127.0.0.1",
                port=args.metrics_port,
            )
        )
    attempts = 0
    while True:
        env[COLD_RESTARTS_ENV] = str(attempts)
        if spec(config.resilience.restart).replica_groups:
            code = run_replica_groups(
                config=config, nproc=args.nproc, train_args=train_args, env=env, reaper=reaper
            )
            verdict = None
            if code == 0 or attempts >= args.cold_restarts:
                break
            attempts += 1
            launcher_events.emit("restart_begin", mode="cold", exit_code=code)
            continue
        port = free_port()
        command = rank_command(config=config, nproc=args.nproc, train_args=train_args, port=port)
        shm = pod_memory_root(config=config, run_id=f"local-{port}")
        if shm is not None:
            reaper.remove_at_end(shm)
        print("+ " + " ".join(command), flush=True)
        code = subprocess.call(command, env=env)
        verdict = read_verdict(run_dir=run_dir, run_id=f"local-{port}") if code else None
        if verdict is not None:
            # A rank decided that no retry can help: report its code and cause, no cold restart.
            print(f"error: {verdict.cause}", file=sys.stderr, flush=True)
            code = verdict.code
            break
        if code == 0 or attempts >= args.cold_restarts:
            break
        attempts += 1
        launcher_events.emit("restart_begin", mode="cold", exit_code=code)
        print(
            f"job failed with exit code {code}; cold restart {attempts}/{args.cold_restarts}",
            flush=True,
        )
        time.sleep(1.0)
    if code != 0:
        status = "preempted" if code == exits.PREEMPTED else "failed"
        launcher_events.emit("run_end", status=status, cause=f"launcher exit code {code}")
    stop_exporter(exporter, final_scrape=False)
    if not args.no_report:
        from training.runlog.report import format_summary, write_report

        try:
            for report_dir in report_dirs(config):
                print(format_summary(write_report(run_dir=report_dir)), flush=True)
        except Exception as err:  # the run's own exit code matters more than the report
            print(f"(no report: {err})", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
