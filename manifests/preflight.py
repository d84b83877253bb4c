"""The preflight Job of an overlay: an all-reduce check across its GPU nodes before training.

    python -m manifests.preflight --overlay 2node --dry-run    # print the Job as YAML
    python -m manifests.preflight --overlay 2node              # run it, print the verdict
    python -m manifests.preflight --overlay 2node --min-busbw-gbs=150   # check flags pass on

(`make eks-preflight OVERLAY=2node`.) The Job is the overlay's training Job from
`manifests/render.py` (same sizes row, same pod template: node selector, GPUs, EFA, huge pages,
volumes, environment) with only what makes it a check changed: its name (`<job>-preflight`),
`backoffLimit: 0` (a failed check must fail, not retry onto the same nodes), a deadline, and
the container's command, `torchrun` with the training launcher's own rendezvous flags running
`python -m training.allreduce_check` (the trainer's supervisor, `training.launch.pod`, accepts
trainer commands only). Every pod prints the check's table and its `PREFLIGHT_REPORT` line.

Submitting needs a kubeconfig and the stack (`cdk-outputs.json`, as `make train TARGET=eks`):
it refuses while the overlay's training Job still holds the nodes, replaces an earlier
preflight Job of the overlay, waits for the end, streams rank 0 and exits 0 (pass),
`exits.ENVIRONMENT` (a slow node or pair, named) or `exits.FAILED` (broken, or no report).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import io
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from manifests import render
from manifests.sizes import OverlaySize
from ops.cluster import (
    Cluster,
    StackOutputs,
    Target,
    UsageError,
    apply,
    call,
    check_shared_objects,
    follow,
    job_state,
    target_from_flags,
)
from training import allreduce_check, exits

SUFFIX = "-preflight"
CHECK_MODULE = "training.allreduce_check"
ACTIVE_DEADLINE_SECONDS = 3600
"""A preflight never holds the nodes longer than an hour (image pull, data preparation by the
init container on a first run, rendezvous and the check itself take minutes)."""
LAUNCHER_RESTART = "none"
"""torchrun with static ranks and no restarts: a check that fails must stay failed."""


def job_name(overlay: str) -> str:
    return render.size_of(overlay).job_name + SUFFIX


def check_command(
    *, size: OverlaySize, namespace: str, check_args: Sequence[str] = ()
) -> list[str]:
    """``torchrun <the training Job's rendezvous flags> -m training.allreduce_check ARGS``.

    The flags come from `render.pod_command` (nodes, ranks per node, the rendezvous store,
    `$(JOB_UID)` and `$(POD_IP)`), so the check meets the way training does.
    """
    training = render.pod_command(
        size=size, namespace=namespace, restart=LAUNCHER_RESTART, train_args=[]
    )
    launcher, flags = training[0], training[1 : training.index("-m")]
    if launcher != "torchrun":
        raise ValueError(f"expected a torchrun command for restart={LAUNCHER_RESTART}")
    allreduce_check.parser().parse_args(list(check_args))  # a bad flag fails here, not in a pod
    return [launcher, *flags, "-m", CHECK_MODULE, *check_args]


def preflight_job(
    *, overlay: str, namespace: str, image: str, check_args: Sequence[str] = ()
) -> dict:
    """The overlay's training Job, turned into its preflight (see the module docstring)."""
    size = render.size_of(overlay)
    objects = render.job_objects(overlay=overlay, namespace=namespace, image=image)
    job = copy.deepcopy(next(o for o in objects if o["kind"] == "Job"))
    job["metadata"]["name"] = job_name(overlay)
    job["spec"]["backoffLimit"] = 0
    job["spec"]["activeDeadlineSeconds"] = ACTIVE_DEADLINE_SECONDS
    (container,) = [
        c for c in job["spec"]["template"]["spec"]["containers"] if c["name"] == render.CONTAINER
    ]
    command = check_command(size=size, namespace=namespace, check_args=check_args)
    container["command"], container["args"] = command[:1], command[1:]
    return job


# --- submitting ---------------------------------------------------------------------------------


def resolve_target(ns: argparse.Namespace) -> Target:
    """The overlay's preflight Job, in the namespace and image of flags over stack outputs."""
    size = render.size_of(ns.overlay)  # an unknown overlay fails before any file is read
    return target_from_flags(
        namespace=ns.namespace,
        image=ns.image,
        outputs=Path(ns.outputs),
        needs_image=True,
        job_name=job_name(size.name),
        container=render.CONTAINER,
    )


