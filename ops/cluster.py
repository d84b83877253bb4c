"""A training Job on a Kubernetes cluster through the kubernetes Python client: apply, watch
(pods by completion index, rank 0's log), stop. Used by the EKS launcher's CLI
(`training.launch.eks`) and the preflight (`manifests.preflight`).

The project's names (the Job, the FSx claim, the trainer container, the field manager) come from
the callers, who render the objects (`manifests/render.py`); this module knows the API only.
Nothing here calls AWS: the namespace and image come from the stack outputs (`cdk-outputs.json`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

APPLY_PATCH = "application/apply-patch+yaml"
CUSTOM_PLURALS = {"JobSet": "jobsets"}
"""Custom resources this module applies and deletes: kind -> the plural of its API path (the
JobSet CRD's ``spec.names.plural``, kubernetes-sigs/jobset)."""
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
    """Where and what runs: resolved by the launcher from flags over stack outputs."""

    namespace: str
    image: str
    job_name: str
    container: str
    """The container whose log is rank 0's (``follow``, ``stream_log``)."""
    fix: str = FIX_KUBECONFIG
    """How to reach the cluster when it cannot be reached (the UpdateKubeconfigCommand)."""


def target_from_flags(
    *,
    namespace: str | None,
    image: str | None,
    outputs: Path,
    needs_image: bool,
    job_name: str,
    container: str,
) -> Target:
    """Flags over stack outputs: the outputs file is read only when a flag it would give is
    missing (the image only when `needs_image`: a submission)."""
    stack = None
    if not (namespace and (image or not needs_image)):
        stack = StackOutputs.from_file(outputs)
    fix = FIX_KUBECONFIG
    if stack and stack.update_kubeconfig_command:
        fix = f"run `{stack.update_kubeconfig_command}`"
    return Target(
        namespace=namespace or stack.namespace,
        image=image or (stack.image if stack else ""),
        job_name=job_name,
        container=container,
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
    policy: Any
    networking: Any
    custom: Any
    """Custom resources (a JobSet): ``CustomObjectsApi``."""

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
            policy=client.PolicyV1Api(api_client),
            networking=client.NetworkingV1Api(api_client),
            custom=client.CustomObjectsApi(api_client),
        )


def call(fn: Callable[..., Any], *args: Any, fix: str, **kwargs: Any) -> Any:
    """Call the API and return the JSON body as a dict; unreachable cluster -> UsageError."""
    import urllib3

    try:
        resp = fn(*args, _preload_content=False, **kwargs)
    except urllib3.exceptions.HTTPError as e:
        raise UsageError(f"cannot reach the cluster ({type(e).__name__}): {fix}") from e
    return json.loads(resp.data or b"{}")


def check_shared_objects(cluster: Cluster, target: Target, *, claim: str) -> None:
    """The stack's namespace and FSx `claim` must exist: a clear message, not a pending pod."""
    from kubernetes.client.exceptions import ApiException

    checks = (
        (cluster.core.read_namespace, (target.namespace,), f"namespace {target.namespace}"),
        (
            cluster.core.read_namespaced_persistent_volume_claim,
            (claim, target.namespace),
            f"FSx claim {target.namespace}/{claim}",
        ),
    )
    for fn, args, what in checks:
        try:
            call(fn, *args, fix=target.fix)
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


def apply(cluster: Cluster, objects: Sequence[dict], *, fix: str, field_manager: str) -> list[str]:
    """Server-side apply each object, in order; returns 'Kind/name' of each applied object."""
    from kubernetes.client.exceptions import ApiException

    namespaced = {
        "Service": cluster.core.patch_namespaced_service,
        "Job": cluster.batch.patch_namespaced_job,
        "Deployment": cluster.apps.patch_namespaced_deployment,
        "PodDisruptionBudget": cluster.policy.patch_namespaced_pod_disruption_budget,
        "NetworkPolicy": cluster.networking.patch_namespaced_network_policy,
    }
    cluster_scoped = {"PriorityClass": cluster.scheduling.patch_priority_class}
    applied = []
    for obj in objects:
        kind, name = obj["kind"], obj["metadata"]["name"]
        namespace = obj["metadata"].get("namespace")
        if kind in CUSTOM_PLURALS:
            group, version = obj["apiVersion"].split("/")
            fn: Callable[..., Any] = cluster.custom.patch_namespaced_custom_object
            where: tuple[str, ...] = (group, version, namespace, CUSTOM_PLURALS[kind], name)
        elif kind in namespaced:
            fn, where = namespaced[kind], (name, namespace)
        else:
            fn, where = cluster_scoped[kind], (name,)
        try:
            call(
                fn,
                *where,
                obj,
                fix=fix,
                field_manager=field_manager,
                force=True,  # we own these objects; take fields over from e.g. kubectl
                _content_type=APPLY_PATCH,
            )
        except ApiException as e:
            if kind in ("Job", "JobSet") and e.status == 422:
                # A Job's pod template is immutable (a JobSet's replicated Jobs too, its
                # webhook): a changed submission needs a new one.
                raise UsageError(
                    f"{kind.lower()} {namespace}/{name} already exists with a different spec: "
                    f"stop it first (`make eks-stop OVERLAY=...`), then submit again"
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
        job = call(
            cluster.batch.read_namespaced_job, target.job_name, target.namespace, fix=target.fix
        )
    except ApiException as e:
        if e.status == 404:
            return JobState(name=target.job_name, exists=False)
        raise
    pods = call(
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
        pod, target.namespace, container=target.container, follow=True, _preload_content=False
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


def stop(
    cluster: Cluster, target: Target, *, out: TextIO, custom: Sequence[tuple[str, str]] = ()
) -> None:
    """Delete the Job (its pods go with it) and its Service, and first the ``custom`` objects
    ((kind, apiVersion): a JobSet, whose Jobs go with it) of the same name; the FSx claim and
    data stay."""
    from kubernetes.client.exceptions import ApiException

    deleters: list[tuple[str, Callable[..., Any], tuple[str, ...]]] = [
        (
            kind,
            cluster.custom.delete_namespaced_custom_object,
            (*api_version.split("/"), target.namespace, CUSTOM_PLURALS[kind], target.job_name),
        )
        for kind, api_version in custom
    ]
    deleters += [
        ("Job", cluster.batch.delete_namespaced_job, (target.job_name, target.namespace)),
        ("Service", cluster.core.delete_namespaced_service, (target.job_name, target.namespace)),
    ]
    for kind, fn, where in deleters:
        try:
            call(
                fn,
                *where,
                fix=target.fix,
                propagation_policy="Foreground",  # the pods are gone before the Job is
            )
            out.write(f"deleted {kind}/{target.job_name} (FSx data kept)\n")
        except ApiException as e:
            if e.status != 404:
                raise
            out.write(f"{kind}/{target.job_name} not found: nothing to stop\n")
