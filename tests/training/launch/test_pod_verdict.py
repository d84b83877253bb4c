"""The pod supervisor's exit code for a run's verdict (training/launch/pod.py): a verdict about
one node (a straggler's eviction) is that node's pod's fault alone.

Run: .venv/bin/pytest tests/training/launch/test_pod_verdict.py
"""

from __future__ import annotations

from training import exits
from training.launch.pod import verdict_code
from training.runlog.verdict import Verdict


def test_a_nodes_verdict_is_its_own_pods_code_and_a_stop_for_the_others() -> None:
    evicted = Verdict(code=exits.NODE_UNFIT, cause="straggler", run_id="r", node="node-b")
    assert verdict_code(evicted, node="node-b") == exits.NODE_UNFIT
    assert verdict_code(evicted, node="node-a") == exits.PREEMPTED
    assert verdict_code(evicted, node="") == exits.PREEMPTED


def test_a_runs_verdict_is_every_pods_code() -> None:
    capped = Verdict(code=exits.RESTARTS_EXHAUSTED, cause="restart cap", run_id="r")
    assert verdict_code(capped, node="node-a") == exits.RESTARTS_EXHAUSTED
    assert verdict_code(capped, node="") == exits.RESTARTS_EXHAUSTED
