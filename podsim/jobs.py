"""Whole pod-emulation scenarios and what to read back from them: the tests (tests/pods) and
the node-loss benchmark (bench/node_loss.py) run these same ones.

Every run trains the same 12 steps of the same model at world size 2 (one pod of 2 ranks, or two
pods of 1), so every final state, faults or not, must equal the fault-free 2-pod reference
bit for bit. Only CPU sizes change, through values the manifests read: NPROC_PER_NODE, RECIPE
and NNODES from the environment, a tiny model, a short run and short timeouts as trainer
overrides in the args.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from infra.fencer.controller import Fencer
from infra.fencer.decide import FencePolicy
from infra.fencer.ec2 import Ec2
from infra.fencer.settings import FENCER
from manifests import render
from podsim import cluster as emulator
from podsim import ec2 as ec2_stand_in
from podsim import kube_api
from podsim import state as state_
from podsim.control_plane import EKS, EKS_DEFAULT_REPAIR_WAIT_S, SCALE, ControlPlane
from podsim.model import TINY_MODEL

STEPS = 12
TWO_NODES = "2node"
FAST = [
    *TINY_MODEL,
    # debug_cpu's own head counts, spelled out: the renderer validates the args against each
    # overlay's GPU recipe too, and 64 / 64 heads (p5_70b) would leave an odd head dim.
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    f"--train.steps={STEPS}",
    "--train.log_every=1",
    "--checkpoint.interval=4",
    "--resilience.heartbeat_timeout_s=8",
    "--resilience.initial_heartbeat_timeout_s=120",
    "--resilience.step_section_timeout_s=8",
    "--resilience.checkpoint_section_timeout_s=60",
    "--resilience.soft_timeout_s=6",
    "--resilience.hard_timeout_s=20",
    "--resilience.join_timeout_s=120",
    "--resilience.stop_timeout_s=3",
    "--resilience.max_restarts=4",
    "--parallel.pg_timeout_s=30",
]
ONE_POD = {"RECIPE": "debug_cpu", "NPROC_PER_NODE": "2", "NNODES": "1"}
TWO_PODS = {"RECIPE": "debug_cpu", "NPROC_PER_NODE": "1"}


def objects(overlay: str, *, restart: str, train_args: list[str]):
    shared = render.shared_objects(namespace="training", image="img", **render.PLACEHOLDER_FSX)
    _, job = render.job_objects(
        overlay=overlay, namespace="training", image="img", restart=restart, train_args=train_args
    )
    config_map = next(o for o in shared if o["kind"] == "ConfigMap")
    return shared, job, config_map


_PREPARED: list[Path] = []
"""The corpus this process prepared first (`prepare_data`): the later runs copy it."""


def prepare_data(root: Path) -> None:
    """A small corpus where an earlier Job's init container left it; the init container's own
    script then runs in every pod and finds it (`data ready`). `training prepare` runs once per
    process (it imports torch and tokenizes; the same stdlib gives the same shards): every
    later run gets a copy of that first corpus."""
    out = root / "fsx" / "data" / "stdlib"
    if _PREPARED and (_PREPARED[0] / "meta.json").exists():
        shutil.copytree(_PREPARED[0], out)
        return
    cache = Path(tempfile.mkdtemp(prefix="podsim-corpus-")) / "stdlib"
    atexit.register(shutil.rmtree, cache.parent, ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "training", "prepare", "--stdlib", "--max-mb", "1", "--out", cache],
        check=True,
        capture_output=True,
        timeout=120,
    )
    _PREPARED[:] = [cache]
    shutil.copytree(cache, out)


def final_state(root: Path, job: dict) -> dict:
    """The newest committed checkpoint on the emulated FSx, as one flat dict."""
    name = job["metadata"]["name"]
    return state_.final_state(
        run_dir(root, job), checkpoint_root=root / "fsx" / "checkpoints" / name
    )


def assert_identical(state: dict, reference: dict) -> None:
    state_.assert_identical(state, reference, steps=STEPS)


def run_dir(root: Path, job: dict) -> Path:
    return root / "fsx" / "runs" / job["metadata"]["name"]


def metrics(root: Path, job: dict) -> list[dict]:
    """Rank 0's step records so far (a line being appended right now is left for later)."""
    path = run_dir(root, job) / "metrics.jsonl"
    if not path.exists():
        return []
    return [
        json.loads(line)
        for line in path.read_text().splitlines(keepends=True)
        if line.endswith("\n") and line.strip()
    ]


