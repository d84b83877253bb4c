"""``python -m infra.fencer``: the fencer's loop, as its Deployment runs it (infra/node_fencer.py
sets every variable below; one owner: ``FencerSettings`` there).

Environment: ``AWS_REGION``; ``FENCE_NODE_SELECTOR`` (the node group's label selector);
``FENCE_WAIT_S``, ``FENCE_MAX_IN_FLIGHT``, ``FENCE_MAX_BAD_FRACTION`` (decide.FencePolicy);
``FENCE_POLL_S`` (seconds between passes); ``FENCE_UNFIT_LABEL`` (the product's unfit label,
``ops.cordon.UNFIT_LABEL``) and ``FENCE_NAMESPACES`` (the training namespaces, comma-separated):
a cordoned, labelled node is replaced once no pod of theirs runs on it; ``FENCE_METRICS_PORT``
(``GET /metrics``); ``FENCE_JOIN_TIMEOUT_S``, ``FENCE_CLUSTER_NAME`` and ``FENCE_NODEGROUP_NAME``
(an instance of the group, by its EKS tags, with no Node this long after launch is terminated);
``FENCE_MOUNT_TIMEOUT_S`` and ``FENCE_MOUNT_CORDON`` (a training pod failing to mount its FSx
volume this long: its node gets this JSON body, the product's ``lustre-mount`` cordon, and the
pod is evicted).
Kubernetes: the in-cluster configuration.
"""

from __future__ import annotations

import json
import os
import sys
import time

from infra.fencer.controller import Fencer, log
from infra.fencer.decide import FencePolicy
from infra.fencer.ec2 import Ec2
from infra.fencer.metrics import serve
from infra.fencer.settings import USAGE

REQUIRED = (
    "AWS_REGION",
    "FENCE_NODE_SELECTOR",
    "FENCE_WAIT_S",
    "FENCE_MAX_IN_FLIGHT",
    "FENCE_MAX_BAD_FRACTION",
    "FENCE_POLL_S",
    "FENCE_UNFIT_LABEL",
    "FENCE_NAMESPACES",
    "FENCE_METRICS_PORT",
    "FENCE_JOIN_TIMEOUT_S",
    "FENCE_CLUSTER_NAME",
    "FENCE_NODEGROUP_NAME",
    "FENCE_MOUNT_TIMEOUT_S",
    "FENCE_MOUNT_CORDON",
)


def main() -> int:
    missing = [name for name in REQUIRED if not os.environ.get(name)]
    if missing:
        print(
            f"fencer: {', '.join(missing)} not set; the Deployment sets them "
            "(infra/node_fencer.py)",
            file=sys.stderr,
        )
        return USAGE
    try:
        policy = FencePolicy(
            wait_s=float(os.environ["FENCE_WAIT_S"]),
            max_in_flight=int(os.environ["FENCE_MAX_IN_FLIGHT"]),
            max_bad_fraction=float(os.environ["FENCE_MAX_BAD_FRACTION"]),
            join_timeout_s=float(os.environ["FENCE_JOIN_TIMEOUT_S"]),
            mount_timeout_s=float(os.environ["FENCE_MOUNT_TIMEOUT_S"]),
        )
        try:
            mount_cordon = json.loads(os.environ["FENCE_MOUNT_CORDON"])
        except json.JSONDecodeError:
            mount_cordon = None
        if not isinstance(mount_cordon, dict) or not mount_cordon:
            raise ValueError("FENCE_MOUNT_CORDON: not a JSON object (a Node patch body)")
        poll_s = float(os.environ["FENCE_POLL_S"])
        metrics_port = int(os.environ["FENCE_METRICS_PORT"])
    except ValueError as err:  # a number that is not one, or out of range: the field named
        print(f"fencer: {err}; the Deployment sets it (infra/node_fencer.py)", file=sys.stderr)
        return USAGE
    from kubernetes import client, config

    config.load_incluster_config()
    fencer = Fencer(
        nodes=client.CoreV1Api(),
        ec2=Ec2(region=os.environ["AWS_REGION"]),
        policy=policy,
        label_selector=os.environ["FENCE_NODE_SELECTOR"],
        unfit_label=os.environ["FENCE_UNFIT_LABEL"],
        namespaces=tuple(n for n in os.environ["FENCE_NAMESPACES"].split(",") if n),
        cluster_name=os.environ["FENCE_CLUSTER_NAME"],
        nodegroup_name=os.environ["FENCE_NODEGROUP_NAME"],
        mount_cordon=mount_cordon,
    )
    serve(fencer.metrics, port=metrics_port)
    log(
        "Started",
        policy=str(policy),
        selector=fencer.label_selector,
        unfit_label=fencer.unfit_label,
        namespaces=list(fencer.namespaces),
    )
    while True:
        try:
            fencer.reconcile()
        except Exception as err:  # one bad pass (API or EC2 down) must not end the loop
            log("PassFailed", error=f"{type(err).__name__}: {str(err)[:300]}")
        time.sleep(poll_s)


if __name__ == "__main__":
    sys.exit(main())
