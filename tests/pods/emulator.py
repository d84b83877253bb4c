"""Emulated pods: run a rendered Job's trainer container exactly as the kubelet would, here.

Each pod gets its own network namespace (a veth on one bridge, its own IP), its own mount and
UTS namespaces (hostname ``<job>-<index>``; ``/fsx`` one directory shared by all pods;
``/scratch`` per pod; ``/etc/hosts`` naming every pod and the rendezvous Service), and runs the
container's ``command`` + ``args`` with ``$(VAR)`` expanded from its ``env`` and the ConfigMap,
as the kubelet does. The downward-API values (pod IP, the Job's uid) are what the API server
would fill in. The rendezvous store runs like its Deployment: its exact command in a "system
node" namespace. Emulated, because they cannot exist here: the API server, the scheduler, the
GPU, EFA. Only CPU sizes change, through values the manifests read (``NPROC_PER_NODE``,
``RECIPE``, and trainer overrides in the args). Needs root (``ip netns``, ``unshare``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from manifests import render

BRIDGE = "fsdpbr0"
SUBNET = "10.231.7"
REPO = Path(__file__).resolve().parents[2]


def can_run() -> str | None:
    """None when pods can be emulated here, else the reason."""
    if os.geteuid() != 0:
        return "emulated pods need root (ip netns, unshare)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"emulated pods need {tool}"
    return None


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion (unknown references stay as written)."""
    for name, val in env.items():
        value = value.replace(f"$({name})", val)
    return value


@dataclass
class Pod:
    name: str
    ip: str
    process: subprocess.Popen
    log: Path

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)


