"""The EKS Job's exact trainer command, run in emulated pods (see podsim/cluster.py).

Run: sudo .venv/bin/pytest tests/pods -s   (root: network and mount namespaces; CI is root;
about 20 minutes on 2 cores, the node-loss tests 3-4 minutes each; `-s` prints each fault's
measured recovery time and the emulated control plane's timeline)

Emulated, because they cannot exist here: the API server and Job controller (emulator.run_job
follows their documented behaviour), the GPU and EFA. Only CPU sizes change, through values the
manifests read: NPROC_PER_NODE, RECIPE and NNODES from the environment, a tiny model, a short
run and short timeouts as trainer overrides in the args.

Every run trains the same 12 steps of the same model at world size 2 (one pod of 2 ranks, or two
pods of 1), so every final state, faults or not, must equal the fault-free 2-pod reference
bit for bit: model and optimizer, `torch.equal` per tensor.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from support import missing_tools, prometheus_server

from infra.fencer.settings import FENCER
from manifests import render, sizes
from podsim import cluster as emulator
from podsim import ec2 as ec2_stand_in
from podsim import jobs
from podsim.control_plane import EKS, SCALE, ControlPlane
from podsim.jobs import FAST, ONE_POD, STEPS, TWO_NODES, TWO_PODS
from podsim.slow_node import SlowNode, slow_node_reason
from training import exits, startup_check
from training.checkpoint.layout import committed_steps
from training.observe.catalog import METRICS_PORT, METRICS_PORT_NAME

reason = emulator.can_run()
pytestmark = [
    pytest.mark.distributed,
    pytest.mark.requires(reason=reason),
    pytest.mark.timeout(600),
]

STRAGGLER_EVERY = 3
STRAGGLER_POLICY = (
    f"--straggler.report_every={STRAGGLER_EVERY}",
    "--straggler.reports=2",
    # Above the slowed node's scores (0.03-0.13); a fault-free report on a loaded 2-core
    # machine dips below it at times (0.09 once, in steps 1-3) but never twice in a row here.
    "--straggler.threshold=0.3",
    "--straggler.evict=true",
)
"""The slow-node test's policy (a report every 3 steps, a node evicted after 2 slow ones);
the fault-free reference runs with it too, and must evict nothing."""
SLOW_NODE_TIMEOUTS = ("--resilience.soft_timeout_s=30", "--resilience.hard_timeout_s=60")
"""The in-process layer's hang timeouts for a node at a tenth of its speed: its work between
heartbeats (the checkpoint writer's shutdown after the eviction) runs 10x longer, beyond the
6 s soft timeout of the other runs, which would read it as a hang."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fault-free run: the 2-node overlay's Job on two emulated pods, with the straggler
    policy of the slow-node test on: no node is evicted, and every report names both."""
    root = tmp_path_factory.mktemp("reference")
    result, job = jobs.run(root, TWO_NODES, restart="injob", env=TWO_PODS, extra=STRAGGLER_POLICY)
    assert result.status == "Complete", jobs.logs(root)
    assert result.exit_codes == {0: [0], 1: [0]}
    events = jobs.events(root, job)
    reports = [e for e in events if e["kind"] == "straggler_report"]
    print("\n[fault-free] straggler scores by step:", {e["step"]: e["nodes"] for e in reports})
    # (A restart under load repeats some reports.)
    assert {e["step"] for e in reports} == set(range(STRAGGLER_EVERY, STEPS + 1, STRAGGLER_EVERY))
    assert all(len(e["nodes"]) == 2 for e in reports), reports
    assert not [e for e in events if e["kind"] == "straggler_eviction"], reports
    return jobs.final_state(root, job)


PROMETHEUS_REASON = missing_tools("prometheus")

# Runs of this list that another test's run already makes end to end (the same overlay, mode,
# env and node count, trained to the end and checked against the reference there): one pod run
# each, asserting both tests' behaviours. The scrape test needs Prometheus: without it, its
# run stays here.
RUN_ELSEWHERE = {
    ("smoke", "nested"): "test_a_bad_node_is_replaced_and_named (its replacement pod)",
    **(
        {}
        if PROMETHEUS_REASON
        else {("smoke", "injob"): "test_prometheus_scrapes_the_pod_and_reads_its_final_state"}
    ),
}

# Every restart mode on the smoke overlay, and every other overlay in its own default mode:
# the mode's launcher flags are derived by one function from the run's config
# (training/command.py), so the full overlay x mode product (9 pod runs, ~4 min of CI)
# would run that derivation again, while each overlay's own rendered command and each mode's
# launcher still run here once. The 2-node overlay's Job in its own mode (nested) runs in the
# two-pod tests below (nested-* faults, the nested node loss): not again on one pod here.
OVERLAY_MODES = [
    *(("smoke", mode) for mode in sizes.RESTART_MODES),
    *(
        (name, size.restart)
        for name, size in sizes.SIZES.items()
        if name not in ("smoke", TWO_NODES)
    ),
]
"""Every (overlay, mode) that trains on one pod to the reference's end (`_trained_on_one_pod`):
here, or in the run RUN_ELSEWHERE names."""


def _trained_on_one_pod(result: emulator.JobResult, job: dict, root: Path, reference: dict) -> None:
    """What every one-pod run of OVERLAY_MODES must show: the pod completed, its run ended and
    its final state is the fault-free reference's, bit for bit."""
    assert result.status == "Complete", f"{result}\n{jobs.logs(root)}"
    assert any(e["kind"] == "run_end" for e in jobs.events(root, job))
    jobs.assert_identical(jobs.final_state(root, job), reference)


@pytest.mark.parametrize(
    ("overlay", "restart"), [m for m in OVERLAY_MODES if m not in RUN_ELSEWHERE]
)
def test_every_overlay_and_every_mode_trains_on_one_pod(
    tmp_path: Path, reference: dict, overlay: str, restart: str
) -> None:
    result, job = jobs.run(tmp_path, overlay, restart=restart, env=ONE_POD, nodes=1)
    assert result.exit_codes == {0: [0]}, f"{result}\n{jobs.logs(tmp_path)}"
    _trained_on_one_pod(result, job, tmp_path, reference)


def _query(port: int, promql: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())["data"]["result"]


@pytest.mark.requires(reason=PROMETHEUS_REASON)
def test_prometheus_scrapes_the_pod_and_reads_its_final_state(
    tmp_path: Path, reference: dict
) -> None:
    """A real Prometheus (Debian's `prometheus`) scrapes the metrics exporter of the emulated
    trainer pod through the pod's IP and the container's named port, as the stack's scraper
    does; the run's final state (not active, every step) reaches it before the pod goes away.
    The run is the smoke overlay's Job in injob mode on one pod: OVERLAY_MODES' (smoke, injob)
    run too (RUN_ELSEWHERE), its final state the reference's.

    Emulated: the API server (the target is the pod's IP, given statically, instead of pod
    discovery: tests/infra/test_infra_observability.py runs the scraper's relabeling), AMP's
    managed scraper (a plain Prometheus), the GPU and EFA."""
    pod_ip = f"{emulator.SUBNET}.10"  # completion index 0 (emulator.add_pod_slot)
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {"job_name": "trainer", "static_configs": [{"targets": [f"{pod_ip}:{METRICS_PORT}"]}]}
        ],
    }
    (tmp_path / "prometheus.yml").write_text(json.dumps(config))
    with prometheus_server(tmp_path / "prometheus.yml", data_dir=tmp_path / "prometheus") as port:
        root = tmp_path / "cluster"
        result, job = jobs.run(root, "smoke", restart="injob", env=ONE_POD, nodes=1)
        assert result.exit_codes == {0: [0]}, f"{result}\n{jobs.logs(root)}"
        (container,) = job["spec"]["template"]["spec"]["containers"]
        assert {"name": METRICS_PORT_NAME, "containerPort": METRICS_PORT} in container["ports"]
        time.sleep(2)  # the newest samples reach the query engine
        steps = _query(port, 'max_over_time(training_steps_total{job="trainer"}[10m])')
        assert steps, f"prometheus never scraped the pod:\n{jobs.logs(root)}"
        assert float(steps[0]["value"][1]) == STEPS
        # The pod's exporter waited for one more scrape after the run ended: the run's final
        # state (not active, every step) reached Prometheus before the pod went away.
        active = _query(port, 'last_over_time(training_run_active{job="trainer"}[10m])')
        assert float(active[0]["value"][1]) == 0
        job_label = _query(port, "last_over_time(training_info[10m])")[0]["metric"]
        assert job_label["training_job"] == job["metadata"]["name"]
    _trained_on_one_pod(result, job, root, reference)


