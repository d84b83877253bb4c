"""The pod supervisor's exit code for a run's verdict (training/launch/pod.py): a verdict about
one node (a straggler's eviction) is that node's pod's fault alone.

Run: .venv/bin/pytest tests/training/launch/test_pod_verdict.py
"""

from __future__ import annotations

from training import exits
from training.launch.pod import pod_exit_code
from training.runlog.verdict import Verdict

STARTED = 1000.0
EVICTED = Verdict(
    code=exits.NODE_UNFIT, cause="straggler", run_id="r", node="node-b", time=STARTED + 60
)


def code(launcher_code: int, verdict: Verdict | None, *, node: str, in_job: bool) -> int:
    return pod_exit_code(
        launcher_code=launcher_code,
        verdict=verdict,
        node=node,
        launcher_started=STARTED,
        in_job=in_job,
        stopped=False,
    )


def test_the_evicted_nodes_pod_exits_node_unfit_whatever_its_launcher_returned() -> None:
    # torchrun reports the rank's exit 6 as 1; ft_launcher exits 0 once it left the rendezvous
    # on the ranks' ExcludeThisNode request.
    for in_job, launcher_code in ((False, 1), (True, 0), (True, 1)):
        assert code(launcher_code, EVICTED, node="node-b", in_job=in_job) == exits.NODE_UNFIT


def test_the_other_pods_stop_under_torchrun_and_go_on_under_ft_launcher() -> None:
    assert code(1, EVICTED, node="node-a", in_job=False) == exits.PREEMPTED
    assert code(1, EVICTED, node="", in_job=False) == exits.PREEMPTED
    # Under ft_launcher the other pods train on; a later end is judged on its own.
    assert code(0, EVICTED, node="node-a", in_job=True) == exits.OK
    assert code(1, EVICTED, node="node-a", in_job=True) == exits.FAILED


def test_an_eviction_older_than_this_pods_launcher_is_not_this_pods() -> None:
    """A replacement that lands on a node evicted earlier (its cordon failed, or it was lifted)
    must not inherit the old verdict."""
    old = Verdict(code=exits.NODE_UNFIT, cause="straggler", run_id="r", node="node-b", time=10)
    assert code(0, old, node="node-b", in_job=True) == exits.OK
    assert code(1, old, node="node-b", in_job=True) == exits.FAILED


def test_a_runs_verdict_is_every_pods_code() -> None:
    capped = Verdict(code=exits.RESTARTS_EXHAUSTED, cause="restart cap", run_id="r")
    for in_job in (False, True):
        assert code(1, capped, node="node-a", in_job=in_job) == exits.RESTARTS_EXHAUSTED
        assert code(1, capped, node="", in_job=in_job) == exits.RESTARTS_EXHAUSTED
        assert code(0, capped, node="node-a", in_job=in_job) == exits.OK
