"""Pod start-up check (training/startup_check.py).

Run: ``.venv/bin/pytest tests/training/test_startup_check.py -q``. The CUDA branch cannot run
here (no GPU): its decisions are tested through :func:`check` with the values a p5 pod reports;
the CPU mode runs for real, as the module, the way the launch script calls it. The NCCL net
plugin is found by the real dynamic loader, in a subprocess with the LD_LIBRARY_PATH a pod
would have, against stand-in libraries built here with gcc (only a p5 image holds the real
aws-ofi-nccl). The /fsx checks read the real /proc/self/mountinfo and write real files; where a
test needs a "lustre" mount it gives the check mountinfo text naming one (no Lustre here), or
points the check at a real mount (/dev/shm, tmpfs) with the expected type set to tmpfs.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from support import requires_root, requires_tool, skip_or_fail

from training import exits
from training.startup_check import (
    FSX_PROBE_DIR,
    NetPlugin,
    Report,
    check,
    check_fsx,
    mount_at,
    termination_message,
)

OFI = NetPlugin(library="libnccl-net-ofi.so", symbol="ncclNetPlugin_v9", detail="in /opt")
P5 = dict(
    expect_device="cuda",
    nproc_per_node="8",
    require_efa=True,
    cuda_available=True,
    device_count=8,
    torch_version="2.13.0",
    cuda_version="13.0",
    nccl_version="2.28.9",
    driver="580.95.05",
    efa="efa",
    fi_info=True,
    net_plugin=OFI,
    node="ip-10-0-1-7.ec2.internal",
)


def test_p5_fits() -> None:
    report = check(**P5)
    assert report.problems == [] and report.node_problems == []
    assert report.code == exits.OK
    assert report.facts["nccl_net_plugin"].startswith("libnccl-net-ofi.so (ncclNetPlugin_v9")


# field: (change, this node's own?)
MISFITS = {
    "cuda": ({"cuda_available": False}, True),
    "NPROC_PER_NODE": ({"device_count": 4}, True),
    "driver": ({"driver": "570.1"}, True),
    "efa": ({"efa": None}, True),
    "nccl": ({"nccl_version": None}, False),
    "nccl_net_plugin": ({"net_plugin": NetPlugin(library=None, symbol=None, detail="x")}, False),
}


@pytest.mark.parametrize("field", list(MISFITS))
def test_each_misfit_names_its_field_and_whose_it_is(field: str) -> None:
    """A node's own misfit (exits.NODE_UNFIT: a replacement pod may run elsewhere) names the
    node; the image's (exits.ENVIRONMENT: every node would meet it) fails the Job."""
    change, node_own = MISFITS[field]
    report = check(**{**P5, **change})
    (problem,) = report.problems + report.node_problems
    assert problem.startswith(field + ":"), problem
    if node_own:
        assert report.node_problems and report.code == exits.NODE_UNFIT
        assert P5["node"] in problem
    else:
        assert report.problems and report.code == exits.ENVIRONMENT


def test_image_misfits_win_over_node_misfits() -> None:
    report = check(**{**P5, "nccl_version": None, "device_count": 4})
    assert report.problems and report.node_problems
    assert report.code == exits.ENVIRONMENT


def test_a_cpu_torch_is_the_images_fault_and_no_fi_info_too() -> None:
    report = check(**{**P5, "cuda_version": None, "cuda_available": False})
    assert report.code == exits.ENVIRONMENT and report.problems[0].startswith("cuda:")
    report = check(**{**P5, "fi_info": False, "efa": None})
    assert report.code == exits.ENVIRONMENT and report.problems[0].startswith("efa:")


def test_single_node_runs_report_efa_and_the_plugin_without_requiring_them() -> None:
    none = NetPlugin(library=None, symbol=None, detail="libnccl-net.so: not found")
    report = check(**{**P5, "require_efa": False, "efa": None, "net_plugin": none})
    assert report.code == exits.OK
    assert report.facts["nccl_net_plugin"] == "none (libnccl-net.so: not found)"


def test_bad_nproc() -> None:
    (problem,) = check(**{**P5, "nproc_per_node": "eight"}).problems
    assert problem.startswith("NPROC_PER_NODE:")


# --- the NCCL net plugin, found by the real dynamic loader ---------------------------------------

needs_gcc = requires_tool("gcc")


def _library(directory: Path, name: str, source: str) -> Path:
    c = directory / f"{name}.c"
    c.write_text(source)
    out = directory / name
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(out), str(c)], check=True, timeout=60)
    return out


