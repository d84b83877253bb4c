"""Launch, watch and stop the training job on EKS through the kubernetes Python client.

    python -m training.launch.eks submit --overlay smoke --follow [--train.steps=100 ...]
    python -m training.launch.eks status --overlay smoke
    python -m training.launch.eks logs   --overlay smoke
    python -m training.launch.eks stop   --overlay smoke

(`make train TARGET=eks OVERLAY=smoke`, `make eks-status`, `make eks-logs`, `make eks-stop`.)

The namespace and the image come from the stack outputs (`cdk-outputs.json`, written by
`make deploy`) unless flags give them; nothing here calls AWS. The shared objects (namespace,
FSx volume and claim, service account, ConfigMap) belong to the CDK stack: this module checks
they exist and applies only the job's Service and Indexed Job, by server-side apply, so
submitting twice changes nothing. Stopping deletes the Job and its Service, never the data.
This module is the CLI; the client calls are `ops.cluster`'s.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from manifests import render
from ops.cluster import (
    DEFAULT_OUTPUTS,
    Cluster,
    Target,
    UsageError,
    apply,
    check_shared_objects,
    follow,
    job_state,
    stop,
    target_from_flags,
)
from training import exits

# --- the target --------------------------------------------------------------------------------


def resolve_target(ns: argparse.Namespace) -> Target:
    """The overlay's training Job, in the namespace and image of flags over stack outputs."""
    size = render.size_of(ns.overlay)  # an unknown overlay fails before any file is read
    return target_from_flags(
        namespace=ns.namespace,
        image=ns.image,
        outputs=Path(ns.outputs),
        needs_image=ns.command == "submit",
        job_name=size.job_name,
        container=render.CONTAINER,
    )


# --- commands ----------------------------------------------------------------------------------


def submit(
    cluster: Cluster,
    target: Target,
    *,
    overlay: str,
    restart: str | None,
    train_args: Sequence[str],
    out: TextIO,
) -> list[str]:
    check_shared_objects(cluster, target, claim=render.PVC_NAME)
    # The overlay's hot spares first (placeholders holding whole GPU nodes, which a replacement
    # trainer pod preempts; none for an overlay without spares), then the Job's Service and Job.
    objects = [
        *render.spare_objects(overlay=overlay, namespace=target.namespace, image=target.image),
        *render.job_objects(
            overlay=overlay,
            namespace=target.namespace,
            image=target.image,
            restart=restart,
            train_args=list(train_args) or None,
        ),
    ]
    applied = apply(cluster, objects, fix=target.fix, field_manager=render.PROJECT)
    size = render.size_of(overlay)
    out.write(
        f"applied {', '.join(applied)} in {target.namespace} (server-side, field manager "
        f"{render.PROJECT}): {size.nodes} node(s) x {size.nproc_per_node} GPUs = "
        f"world size {size.world_size}, recipe {size.recipe}; {size.spares} hot spare(s)\n"
    )
    return applied


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.launch.eks", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--overlay", default="smoke", help=f"one of {', '.join(render.OVERLAYS)}")
    common.add_argument("--outputs", default=str(DEFAULT_OUTPUTS), help="cdk-outputs.json path")
    common.add_argument("--namespace", help="overrides the stack's TrainingNamespace")
    common.add_argument("--image", help="overrides the stack's ImageUri")
    common.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube)")
    common.add_argument("--context", help="kubeconfig context (default: the current one)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", parents=[common], help="apply the job (idempotent)")
    s.add_argument("--restart", choices=render.RESTART_MODES, help="default: the overlay's")
    s.add_argument("--follow", action="store_true", help="wait, stream rank 0, report the end")
    s.add_argument("--timeout", type=float, help="seconds --follow waits before giving up")
    sub.add_parser("status", parents=[common], help="the job's pods, restarts and completion")
    lg = sub.add_parser("logs", parents=[common], help="stream rank 0's log until the job ends")
    lg.add_argument("--timeout", type=float, help="seconds to wait before giving up")
    sub.add_parser("stop", parents=[common], help="delete the job, never the data")
    return p


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Launcher flags, then the trainer overrides (`--section.field=value`) for `submit`."""
    ns, rest = parser().parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "." in a.split("=", 1)[0])]
    if bad or (rest and ns.command != "submit"):
        raise UsageError(
            f"unrecognized argument(s) {' '.join(bad or rest)}: trainer overrides look like "
            "--train.steps=100 and go to `submit` only"
        )
    return ns, rest


def run(
    argv: Sequence[str],
    *,
    out: TextIO = sys.stdout,
    cluster: Cluster | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """The CLI, with the cluster injectable (tests pass one wired to a local HTTP server)."""
    ns, train_args = parse(argv)
    target = resolve_target(ns)
    if cluster is None:
        cluster = Cluster.connect(kubeconfig=ns.kubeconfig, context=ns.context, fix=target.fix)
    if ns.command == "submit":
        submit(
            cluster, target, overlay=ns.overlay, restart=ns.restart, train_args=train_args, out=out
        )
        if ns.follow:
            return follow(cluster, target, out=out, timeout_s=ns.timeout, sleep=sleep)
        return 0
    if ns.command == "status":
        state = job_state(cluster, target)
        out.write(state.describe() + "\n")
        return 0 if state.exists else 1
    if ns.command == "logs":
        return follow(cluster, target, out=out, timeout_s=ns.timeout, sleep=sleep)
    stop(cluster, target, out=out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except (UsageError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return exits.USAGE
    except Exception as e:
        from kubernetes.client.exceptions import ApiException

        if not isinstance(e, ApiException):
            raise
        # Anything else the API server refuses: its own reason, in one line.
        print(f"error: the API server answered HTTP {e.status} {e.reason}", file=sys.stderr)
        return exits.FAILED
    except KeyboardInterrupt:
        print("\ninterrupted: the job keeps running (make eks-stop to delete it)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