@dataclass
class Cluster:
    """One bridge, the rendezvous store's namespace, and a namespace per pod slot."""

    root: Path
    namespace: str = "training"
    netns: list[str] = field(default_factory=list)
    hosts: dict[str, str] = field(default_factory=dict)
    store: subprocess.Popen | None = None

    def _add_netns(self, name: str, ip: str) -> None:
        _sh("ip", "netns", "add", name)
        self.netns.append(name)
        host_if, pod_if = f"fsdpv{len(self.netns)}h", f"fsdpv{len(self.netns)}p"
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", pod_if)
        _sh("ip", "link", "set", host_if, "master", BRIDGE, "up")
        _sh("ip", "link", "set", pod_if, "netns", name)
        _sh("ip", "netns", "exec", name, "ip", "addr", "add", f"{ip}/24", "dev", pod_if)
        _sh("ip", "netns", "exec", name, "ip", "link", "set", pod_if, "up")
        _sh("ip", "netns", "exec", name, "ip", "link", "set", "lo", "up")

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
        binds = "".join(
            f"mkdir -p {shlex.quote(target)} && mount --bind {shlex.quote(str(src))} "
            f"{shlex.quote(target)} && "
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
        self._add_netns("fsdp-store", ip)
        self.store = self._run_in(
            netns="fsdp-store",
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
        self._add_netns(f"fsdp-pod{index}", ip)
        return ip

    def start_pod(
        self,
        *,
        job: dict,
        config_map: dict,
        index: int,
        job_uid: str,
        env_overrides: dict[str, str],
        attempt: int,
    ) -> Pod:
        """The Job's trainer container for completion index `index`, as the kubelet runs it."""
        name = f"{job['metadata']['name']}-{index}"
        ip = self.hosts[name]
        (container,) = job["spec"]["template"]["spec"]["containers"]
        env = dict(config_map["data"])
        for item in container["env"]:
            if "value" in item:
                env[item["name"]] = item["value"]
        env.update(
            {
                "POD_IP": ip,
                "JOB_UID": job_uid,
                "JOB_COMPLETION_INDEX": str(index),
                "HOSTNAME": name,
                **env_overrides,
            }
        )
        argv = [expand(a, env) for a in (*container["command"], *container["args"])]
        scratch = self.root / f"scratch-{index}-{attempt}"
        scratch.mkdir(parents=True, exist_ok=True)
        log = self.root / f"{name}-{attempt}.log"
        process = self._run_in(
            netns=f"fsdp-pod{index}",
            hostname=name,
            mounts={"/fsx": self.root / "fsx", "/scratch": scratch},
            argv=argv,
            env={**self._base_env(), **env},
            log=log,
        )
        return Pod(name=name, ip=ip, process=process, log=log)

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


@contextlib.contextmanager
def cluster(root: Path) -> Iterator[Cluster]:
    """Set up the bridge; tear down every namespace, link and process it made."""
    # Whatever a crashed earlier run left behind.
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    for line in links.splitlines():
        name = line.split(": ")[1].split("@")[0]
        if name.startswith(("fsdpv", BRIDGE)):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
    for i in range(8):
        subprocess.run(["ip", "netns", "del", f"fsdp-pod{i}"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "fsdp-store"], capture_output=True)
    _sh("ip", "link", "add", BRIDGE, "type", "bridge")
    _sh("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
    _sh("ip", "link", "set", BRIDGE, "up")
    (root / "fsx").mkdir(parents=True, exist_ok=True)
    c = Cluster(root=root)
    try:
        yield c
    finally:
        c.teardown()


def new_job_uid() -> str:
    return str(uuid.uuid4())


@dataclass
class JobResult:
    status: str
    """"Complete" or "Failed" (the Job's final condition)."""
    reason: str
    exit_codes: dict[int, list[int]]
    """Completion index -> exit code of each pod it ran, in order."""


def fail_job_codes(job: dict) -> set[int]:
    return {
        code
        for rule in job["spec"]["podFailurePolicy"]["rules"]
        if rule["action"] == "FailJob"
        for code in rule["onExitCodes"]["values"]
    }


def run_job(
    c: Cluster,
    *,
    job: dict,
    config_map: dict,
    job_uid: str,
    env_overrides: dict[str, str],
    timeout_s: float,
    on_start=None,
) -> JobResult:
    """The Job controller's documented behaviour for an Indexed Job with restartPolicy Never:
    an exit code listed in a FailJob rule fails the Job at once; any other failure counts
    against backoffLimit and a replacement pod with the same index starts once the old one is
    gone (podReplacementPolicy Failed); the Job completes when every index succeeded.
    `on_start(index, attempt, pod)` lets a test inject faults into a running pod."""
    import time

    spec = job["spec"]
    fail_codes = fail_job_codes(job)
    failures = 0
    codes: dict[int, list[int]] = {i: [] for i in range(spec["completions"])}
    running = {}
    for index in range(spec["completions"]):
        c.add_pod_slot(job=job["metadata"]["name"], index=index)

    def start(index: int, attempt: int) -> None:
        running[index] = c.start_pod(
            job=job,
            config_map=config_map,
            index=index,
            job_uid=job_uid,
            env_overrides=env_overrides,
            attempt=attempt,
        )
        if on_start:
            on_start(index, attempt, running[index])

    def fail(reason: str) -> JobResult:
        for other in running.values():  # the controller deletes the Job's other pods
            with contextlib.suppress(ProcessLookupError):
                os.killpg(other.process.pid, 9)
        return JobResult(status="Failed", reason=reason, exit_codes=codes)

    for index in range(spec["completions"]):
        start(index, 0)
    deadline = time.monotonic() + timeout_s
    while running:
        if time.monotonic() > deadline:
            return fail("emulator timeout")
        for index, pod in list(running.items()):
            code = pod.process.poll()
            if code is None:
                continue
            codes[index].append(code)
            del running[index]
            if code == 0:
                continue
            if code in fail_codes:
                return fail(f"PodFailurePolicy: exit {code}")
            failures += 1
            if failures > spec["backoffLimit"]:
                return fail("BackoffLimitExceeded")
            start(index, len(codes[index]))
        time.sleep(0.5)
    return JobResult(status="Complete", reason="", exit_codes=codes)
