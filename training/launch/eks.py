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

``--restart replica`` (``make train TARGET=eks RESTART=replica``) submits the replica groups
instead (``manifests/replica.py``): the torchft Lighthouse's objects and a JobSet of one Job per
group (the stack installs the JobSet controller: ``infra/addons.py``). ``--follow`` then
watches group 0's Job, ``status`` and ``logs`` the one ``--group`` names; ``stop`` deletes the
JobSet with its Jobs (the Lighthouse stays, like the rendezvous store).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from manifests import render, replica
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
from training.modes import MODES

REPLICA_MODES = tuple(m for m, row in MODES.items() if row.replica_groups)
"""Modes run as a JobSet of replica groups (``manifests/replica.py``), not a plain Job."""

# --- the target --------------------------------------------------------------------------------


def resolve_target(ns: argparse.Namespace) -> Target:
    """The overlay's training Job (a replica run's: one group's Job of its JobSet), in the
    namespace and image of flags over stack outputs."""
    size = render.size_of(ns.overlay)  # an unknown overlay fails before any file is read
    job_name = size.job_name
    group = getattr(ns, "group", None)
    if group is None and getattr(ns, "restart", None) in REPLICA_MODES:
        group = 0  # a replica submission's --follow watches group 0's Job unless told
    if group is not None:
        job_name = replica.group_job_name(size.job_name, group)
    return target_from_flags(
        namespace=ns.namespace,
        image=ns.image,
        outputs=Path(ns.outputs),
        needs_image=ns.command == "submit",
        job_name=job_name,
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
    # trainer pod preempts; none for an overlay without spares; they serve any replica group),
    # then the Job's Service and Job, or the Lighthouse's objects and the groups' JobSet.
    spares = render.spare_objects(overlay=overlay, namespace=target.namespace, image=target.image)
    size = render.size_of(overlay)
    if restart in REPLICA_MODES:
        args = list(train_args) or size.train_args
        groups = replica.replica_groups_of(overlay=overlay, train_args=args)
        job = replica.jobset_objects(
            overlay=overlay,
            namespace=target.namespace,
            image=target.image,
            groups=groups,
            train_args=args,
        )
        shape = f"{groups} replica groups x {size.nodes} node(s) x {size.nproc_per_node} GPUs"
    else:
        job = render.job_objects(
            overlay=overlay,
            namespace=target.namespace,
            image=target.image,
            restart=restart,
            train_args=list(train_args) or None,
        )
        shape = f"{size.nodes} node(s) x {size.nproc_per_node} GPUs = world size {size.world_size}"
    applied = apply(cluster, [*spares, *job], fix=target.fix, field_manager=render.PROJECT)
    out.write(
        f"applied {', '.join(applied)} in {target.namespace} (server-side, field manager "
        f"{render.PROJECT}): {shape}, recipe {size.recipe}; {size.spares} hot spare(s)\n"
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
    group = argparse.ArgumentParser(add_help=False)
    group.add_argument(
        "--group", type=int, help="a replica run's group whose Job to watch (submit: 0)"
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("submit", parents=[common, group], help="apply the job (idempotent)")
    s.add_argument(
        "--restart", choices=(*render.RESTART_MODES, *REPLICA_MODES), help="default: the overlay's"
    )
    s.add_argument("--follow", action="store_true", help="wait, stream rank 0, report the end")
    s.add_argument("--timeout", type=float, help="seconds --follow waits before giving up")
    sub.add_parser(
        "status", parents=[common, group], help="the job's pods, restarts and completion"
    )
    lg = sub.add_parser(
        "logs", parents=[common, group], help="stream rank 0's log until the job ends"
    )
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
    # A replica run's JobSet (and its Jobs) goes first; a plain run has none (404: "not found").
    stop(cluster, target, out=out, custom=[("JobSet", replica.JOBSET_API_VERSION)])
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
