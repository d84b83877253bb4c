"""A node the product judges unfit leaves the bill too: the trainer pod cordons it with the
product's unfit label and exits NODE_UNFIT, the Job's replacement lands on the spare, and the
node fencer (infra/fencer, its own code) replaces the node once no pod of the Job runs there:
TerminateInstances through its SigV4-signed EC2 calls to the EC2 stand-in (moto in server
mode), then the out-of-service taint; the node group's new instance then joins and the spare
placeholder lands on it (docs/node-loss.md, "Every bad node ends the same way").

Run: sudo .venv/bin/pytest tests/pods/test_bad_nodes.py -s (root: network and mount
namespaces; moto from `.venv-moto`, `make moto-venv`). Emulated: the API server (the trainer's
cordon reaches podsim/kube_api.py through the real `kubernetes` client and `ops.cordon`; the
fencer reads Nodes and pods from podsim/ec2.py's NodeApi in the API's JSON shapes), EC2 (moto),
the node group's relaunch (podsim/control_plane.py). Timers: the shipped ones, scaled by SCALE.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ops.cordon import STARTUP_CHECK, UNFIT_LABEL
from podsim import cluster as emulator
from podsim import ec2 as ec2_stand_in
from podsim import jobs
from podsim.control_plane import EKS, SCALE
from podsim.jobs import ONE_POD, TWO_NODES
from training import exits, startup_check

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.requires(reason=emulator.can_run()),
    pytest.mark.requires(reason=ec2_stand_in.moto_reason()),
    pytest.mark.timeout(600),
]


def test_a_node_unfit_node_is_replaced_once_its_pod_has_left(tmp_path: Path) -> None:
    """One node and one spare; the node's Lustre client is stuck (its probe file a FIFO), so
    the start-up check cordons the node (reason startup-check) and exits NODE_UNFIT. While the
    pod runs, the fencer leaves the node alone (a node it terminated early would kill the
    check, and the pod would not exit 6); once the pod has failed, the fencer terminates the
    node's instance and taints it. The Job completes on the spare; the spare's instance and
    the hand-free one keep running."""
    state: dict = {}
    bad = "node-0"  # the plane's first node (emulator.Cluster.add_node)
    fifo = tmp_path / "fsx" / startup_check.FSX_PROBE_DIR / bad
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    with jobs.fenced_control_plane(
        tmp_path,
        nodes=1,
        times=EKS.scaled(SCALE),
        state=state,
        unfit_label=UNFIT_LABEL,
        namespaces=(ec2_stand_in.NAMESPACE,),
    ) as (ec2, plane, halt):
        result, _ = jobs.run(
            tmp_path,
            TWO_NODES,
            restart="injob",
            env={**ONE_POD, "FSX_PROBE_TIMEOUT_S": "3"},
            nodes=1,
            control_plane=plane,
            after=lambda _: halt(),
        )
        log = jobs.logs(tmp_path)
        p, cloud, fencer = state["plane"], state["cloud"], state["fencer"]
        timeline = p.timeline(since=p.started)
        assert result.status == "Complete", f"{result}\n{log}\n{timeline}"
        # Exit 6 from the check itself: the node was not terminated under the running pod.
        assert result.exit_codes == {0: [exits.NODE_UNFIT, 0]}, log
        assert p.unfit == {bad: STARTUP_CHECK}, timeline
        assert result.nodes[0][0] == bad and result.nodes[0][1] != bad, result.nodes
        assert fencer.fenced == [bad], timeline
        (patched, body), *more = fencer.nodes.patches
        assert patched == bad and more == [], fencer.nodes.patches
        assert body["spec"]["taints"][-1]["key"] == "node.kubernetes.io/out-of-service"
        others = [iid for name, iid in cloud.instances.items() if name != bad]
        states = ec2.states([cloud.instances[bad], *others])
        assert states[cloud.instances[bad]] == "terminated", states
        assert all(states[iid] == "running" for iid in others), states
        assert 'node_fencer_terminations_total{kind="replaced"} 1.0' in fencer.metrics.render()
        print(f"\n[unfit node replaced]\n{timeline}")
