"""Pod start-up check, run before rendezvous: does this machine fit the job?

Run: ``python -m training.startup_check [--expect-device cuda|cpu|auto]``. Reads from the
environment (the EKS Job sets each; a local run sets none of the optional ones):
``NPROC_PER_NODE`` (ranks this node will start; default 1), ``EXPECT_DEVICE`` (default ``cuda``;
the flag wins), ``REQUIRE_EFA=1`` (multi-node over EFA), ``FSX_MOUNT`` and ``FSX_FSTYPE`` (the
shared file system's mount point and type), ``NODE_NAME`` (the downward API's ``spec.nodeName``)
and ``TERMINATION_MESSAGE_PATH`` (the container's ``terminationMessagePath``).

Prints one JSON line of facts (torch, CUDA, driver, NCCL, GPUs, EFA provider, NCCL net plugin,
the /fsx mount, the node) and exits 0, or prints one ``startup_check: <field>: <problem>; <fix>``
line per misfit to stderr, writes a summary naming the node to the termination message, and
exits with one of two codes (training/exits.py), which the Job's pod failure policy tells apart:
- ``ENVIRONMENT`` for what every node would meet (a CPU torch, no NCCL, no NCCL net plugin in
  the image, /fsx not the expected file system, read-only or full): the Job fails at once;
- ``NODE_UNFIT`` for what is this node's own (CUDA sees no GPU or too few, a driver older than
  the CUDA build, no EFA device, a write to /fsx that fails with an I/O error or does not
  finish): the pod fails and counts against ``backoffLimit``; in a pod, the check first cordons
  its node with the product's unfit label (``ops.cordon.cordon``, the trainer's one node
  permission), so the replacement never lands on the same bad node, and the node fencer
  replaces the node once no training pod runs there (docs/node-loss.md).

Checks on ``cuda``: CUDA available, ``torch.cuda.device_count() >= NPROC_PER_NODE``, NCCL built
in, the CUDA driver at least the torch build's CUDA major (CUDA 13 needs an R580+ driver:
NVIDIA's CUDA toolkit release notes, table 3), and the NCCL net plugin NCCL would load (below).
The EFA provider and the plugin are reported always and required only when ``REQUIRE_EFA=1``.
On ``cpu``: only that torch imports and ``NPROC_PER_NODE`` is a positive integer; the plugin is
"not applicable". On both: /fsx, when ``FSX_MOUNT`` is set.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ops import cordon as cluster
from training import exits
from training.runlog.verdict import NODE_NAME_ENV

# Minimum NVIDIA driver major per CUDA major (CUDA release notes, "CUDA Toolkit and Minimum
# Required Driver Version"): 12.x needs >= 525, 13.x needs >= 580.
MIN_DRIVER_FOR_CUDA: dict[int, int] = {12: 525, 13: 580}

NCCL_NET_PLUGIN_SYMBOLS = tuple(f"ncclNetPlugin_v{v}" for v in range(12, 4, -1))
"""The versioned structs NCCL looks up in a net plugin (src/plugin/net.cc, ncclNetPluginLoad:
the newest first, none below v5)."""

FSX_PROBE_DIR = ".startup_check"
"""Under the /fsx mount: one probe file per node, written, synced and removed."""
FSX_PROBE_TIMEOUT_S = 60.0
# A write that fails with one of these is the file system's or the Job's (every node meets it);
# any other error, or none within the timeout, is this node's client.
FSX_JOB_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})

TERMINATION_MESSAGE_LIMIT = 4096
"""The kubelet keeps at most 4096 bytes of a container's termination message (Kubernetes docs,
"Determine the Reason for Pod Failure")."""


@dataclass
class Report:
    facts: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    """What every node would meet: the Job fails (exits.ENVIRONMENT)."""
    node_problems: list[str] = field(default_factory=list)
    """This node's own: a replacement pod may succeed elsewhere (exits.NODE_UNFIT)."""

    @property
    def code(self) -> int:
        if self.problems:
            return exits.ENVIRONMENT
        return exits.NODE_UNFIT if self.node_problems else exits.OK


