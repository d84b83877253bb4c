"""Emulated pods: run a rendered Job's trainer container exactly as the kubelet would, here.

Each pod gets its own network namespace (a veth on one bridge, its own IP), its own mount and
UTS namespaces (hostname ``<job>-<index>``; ``/fsx`` one directory shared by all pods;
``/scratch`` per node or per pod, as the pod spec's volume says; ``/dev/shm`` the pod's own
memory-backed emptyDir; ``/etc/hosts`` naming every pod
and the rendezvous Service), and runs the container's ``command`` + ``args`` with ``$(VAR)``
expanded from its ``env`` and the ConfigMap, as the kubelet does. The downward-API values (pod
IP, the Job's uid) are what the API server would fill in. The rendezvous store runs like its
Deployment: its exact command in a "system node" namespace. Emulated, because they cannot exist
here: the API server, the scheduler, the GPU, EFA. Only CPU sizes change, through values the
manifests read (``NPROC_PER_NODE``, ``RECIPE``, and trainer overrides in the args). Needs root
(``ip netns``, ``unshare``)."""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from manifests import render
from podsim.kube_api import SERVICE_ACCOUNT_DIR
from podsim.machine import missing_tools, root_reason

if TYPE_CHECKING:
    from podsim.kube_api import ApiEndpoint


class ControlPlane(Protocol):
    """What `run_job` asks of the emulated control plane (podsim/control_plane.py, which
    imports this module: a protocol here, not an import back)."""

    def place(self, index: int) -> Node | None: ...
    def node_ready_at(self) -> float: ...
    def bound(self, index: int, pod: Pod) -> None: ...
    def failed_pods(self) -> dict[str, tuple[str, tuple[str, ...]]]: ...
    def released(self, pod: Pod) -> None: ...


RUN = os.getpid()
"""Every bridge, link and namespace this process makes carries its pid, so two runs of the pod
tests on one machine (a CI run beside a developer's) neither share nor tear down each other's;
a crashed run's leftovers are removed by the next run once that pid is gone."""
BRIDGE = f"fbr{RUN}"
NETNS = f"fsdp{RUN}-"
"""The prefix of this run's network namespaces."""
SUBNET = f"10.{200 + RUN % 50}.{RUN // 50 % 250}"
"""A /24 of its own per pid (two live runs collide only when their pids agree modulo 12,500)."""
_OWNED = re.compile(r"^(?:fbr|fv|fsdp)(\d+)")
SHM = Path("/dev/shm")
"""Where the pods' memory-backed emptyDirs live: this machine's tmpfs."""
REPO = Path(__file__).resolve().parents[1]


def can_run() -> str | None:
    """None when pods can be emulated here, else the reason (one line, with the fix)."""
    return root_reason("emulated pods (ip netns, unshare, mount)") or missing_tools("ip", "unshare")


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion (unknown references stay as written)."""
    for name, val in env.items():
        value = value.replace(f"$({name})", val)
    return value


def _tmpfs_size(quantity: str) -> str:
    """A Kubernetes binary quantity ("256Gi") as tmpfs's size option ("256g"); no limit: half
    of RAM, tmpfs's own default."""
    units = {"Ki": "k", "Mi": "m", "Gi": "g", "Ti": "t"}
    for suffix, unit in units.items():
        if quantity.endswith(suffix):
            return quantity[: -len(suffix)] + unit
    return quantity or "50%"


@dataclass
class Pod:
    name: str
    ip: str
    process: subprocess.Popen
    log: Path
    index: int
    node: str
    termination_log: Path
    """The file bound at the container's terminationMessagePath."""
    message_policy: str
    netns: str
    """The network namespace the pod runs in: its node's."""

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def termination_message(self, exit_code: int) -> str:
        """The kubelet's reading of a terminated container's message (Kubernetes docs,
        "Determine the Reason for Pod Failure"): the file's text; if it is empty, the container
        failed and the policy is FallbackToLogsOnError, the last 80 lines or 2048 bytes of its
        log, whichever is smaller."""
        text = self.termination_log.read_text(errors="replace")
        if text or exit_code == 0 or self.message_policy != "FallbackToLogsOnError":
            return text
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-80:])
        return tail.encode()[-2048:].decode(errors="replace")


