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
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from manifests import render
from training import exits

APPLY_PATCH = "application/apply-patch+yaml"
DEFAULT_OUTPUTS = Path("cdk-outputs.json")
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
FIX_KUBECONFIG = "run the stack's UpdateKubeconfigCommand (see cdk-outputs.json)"


class UsageError(Exception):
    """A problem the user fixes (missing file, cluster, namespace): one message, exit 2."""


# --- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class StackOutputs:
    """The values this launcher needs from `cdk-outputs.json`."""

    namespace: str
    image: str
    cluster_name: str = ""
    update_kubeconfig_command: str = ""

    @classmethod
    def from_file(cls, path: Path) -> StackOutputs:
        if not path.is_file():
            raise UsageError(
                f"stack outputs file {path} not found: run `make deploy` (it writes "
                "cdk-outputs.json), or pass --outputs PATH, or --namespace and --image"
            )
        try:
            stacks = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UsageError(f"{path} is not valid JSON ({e}): run `make deploy` again") from e
        # {"<StackName>": {...outputs...}}: take the stack that has our outputs.
        found = [v for v in stacks.values() if isinstance(v, dict) and "TrainingNamespace" in v]
        if len(found) != 1:
            raise UsageError(
                f"{path}: expected exactly one stack with a TrainingNamespace output, "
                f"found {len(found)}: run `make deploy`, or pass --namespace and --image"
            )
        (out,) = found
        missing = [k for k in ("TrainingNamespace", "ImageUri") if not out.get(k)]
        if missing:
            raise UsageError(f"{path}: output(s) {', '.join(missing)} missing: run `make deploy`")
        return cls(
            namespace=out["TrainingNamespace"],
            image=out["ImageUri"],
            cluster_name=out.get("ClusterName", ""),
            update_kubeconfig_command=out.get("UpdateKubeconfigCommand", ""),
        )


@dataclass(frozen=True, kw_only=True)
class Target:
    """Where and what to run: resolved from flags over stack outputs."""

    namespace: str
    image: str
    overlay: str
    fix: str = FIX_KUBECONFIG
    """How to reach the cluster when it cannot be reached (the UpdateKubeconfigCommand)."""

    @property
    def job_name(self) -> str:
        return render.size_of(self.overlay).job_name


def resolve_target(ns: argparse.Namespace) -> Target:
    render.size_of(ns.overlay)  # an unknown overlay fails before any file is read
    outputs = None
    if not (ns.namespace and (ns.image or ns.command != "submit")):
        outputs = StackOutputs.from_file(Path(ns.outputs))
    fix = FIX_KUBECONFIG
    if outputs and outputs.update_kubeconfig_command:
        fix = f"run `{outputs.update_kubeconfig_command}`"
    return Target(
        namespace=ns.namespace or outputs.namespace,
        image=ns.image or (outputs.image if outputs else ""),
        overlay=ns.overlay,
        fix=fix,
    )


# --- the cluster -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """The API groups we use, over one ApiClient (built from a kubeconfig or given)."""

    core: Any
    batch: Any
    apps: Any
    scheduling: Any

    @classmethod
    def connect(cls, *, kubeconfig: str | None, context: str | None, fix: str) -> Cluster:
        from kubernetes import client, config

        configuration = client.Configuration()
        try:
            config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=configuration
            )
        except (config.ConfigException, FileNotFoundError) as e:
            raise UsageError(f"no usable kubeconfig ({e}): {fix}") from e
        return cls.from_api_client(client.ApiClient(configuration))

    @classmethod
    def from_api_client(cls, api_client: Any) -> Cluster:
        from kubernetes import client

        return cls(
            core=client.CoreV1Api(api_client),
            batch=client.BatchV1Api(api_client),
            apps=client.AppsV1Api(api_client),
            scheduling=client.SchedulingV1Api(api_client),
        )


def _call(fn: Callable[..., Any], *args: Any, fix: str, **kwargs: Any) -> Any:
    """Call the API and return the JSON body as a dict; unreachable cluster -> UsageError."""
    import urllib3

    try:
        resp = fn(*args, _preload_content=False, **kwargs)
    except urllib3.exceptions.HTTPError as e:
        raise UsageError(f"cannot reach the cluster ({type(e).__name__}): {fix}") from e
    return json.loads(resp.data or b"{}")