def _find_plugin(env: dict[str, str]) -> dict:
    """nccl_net_plugin in a fresh process (the loader reads LD_LIBRARY_PATH at start)."""
    code = (
        "import dataclasses, json, os\n"
        "from training.startup_check import nccl_net_plugin\n"
        "print(json.dumps(dataclasses.asdict(nccl_net_plugin(os.environ))))\n"
    )
    base = {k: v for k, v in os.environ.items() if k not in ("NCCL_NET_PLUGIN", "LD_LIBRARY_PATH")}
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


@needs_gcc
def test_nccl_would_load_the_plugin_that_ld_library_path_and_nccl_net_plugin_name(
    tmp_path: Path,
) -> None:
    """The image sets NCCL_NET_PLUGIN=ofi and puts aws-ofi-nccl's directory on
    LD_LIBRARY_PATH (training/Dockerfile): NCCL then dlopens libnccl-net-ofi.so."""
    lib_dir = tmp_path / "ofi-nccl" / "lib"
    lib_dir.mkdir(parents=True)
    _library(lib_dir, "libnccl-net-ofi.so", "int ncclNetPlugin_v9 = 0;\n")
    found = _find_plugin({"NCCL_NET_PLUGIN": "ofi", "LD_LIBRARY_PATH": str(lib_dir)})
    assert found == {
        "library": "libnccl-net-ofi.so",
        "symbol": "ncclNetPlugin_v9",
        "detail": f"in {lib_dir}",
    }
    # A full path in NCCL_NET_PLUGIN is tried as it is, first.
    full = str(lib_dir / "libnccl-net-ofi.so")
    assert _find_plugin({"NCCL_NET_PLUGIN": full})["symbol"] == "ncclNetPlugin_v9"
    # Without LD_LIBRARY_PATH the loader does not find it: NCCL would use its own sockets.
    missing = _find_plugin({"NCCL_NET_PLUGIN": "ofi"})
    assert missing["library"] is None and "libnccl-net-ofi.so" in missing["detail"]
    # Unset, NCCL looks for libnccl-net.so only.
    assert _find_plugin({"LD_LIBRARY_PATH": str(lib_dir)})["library"] is None


@needs_gcc
def test_a_library_without_a_plugin_struct_is_no_plugin(tmp_path: Path) -> None:
    _library(tmp_path, "libnccl-net-ofi.so", "int unrelated = 0;\n")
    found = _find_plugin({"NCCL_NET_PLUGIN": "ofi", "LD_LIBRARY_PATH": str(tmp_path)})
    assert found["library"] == "libnccl-net-ofi.so" and found["symbol"] is None
    plugin = NetPlugin(**found)
    report = check(**{**P5, "net_plugin": plugin})
    assert report.code == exits.ENVIRONMENT
    assert report.problems[0].startswith("nccl_net_plugin:")


# --- /fsx ----------------------------------------------------------------------------------------

MOUNTINFO = (
    "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
    "31 22 0:40 / /fsx rw,relatime shared:9 master:3 - lustre 10.0.1.5@tcp:/abcdefgh rw,flock\n"
    "32 22 0:41 / /data\\040set rw - tmpfs tmpfs rw\n"
)


def test_mountinfo_parsing() -> None:
    fsx = mount_at("/fsx", MOUNTINFO)
    assert fsx is not None and fsx.fstype == "lustre" and fsx.source == "10.0.1.5@tcp:/abcdefgh"
    assert "rw" in fsx.options and "flock" in fsx.options
    assert mount_at("/data set", MOUNTINFO).fstype == "tmpfs"  # octal escapes
    assert mount_at("/fsx/", MOUNTINFO) == fsx
    assert mount_at("/fsx/runs", MOUNTINFO) is None  # a directory below is no mount point
    later = MOUNTINFO + "40 31 0:50 / /fsx ro - ext4 /dev/vdb ro\n"
    assert mount_at("/fsx", later).fstype == "ext4"  # the last mount covers the others
    real = mount_at("/", Path("/proc/self/mountinfo").read_text())
    assert real is not None and real.fstype


def _fsx(tmp_path: Path, *, fstype: str = "lustre", options: str = "rw", **kwargs) -> Report:
    report = Report()
    info = f"31 22 0:40 / {tmp_path} {options} - {fstype} 10.0.1.5@tcp:/abcdefgh rw\n"
    check_fsx(
        report=report,
        mount_point=str(tmp_path),
        expected_fstype="lustre",
        node="node-a",
        mountinfo=kwargs.pop("mountinfo", info),
        **kwargs,
    )
    return report


def test_a_lustre_mount_that_takes_a_write_passes(tmp_path: Path) -> None:
    report = _fsx(tmp_path)
    assert report.code == exits.OK, report
    assert report.facts["fsx"] == {"fstype": "lustre", "source": "10.0.1.5@tcp:/abcdefgh"}
    assert list((tmp_path / FSX_PROBE_DIR).iterdir()) == []  # the probe file is gone