@dataclass(frozen=True)
class Node:
    """An emulated node: a network namespace with its own IP on the bridge."""

    name: str
    netns: str
    ip: str
    host_if: str
    """The bridge side of its veth: down is a node whose network is cut."""


@dataclass
class Cluster:
    """One bridge, the rendezvous store's namespace, and a namespace per pod slot."""

    root: Path
    namespace: str = "training"
    netns: list[str] = field(default_factory=list)
    hosts: dict[str, str] = field(default_factory=dict)
    store: subprocess.Popen | None = None
    nodes: list[Node] = field(default_factory=list)
    api: ApiEndpoint | None = None
    """The emulated API server (kube_api.py), if any: every container gets its address, and a
    pod whose spec mounts a ServiceAccount token gets the token (the kubelet's rules)."""
    memory_dirs: list[Path] = field(default_factory=list)
    """Each pod's memory-backed emptyDir (``_memory_volumes``), removed at teardown."""

    def _add_netns(self, name: str, ip: str) -> str:
        _sh("ip", "netns", "add", name)
        self.netns.append(name)
        host_if, pod_if = f"fv{RUN}x{len(self.netns)}h", f"fv{RUN}x{len(self.netns)}p"
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", pod_if)
        _sh("ip", "link", "set", host_if, "master", BRIDGE, "up")
        _sh("ip", "link", "set", pod_if, "netns", name)
        _sh("ip", "netns", "exec", name, "ip", "addr", "add", f"{ip}/24", "dev", pod_if)
        _sh("ip", "netns", "exec", name, "ip", "link", "set", pod_if, "up")
        _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")
        return host_if

    def add_node(self) -> Node:
        """A new node (a fresh network namespace and IP), as a new instance joining."""
        k = len(self.nodes)
        name, ip = f"{NETNS}n{k}", f"{SUBNET}.{100 + k}"
        node = Node(name=f"node-{k}", netns=name, ip=ip, host_if=self._add_netns(name, ip))
        self.nodes.append(node)
        return node

    def run_on_node(self, node: Node, *, argv: list[str], log: Path) -> subprocess.Popen:
        """A container with no volumes and no environment of its own on `node` (a spare's
        placeholder)."""
        return self._run_in(
            netns=node.netns,
            hostname=node.name,
            mounts={},
            argv=argv,
            env=self._base_env(),
            log=log,
        )

    def _write_hosts(self) -> Path:
        path = self.root / "hosts"
        lines = ["127.0.0.1 localhost"] + [f"{ip} {name}" for name, ip in self.hosts.items()]
        path.write_text("\n".join(lines) + "\n")
        return path

    def _run_in(
        self,
        *,
        netns: str,
        hostname: str,
        mounts: dict[str, Path],
        argv: list[str],
        env: dict[str, str],
        log: Path,
    ) -> subprocess.Popen:
        # A directory is bound on a directory, a file on a file (the mount point of a file,
        # e.g. /dev/termination-log, is an empty file that stays on this machine, as on a node).
        binds = "".join(
            (
                f"mkdir -p {shlex.quote(target)}"
                if src.is_dir()
                else f"{{ [ -e {shlex.quote(target)} ] || : > {shlex.quote(target)}; }}"
            )
            + f" && mount --bind {shlex.quote(str(src))} {shlex.quote(target)} && "
            for target, src in mounts.items()
        )
        inner = (
            f"hostname {shlex.quote(hostname)} && {binds}"
            f"mount --bind {shlex.quote(str(self._write_hosts()))} /etc/hosts && "
            f"cd {shlex.quote(str(REPO))} && exec {shlex.join(argv)}"
        )
        return subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                netns,
                "unshare",
                "--mount",
                "--uts",
                "--propagation",
                "private",
                "sh",
                "-c",
                inner,
            ],
            env=env,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start_store(self, *, shared: list[dict]) -> None:
        deployment = next(o for o in shared if o["kind"] == "Deployment")
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        ip = f"{SUBNET}.2"
        self.hosts[f"{render.RDZV_STORE}.{self.namespace}"] = ip
        self._add_netns(f"{NETNS}store", ip)
        self.store = self._run_in(
            netns=f"{NETNS}store",
            hostname="store",
            mounts={},
            argv=[*container["command"], *container["args"]],
            env=self._base_env(),
            log=self.root / "store.log",
        )

    def _base_env(self) -> dict[str, str]:
        venv_bin = str(Path(sys.executable).parent)
        return {
            "PATH": f"{venv_bin}:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/root",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "TORCH_CPP_LOG_LEVEL": "ERROR",
        }

    def add_pod_slot(self, *, job: str, index: int) -> str:
        ip = f"{SUBNET}.{10 + index}"
        name = f"{job}-{index}"
        self.hosts[f"{name}.{job}"] = ip
        self.hosts[name] = ip
        self._add_netns(f"{NETNS}pod{index}", ip)
        return ip

    def _container_env(
        self, *, container: dict, config_map: dict | None, downward: dict[str, str]
    ) -> dict[str, str]:
        """envFrom first, then env (later entries win), as the kubelet builds it."""
        env = dict(config_map["data"]) if config_map and container.get("envFrom") else {}
        for item in container.get("env", []):
            env[item["name"]] = item["value"] if "value" in item else downward[item["name"]]
        return env

    def start_pod(
        self,
        *,
        job: dict,
        config_map: dict,
        index: int,
        job_uid: str,
        env_overrides: dict[str, str],
        attempt: int,
        on: Node | None = None,
    ) -> Pod:
        """The Job's pod for completion index `index`, as the kubelet runs it: each init
        container to completion, then the trainer container. `on`: the node the scheduler
        chose (default: the index's own slot, `add_pod_slot`); the pod's DNS names follow it."""
        name = f"{job['metadata']['name']}-{index}"
        if on is not None:
            self.hosts[name] = self.hosts[f"{name}.{job['metadata']['name']}"] = on.ip
            self._write_hosts()
        ip = self.hosts[name]
        netns = on.netns if on is not None else f"{NETNS}pod{index}"
        spec = job["spec"]["template"]["spec"]
        # Set by the Job controller and the runtime in every container of the pod.
        pod_env = {"JOB_COMPLETION_INDEX": str(index), "HOSTNAME": name}
        # The scheduler's choice: every pod start lands on a node of its own (a cluster with
        # a spare node; on a full one a replacement can meet the same node again).
        node = on.name if on is not None else node_name(index=index, attempt=attempt)
        downward = {"POD_IP": ip, "JOB_UID": job_uid, "NODE_NAME": node}
        # /scratch as the pod spec declares it: a hostPath is the node's directory, shared by
        # every pod the node runs and outliving each (kubernetes.io, "Volumes": hostPath); an
        # emptyDir is the pod's own and goes with it.
        (scratch_volume,) = [v for v in spec["volumes"] if v["name"] == "scratch"]
        owner = f"node-{node}" if "hostPath" in scratch_volume else f"pod-{index}-{attempt}"
        scratch = self.root / f"scratch-{owner}"
        scratch.mkdir(parents=True, exist_ok=True)
        log = self.root / f"{name}-{attempt}.log"
        (container,) = spec["containers"]
        termination_log = self.root / f"termination-{index}-{attempt}"
        termination_log.write_text("")
        mounts = {
            "/fsx": self.root / "fsx",
            "/scratch": scratch,
            **self._memory_volumes(spec=spec, container=container, owner=f"pod-{index}-{attempt}"),
        }
        if self.api is not None:
            pod_env.update(self.api.pod_env())
            if spec.get("automountServiceAccountToken"):
                mounts[SERVICE_ACCOUNT_DIR] = self.api.secrets

        def run(container: dict, extra_mounts: dict[str, Path] | None = None) -> subprocess.Popen:
            env = {
                **self._container_env(
                    container=container, config_map=config_map, downward=downward
                ),
                **pod_env,
                **env_overrides,
            }
            argv = [expand(a, env) for a in (*container["command"], *container.get("args", []))]
            return self._run_in(
                netns=netns,
                hostname=name,
                mounts={**mounts, **(extra_mounts or {})},
                argv=argv,
                env={**self._base_env(), **env},
                log=log,
            )

        for init in spec.get("initContainers", []):
            code = run(init).wait(timeout=600)
            if code != 0:
                raise RuntimeError(f"init container {init['name']} of {name} exited {code}")
        message_path = container.get("terminationMessagePath", "/dev/termination-log")
        return Pod(
            name=name,
            ip=ip,
            process=run(container, {message_path: termination_log}),
            log=log,
            index=index,
            node=node,
            termination_log=termination_log,
            message_policy=container.get("terminationMessagePolicy", "File"),
            netns=netns,
        )

    def _memory_volumes(self, *, spec: dict, container: dict, owner: str) -> dict[str, Path]:
        """The container's memory-backed emptyDir volumes (the trainer's ``/dev/shm``), each the
        pod's own tmpfs: Kubernetes mounts a tmpfs for ``emptyDir.medium: Memory``, sized to the
        volume's ``sizeLimit`` (SizeMemoryBackedVolumes, KEP-1967, GA in 1.32), created when the
        pod is assigned to a node, shared by the pod's containers (bind-mounted into each),
        kept across container crashes, and deleted for good when the pod leaves the node
        (kubernetes.io, "Volumes": emptyDir). Here each pod start mounts a fresh tmpfs of that
        size on this machine (a size is a limit, not an allocation), unmounted at teardown: a
        replacement pod never sees its predecessor's files, a process restarted inside the pod
        does, and ``statvfs`` in the pod reports the size the node would."""
        memory = {
            v["name"]: v["emptyDir"].get("sizeLimit", "")
            for v in spec["volumes"]
            if v.get("emptyDir", {}).get("medium") == "Memory"
        }
        mounts = {}
        for mount in container.get("volumeMounts", []):
            if mount["name"] in memory:
                directory = SHM / f"{NETNS}{owner}-{mount['name']}"
                directory.mkdir(parents=True, exist_ok=True)
                size = _tmpfs_size(memory[mount["name"]])
                _sh("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory))
                self.memory_dirs.append(directory)
                mounts[mount["mountPath"]] = directory
        return mounts

    def pids(self, index: int) -> list[int]:
        """Every process in pod `index` (its network namespace)."""
        return self.netns_pids(f"{NETNS}pod{index}")

    def netns_pids(self, netns: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout
        return [int(pid) for pid in out.split()]

    def kill_pod(self, index: int) -> None:
        """The node under pod `index` dies: every process in it is SIGKILLed at once."""
        self.kill_netns(f"{NETNS}pod{index}")

    def kill_netns(self, netns: str) -> None:
        for pid in self.netns_pids(netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def signal_netns(self, netns: str, sig: int) -> list[int]:
        """Send `sig` to every process in `netns`; the pids it reached."""
        reached = []
        for pid in self.netns_pids(netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
                reached.append(pid)
        return reached

    def set_link(self, node: Node, *, up: bool) -> None:
        """Cut (or restore) `node`'s network: the bridge side of its veth down (up)."""
        _sh("ip", "link", "set", node.host_if, "up" if up else "down")

    def teardown(self) -> None:
        if self.store is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.store.pid, 9)
        for name in self.netns:
            # Every process left in the namespace dies with it.
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            for pid in pids.stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), 9)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)
        for directory in self.memory_dirs:
            subprocess.run(["umount", "--lazy", str(directory)], capture_output=True)
            shutil.rmtree(directory, ignore_errors=True)


