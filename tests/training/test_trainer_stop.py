"""The trainer's early stops share one path (``trainer.StopReason``): a node evicted by a hook
and a drain (SIGTERM) both take a blocking final checkpoint at the step they are decided,
emit ``run_end`` with their status and return a preempted ``TrainResult``.

One real rank (gloo, in this process), the tiny model, the synchronous engine; the SIGTERM is
a real signal to this process, handled by ``training.stop.StopRequest``. A SIGTERM that lands in
the work between two steps, which then outlasts the stop's grace, still stops at a step with a
final checkpoint: one rank in a process of its own (probes/drain_probe.py), since the stop's
watcher would end this one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO_ROOT, TINY_MODEL, subprocess_env

from training import exits
from training.checkpoint.layout import committed_steps
from training.hooks import NodeEviction, StepHooks
from training.overrides import build_config
from training.run import run_training
from training.runlog import writer
from training.runlog.files import read_jsonl
from training.trainer import StopReason


class StopAt(StepHooks):
    """Evicts this node after ``step``, or sends this process SIGTERM during it."""

    def __init__(self, *, step: int, how: str) -> None:
        self.step = step
        self.how = how
        self.done = 0

    def before_step(self, step: int) -> None:
        if self.how == "sigterm" and step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def after_step(self, step: int) -> None:
        self.done = step

    def eviction(self) -> NodeEviction | None:
        if self.how == "evict" and self.done == self.step:
            return NodeEviction(node="node-a", cause="slow in 3 reports", this_node=True)
        return None


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("how", "status", "code"),
    [("evict", "evicted", exits.NODE_UNFIT), ("sigterm", "preempted", exits.PREEMPTED)],
)
def test_an_early_stop_saves_at_its_step_and_says_why(
    tmp_path: Path, corpus: Path, one_rank_group: None, how: str, status: str, code: int
) -> None:
    run_dir = tmp_path / "run"
    config, _ = build_config(
        [
            *TINY_MODEL,
            "--run-dir",
            str(run_dir),
            f"--data.path={corpus}",
            "--train.steps=50",
            "--checkpoint.interval=4",
            "--checkpoint.engine=sync",
        ]
    )
    stop_at = StopAt(step=6, how=how)
    result = run_training(config, hooks=lambda _env, _events: stop_at, rank=0, world_size=1)
    assert (result.final_step, result.preempted, result.exit_code) == (6, True, code)
    assert committed_steps(Path(config.checkpoint_dir))[-1] == 6
    writer.flush()
    events, _ = read_jsonl(run_dir / "events.jsonl")
    ends = [(e["step"], e["status"]) for e in events if e["kind"] == "run_end"]
    assert ends == [(6, status)]


def test_an_eviction_outranks_a_drain_at_the_same_step() -> None:
    eviction = NodeEviction(node="node-a", cause="slow", this_node=False)
    assert StopReason.of(eviction=eviction, drained=True).status == "evicted"
    assert StopReason.of(eviction=None, drained=True).status == "preempted"
    assert StopReason.of(eviction=None, drained=False) is None


DRAIN_PROBE = Path(__file__).parent / "probes" / "drain_probe.py"


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "stop_step"),
    [
        # SIGTERM in the checkpoint schedule of step 4, which then waits (pass by pass) for
        # twice the grace, as the first save waits for the NVRx worker's start on a busy node.
        ("save", 5),
        # SIGTERM in step 1: its all-reduce agrees on the stop, then the first-step prepare
        # takes twice the grace in one piece.
        ("agreed", 1),
        # The same as "save" with the NVRx engine's own wait: its worker's start held up.
        ("worker", 5),
    ],
)
def test_a_drain_during_slow_work_between_steps_still_saves_at_its_step(
    tmp_path: Path, corpus: Path, case: str, stop_step: int
) -> None:
    run_dir = tmp_path / "run"
    out, err = tmp_path / "probe.out", tmp_path / "probe.err"
    # Files, not pipes: a worker the probe leaves stopped would hold a pipe open.
    with out.open("w") as stdout, err.open("w") as stderr:
        code = subprocess.run(
            [sys.executable, str(DRAIN_PROBE), case, str(run_dir), str(corpus)],
            cwd=REPO_ROOT,
            env=subprocess_env(),
            stdout=stdout,
            stderr=stderr,
            timeout=100,
        ).returncode
    lines = out.read_text().splitlines()
    for line in lines:  # a stopped worker the probe left behind
        if line.startswith("worker "):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(line.split()[1]), signal.SIGKILL)
    # Before the fix: the watcher ended the rank (143, "no step boundary within ...") in the
    # middle of that work, without a final checkpoint.
    assert code == 0, err.read_text()[-3000:]
    result = json.loads(lines[-1])
    assert (result["final_step"], result["preempted"]) == (stop_step, True)
    assert committed_steps(run_dir / "checkpoints")[-1] == stop_step
    events, _ = read_jsonl(run_dir / "events.jsonl")
    ends = [(e["step"], e["status"]) for e in events if e["kind"] == "run_end"]
    assert ends == [(stop_step, "preempted")]