def test_not_a_mount_the_wrong_file_system_or_read_only_fails_the_job(tmp_path: Path) -> None:
    real = Path("/proc/self/mountinfo").read_text()
    (problem,) = _fsx(tmp_path, mountinfo=real).problems
    assert problem == (
        f"fsx: {tmp_path} is not a mount point; mount the FSx for Lustre claim there "
        "(the Job's fsx volume, fsx.csi.aws.com)"
    )
    (problem,) = _fsx(tmp_path, fstype="ext4").problems
    assert f"fsx: {tmp_path} is a ext4 mount of 10.0.1.5@tcp:/abcdefgh, not lustre" in problem
    (problem,) = _fsx(tmp_path, options="ro,relatime").problems
    assert "read-only" in problem


def _failing(code: int):
    def probe(_path: Path) -> None:
        raise OSError(code, os.strerror(code))

    return probe


def test_a_write_error_is_the_nodes_unless_the_file_system_is_full_or_forbidden(
    tmp_path: Path,
) -> None:
    """The write fails at the file-system boundary (an injected OSError: Lustre cannot be
    made to fail here): EIO and the like are this node's client; ENOSPC, EDQUOT, EROFS,
    EACCES, EPERM are the file system's, met by every node."""
    for code in (errno.EIO, errno.ESHUTDOWN, errno.ENOTCONN):
        report = _fsx(tmp_path, probe=_failing(code))
        (problem,) = report.node_problems
        assert report.code == exits.NODE_UNFIT and "node node-a" in problem
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EACCES):
        report = _fsx(tmp_path, probe=_failing(code))
        assert report.code == exits.ENVIRONMENT, code


def test_a_write_that_never_returns_is_the_nodes(tmp_path: Path) -> None:
    """The node's probe file is a FIFO: opening it for writing blocks in the kernel (as a
    create does on a Lustre client cut off from its servers) and the check still answers."""
    (tmp_path / FSX_PROBE_DIR).mkdir()
    os.mkfifo(tmp_path / FSX_PROBE_DIR / "node-a")
    report = _fsx(tmp_path, timeout_s=0.5)
    (problem,) = report.node_problems
    assert report.code == exits.NODE_UNFIT
    assert problem.startswith("fsx: a write to") and "did not finish in 0.5 s on node node-a" in (
        problem
    )


def test_the_termination_message_names_the_node_and_stays_within_the_limit() -> None:
    report = check(**{**P5, "device_count": 4})
    text = termination_message(report)
    assert text.splitlines()[0] == (
        f"startup_check: node {P5['node']} does not fit; a replacement pod may run elsewhere"
    )
    report.node_problems.extend(["x" * 1000] * 10)
    assert len(termination_message(report).encode()) <= 4096


# --- the module, as the pod runs it --------------------------------------------------------------