def events(root: Path, job: dict) -> list[dict]:
    path = run_dir(root, job) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def logs(root: Path) -> str:
    logs = sorted(root.glob("*.log"))
    return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-4000:] for p in logs)


def run(
    root: Path,
    overlay: str,
    *,
    restart: str,
    env: dict[str, str],
    nodes: int | None = None,
    extra: tuple[str, ...] = (),
    when_step: tuple[int, Callable[[emulator.Cluster], None]] | None = None,
    delete: threading.Event | None = None,
    mutate_job: Callable[[dict], None] | None = None,
    timeout_s: float = 300,
    expect_lustre: bool = False,
    control_plane: Callable[[emulator.Cluster, list[dict]], ControlPlane] | None = None,
    after: Callable[[emulator.Cluster], None] | None = None,
):
    """One emulated Job on a fresh cluster under `root`; `when_step=(k, act)` calls act(cluster)
    once rank 0 has logged step k. The emulated /fsx is a bind mount of a local directory, not
    Lustre: the pods' start-up check is told to expect that directory's file system type
    (FSX_FSTYPE, found by findmnt) unless `expect_lustre` keeps the Job's own `lustre`.
    `control_plane(cluster, spare_objects)` builds the emulated control plane that places the
    pods on nodes; `after(cluster)` runs once the Job has ended, before the teardown."""
    with emulator.cluster(root) as pods, contextlib.ExitStack() as stack:
        if not (root / "fsx" / "data" / "stdlib" / "meta.json").exists():
            prepare_data(root)
        if not expect_lustre:
            env = {"FSX_FSTYPE": fstype(root / "fsx"), **env}
        shared, job, config_map = objects(overlay, restart=restart, train_args=[*FAST, *extra])
        if nodes is not None:
            job = emulator.scaled(job, nodes=nodes)
        if mutate_job is not None:
            mutate_job(job)
        pods.start_store(shared=shared)
        plane = None
        if control_plane is not None:
            spares = render.spare_objects(overlay=overlay, namespace="training", image="img")
            plane = control_plane(pods, spares)
            # The API a pod may call (a cordon), on the bridge's own address.
            pods.api = stack.enter_context(
                kube_api.serve(
                    root,
                    ip=f"{emulator.SUBNET}.1",
                    on_cordon=plane.cordon,
                    spare_nodes=plane.spare_nodes,
                    spare_labels=next(o for o in spares if o["kind"] == "Deployment")["spec"][
                        "template"
                    ]["metadata"]["labels"],
                )
            )
        watcher = None
        if when_step is not None:
            step, act = when_step

            def watch() -> None:
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline:
                    if any(m["step"] >= step for m in metrics(root, job)):
                        act(pods)
                        return
                    time.sleep(0.05)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
        result = emulator.run_job(
            pods,
            job=job,
            config_map=config_map,
            job_uid=emulator.new_job_uid(),
            env_overrides=env,
            timeout_s=timeout_s,
            delete=delete,
            control_plane=plane,
        )
        if watcher is not None:
            watcher.join(timeout=5)
        if after is not None:
            after(pods)
    return result, job


def fstype(path: Path) -> str:
    """The type of the file system holding `path` (util-linux findmnt, not the check's own
    mountinfo parser)."""
    out = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "--target", str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return out.stdout.strip()


def recovery_s(root: Path, job: dict, *, fault_time: float) -> float:
    """From the fault to the start of the first step trained after it."""
    after = [m for m in metrics(root, job) if m["time"] - m["step_time_s"] > fault_time]
    assert after, "no step after the fault"
    first = min(after, key=lambda m: m["time"])
    return first["time"] - first["step_time_s"] - fault_time


def two_node_plane(
    pods: emulator.Cluster, spare_objects: list[dict], *, spares: int, root: Path
) -> ControlPlane:
    """The emulated control plane of the 2-node overlay: two nodes, `spares` spares holding the
    rendered placeholder, EKS's timers at 1/SCALE."""
    return ControlPlane(
        pods,
        nodes=2,
        spares=spares,
        spare_command=spare_command(spare_objects),
        times=EKS.scaled(SCALE),
        root=root,
    )


