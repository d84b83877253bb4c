"""The exporter's figures of a real faulty run: a 2-rank local run with the in-job restart layer
(NVRx's ft_launcher) survives an injected exception and a SIGKILL, and the view of its run
directory counts each restart by layer and cause, each fault on its node, the restores and the
end of the run, as the events the ranks really wrote say (not hand-written logs).

    .venv/bin/pytest tests/observability/test_real_faults.py -q     # ~1 min on 2 cores
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from support import TINY_MODEL, events, launch_local, tail

from training.observe.view import RunView

STEPS = 24


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_restarts_and_faults_of_a_real_run(tmp_path: Path, corpus: Path) -> None:
    run_dir = tmp_path / "run"
    proc = launch_local(
        run_dir,
        corpus,
        *TINY_MODEL,
        f"--train.steps={STEPS}",
        "--checkpoint.interval=4",
        "--restart=injob",
        "--faults=exception@1:6;sigkill@0:14",
        "--metrics-port=0",
        # No hang here: generous timeouts, so that a loaded machine's slow steps (seen: 6.8 s
        # checkpoint stalls at a load of 8 on 2 cores) are not taken for hangs.
        "--resilience.heartbeat_timeout_s=30",
        "--resilience.step_section_timeout_s=30",
        "--resilience.checkpoint_section_timeout_s=30",
        "--parallel.pg_timeout_s=60",
        timeout=240,
    )
    assert proc.returncode == 0, tail(proc.log)
    view = RunView(
        run_dir=run_dir,
        job="run",
        node=0,
        nproc_per_node=2,
        reporter=True,
        stall_factor=50,
        stall_floor_s=300,
        checkpoint_interval=4,
    )
    values = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "training_job"))): s.value
        for s in view.samples()
    }
    restarts = {k[1]: v for k, v in values.items() if k[0] == "training_restarts_total"}
    assert restarts == {
        (("cause", "exception"), ("layer", "injob")): 1,
        (("cause", "sigkill"), ("layer", "injob")): 1,
    }, restarts
    faults = {k[1]: v for k, v in values.items() if k[0] == "training_faults_total"}
    assert faults == {
        (("cause", "exception"), ("node", "0")): 1,
        (("cause", "sigkill"), ("node", "0")): 1,
    }
    assert values[("training_restart_lost_seconds_total", (("layer", "injob"),))] > 0
    # Each restart restores the newest state it finds: a committed checkpoint (commits trail
    # their step) or the pod's memory snapshot (the recipe's checkpoint.memory_interval), one
    # restore per restart that found one, counted once, by its source.
    loads = [e for e in events(run_dir) if e["kind"] == "checkpoint_load" and e["rank"] == 0]
    assert 1 <= len(loads) <= 2
    by_source = Counter(e["source"] for e in loads)
    restores = {k[1]: v for k, v in values.items() if k[0] == "training_checkpoint_restores_total"}
    assert restores == {(("source", s),): n for s, n in by_source.items()}, (restores, loads)
    for source in by_source:
        assert values[("training_checkpoint_restore_seconds", (("source", source),))] > 0
    assert values[("training_checkpoints_committed_total", ())] == STEPS // 4
    assert values[("training_step", ())] == STEPS
    assert values[("training_steps_total", ())] > STEPS  # steps repeated after the restarts
    assert values[("training_attempt", ())] == 2
    assert values[("training_checkpoint_last_commit_step", ())] == STEPS
    assert values[("training_run_active", ())] == 0
    assert 0 < values[("training_ettr_ratio", ())] < 1