def efa_provider() -> tuple[bool, str | None]:
    """(fi_info found, the first provider of ``fi_info -p efa`` or None)."""
    fi_info = shutil.which("fi_info") or (
        "/opt/amazon/efa/bin/fi_info" if os.path.exists("/opt/amazon/efa/bin/fi_info") else None
    )
    if fi_info is None:
        return False, None
    try:
        out = subprocess.run(
            [fi_info, "-p", "efa"], capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return True, None
    if out.returncode != 0:
        return True, None
    for line in out.stdout.splitlines():
        if line.strip().startswith("provider:"):
            return True, line.split(":", 1)[1].strip()
    return True, None


def driver_version() -> str | None:
    """NVIDIA driver version from ``nvidia-smi`` (None without it)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


# --- the NCCL net plugin (aws-ofi-nccl on EFA) ---------------------------------------------------


@dataclass(frozen=True)
class NetPlugin:
    library: str | None
    """The name that loaded (as NCCL would dlopen it), or None."""
    symbol: str | None
    """The plugin struct found in it, or None."""
    detail: str
    """What was tried, or where the library lies on LD_LIBRARY_PATH."""


def nccl_net_plugin(env: Mapping[str, str]) -> NetPlugin:
    """The net plugin NCCL would load in this process, found the way NCCL finds it (NCCL
    src/plugin/net.cc, openNetPluginLib): with NCCL_NET_PLUGIN set, dlopen of its value, then of
    ``libnccl-net-<value>.so``; without it, ``libnccl-net.so``; the dynamic loader searches
    LD_LIBRARY_PATH (as set when the process started), the ld.so cache and the system
    directories. Then the newest ``ncclNetPlugin_vN`` struct in it."""
    name = env.get("NCCL_NET_PLUGIN", "")
    candidates = [name, f"libnccl-net-{name}.so"] if name else ["libnccl-net.so"]
    errors = []
    for candidate in candidates:
        try:
            lib = ctypes.CDLL(candidate, mode=os.RTLD_NOW | os.RTLD_LOCAL)
        except OSError as err:
            errors.append(str(err))
            continue
        symbol = next((s for s in NCCL_NET_PLUGIN_SYMBOLS if hasattr(lib, s)), None)
        dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
        where = next((d for d in dirs if os.path.exists(os.path.join(d, candidate))), None)
        detail = f"in {where}" if where else "through the loader's cache or system directories"
        if symbol is None:
            oldest, newest = NCCL_NET_PLUGIN_SYMBOLS[-1], NCCL_NET_PLUGIN_SYMBOLS[0]
            detail = f"loads but has none of {oldest}..{newest}"
        return NetPlugin(library=candidate, symbol=symbol, detail=detail)
    return NetPlugin(library=None, symbol=None, detail="; ".join(errors))


# --- the shared file system (/fsx) --------------------------------------------------------------


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str
    source: str
    options: tuple[str, ...]


def _unescape(field_: str) -> str:
    # Spaces, tabs, newlines and backslashes in paths are octal escapes (\040 ...).
    out, i = [], 0
    while i < len(field_):
        if field_[i] == "\\" and field_[i + 1 : i + 4].isdigit():
            out.append(chr(int(field_[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field_[i])
            i += 1
    return "".join(out)


def mount_at(path: str, mountinfo: str) -> Mount | None:
    """The mount whose mount point is exactly `path`, from /proc/self/mountinfo text (proc(5):
    ID, parent ID, major:minor, root, mount point, mount options, optional fields, "-",
    filesystem type, source, super options). The last entry wins: a later mount on the same
    point covers the earlier ones. A bind mount shows the type of the file system it binds."""
    want = os.path.normpath(path)
    found = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if _unescape(fields[4]) != want or len(fields) < sep + 3:
            continue
        found = Mount(
            point=want,
            fstype=fields[sep + 1],
            source=_unescape(fields[sep + 2]),
            options=tuple(fields[5].split(",")) + tuple(fields[sep + 3].split(",")),
        )
    return found


def write_probe(path: Path) -> None:
    """Create, write, fsync and remove `path` (what a checkpoint's first file does)."""
    path.parent.mkdir(exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"startup_check\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    path.unlink()


def probe_with_timeout(
    probe: Callable[[], None], *, timeout_s: float
) -> tuple[str, OSError | None]:
    """("ok" | "error" | "timeout", the error). The probe runs in a daemon thread: a write stuck
    in the kernel cannot be interrupted, but the check still answers and exits."""
    result: list[OSError | None] = []

    def run() -> None:
        try:
            probe()
            result.append(None)
        except OSError as err:
            result.append(err)

    thread = threading.Thread(target=run, name="fsx-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not result:
        return "timeout", None
    return ("ok", None) if result[0] is None else ("error", result[0])


def check_fsx(
    *,
    report: Report,
    mount_point: str,
    expected_fstype: str,
    node: str,
    mountinfo: str,
    timeout_s: float = FSX_PROBE_TIMEOUT_S,
    probe: Callable[[Path], None] = write_probe,
) -> None:
    """`mount_point` is a mount of `expected_fstype`, read-write, and a file written there is
    synced and removed within `timeout_s`. Adds facts and problems to `report`."""
    mount = mount_at(mount_point, mountinfo)
    report.facts["fsx"] = (
        None if mount is None else {"fstype": mount.fstype, "source": mount.source}
    )
    fix = "mount the FSx for Lustre claim there (the Job's fsx volume, fsx.csi.aws.com)"
    if mount is None:
        report.problems.append(f"fsx: {mount_point} is not a mount point; {fix}")
        return
    if mount.fstype != expected_fstype:
        report.problems.append(
            f"fsx: {mount_point} is a {mount.fstype} mount of {mount.source}, not "
            f"{expected_fstype}; {fix}"
        )
        return
    if "ro" in mount.options:
        report.problems.append(
            f"fsx: {mount_point} is mounted read-only; the trainer writes checkpoints there: "
            "drop readOnly from the volume and its claim"
        )
        return
    target = Path(mount_point) / FSX_PROBE_DIR / node
    state, err = probe_with_timeout(lambda: probe(target), timeout_s=timeout_s)
    if state == "timeout":
        report.node_problems.append(
            f"fsx: a write to {target} did not finish in {timeout_s:g} s on node {node}; this "
            "node's Lustre client is stuck (see its kernel log): a replacement pod may run "
            "on another node"
        )
    elif err is not None and err.errno in FSX_JOB_ERRNOS:
        report.problems.append(
            f"fsx: cannot write {target}: {err.strerror}; free space or fix the file "
            "system's permissions (every node meets the same)"
        )
    elif err is not None:
        report.node_problems.append(
            f"fsx: cannot write {target} on node {node}: {err.strerror}; this node's Lustre "
            "client is broken (see its kernel log): a replacement pod may run on another node"
        )


# --- the decision -------------------------------------------------------------------------------


POD_MEMORY_BYTES_ENV = "POD_MEMORY_BYTES"
"""Bytes of ``/dev/shm`` this node's memory snapshots need (the Job sets it from
``facts.checkpoint.snapshot_bytes_per_node``, manifests/render.py), beside ``POD_MEMORY_DIR``."""
POD_MEMORY_DIR_ENV = "POD_MEMORY_DIR"
CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")


def check_pod_memory(
    *, report: Report, directory: Path, needed: int, memory_max: str | None
) -> None:
    """The pod's memory must hold this node's memory snapshots: the tmpfs under ``directory``
    (its size limit, and its free space: ``statvfs``) and the container's memory limit
    (cgroup v2 ``memory.max``; a memory-backed emptyDir's pages count against it: Kubernetes
    docs, "Volumes", emptyDir). A tmpfs too small is every node's: the Job fails
    (``report.problems``). One big enough whose free space is short (files outside the
    snapshots' directory: another process's shared memory) is this pod's: a replacement pod
    gets a fresh emptyDir (``report.node_problems``). Files already under ``directory`` count
    as free: this run's slots from a previous container are reused in place, and other runs'
    are pruned at start (``pod_memory.PodMemorySnapshots.prune``). Without the room a
    snapshot would find no space (ENOSPC, ``snapshot_files.reserve``): pod memory then goes
    off on that rank and restarts read storage."""
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stat = os.statvfs(probe)
    size = stat.f_blocks * stat.f_frsize
    reusable = _bytes_under(directory)
    free = stat.f_bavail * stat.f_frsize + reusable
    report.facts["pod_memory"] = {
        "dir": str(directory),
        "needed": needed,
        "tmpfs_size": size,
        "tmpfs_free": free,
    }
    fix = (
        "raise NodeType.shm in facts/hardware.py, or set --checkpoint.memory_interval=0 "
        "(no memory snapshots: restarts load from storage)"
    )
    if size < needed:
        report.problems.append(
            f"checkpoint.pod_memory_dir: {probe} holds {size / 2**30:.1f} GiB, the memory "
            f"snapshots need {needed / 2**30:.1f} GiB per node; {fix}"
        )
    elif free < needed:
        report.node_problems.append(
            f"checkpoint.pod_memory_dir: {probe} has {_size(free)} free of {_size(size)} "
            f"({_size(size - free)} in other files), the memory snapshots need "
            f"{_size(needed)} per node; a replacement pod starts with an empty one (or {fix})"
        )
    limit = (memory_max or "max").strip()
    if limit != "max" and int(limit) < needed:
        report.problems.append(
            f"checkpoint.pod_memory_dir: the container's memory limit ({int(limit) / 2**30:.1f}"
            f" GiB, cgroup memory.max) is below the snapshots' {needed / 2**30:.1f} GiB, which "
            f"count against it; {fix}"
        )


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _bytes_under(directory: Path) -> int:
    """Bytes allocated to the files under ``directory`` (0 when it does not exist)."""
    total = 0
    for path in Path(directory).rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file():
                total += path.stat().st_blocks * 512
    return total


def check(
    *,
    expect_device: str,
    nproc_per_node: str,
    require_efa: bool,
    cuda_available: bool,
    device_count: int,
    torch_version: str,
    cuda_version: str | None,
    nccl_version: str | None,
    driver: str | None,
    efa: str | None,
    fi_info: bool = True,
    net_plugin: NetPlugin | None = None,
    node: str = "",
) -> Report:
    """Pure decision over the facts gathered by :func:`gather` (tested on CPU with real values).
    `net_plugin` is None on a CPU run (not applicable)."""
    report = Report(
        facts={
            "node": node,
            "expect_device": expect_device,
            "torch": torch_version,
            "cuda": cuda_version,
            "driver": driver,
            "nccl": nccl_version,
            "gpus": device_count,
            "nproc_per_node": nproc_per_node,
            "efa_provider": efa,
            "nccl_net_plugin": (
                "not applicable (cpu)"
                if net_plugin is None
                else f"{net_plugin.library} ({net_plugin.symbol}, {net_plugin.detail})"
                if net_plugin.library
                else f"none ({net_plugin.detail})"
            ),
        }
    )
    problems, mine = report.problems, report.node_problems
    try:
        nproc = int(nproc_per_node)
        if nproc < 1:
            raise ValueError
    except ValueError:
        problems.append(
            f"NPROC_PER_NODE: must be a positive integer, got {nproc_per_node!r}; "
            "set it to the number of ranks per node"
        )
        return report
    if expect_device == "cpu":
        return report
    if cuda_version is None:
        problems.append(f"cuda: torch {torch_version} is a CPU build; use the image's CUDA torch")
        return report
    if not cuda_available:
        mine.append(
            f"cuda: torch {torch_version} (CUDA {cuda_version}) sees no usable GPU on node "
            f"{node}; its NVIDIA driver or device plugin is broken"
        )
        return report
    if device_count < nproc:
        mine.append(
            f"NPROC_PER_NODE: {nproc} ranks but {device_count} GPUs visible on node {node}; "
            "a GPU fell off the bus or the device plugin handed out fewer than nvidia.com/gpu"
        )
    if nccl_version is None:
        problems.append("nccl: torch was built without NCCL; use the CUDA torch wheel")
    cuda_major = int(cuda_version.split(".")[0])
    need = MIN_DRIVER_FOR_CUDA.get(cuda_major)
    if driver is not None and need is not None and int(driver.split(".")[0]) < need:
        mine.append(
            f"driver: {driver} on node {node} is older than CUDA {cuda_version} needs "
            f"(>= {need}); use a node AMI with a newer NVIDIA driver"
        )
    if require_efa and not fi_info:
        problems.append(
            "efa: no fi_info in the image (libfabric); build the image with the EFA installer"
        )
    elif require_efa and efa != "efa":
        mine.append(
            f"efa: libfabric has no EFA provider on node {node} (fi_info -p efa); the pod "
            "requests vpc.amazonaws.com/efa, so the node's EFA devices or driver are missing"
        )
    if require_efa and net_plugin is not None and net_plugin.symbol is None:
        problems.append(
            f"nccl_net_plugin: NCCL would load no net plugin ({net_plugin.detail}) and fall "
            "back to TCP sockets; put aws-ofi-nccl where NCCL_NET_PLUGIN and LD_LIBRARY_PATH "
            "say (the image's EFA installer)"
        )
    return report


def gather(*, expect_device: str, nproc_per_node: str, require_efa: bool, node: str) -> Report:
    import torch

    cuda_available = torch.cuda.is_available()
    nccl = None
    if torch.distributed.is_nccl_available():
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    fi_info, efa = efa_provider()
    return check(
        expect_device=expect_device,
        nproc_per_node=nproc_per_node,
        require_efa=require_efa,
        cuda_available=cuda_available,
        device_count=torch.cuda.device_count() if cuda_available else 0,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        nccl_version=nccl,
        driver=driver_version() if expect_device == "cuda" else None,
        efa=efa,
        fi_info=fi_info,
        net_plugin=nccl_net_plugin(os.environ) if expect_device == "cuda" else None,
        node=node,
    )


def termination_message(report: Report) -> str:
    """One summary for `kubectl describe pod` and the Job's status, within the kubelet's limit."""
    node = report.facts.get("node") or "?"
    if report.problems:
        head = f"startup_check: this job does not fit node {node}, nor would it fit any other"
    else:
        head = f"startup_check: node {node} does not fit; a replacement pod may run elsewhere"
    text = "\n".join([head, *report.problems, *report.node_problems])
    return text.encode()[:TERMINATION_MESSAGE_LIMIT].decode(errors="ignore")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.startup_check")
    parser.add_argument(
        "--expect-device",
        choices=("cuda", "cpu", "auto"),
        default=os.environ.get("EXPECT_DEVICE", "cuda"),
        help="auto (the run's parallel.device default): cuda when torch sees a GPU, else cpu",
    )
    args = parser.parse_args(argv)
    expect = args.expect_device
    if expect == "auto":
        import torch

        expect = "cuda" if torch.cuda.is_available() else "cpu"
    node = os.environ.get(NODE_NAME_ENV) or socket.gethostname()
    report = gather(
        expect_device=expect,
        nproc_per_node=os.environ.get("NPROC_PER_NODE", "1"),
        require_efa=os.environ.get("REQUIRE_EFA", "0") == "1",
        node=node,
    )
    if os.environ.get("FSX_MOUNT") and not os.environ.get("FSX_FSTYPE"):
        report.problems.append("FSX_FSTYPE: not set beside FSX_MOUNT; the Job sets both")
    elif os.environ.get("FSX_MOUNT"):
        check_fsx(
            report=report,
            mount_point=os.environ["FSX_MOUNT"],
            expected_fstype=os.environ["FSX_FSTYPE"],
            node=node,
            mountinfo=Path("/proc/self/mountinfo").read_text(),
            timeout_s=float(os.environ.get("FSX_PROBE_TIMEOUT_S", FSX_PROBE_TIMEOUT_S)),
        )
    if os.environ.get(POD_MEMORY_BYTES_ENV) and os.environ.get(POD_MEMORY_DIR_ENV):
        check_pod_memory(
            report=report,
            directory=Path(os.environ[POD_MEMORY_DIR_ENV]),
            needed=int(os.environ[POD_MEMORY_BYTES_ENV]),
            memory_max=CGROUP_MEMORY_MAX.read_text() if CGROUP_MEMORY_MAX.exists() else None,
        )
    print(json.dumps({"startup_check": report.facts}, separators=(",", ":")), flush=True)
    for problem in [*report.problems, *report.node_problems]:
        print(f"startup_check: {problem}", file=sys.stderr, flush=True)
    if report.code != exits.OK:
        print(termination_message(report).splitlines()[0], file=sys.stderr, flush=True)
        path = os.environ.get("TERMINATION_MESSAGE_PATH")
        if path:
            try:
                Path(path).write_text(termination_message(report))
            except OSError as err:
                print(f"startup_check: cannot write {path}: {err}", file=sys.stderr)
    if report.code == exits.NODE_UNFIT and cluster.in_cluster():
        cluster.cordon(node, reason=cluster.STARTUP_CHECK)  # a warning when it fails
    return report.code


if __name__ == "__main__":
    sys.exit(main())