def _kill_pod(index: int, record: dict) -> Callable[[emulator.Cluster], None]:
    def act(pods: emulator.Cluster) -> None:
        record["time"] = time.time()
        pods.kill_pod(index)

    return act


# name: (restart mode, trainer faults, or a pod to kill at step 6). NPROC_PER_NODE=1: rank i
# is pod i. Nested mode (the EKS default) meets the faults only its in-job layer can mend.
# The SIGKILLed rank's replacement, in the same pod, restores from the pod's memory
# (POD_MEMORY_RESTORES: snapshots every step, at 5 and 6 here, step 4 being a checkpoint); the
# fault comes at step 7, so that the slot of step 5 is complete even if the kill cuts the
# publish of step 6 short (two slots: the previous snapshot stays whole).
# Pod 1 frozen (SIGSTOP on every process) and cut off, in injob and nested, is the lost-node
# test's fault below, so it is not repeated here as a frozen rank or a killed pod 1.
TWO_POD_FAULTS = {
    "injob-sigkill-rank": ("injob", "sigkill@1:7", None),
    "injob-kill-pod-0": ("injob", "", 0),
    "nested-sigstop-rank": ("nested", "sigstop@1:6", None),
    "nested-kill-pod-0": ("nested", "", 0),
}


POD_MEMORY_RESTORES = ("injob-sigkill-rank",)