def _run(env_extra: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "training.startup_check", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_cpu_mode_passes_here() -> None:
    out = _run({"NPROC_PER_NODE": "2"}, "--expect-device", "cpu")
    assert out.returncode == exits.OK, out.stderr
    facts = json.loads(out.stdout)["startup_check"]
    assert facts["nproc_per_node"] == "2" and facts["torch"].startswith("2.13.0")
    assert facts["nccl_net_plugin"] == "not applicable (cpu)"
    assert "fsx" not in facts  # a local run has no FSX_MOUNT


def test_cuda_expected_on_cpu_machine_fails_with_environment_code(tmp_path: Path) -> None:
    message = tmp_path / "termination-log"
    out = _run(
        {
            "NPROC_PER_NODE": "8",
            "EXPECT_DEVICE": "cuda",
            "NODE_NAME": "node-x",
            "TERMINATION_MESSAGE_PATH": str(message),
        }
    )
    assert out.returncode == exits.ENVIRONMENT
    assert "startup_check: cuda:" in out.stderr
    assert message.read_text().startswith(
        "startup_check: this job does not fit node node-x, nor would it fit any other"
    )


def test_a_stuck_fsx_client_exits_node_unfit_naming_the_node(tmp_path: Path) -> None:
    """The module end to end on a real mount (/dev/shm, tmpfs, with FSX_FSTYPE=tmpfs) whose
    probe file for this node is a FIFO: exit NODE_UNFIT and a termination message naming the
    node. /fsx itself (FSX_MOUNT unset) is checked in tests/pods."""
    shm = Path("/dev/shm")
    if mount_at(str(shm), Path("/proc/self/mountinfo").read_text()) is None:
        skip_or_fail("/dev/shm is not a mount point here (mount -t tmpfs tmpfs /dev/shm)")
    node = f"node-{uuid.uuid4().hex[:8]}"
    fifo = shm / FSX_PROBE_DIR / node
    fifo.parent.mkdir(exist_ok=True)
    os.mkfifo(fifo)
    message = tmp_path / "termination-log"
    try:
        out = _run(
            {
                "FSX_MOUNT": str(shm),
                "FSX_FSTYPE": "tmpfs",
                "FSX_PROBE_TIMEOUT_S": "1",
                "NODE_NAME": node,
                "TERMINATION_MESSAGE_PATH": str(message),
            },
            "--expect-device=cpu",
        )
    finally:
        fifo.unlink()
        with contextlib.suppress(OSError):
            fifo.parent.rmdir()  # empty unless another run is using it
    assert out.returncode == exits.NODE_UNFIT, out.stderr
    assert f"did not finish in 1 s on node {node}" in out.stderr
    text = message.read_text()
    assert text.startswith(f"startup_check: node {node} does not fit")
    assert "fsx: a write to" in text
    # The same mount with the Job's expected type: every node would meet it, exit ENVIRONMENT.
    out = _run(
        {"FSX_MOUNT": str(shm), "FSX_FSTYPE": "lustre", "NODE_NAME": node},
        "--expect-device=cpu",
    )
    assert out.returncode == exits.ENVIRONMENT
    assert f"startup_check: fsx: {shm} is a tmpfs mount" in out.stderr


def test_fsx_mount_without_its_type_is_a_job_setting_error(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "FSX_FSTYPE"}
    out = subprocess.run(
        [sys.executable, "-m", "training.startup_check", "--expect-device=cpu"],
        env={**env, "FSX_MOUNT": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == exits.ENVIRONMENT
    assert "startup_check: FSX_FSTYPE: not set beside FSX_MOUNT" in out.stderr


def test_pod_memory_too_small_for_the_snapshots_names_the_field_and_the_fix(
    tmp_path: Path,
) -> None:
    from training.startup_check import Report, check_pod_memory

    size = os.statvfs(tmp_path).f_blocks * os.statvfs(tmp_path).f_frsize
    fits = Report()
    check_pod_memory(
        report=fits, directory=tmp_path / "snapshots", needed=1 << 20, memory_max="max"
    )
    assert fits.problems == [] and fits.facts["pod_memory"]["tmpfs_size"] == size
    short = Report()
    check_pod_memory(report=short, directory=tmp_path, needed=size + 1, memory_max=str(1 << 20))
    assert len(short.problems) == 2 and short.code == exits.ENVIRONMENT
    assert all(p.startswith("checkpoint.pod_memory_dir:") for p in short.problems)
    assert all("NodeType.shm in facts/hardware.py" in p for p in short.problems)


@requires_root("mounting a tmpfs in a private mount namespace")
@requires_tool("unshare")
def test_pod_memory_compares_the_snapshots_with_the_free_space_of_the_tmpfs() -> None:
    """A 16 MiB tmpfs (mounted in a private mount namespace) of which 12 MiB are taken by
    another file: 8 MiB of snapshots fit its size, not its 4 MiB free, which the check names
    as this pod's problem (a replacement pod starts with an empty emptyDir). This run's own
    files from a previous container count as free: they are reused in place."""
    script = textwrap.dedent(
        """
        import json, sys
        from pathlib import Path
        from training.startup_check import Report, check_pod_memory
        shm = Path(sys.argv[1])
        (shm / "other").write_bytes(b"x" * (12 << 20))
        short = Report()
        check_pod_memory(report=short, directory=shm / "snapshots", needed=8 << 20,
                         memory_max="max")
        (shm / "snapshots").mkdir()
        (shm / "snapshots" / "previous").write_bytes(b"x" * (3 << 20))
        reused = Report()
        check_pod_memory(report=reused, directory=shm / "snapshots", needed=3 << 20,
                         memory_max="max")
        print(json.dumps([short.problems, short.node_problems, reused.node_problems]))
        """
    )
    mount_point = Path(f"/tmp/startup-tmpfs-{os.getpid()}")
    mount_point.mkdir()
    try:
        out = subprocess.run(
            [
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                'mount -t tmpfs -o size=16m tmpfs "$1" && exec "$2" -c "$3" "$1"',
                "sh",
                str(mount_point),
                sys.executable,
                script,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=Path(__file__).resolve().parents[2],
        )
    finally:
        mount_point.rmdir()
    assert out.returncode == 0, out.stderr
    problems, node_problems, reused = json.loads(out.stdout.splitlines()[-1])
    assert problems == [] and reused == []
    [problem] = node_problems
    assert problem.startswith("checkpoint.pod_memory_dir: ")
    assert "has 4.0 MiB free of 16.0 MiB (12.0 MiB in other files)" in problem, problem
    assert "need 8.0 MiB per node; a replacement pod starts with an empty one" in problem