class _Tee(io.TextIOBase):
    """Writes through to `out` and keeps a copy (the report is parsed from rank 0's log)."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.buffer_ = out, io.StringIO()

    def write(self, text: str) -> int:
        self.out.write(text)
        return self.buffer_.write(text)

    def flush(self) -> None:
        self.out.flush()


def read_report(log: str) -> dict | None:
    """The last `PREFLIGHT_REPORT` line of a log, parsed; None when there is none."""
    prefix = allreduce_check.REPORT_PREFIX
    lines = [line for line in log.splitlines() if line.startswith(prefix)]
    return json.loads(lines[-1][len(prefix) :]) if lines else None


def verdict(*, report: dict | None, job_code: int) -> tuple[int, str]:
    """The CLI's exit code and last line from the report and how the Job ended."""
    if report is None:
        return exits.FAILED, (
            "preflight FAILED: no report from rank 0 (a pod never started, a node broke before "
            "the check finished, or it timed out); see the pods above and their logs"
        )
    if report["ok"] and job_code == 0:
        return exits.OK, "preflight PASSED: no slow or broken node"
    named = [f"slow node {n}" for n in report["slow_nodes"]]
    named += [f"slow pair {a} + {b}" for a, b in report["slow_pairs"]]
    named += [f"broken: {b}" for b in report["broken"]]
    named = named or report["problems"]
    if not named:
        return exits.FAILED, "preflight FAILED: the check passed but the Job did not (see the pods)"
    code = exits.ENVIRONMENT if report["exit_code"] == exits.ENVIRONMENT else exits.FAILED
    return code, "preflight FAILED: " + "; ".join(named)


def submit_and_wait(
    cluster: Cluster,
    target: Target,
    *,
    overlay: str,
    check_args: Sequence[str],
    out: TextIO,
    timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    from kubernetes.client.exceptions import ApiException

    check_shared_objects(cluster, target, claim=render.PVC_NAME)
    training = dataclasses.replace(target, job_name=render.size_of(overlay).job_name)
    state = job_state(cluster, training)
    if state.exists and not state.done:
        raise UsageError(
            f"training job {target.namespace}/{state.name} is still there and holds the nodes: "
            f"stop it first (`make eks-stop OVERLAY={overlay}`), then run the preflight"
        )
    # One preflight per overlay: an earlier one (finished or not) is replaced, pods included.
    try:
        call(
            cluster.batch.delete_namespaced_job,
            target.job_name,
            target.namespace,
            fix=target.fix,
            propagation_policy="Foreground",
        )
        out.write(f"deleted the previous {target.job_name}; waiting for its pods to go\n")
        for _ in range(120):
            if not job_state(cluster, target).exists:
                break
            sleep(2)
    except ApiException as e:
        if e.status != 404:
            raise
    job = preflight_job(
        overlay=overlay,
        namespace=target.namespace,
        image=target.image,
        check_args=check_args,
    )
    (applied,) = apply(cluster, [job], fix=target.fix, field_manager=render.PROJECT)
    size = render.size_of(overlay)
    out.write(
        f"applied {applied} in {target.namespace}: all-reduce check on {size.nodes} node(s) x "
        f"{size.nproc_per_node} GPUs\n"
    )
    tee = _Tee(out)
    job_code = follow(cluster, target, out=tee, timeout_s=timeout_s, sleep=sleep)
    code, line = verdict(report=read_report(tee.buffer_.getvalue()), job_code=job_code)
    out.write(line + "\n")
    return code


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m manifests.preflight", description=__doc__, allow_abbrev=False
    )
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--overlay", default="smoke", help=f"one of {', '.join(render.OVERLAYS)}")
    p.add_argument("--dry-run", action="store_true", help="print the Job as YAML, submit nothing")
    p.add_argument("--outputs", default="cdk-outputs.json", help="cdk-outputs.json path")
    p.add_argument("--namespace", help="overrides the stack's TrainingNamespace")
    p.add_argument("--image", help="overrides the stack's ImageUri")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube)")
    p.add_argument("--context", help="kubeconfig context (default: the current one)")
    p.add_argument("--timeout", type=float, help="seconds to wait for the end before giving up")
    return p


def run(
    argv: Sequence[str],
    *,
    out: TextIO = sys.stdout,
    cluster: Cluster | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """The CLI; unknown flags go to the check (validated here). The cluster is injectable."""
    ns, check_args = parser().parse_known_args(argv)
    size = render.size_of(ns.overlay)  # an unknown overlay fails first
    try:
        allreduce_check.parser().parse_args(check_args)
    except SystemExit:
        return exits.USAGE  # argparse printed which flag
    if ns.dry_run:
        namespace, image = ns.namespace, ns.image
        if not (namespace and image) and Path(ns.outputs).is_file():
            stack = StackOutputs.from_file(Path(ns.outputs))
            namespace, image = namespace or stack.namespace, image or stack.image
        job = preflight_job(
            overlay=size.name,
            namespace=namespace or render.DEFAULT_NAMESPACE,
            image=image or render.PLACEHOLDER_IMAGE,
            check_args=check_args,
        )
        out.write(render.to_yaml(job))
        return exits.OK
    target = resolve_target(ns)
    if cluster is None:
        cluster = Cluster.connect(kubeconfig=ns.kubeconfig, context=ns.context, fix=target.fix)
    return submit_and_wait(
        cluster,
        target,
        overlay=size.name,
        check_args=check_args,
        out=out,
        timeout_s=ns.timeout,
        sleep=sleep,
    )


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
        print(f"error: the API server answered HTTP {e.status} {e.reason}", file=sys.stderr)
        return exits.FAILED


if __name__ == "__main__":
    sys.exit(main())