@pytest.mark.parametrize("name", list(TWO_POD_FAULTS))
def test_two_pods_survive_the_loss_of_any_rank_or_pod(
    tmp_path: Path, reference: dict, name: str
) -> None:
    restart, faults, pod = TWO_POD_FAULTS[name]
    record: dict = {}
    result, job = jobs.run(
        tmp_path,
        TWO_NODES,
        restart=restart,
        env=TWO_PODS,
        extra=(
            *((f"--faults={faults}",) if faults else ()),
            *(("--checkpoint.memory_interval=1",) if name in POD_MEMORY_RESTORES else ()),
        ),
        when_step=(6, _kill_pod(pod, record)) if pod is not None else None,
    )
    assert result.status == "Complete", f"{result}\n{jobs.logs(tmp_path)}"
    if pod is not None:
        # The killed pod was replaced (exit 137, then a pod that completed); the other pod's
        # launcher restarted its workers and stayed.
        assert result.exit_codes[pod] == [137, 0], result.exit_codes
        assert result.exit_codes[1 - pod] == [0], result.exit_codes
        fault_time = record["time"]
    else:
        assert result.exit_codes == {0: [0], 1: [0]}, result.exit_codes
        (fired,) = [e for e in jobs.events(tmp_path, job) if e["kind"] == "fault"]
        fault_time = fired["time"]
    jobs.assert_identical(jobs.final_state(tmp_path, job), reference)
    steps = {m["step"] for m in jobs.metrics(tmp_path, job)}
    assert steps == set(range(1, STEPS + 1))
    if name in POD_MEMORY_RESTORES:
        # Every rank of the in-job restart loads the same snapshot from its pod's memory (the
        # Job's memory-backed /dev/shm), newer than the newest checkpoint on storage (step 4).
        loads = [
            e
            for e in jobs.events(tmp_path, job)
            if e["kind"] == "checkpoint_load" and e["time"] > fault_time
        ]
        assert {(e["rank"], e["source"]) for e in loads} == {(0, "pod_memory"), (1, "pod_memory")}
        assert len({e["step"] for e in loads}) == 1 and loads[0]["step"] in (5, 6), loads
    print(f"\n[pod recovery] {name}: {jobs.recovery_s(tmp_path, job, fault_time=fault_time):.1f} s")