@contextlib.contextmanager
def cluster(root: Path) -> Iterator[Cluster]:
    """Set up the bridge; tear down every namespace, link and process it made."""
    # Whatever a crashed earlier run left behind: names whose run (pid) is gone.
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(": ")[1].split("@")[0]
        if _stale(name):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in [line.split()[0] for line in listed.splitlines() if line.strip()]:
        if not _stale(name):
            continue
        pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
        for pid in pids.stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for directory in SHM.glob("fsdp*") if SHM.is_dir() else []:
        if _stale(directory.name):
            subprocess.run(["umount", "--lazy", str(directory)], capture_output=True)
            shutil.rmtree(directory, ignore_errors=True)
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    (root / "fsx").mkdir(parents=True, exist_ok=True)
    c = Cluster(root=root)
    try:
        yield c
    finally:
        c.teardown()


def _stale(name: str) -> bool:
    """A link or namespace made by a pod-test run that no longer exists."""
    match = _OWNED.match(name)
    if match is None or int(match.group(1)) == RUN:
        return match is not None
    try:
        os.kill(int(match.group(1)), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def new_job_uid() -> str:
    return str(uuid.uuid4())


@dataclass
class JobResult:
    status: str
    """"Complete", "Failed", or "Deleted" (every pod was sent SIGTERM: a drain or a delete)."""
    reason: str
    exit_codes: dict[int, list[int | None]]
    """Completion index -> exit code of each pod it ran, in order (a signal N reads 128 + N,
    as the kubelet reports it; None: the control plane failed the pod, whose container never
    reported an exit, e.g. on a lost node)."""
    messages: dict[int, list[str]] = field(default_factory=dict)
    """Completion index -> each pod's termination message, in order."""
    nodes: dict[int, list[str]] = field(default_factory=dict)
    """Completion index -> the node each pod ran on, in order."""


def node_name(*, index: int, attempt: int) -> str:
    return f"node-{index}-{attempt}"


def pod_failure_action(
    job: dict, *, container: str, exit_code: int | None, conditions: tuple[str, ...] = ()
) -> str:
    """The Job's podFailurePolicy for a failed pod (Kubernetes docs, Job: "Pod failure
    policy"; the API's PodFailurePolicy: rules are evaluated in order, the first match wins,
    no match means the default handling, Count). `exit_code`: the container's, None when it
    never terminated (its node was lost: onExitCodes rules match terminated containers only);
    `conditions`: the pod's True conditions (DisruptionTarget, set by the taint eviction
    controller and PodGC)."""
    for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
        if "onPodConditions" in rule:
            wanted = {c["type"] for c in rule["onPodConditions"]}
            if wanted & set(conditions):
                return rule["action"]
            continue
        on = rule.get("onExitCodes")
        if on is None or exit_code is None or on.get("containerName", container) != container:
            continue
        listed = exit_code in on["values"]
        if listed == (on["operator"] == "In"):
            return rule["action"]
    return "Count"


def container_exit_code(returncode: int) -> int:
    """What the kubelet reports for a container's main process: 128 + N after signal N."""
    return 128 - returncode if returncode < 0 else returncode


def scaled(job: dict, *, nodes: int) -> dict:
    """The same Job with `nodes` pods: completions, parallelism and the NNODES the launcher
    reads (a CPU size, set where the manifest sets it)."""
    job = copy.deepcopy(job)
    job["spec"]["completions"] = job["spec"]["parallelism"] = nodes
    (container,) = job["spec"]["template"]["spec"]["containers"]
    for item in container["env"]:
        if item["name"] == "NNODES":
            item["value"] = str(nodes)
    return job


def run_job(
    c: Cluster,
    *,
    job: dict,
    config_map: dict,
    job_uid: str,
    env_overrides: dict[str, str],
    timeout_s: float,
    on_start: Callable[[int, int, Pod], None] | None = None,
    delete: threading.Event | None = None,
    control_plane: ControlPlane | None = None,
) -> JobResult:
    """The Job controller's documented behaviour for an Indexed Job with restartPolicy Never:
    a failed pod's exit code goes through the pod failure policy (`pod_failure_action`):
    FailJob fails the Job at once; Count (also when no rule matches) counts against
    backoffLimit and Ignore does not, and either way a replacement pod with the same index
    starts once the old one is gone (podReplacementPolicy Failed); the Job completes when
    every index succeeded.
    `on_start(index, attempt, pod)` lets a test watch a pod; setting `delete` terminates every
    pod as the kubelet does for a drain or `kubectl delete job` (SIGTERM to the container's
    main process, SIGKILL after terminationGracePeriodSeconds) and ends the Job "Deleted".
    `control_plane` (podsim/control_plane.py) places pods on nodes and fails the pods of
    lost nodes, by the node lifecycle, taint eviction and PodGC rules; without it each index
    has a node slot of its own."""
    spec = job["spec"]
    grace_s = spec["template"]["spec"]["terminationGracePeriodSeconds"]
    (container,) = spec["template"]["spec"]["containers"]
    failures = 0
    codes: dict[int, list[int]] = {i: [] for i in range(spec["completions"])}
    messages: dict[int, list[str]] = {i: [] for i in range(spec["completions"])}
    nodes: dict[int, list[str]] = {i: [] for i in range(spec["completions"])}
    running: dict[int, Pod] = {}
    pending: dict[int, tuple[int, float]] = {}
    """Index -> (attempt, when its node is ready): created, not yet placed."""
    if control_plane is None:
        for index in range(spec["completions"]):
            c.add_pod_slot(job=job["metadata"]["name"], index=index)

    def start(index: int, attempt: int) -> None:
        on = None
        if control_plane is not None:
            on = control_plane.place(index)
            if on is None:  # no free node yet: Pending until one joins
                pending[index] = (attempt, control_plane.node_ready_at())
                return
        running[index] = c.start_pod(
            job=job,
            config_map=config_map,
            index=index,
            job_uid=job_uid,
            env_overrides=env_overrides,
            attempt=attempt,
            on=on,
        )
        nodes[index].append(running[index].node)
        if control_plane is not None:
            control_plane.bound(index, running[index])
        if on_start:
            on_start(index, attempt, running[index])

    def ended(index: int, pod: Pod, code: int | None) -> None:
        codes[index].append(code)
        messages[index].append("" if code is None else pod.termination_message(code))

    def result(status: str, reason: str) -> JobResult:
        return JobResult(
            status=status, reason=reason, exit_codes=codes, messages=messages, nodes=nodes
        )

    def stop_all() -> None:  # the controller deletes the Job's other pods
        for other in running.values():
            c.kill_netns(other.netns)
            other.process.wait()

    def fail(reason: str) -> JobResult:
        stop_all()
        return result("Failed", reason)

    def terminate() -> JobResult:
        for pod in running.values():
            pod.process.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace_s
        for index, pod in running.items():
            try:
                code = pod.process.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                c.kill_netns(pod.netns)
                code = pod.process.wait()
            ended(index, pod, container_exit_code(code))
        running.clear()
        return result("Deleted", "terminated")

    for index in range(spec["completions"]):
        start(index, 0)
    deadline = time.monotonic() + timeout_s
    while running or pending:
        if delete is not None and delete.is_set():
            return terminate()
        if time.monotonic() > deadline:
            return fail("emulator timeout")
        for index, (attempt, ready_at) in list(pending.items()):
            if time.monotonic() >= ready_at:
                del pending[index]
                start(index, attempt)
        lost = control_plane.failed_pods() if control_plane is not None else {}
        for index, pod in list(running.items()):
            if pod.name in lost and lost[pod.name][0] == pod.node:
                # Failed by the control plane (PodGC); its processes stay as they are on the
                # node nobody can reach. No exit code: the pod's conditions decide.
                code, conditions = None, lost[pod.name][1]
            else:
                if control_plane is not None and control_plane.silent(pod):
                    continue  # no kubelet reports anything from a lost node
                returncode = pod.process.poll()
                if returncode is None:
                    continue
                code, conditions = container_exit_code(returncode), ()
                c.kill_netns(pod.netns)  # the container's other processes end with it
                if control_plane is not None:
                    control_plane.released(pod)
            ended(index, pod, code)
            del running[index]
            if code == 0:
                continue
            action = pod_failure_action(
                job, container=container["name"], exit_code=code, conditions=conditions
            )
            if action == "FailJob":
                return fail(f"PodFailurePolicy: exit {code}")
            if action == "Count":
                failures += 1
            if failures > spec["backoffLimit"]:
                return fail("BackoffLimitExceeded")
            start(index, len(codes[index]))
        if delete is not None:
            delete.wait(0.2)  # returns at once when set
        else:
            time.sleep(0.2)
    return result("Complete", "")