def preflight(cluster: Cluster, target: Target) -> None:
    """The stack's shared objects must exist: a clear message instead of a pending pod."""
    from kubernetes.client.exceptions import ApiException

    checks = (
        (cluster.core.read_namespace, (target.namespace,), f"namespace {target.namespace}"),
        (
            cluster.core.read_namespaced_persistent_volume_claim,
            (render.PVC_NAME, target.namespace),
            f"FSx claim {target.namespace}/{render.PVC_NAME}",
        ),
    )
    for fn, args, what in checks:
        try:
            _call(fn, *args, fix=target.fix)
        except ApiException as e:
            if e.status == 404:
                raise UsageError(
                    f"{what} not found on the cluster: run `make deploy` (the stack creates it),"
                    " or pass --namespace with the stack's TrainingNamespace"
                ) from e
            if e.status in (401, 403):
                raise UsageError(
                    f"not allowed to read {what} (HTTP {e.status}): {target.fix}"
                ) from e
            raise


def apply(cluster: Cluster, objects: Sequence[dict], *, fix: str) -> list[str]:
    """Server-side apply each object, in order; returns 'Kind/name' of each applied object."""
    from kubernetes.client.exceptions import ApiException

    namespaced = {
        "Service": cluster.core.patch_namespaced_service,
        "Job": cluster.batch.patch_namespaced_job,
        "Deployment": cluster.apps.patch_namespaced_deployment,
    }
    cluster_scoped = {"PriorityClass": cluster.scheduling.patch_priority_class}
    applied = []
    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        namespace = obj["metadata"].get("namespace")
        where = (name, namespace) if kind in namespaced else (name,)
        try:
            _call(
                namespaced.get(kind) or cluster_scoped[kind],
                *where,
                obj,
                fix=fix,
                field_manager=render.PROJECT,
                force=True,  # we own these objects; take fields over from e.g. kubectl
                _content_type=APPLY_PATCH,
            )
        except ApiException as e:
            if kind == "Job" and e.status == 422:
                # A Job's pod template is immutable: a changed submission needs a new Job.
                raise UsageError(
                    f"job {namespace}/{name} already exists with a different spec: stop it "
                    f"first (`make eks-stop OVERLAY=...`), then submit again"
                ) from e
            raise
        applied.append(f"{kind}/{name}")
    return applied


# --- watching ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class JobState:
    """What `status` prints: the Job's counters and its pods by completion index."""

    name: str
    exists: bool
    active: int = 0
    succeeded: int = 0
    failed: int = 0
    completions: int = 0
    condition: str = ""
    """Complete, Failed (with reason), or empty while running."""
    pods: tuple[dict, ...] = field(default=())

    @property
    def done(self) -> bool:
        return self.condition.startswith(("Complete", "Failed"))

    def describe(self) -> str:
        if not self.exists:
            return f"job {self.name}: not found"
        lines = [
            f"job {self.name}: {self.condition or 'running'}; pods active {self.active}, "
            f"succeeded {self.succeeded}/{self.completions}, failed {self.failed} "
            f"(each failed pod was replaced: a restart of that node's ranks)"
        ]
        for pod in self.pods:
            lines.append(f"  {pod_line(pod)}")
        return "\n".join(lines)


def pod_index(pod: dict) -> int:
    return int(pod["metadata"].get("annotations", {}).get(INDEX_ANNOTATION, "-1"))


def pod_line(pod: dict) -> str:
    status = pod.get("status", {})
    detail = ""
    for c in status.get("containerStatuses", []) + status.get("initContainerStatuses", []):
        state = c.get("state", {})
        for key in ("waiting", "terminated"):
            if state.get(key, {}).get("reason"):
                detail = f" {c['name']}: {state[key]['reason']}"
                break
    for cond in status.get("conditions", []):
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            detail = f" unschedulable: {cond.get('message', cond.get('reason', ''))}"
    restarts = sum(c.get("restartCount", 0) for c in status.get("containerStatuses", []))
    return (
        f"index {pod_index(pod)} {pod['metadata']['name']} {status.get('phase', '?')}"
        f" node={pod.get('spec', {}).get('nodeName', '-')} restarts={restarts}{detail}"
    )


def job_state(cluster: Cluster, target: Target) -> JobState:
    from kubernetes.client.exceptions import ApiException

    try:
        job = _call(
            cluster.batch.read_namespaced_job, target.job_name, target.namespace, fix=target.fix
        )
    except ApiException as e:
        if e.status == 404:
            return JobState(name=target.job_name, exists=False)
        raise
    pods = _call(
        cluster.core.list_namespaced_pod,
        target.namespace,
        fix=target.fix,
        label_selector=f"batch.kubernetes.io/job-name={target.job_name}",
    ).get("items", [])
    status = job.get("status", {})
    condition = ""
    for cond in status.get("conditions", []):
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            reason = cond.get("reason")
            condition = cond["type"] + (f" ({reason})" if reason else "")
    return JobState(
        name=target.job_name,
        exists=True,
        active=status.get("active", 0),
        succeeded=status.get("succeeded", 0),
        failed=status.get("failed", 0),
        completions=job.get("spec", {}).get("completions", 0),
        condition=condition,
        pods=tuple(sorted(pods, key=lambda p: (pod_index(p), p["metadata"]["name"]))),
    )