def test_sigterm_to_every_pod_drains_then_a_resubmission_resumes(
    tmp_path: Path, reference: dict
) -> None:
    """A drain (or `kubectl delete job`): every pod gets SIGTERM, takes the final checkpoint and
    exits 143; a new Job of the same overlay (a fresh uid: a fresh rendezvous) resumes from it."""
    delete = threading.Event()
    result, job = jobs.run(
        tmp_path,
        TWO_NODES,
        restart="injob",
        env=TWO_PODS,
        when_step=(3, lambda _: delete.set()),
        delete=delete,
    )
    assert result.status == "Deleted"
    assert result.exit_codes == {0: [exits.PREEMPTED], 1: [exits.PREEMPTED]}, jobs.logs(tmp_path)
    preempted = [e for e in jobs.events(tmp_path, job) if e.get("status") == "preempted"]
    assert {e["step"] for e in preempted} == {preempted[0]["step"]}
    drained_at = preempted[0]["step"]
    assert drained_at < STEPS
    commits = sorted((tmp_path / "fsx" / "checkpoints" / job["metadata"]["name"]).glob("step_*"))
    assert commits[-1].name == f"step_{drained_at:08d}"

    result, job = jobs.run(tmp_path, TWO_NODES, restart="injob", env=TWO_PODS)
    assert result.status == "Complete", jobs.logs(tmp_path)
    loads = [e for e in jobs.events(tmp_path, job) if e["kind"] == "checkpoint_load"]
    assert loads and loads[-1]["step"] == drained_at
    jobs.assert_identical(jobs.final_state(tmp_path, job), reference)


def test_a_bad_trainer_flag_fails_the_job_at_once(tmp_path: Path) -> None:
    def add_bad_flag(job: dict) -> None:
        job["spec"]["template"]["spec"]["containers"][0]["args"].append("--train.stepz=5")

    result, _ = jobs.run(
        tmp_path, "smoke", restart="nested", env=ONE_POD, mutate_job=add_bad_flag, timeout_s=120
    )
    assert result.status == "Failed" and result.reason == f"PodFailurePolicy: exit {exits.USAGE}"
    assert result.exit_codes == {0: [exits.USAGE]}


def test_the_kubelet_reports_a_signal_as_128_plus_its_number() -> None:
    assert emulator.container_exit_code(-signal.SIGKILL) == 137
    assert emulator.container_exit_code(-signal.SIGTERM) == exits.PREEMPTED
    assert emulator.container_exit_code(3) == 3


def test_a_pod_on_a_node_that_does_not_fit_fails_the_job_at_once(tmp_path: Path) -> None:
    """The overlay's own GPU recipe on this GPU-less machine: the pod's start-up check refuses
    (exit 5, the pod failure policy fails the Job) before any launcher or rendezvous."""
    # RECIPE stays p5_smoke: CUDA expected.
    result, _ = jobs.run(
        tmp_path, "smoke", restart="nested", env={"NPROC_PER_NODE": "2"}, timeout_s=120
    )
    log = jobs.logs(tmp_path)
    assert result.status == "Failed", log
    assert result.reason == f"PodFailurePolicy: exit {exits.ENVIRONMENT}", log
    assert "startup_check: cuda" in log
    assert "[ft_launcher" not in log, "no launcher may start on a node that does not fit"


def test_an_fsx_that_is_not_lustre_fails_the_job_at_once(tmp_path: Path) -> None:
    """The Job's own FSX_FSTYPE (lustre) on the emulated /fsx, a bind mount of a local
    directory: the start-up check refuses before any launcher starts, naming the file system it
    found; the Job fails (every node would meet the same claim) and the pod's termination
    message names the node."""
    result, _ = jobs.run(
        tmp_path, "smoke", restart="nested", env=ONE_POD, expect_lustre=True, timeout_s=120
    )
    log = jobs.logs(tmp_path)
    assert result.status == "Failed", log
    assert result.reason == f"PodFailurePolicy: exit {exits.ENVIRONMENT}", log
    fstype = jobs.fstype(tmp_path / "fsx")
    assert f"startup_check: fsx: /fsx is a {fstype} mount" in log and "not lustre" in log
    assert "[ft_launcher" not in log, "no launcher may start without the file system"
    (message,) = result.messages[0]
    node = emulator.node_name(index=0, attempt=0)
    assert result.nodes[0] == [node]
    assert message.startswith(f"startup_check: this job does not fit node {node}")
    assert "fsx: /fsx is a" in message