def spare_command(spare_objects: list[dict]) -> list[str]:
    (deployment,) = [o for o in spare_objects if o["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["command"]


def node_loss_run(
    root: Path, *, restart: str, spares: int, after=None, extra: tuple[str, ...] = ()
):
    """The 2-node Job on the emulated control plane with `spares` spare nodes; pod 1's node is
    lost at step 6. Returns the Job's result, the Job, the control plane and the fault time."""
    state: dict = {}

    def plane(pods: emulator.Cluster, spare_objects: list[dict]) -> ControlPlane:
        state["plane"] = two_node_plane(pods, spare_objects, spares=spares, root=root)
        return state["plane"]

    def lose(_: emulator.Cluster) -> None:
        state["time"] = time.time()
        state["node"] = state["plane"].lose(1)

    result, job = run(
        root,
        TWO_NODES,
        restart=restart,
        env=TWO_PODS,
        when_step=(6, lose),
        control_plane=plane,
        after=(lambda pods: after(state, pods)) if after is not None else None,
        extra=extra,
    )
    return result, job, state


@contextlib.contextmanager
def fenced_control_plane(root: Path, *, nodes: int, times, state: dict, **fencer_args: Any):
    """The node fencer (infra/fencer, its own code) over the emulated cluster: EC2 is moto in
    server mode behind the front that tells the cloud what was terminated; the fencer
    reconciles on a thread of its own at its shipped poll, its wait scaled by SCALE, paced by
    the overlay's one spare. Yields (ec2, plane, halt): ``plane`` is the ``control_plane`` for
    :func:`run` (it fills ``state``: plane, cloud, fencer, loop), ``halt()`` ends the loop.
    ``fencer_args``: the rest of :class:`Fencer`'s arguments (the unfit label, namespaces)."""
    if (missing := ec2_stand_in.moto_reason()) is not None:
        raise RuntimeError(missing)
    root.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        moto = stack.enter_context(ec2_stand_in.moto_server(root))
        endpoint = stack.enter_context(
            ec2_stand_in.ec2_front(moto, on_terminate=lambda ids: state["cloud"].terminated(ids))
        )
        stack.enter_context(ec2_stand_in.aws_environment(endpoint))
        ec2 = Ec2(region=os.environ["AWS_REGION"])

        def plane(pods: emulator.Cluster, spare_objects: list[dict]) -> ControlPlane:
            state["plane"] = p = ControlPlane(
                pods,
                nodes=nodes,
                spares=1,
                spare_command=spare_command(spare_objects),
                times=times,
                root=root,
            )
            state["cloud"] = cloud = ec2_stand_in.Cloud(plane=p, ec2=ec2)
            state["fencer"] = fencer = Fencer(
                nodes=ec2_stand_in.NodeApi(plane=p, cloud=cloud),
                ec2=ec2,
                policy=FencePolicy(
                    wait_s=FENCER.wait_s * SCALE,
                    max_in_flight=1,  # the overlay's one spare
                    max_bad_fraction=FENCER.max_bad_fraction,
                ),
                label_selector=ec2_stand_in.SELECTOR,
                **fencer_args,
            )

            def loop() -> None:
                while not stop.wait(FENCER.poll_s * SCALE):
                    fencer.reconcile()

            state["loop"] = threading.Thread(target=loop, daemon=True)
            state["loop"].start()
            return p

        def halt() -> None:
            stop.set()
            if "loop" in state:
                state["loop"].join(timeout=10)

        try:
            yield ec2, plane, halt
        finally:
            stop.set()


def fenced_node_loss_run(tmp_path: Path, *, restart: str = "injob"):
    """The 2-node Job with one spare; pod 1's node lost at step 6 and fenced by the node fencer
    (infra/fencer) through the EC2 stand-in; EKS repair at its default 30-minute wait. After
    the Job, the fenced node is thawed (`state["thawed"]`: the pids SIGCONT reached,
    `state["log_grew"]`: bytes its old pod's log grew). Returns (result, job, state, times)."""
    times = replace(EKS, repair_wait_s=EKS_DEFAULT_REPAIR_WAIT_S).scaled(SCALE)
    state: dict = {}
    with fenced_control_plane(tmp_path, nodes=2, times=times, state=state) as (_, plane, halt):

        def lose(_: emulator.Cluster) -> None:
            state["time"] = time.time()
            state["node"] = state["plane"].lose(1)

        def thaw(pods: emulator.Cluster) -> None:
            halt()
            node = state["node"]
            log = tmp_path / f"{job['metadata']['name']}-1-0.log"
            before = log.stat().st_size
            pods.set_link(node, up=True)
            state["thawed"] = pods.signal_netns(node.netns, signal.SIGCONT)
            time.sleep(2)
            state["log_grew"] = log.stat().st_size - before

        _, job, _ = objects(TWO_NODES, restart=restart, train_args=[*FAST])
        result, job = run(
            tmp_path,
            TWO_NODES,
            restart=restart,
            env=TWO_PODS,
            when_step=(6, lose),
            control_plane=plane,
            after=thaw,
        )
    return result, job, state, times