def rank0_pod(state: JobState) -> dict | None:
    """The newest pod of completion index 0 that has started its trainer (logs exist)."""
    started = [
        p
        for p in state.pods
        if pod_index(p) == 0
        and p.get("status", {}).get("phase") in ("Running", "Succeeded", "Failed")
    ]
    started.sort(key=lambda p: p["metadata"].get("creationTimestamp", ""))
    return started[-1] if started else None


def stream_log(cluster: Cluster, target: Target, pod: str, out: TextIO) -> None:
    """Copy the pod's trainer log to `out` until the container exits (follow=True)."""
    resp = cluster.core.read_namespaced_pod_log(
        pod, target.namespace, container=render.CONTAINER, follow=True, _preload_content=False
    )
    for text in _decoded(resp.stream(2**16)):
        out.write(text)
        out.flush()


def _decoded(chunks: Iterator[bytes]) -> Iterator[str]:
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for chunk in chunks:
        yield decoder.decode(chunk)
    yield decoder.decode(b"", final=True)


def follow(
    cluster: Cluster,
    target: Target,
    *,
    out: TextIO,
    poll_s: float = 10.0,
    timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Wait for the pods, stream rank 0's log (again after each replacement), report the end.

    Returns 0 when the Job completes, 1 when it fails (or the timeout passes).
    """
    start = clock()
    streamed: set[str] = set()
    last = ""
    while True:
        state = job_state(cluster, target)
        if not state.exists:
            raise UsageError(f"job {target.namespace}/{target.job_name} not found: submit it")
        pod = rank0_pod(state)
        if pod and pod["metadata"]["name"] not in streamed:
            name = pod["metadata"]["name"]
            if streamed:
                out.write(f"--- rank 0 restarted in a new pod: {name}\n")
            out.write(f"--- streaming rank 0: {target.namespace}/{name}\n")
            streamed.add(name)
            stream_log(cluster, target, name, out)
            continue  # re-read the state: the pod may have ended, or been replaced
        if state.done:
            out.write(state.describe() + "\n")
            return 0 if state.condition.startswith("Complete") else 1
        summary = state.describe()
        if summary != last:
            out.write(summary + "\n")
            last = summary
        if timeout_s is not None and clock() - start > timeout_s:
            out.write(f"gave up waiting after {timeout_s:.0f} s; the job keeps running\n")
            return 1
        sleep(poll_s)


# --- commands ----------------------------------------------------------------------------------


def submit(
    cluster: Cluster,
    target: Target,
    *,
    restart: str | None,
    train_args: Sequence[str],
    out: TextIO,
) -> list[str]:
    preflight(cluster, target)
    # The overlay's hot spares first (placeholders holding whole GPU nodes, which a replacement
    # trainer pod preempts; none for an overlay without spares), then the Job's Service and Job.
    objects = [
        *render.spare_objects(
            overlay=target.overlay, namespace=target.namespace, image=target.image
        ),
        *render.job_objects(
            overlay=target.overlay,
            namespace=target.namespace,
            image=target.image,
            restart=restart,
            train_args=list(train_args) or None,
        ),
    ]
    applied = apply(cluster, objects, fix=target.fix)
    size = render.size_of(target.overlay)
    out.write(
        f"applied {', '.join(applied)} in {target.namespace} (server-side, field manager "
        f"{render.PROJECT}): {size.nodes} node(s) x {size.nproc_per_node} GPUs = "
        f"world size {size.world_size}, recipe {size.recipe}; {size.spares} hot spare(s)\n"
    )
    return applied


def stop(cluster: Cluster, target: Target, *, out: TextIO) -> None:
    """Delete the Job (its pods go with it) and its Service; the FSx claim and data stay."""
    from kubernetes.client.exceptions import ApiException

    deleters = (
        ("Job", cluster.batch.delete_namespaced_job),
        ("Service", cluster.core.delete_namespaced_service),
    )
    for kind, fn in deleters:
        try:
            _call(
                fn,
                target.job_name,
                target.namespace,
                fix=target.fix,
                propagation_policy="Foreground",  # the pods are gone before the Job is
            )
            out.write(f"deleted {kind}/{target.job_name} (FSx data kept)\n")
        except ApiException as e:
            if e.status != 404:
                raise
            out.write(f"{kind}/{target.job_name} not found: nothing to stop\n")


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
        submit(cluster, target, restart=ns.restart, train_args=train_args, out=out)
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
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: the job keeps running (make eks-stop to delete it)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