def test_a_bad_node_is_replaced_and_named(tmp_path: Path, reference: dict) -> None:
    """The first pod's node has a stuck Lustre client: its probe file on the emulated /fsx is a
    FIFO, so the check's write blocks as a create on a client cut off from its servers does.
    The check exits NODE_UNFIT naming the node; the pod failure policy counts it (Count) and
    the replacement pod, on another node, trains to the end. That replacement is the smoke
    overlay's Job in nested mode on one pod: it is also OVERLAY_MODES' (smoke, nested) run
    (RUN_ELSEWHERE), its final state the reference's."""
    bad = emulator.node_name(index=0, attempt=0)
    fifo = tmp_path / "fsx" / startup_check.FSX_PROBE_DIR / bad
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    result, job = jobs.run(
        tmp_path,
        "smoke",
        restart="nested",
        env={**ONE_POD, "FSX_PROBE_TIMEOUT_S": "3"},
        nodes=1,
    )
    log = jobs.logs(tmp_path)
    assert result.status == "Complete", f"{result}\n{log}"
    assert result.exit_codes == {0: [exits.NODE_UNFIT, 0]}, log
    assert result.nodes[0] == [bad, emulator.node_name(index=0, attempt=1)]
    first, _ = result.messages[0]
    assert first.startswith(f"startup_check: node {bad} does not fit"), first
    assert f"did not finish in 3 s on node {bad}" in first
    _trained_on_one_pod(result, job, tmp_path, reference)


# --- a node lost the way nodes are lost (docs/node-loss.md) --------------------------------------


PEER_COPY = ("--checkpoint.memory_interval=1", "--checkpoint.peer_copy=true")
"""Pod-memory snapshots every step, each copied to the other node's pod memory."""


@pytest.mark.parametrize(
    ("restart", "spares", "peer_copy"),
    [("injob", 1, True), ("injob", 0, False), ("nested", 1, True)],
    ids=["injob-with-spare-peer-copy", "injob-no-spare", "nested-with-spare-peer-copy"],
)
def test_a_lost_node_is_replaced_and_the_run_ends_identical(
    tmp_path: Path, reference: dict, restart: str, spares: int, peer_copy: bool
) -> None:
    """Pod 1's node stops answering at step 6: its network cut, its processes frozen. The
    surviving launcher restarts its worker when the step section times out and waits in the
    rendezvous; the control plane's rules (control_plane.py, durations scaled by SCALE) fail
    the lost pod only once its Node object is gone; the Job's replacement lands on the spare
    (its placeholder preempted) or, without one, on the repaired node once it has booted and
    pulled the image; it joins with a new IP, every rank restores the newest checkpoint, and
    the run ends bit-identical to the fault-free one. The frozen pod is never killed by the
    control plane: it is still frozen when the Job completes. The repaired node then takes
    the used spare's place (the spares' Deployment lands its Pending placeholder there).
    With the peer copy on (pod-memory snapshots every step, each sent to the other node), the
    replacement pod's rank finds no snapshot in its own, fresh memory and restores its shard
    from the surviving pod's copy, newer than the newest checkpoint on storage: every rank's
    load says ``source=peer``; without it, storage's newest commit before the loss (none yet:
    a fresh start)."""
    frozen: dict = {}

    def look(state: dict, pods: emulator.Cluster) -> None:
        frozen["pids"] = pods.netns_pids(state["node"].netns)
        frozen["states"] = {_proc_state(pid) for pid in frozen["pids"]}
        # The repaired node joins and takes the preempted spare's place: N + K again.
        plane = state["plane"]
        deadline = time.monotonic() + 60
        while spares and len(plane.spare_nodes()) < spares and time.monotonic() < deadline:
            plane.failed_pods()
            time.sleep(0.1)
        frozen["spares"] = plane.spare_nodes()

    result, job, state = jobs.node_loss_run(
        tmp_path, restart=restart, spares=spares, after=look, extra=PEER_COPY if peer_copy else ()
    )
    log = jobs.logs(tmp_path)
    assert result.status == "Complete", f"{result}\n{log}"
    events = jobs.events(tmp_path, job)
    after_loss = [e for e in events if e["kind"] == "checkpoint_load" and e["time"] > state["time"]]
    # What storage holds for the replacement: the commits before the loss (a commit needs every
    # rank, and pod 1's is frozen from then on). The save of step 4 commits a step or more
    # later, once both ranks' writes are durable: on a loaded machine not always by step 6.
    committed = [
        e["step"]
        for e in events
        if e["kind"] == "checkpoint_committed" and e["time"] < state["time"]
    ]
    if peer_copy:
        assert after_loss, log
        first = min(e["step"] for e in after_loss)
        assert {e["source"] for e in after_loss if e["step"] == first} == {"peer"}, after_loss
        assert first > max(committed, default=0), after_loss  # newer than storage's newest
    elif committed:
        assert after_loss, log
        first = min(after_loss, key=lambda e: e["time"])
        assert (first["step"], first["source"]) == (max(committed), "storage"), after_loss
    else:
        assert after_loss == [], after_loss  # nothing committed yet: the run starts afresh
    # The lost pod: failed by the control plane (no exit code), replaced on another node.
    assert result.exit_codes == {0: [0], 1: [None, 0]}, result.exit_codes
    lost_node, new_node = result.nodes[1]
    assert lost_node == state["node"].name and new_node != lost_node
    assert frozen["pids"] and frozen["states"] == {"T"}, frozen
    # With a spare: the one used is gone from the pool, the repaired node holds its place.
    assert len(frozen["spares"]) == spares, frozen
    assert not set(result.nodes[1]) & set(frozen["spares"]), frozen
    jobs.assert_identical(jobs.final_state(tmp_path, job), reference)
    assert {m["step"] for m in jobs.metrics(tmp_path, job)} == set(range(1, STEPS + 1))
    plane = state["plane"]
    recovery = jobs.recovery_s(tmp_path, job, fault_time=state["time"])
    control = EKS.scaled(SCALE)
    failed_after = (
        control.monitor_grace_s + control.repair_wait_s + control.terminate_s + control.podgc_s
    )
    joins = control.boot_and_pull_s - control.terminate_s - control.podgc_s
    print(
        f"\n[node loss] {restart} spares={spares}: fault -> first step {recovery:.1f} s "
        f"(control plane scaled x{SCALE:.4f}: pod Failed after {failed_after:.1f} s"
        f"{'' if spares else f', the new node joins {joins:.1f} s later'})"
        f"\n{plane.timeline(since=state['time'])}"
    )
    assert recovery > failed_after  # nothing resumed before Kubernetes replaced the pod


