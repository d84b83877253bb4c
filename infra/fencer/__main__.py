"""``python -m infra.fencer``: the fencer's loop, as its Deployment runs it (infra/node_fencer.py
sets every variable below; one owner: ``FencerSettings`` there).

Environment: ``AWS_REGION``; ``FENCE_NODE_SELECTOR`` (the node group's label selector);
``FENCE_WAIT_S``, ``FENCE_MAX_IN_FLIGHT``, ``FENCE_MAX_BAD_FRACTION`` (decide.FencePolicy);
``FENCE_POLL_S`` (seconds between passes). Kubernetes: the in-cluster configuration.
"""

from __future__ import annotations

import os
import sys
import time

from infra.fencer.controller import Fencer, log
from infra.fencer.decide import FencePolicy
from infra.fencer.ec2 import Ec2
from infra.fencer.settings import USAGE

REQUIRED = (
    "AWS_REGION",
    "FENCE_NODE_SELECTOR",
    "FENCE_WAIT_S",
    "FENCE_MAX_IN_FLIGHT",
    "FENCE_MAX_BAD_FRACTION",
    "FENCE_POLL_S",
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
        )
        poll_s = float(os.environ["FENCE_POLL_S"])
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
    )
    log("Started", policy=str(policy), selector=fencer.label_selector)
    while True:
        try:
            fencer.reconcile()
        except Exception as err:  # one bad pass (API or EC2 down) must not end the loop
            log("PassFailed", error=f"{type(err).__name__}: {str(err)[:300]}")
        time.sleep(poll_s)


if __name__ == "__main__":
    sys.exit(main())
