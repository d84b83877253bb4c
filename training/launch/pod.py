"""The trainer container's entry point in the EKS Job: ``python -m training.launch.pod CMD...``.

CMD is the node's launcher command, rendered by `manifests/render.py` from
`training.command` (so the flags come from the run's config). Before starting it:
- the trainer's arguments are validated (a bad flag exits `exits.USAGE` at once, and the pod
  failure policy fails the Job instead of retrying);
- the node must fit the run (`training.startup_check`: torch, CUDA, driver, NCCL, GPU count,
  EFA, /fsx; what no node would fit exits `exits.ENVIRONMENT`, which fails the Job; what is this
  node's own fault exits `exits.NODE_UNFIT`, which the Job counts and replaces), checked while
  waiting for
- the rendezvous host to resolve (the Service's DNS name appears shortly after the pod).
Then the launcher runs as a child; SIGTERM and SIGINT (the kubelet's stop) are passed on to it,
and its exit code is translated (`pod_exit_code`): a verdict left by a rank
(`training.runlog.verdict`) wins, a stop on request is `exits.PREEMPTED`, anything else stays a
retryable failure.

A node the straggler policy evicted: its ranks write a verdict naming it and, under
`ft_launcher` (``injob``, ``nested``), ask their launcher to leave the node out of the next
rendezvous (``WorkloadAction.ExcludeThisNode``), so that launcher exits (with 0) instead of
restarting them, while the other nodes' launchers restart their workers and wait in the
rendezvous for the replacement. This supervisor then cordons the node (`ops.cordon`) and
exits `exits.NODE_UNFIT`: the Job replaces the pod, and the scheduler puts the replacement on
another node.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ops.cordon import STRAGGLER, cordon
from training import exits
from training.command import trainer_args_of
from training.config import JobConfig
from training.exits import ConfigError
from training.modes import MODES
from training.observe.catalog import METRICS_PORT
from training.observe.launch import (
    FINAL_SCRAPE_WAIT_S,
    exporter_command,
    start_exporter,
    stop_exporter,
)
from training.overrides import build_config
from training.runlog.verdict import NODE_NAME_ENV, Verdict, read_verdict


def _flag(command: Sequence[str], name: str) -> str:
    prefix = f"--{name}="
    return next((arg[len(prefix) :] for arg in command if arg.startswith(prefix)), "")


def wait_for_host(host: str, *, timeout_s: float, poll_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.getaddrinfo(host, None)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


def start_startup_check(*, device: str) -> subprocess.Popen:
    """`python -m training.startup_check` for the run's device, in its own process (its torch
    import then costs the supervisor no memory for the rest of the job). NPROC_PER_NODE and
    REQUIRE_EFA come from the pod's environment, as the Job sets them."""
    return subprocess.Popen(
        [sys.executable, "-m", "training.startup_check", f"--expect-device={device}"]
    )


def pod_exporter(command: Sequence[str], config: JobConfig) -> subprocess.Popen | None:
    """This pod's metrics exporter (training/observe): on the container's named port, all
    addresses (the scraper reaches it by pod IP); node 0 serves the job's figures too."""
    node = int(os.environ.get("JOB_COMPLETION_INDEX", "0"))
    return start_exporter(
        exporter_command(
            config=config,
            job=os.environ.get("JOB_NAME") or Path(config.run_dir).name,
            node=node,
            nproc_per_node=int(_flag(command, "nproc-per-node") or "1"),
            reporter=node == 0,
            addr="0.0.0.0",
            port=METRICS_PORT,
            final_scrape_wait_s=FINAL_SCRAPE_WAIT_S,
        )
    )


def supervise(command: Sequence[str]) -> int:
    try:
        config, _ = build_config(trainer_args_of(command))
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return exits.USAGE
    exporter = pod_exporter(command, config)
    code = exits.FAILED
    try:
        code = _supervise(command, config)
    finally:
        # A completed run waits for its final scrape; any other end leaves at once (a
        # replacement pod starts only after this one is gone).
        stop_exporter(exporter, final_scrape=code == exits.OK)
    return code


def _supervise(command: Sequence[str], config: JobConfig) -> int:
    check = start_startup_check(device=config.parallel.device)
    endpoint = _flag(command, "rdzv-endpoint")
    host = endpoint.rsplit(":", 1)[0]
    if host and not wait_for_host(host, timeout_s=config.resilience.join_timeout_s):
        check.kill()
        print(f"error: rendezvous host {host} never resolved", file=sys.stderr, flush=True)
        return exits.FAILED
    code = check.wait()
    if code != exits.OK:
        print("error: this node does not fit the run (startup_check above)", file=sys.stderr)
        # The check's own verdict decides between failing the Job and replacing this pod.
        return code if code in (exits.ENVIRONMENT, exits.NODE_UNFIT) else exits.ENVIRONMENT
    stopping: list[int] = []
    started = time.time()
    child = subprocess.Popen(list(command))

    def forward(signum: int, _frame) -> None:
        stopping.append(signum)
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    code = child.wait()
    node = os.environ.get(NODE_NAME_ENV, "")
    verdict = read_verdict(run_dir=Path(config.run_dir), run_id=_flag(command, "rdzv-id"))
    outcome = pod_exit_code(
        launcher_code=code,
        verdict=verdict,
        node=node,
        launcher_started=started,
        in_job=MODES[config.resilience.restart].keeps_nodes,
        stopped=bool(stopping),
    )
    if evicted(verdict, node=node, launcher_started=started):
        print(f"error: {verdict.cause}", file=sys.stderr, flush=True)
        # Before the pod ends: the Job's replacement must not land on this node again.
        cordon(node, reason=STRAGGLER)
    elif verdict is not None and not verdict.node and code != 0:
        print(f"error: {verdict.cause}", file=sys.stderr, flush=True)
    return outcome


def evicted(verdict: Verdict | None, *, node: str, launcher_started: float) -> bool:
    """True when `verdict` evicts this pod's node and was written while this pod's launcher ran
    (a verdict left by an earlier pod on this node does not count)."""
    return (
        verdict is not None
        and bool(verdict.node)
        and verdict.node == node
        and verdict.time >= launcher_started
    )


def pod_exit_code(
    *,
    launcher_code: int,
    verdict: Verdict | None,
    node: str,
    launcher_started: float,
    in_job: bool,
    stopped: bool,
) -> int:
    """This pod's exit code from its launcher's and the run's verdict.

    - A verdict evicting this node (`evicted`) is this pod's code whatever the launcher
      returned (``ft_launcher`` exits 0 after leaving the rendezvous on request).
    - A verdict about another node: with ``torchrun`` every pod stopped with the final
      checkpoint for its sake, as by a drain (PREEMPTED, never the node's fault); under
      ``ft_launcher`` (`in_job`) this pod's launcher went on in-job, so the verdict is not
      about its end.
    - A verdict about the whole run (no node) is every pod's code when the launcher failed.
    """
    if verdict is not None and verdict.node:
        if evicted(verdict, node=node, launcher_started=launcher_started):
            return verdict.code
        if verdict.node != node and not in_job and launcher_code != 0:
            return exits.PREEMPTED
        verdict = None
    if launcher_code == 0:
        return exits.OK
    if verdict is not None:
        return verdict.code
    if stopped:
        return exits.PREEMPTED
    return exits.FAILED if launcher_code > 0 else 128 - launcher_code


def main(argv: Sequence[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("usage: python -m training.launch.pod LAUNCHER [FLAGS...] -m training -- train ...")
        return exits.USAGE
    return supervise(command)


if __name__ == "__main__":
    sys.exit(main())