def _proc_state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped); '-' once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "-"
    return stat.rsplit(")", 1)[1].split()[0]


def test_a_lost_node_that_comes_back_mid_run_does_not_corrupt_it(
    tmp_path: Path, reference: dict
) -> None:
    """The harsher end of a node loss: the lost node comes back (network and processes) while
    its replacement trains. Until its kubelet stops the deleted pod (2 s housekeeping, then
    SIGTERM, SIGKILL 2 s later: control_plane.node_returns) the old launcher and ranks run
    beside the new ones, sharing /fsx and the rendezvous store. What they may do there is
    shown (printed), and what must hold is checked: the Job completes, every committed
    checkpoint verifies, and the final state is the fault-free one, bit for bit."""
    from training.checkpoint import layout

    state: dict = {}

    def plane(pods: emulator.Cluster, spare_objects: list[dict]) -> ControlPlane:
        state["plane"] = jobs.two_node_plane(pods, spare_objects, spares=1, root=tmp_path)
        return state["plane"]

    def come_back() -> None:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if any(
                m["time"] - m["step_time_s"] > state["time"] for m in jobs.metrics(tmp_path, job)
            ):
                state["returned_at"] = time.time()
                state["old_exit"] = state["plane"].node_returns()
                return
            time.sleep(0.05)

    def lose(_: emulator.Cluster) -> None:
        state["time"] = time.time()
        state["node"] = state["plane"].lose(1)
        state["thread"] = threading.Thread(target=come_back, daemon=True)
        state["thread"].start()

    _, job, _ = jobs.objects(TWO_NODES, restart="injob", train_args=[*FAST])
    result, job = jobs.run(
        tmp_path,
        TWO_NODES,
        restart="injob",
        env=TWO_PODS,
        when_step=(6, lose),
        control_plane=plane,
        after=lambda _: state["thread"].join(timeout=60),
    )
    log = jobs.logs(tmp_path)
    assert result.status == "Complete", f"{result}\n{log}"
    assert "returned_at" in state, "the lost node never came back during the run"
    root = tmp_path / "fsx" / "checkpoints" / job["metadata"]["name"]
    for step in layout.committed_steps(root):
        assert layout.verify(layout.step_dir(root, step)) is None, step
    jobs.assert_identical(jobs.final_state(tmp_path, job), reference)
    old_log = (tmp_path / f"{job['metadata']['name']}-1-0.log").read_text(errors="replace")
    tail = "\n".join(old_log.splitlines()[-12:])
    print(
        f"\n[node back] old pod's main process exit status {state['old_exit']}; "
        f"committed steps {layout.committed_steps(root)}"
        f"\n{state['plane'].timeline(since=state['time'])}\n--- old pod log tail\n{tail}"
    )


# --- a slow node (docs/stragglers.md) -------------------------------------------------------------


@pytest.mark.requires(reason=slow_node_reason())
def test_a_slow_node_is_cordoned_and_moved_to_a_spare(tmp_path: Path, reference: dict) -> None:
    """Pod 1's node runs at a tenth of its speed once the step-1 checkpoint is committed:
    every process of the pod, and every process they start later, frozen for 9 ms of every
    10 ms (podsim.slow_node.SlowNode, which says why not a CFS quota), in nested mode, the EKS
    default, with the straggler policy on. Its node is named and evicted: every rank takes the final
    checkpoint; pod 1's rank writes the verdict and asks its launcher to leave the rendezvous
    (NVRx ExcludeThisNode), its supervisor cordons the node through the Kubernetes client
    (in-cluster config) and exits NODE_UNFIT; pod 0 keeps its launcher, which restarts its
    worker in-job. The Job's replacement skips the cordoned node (free again, but
    unschedulable) and lands on the spare; the run resumes from the final checkpoint and ends
    bit-identical to the fault-free one (which ran the same policy and evicted nothing).

    Emulated: the API server (podsim/kube_api.py answers the one PATCH a cordon is; no RBAC or
    admission policy) and the scheduler (control_plane.py: NodeUnschedulable, preemption)."""
    state: dict = {}

    def plane(pods: emulator.Cluster, spare_objects: list[dict]) -> ControlPlane:
        state["plane"] = jobs.two_node_plane(pods, spare_objects, spares=1, root=tmp_path)
        state["spare"] = state["plane"].spare_nodes()[0]
        return state["plane"]

    def slow_down(pods: emulator.Cluster) -> None:
        # Once the first checkpoint (step 1) is committed: the first save waits for the pod's
        # NVRx writer process to start (it imports torch), seconds of CPU that a tenth of a
        # CPU would stretch past every timeout. The commit record on disk, not the event (the
        # event writer flushes every 0.5 s, several debug steps late: the slowdown then landed in
        # the middle of a report's window).
        checkpoints = tmp_path / "fsx" / "checkpoints" / render.size_of(TWO_NODES).job_name
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and 1 not in committed_steps(checkpoints):
            time.sleep(0.02)
        pids = pods.netns_pids(state["plane"].pods[1].netns)
        state["slow"] = SlowNode(pids, name=f"slow-node-{os.getpid()}")

    try:
        result, job = jobs.run(
            tmp_path,
            TWO_NODES,
            restart="nested",
            env=TWO_PODS,
            extra=(
                *STRAGGLER_POLICY,
                *SLOW_NODE_TIMEOUTS,
                "--checkpoint.interval=1",
                "--checkpoint.local_interval=0",  # every step is a shared save: no local tier
            ),
            when_step=(1, slow_down),
            control_plane=plane,
        )
    finally:
        if "slow" in state:
            state["slow"].close()
    frozen = state["slow"].periods if "slow" in state else 0
    log = jobs.logs(tmp_path)
    events = jobs.events(tmp_path, job)
    reports = {e["step"]: e["nodes"] for e in events if e["kind"] == "straggler_report"}
    print(f"\n[straggler] scores by step: {reports}; periods frozen: {frozen}")
    assert frozen > 0, "the slow pod was never frozen"
    assert result.status == "Complete", f"{result}\n{log}"
    assert result.exit_codes == {0: [0], 1: [exits.NODE_UNFIT, 0]}, f"{result}\n{log}"
    slow_node, new_node = result.nodes[1]
    assert state["plane"].cordoned == {slow_node}
    assert new_node == state["spare"]
    (eviction,) = [e for e in events if e["kind"] == "straggler_eviction"]
    assert eviction["node"] == slow_node and eviction["ranks"] == [1]
    # Evicted at its second slow report in a row (the policy's `reports=2`): steps 4-6 and 7-9
    # when the slowdown lands right after step 1; one report later when a loaded machine lets a
    # step or two of 4-6 through before it does.
    slow = [step for step in sorted(reports) if reports[step].get(slow_node, 1.0) < 0.3]
    assert eviction["step"] in (3 * STRAGGLER_EVERY, 4 * STRAGGLER_EVERY), reports
    assert slow[:2] == [eviction["step"] - STRAGGLER_EVERY, eviction["step"]], reports
    ends = [e["status"] for e in events if e["kind"] == "run_end"]
    assert "evicted" in ends and ends[-1] == "completed", ends
    loads = [e for e in events if e["kind"] == "checkpoint_load"]
    assert loads and loads[-1]["step"] == eviction["step"], "resumed from the final checkpoint"
    jobs.assert_identical(jobs.final_state(tmp_path, job), reference)
    print(
        f"[straggler] {slow_node} evicted at step {eviction['step']}, cordoned; "
        f"replacement on {new_node}\n{state['plane'].timeline(since=state['plane'].events[0][0])}"
    )


# --- a lost node fenced by the stack itself (infra/fencer, docs/node-loss.md) ---------------------


@pytest.mark.requires(reason=ec2_stand_in.moto_reason())
def test_a_lost_node_is_fenced_its_pod_moves_to_a_spare_and_its_zombie_writes_nothing(
    tmp_path: Path, reference: dict
) -> None:
    """Pod 1's node stops answering at step 6 (network cut, processes frozen). EKS node repair
    keeps its default 30-minute wait, so only the fencer can act: it reads the Nodes
    (ec2_stand_in.NodeApi over the emulated control plane), sees `Ready=Unknown` past its wait,
    terminates the node's instance through its own SigV4-signed EC2 calls to the EC2 stand-in
    (moto in server mode), and taints the node out-of-service only once EC2 reports the
    instance terminated; the emulated hypervisor kills the node's processes at the
    TerminateInstances, before EC2 can report it terminated (ec2_stand_in.ec2_front). PodGC
    then fails the pod, the Job's replacement preempts the spare, and the run ends
    bit-identical. The frozen node, thawed after the Job (its network up, SIGCONT), has nothing
    left to run: it writes nothing. Timers: the shipped ones (infra/fencer/settings.py and the
    node lifecycle's), scaled by SCALE. Emulated: EC2 (moto), the API server, PodGC."""
    result, job, state, times = jobs.fenced_node_loss_run(tmp_path)
    log = jobs.logs(tmp_path)
    assert result.status == "Complete", f"{result}\n{log}"
    plane, cloud, fencer = state["plane"], state["cloud"], state["fencer"]
    lost = state["node"].name
    timeline = plane.timeline(since=state["time"])
    assert fencer.fenced == [lost], timeline
    assert fencer.alert is None
    (loss,) = plane.losses
    # Fenced first, then out of service: the processes died before the taint.
    assert cloud.killed[lost] <= loss.out_of_service_at, timeline
    silent = loss.out_of_service_at - (loss.at + times.monitor_grace_s)
    assert silent >= FENCER.wait_s * SCALE, timeline
    # Long before EKS's repair would have replaced the node.
    assert loss.out_of_service_at < loss.at + times.monitor_grace_s + times.repair_wait_s
    assert result.exit_codes == {0: [0], 1: [None, 0]}, result.exit_codes
    lost_node, new_node = result.nodes[1]
    assert lost_node == lost and new_node != lost
    assert plane.bound_at[f"{job['metadata']['name']}-1"] > cloud.killed[lost]
    jobs.assert_identical(jobs.final_state(tmp_path, job), reference)
    # The zombie: nothing of the old incarnation was left to wake.
    assert state["thawed"] == [] and state["log_grew"] == 0, state
    recovery = jobs.recovery_s(tmp_path, job, fault_time=state["time"])
    print(
        f"\n[fenced] fault -> first step {recovery:.1f} s (x{SCALE:.4f}: out of service "
        f"{loss.out_of_service_at - loss.at:.1f} s after the fault)\n{timeline}"
    )


# A NODE_UNFIT pod's node cordoned, its replacement landing elsewhere: the same run (one node,
# one spare, the Lustre probe a FIFO, injob on one pod) is tests/pods/test_bad_nodes.py's, which
# asserts the exit codes (NODE_UNFIT, then 0), the cordon (`unfit` is set only by the cordon's
# PATCH, podsim/control_plane.py) and the replacement's other node, and then the fencer's work.
# Without the cordon its replacement would land on the same free node and exit NODE_UNFIT again.
