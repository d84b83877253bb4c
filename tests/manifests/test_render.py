"""Tests of the manifests: kustomize build, strict schema validation, size invariants, snapshots.

Run: .venv/bin/pytest tests/manifests/test_render.py
Update the snapshots after an intended change: .venv/bin/pytest tests/manifests --snapshot-update
Regenerate the YAML after changing manifests/sizes.py or render.py:
    .venv/bin/python -m manifests.kustomize write

The kustomize tests need `kubectl` (its built-in kustomize) and are skipped without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from support import requires_tool

from manifests import kustomize, render
from manifests.sizes import SIZES

ROOT = Path(render.__file__).resolve().parent
KUBECTL = shutil.which("kubectl")
needs_kubectl = requires_tool("kubectl")  # kubectl kustomize


def _key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


KUSTOMIZE_UNKNOWN_CLUSTER_SCOPED = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
"""Cluster-scoped kinds newer than kustomize's built-in OpenAPI schema (kyaml's, Kubernetes
1.21; admissionregistration v1 policies are 1.30): its namespace transformer stamps them with
the namespace. The API server drops a namespace on a cluster-scoped object (apiserver
``rest.BeforeCreate``), so the applied object is the renderer's."""


def _kustomize(overlay: str) -> list[dict]:
    docs = _kustomize_raw(overlay)
    for doc in docs:
        if doc["kind"] in KUSTOMIZE_UNKNOWN_CLUSTER_SCOPED:
            assert doc["metadata"].pop("namespace", render.DEFAULT_NAMESPACE) == (
                render.DEFAULT_NAMESPACE
            )
    return docs


def _kustomize_raw(overlay: str) -> list[dict]:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(ROOT / "overlays" / overlay)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def _job(objs: list[dict]) -> dict:
    (job,) = [o for o in objs if o["kind"] == "Job"]
    return job


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_overlays_constant_names_every_sizes_row():
    assert render.OVERLAYS == ("smoke", "2node", "16node")
    assert set(render.OVERLAYS) == {p.name for p in (ROOT / "overlays").iterdir()}


def test_committed_yaml_is_what_the_generator_writes():
    """The YAML is generated from sizes.py: fails when someone edits one without the other."""
    for rel, text in kustomize.generated_files().items():
        path = ROOT / rel
        assert path.exists(), f"{rel} missing: run python -m manifests.kustomize write"
        assert path.read_text() == text, f"{rel} is stale: run python -m manifests.kustomize write"
    committed = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.yaml")}
    assert committed == set(kustomize.generated_files()), "stray YAML under manifests/"


@needs_kubectl
@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_kustomize_build_equals_python_renderer(overlay):
    """`kubectl apply -k` users get exactly the objects the CDK app and the launcher apply."""
    built = {_key(o): o for o in _kustomize(overlay)}
    rendered = {_key(o): o for o in render.placeholder_objects(overlay=overlay)}
    assert built.keys() == rendered.keys()
    for key, obj in rendered.items():
        assert built[key] == obj, key


@needs_kubectl
@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_kustomize_output_validates_strictly(overlay):
    for obj in _kustomize(overlay):
        kubernetes_validate.validate(obj, render.KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_rendered_objects_validate_strictly(overlay):
    for obj in render.placeholder_objects(overlay=overlay):
        kubernetes_validate.validate(obj, render.KUBERNETES_VERSION, strict=True)


def test_validation_can_fail():
    """The strict check is real: an unknown field is rejected."""
    job = _job(render.job_objects(overlay="smoke", namespace="ns", image="img"))
    job["spec"]["parallelizm"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, render.KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_size_invariants(overlay):
    size = SIZES[overlay]
    job = _job(render.job_objects(overlay=overlay, namespace="ns", image="img"))
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    res = container["resources"]
    env = _env(container)
    gpus = int(res["limits"]["nvidia.com/gpu"])

    assert spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == spec["completions"] == size.nodes
    assert int(env["NNODES"]) == size.nodes
    assert "--nnodes=$(NNODES)" in container["args"]
    assert int(env["NPROC_PER_NODE"]) == gpus == 8  # p5.48xlarge
    assert "--nproc-per-node=$(NPROC_PER_NODE)" in container["args"]
    assert int(res["limits"]["vpc.amazonaws.com/efa"]) == 32  # p5's network cards
    # Extended resources and huge pages: requests must equal limits.
    for name, value in res["limits"].items():
        assert res["requests"][name] == value
    assert res["limits"]["hugepages-2Mi"]
    assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
    assert env["RECIPE"] == size.recipe


def test_overlay_recipes():
    recipes = {o: SIZES[o].recipe for o in render.OVERLAYS}
    assert recipes == {"smoke": "p5_smoke", "2node": "p5_8b", "16node": "p5_70b"}


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_pod_shape(overlay):
    service, job = render.job_objects(overlay=overlay, namespace="ns", image="img:1")
    spec = job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    # Stable pod DNS names through the headless Service.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    # Storage: FSx, memory-backed /dev/shm, node scratch.
    assert volumes[mounts["/fsx"]]["persistentVolumeClaim"]["claimName"] == render.PVC_NAME
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    # Scratch outlives the pod (local checkpoints for a replacement on the same node), on the
    # node's instance-store RAID0.
    scratch = volumes[mounts["/scratch"]]["hostPath"]
    assert scratch == {"path": render.NODE_SCRATCH, "type": "DirectoryOrCreate"}
    assert scratch["path"].startswith("/mnt/k8s-disks/0/")
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    assert container["envFrom"] == [{"configMapRef": {"name": render.CONFIG_MAP}}]
    assert container["image"] == "img:1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    # Failure handling: a bad node is retried, config errors fail at once, disruptions do not
    # count.
    rules = spec["podFailurePolicy"]["rules"]
    assert [r["action"] for r in rules] == ["Count", "FailJob", "Ignore"]
    assert 2 in rules[1]["onExitCodes"]["values"]
    assert rules[2] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert pod["restartPolicy"] == "Never"
    assert spec["backoffLimit"] >= 1
    assert spec["ttlSecondsAfterFinished"] > 0
    assert pod["terminationGracePeriodSeconds"] >= 300


def test_efa_nccl_environment():
    cm = next(
        o
        for o in render.shared_objects(namespace="ns", image="i", **render.PLACEHOLDER_FSX)
        if o["kind"] == "ConfigMap"
    )
    assert cm["data"]["FI_PROVIDER"] == "efa"
    assert cm["data"]["FI_EFA_USE_DEVICE_RDMA"] == "1"


def test_shared_objects_take_cdk_tokens_as_opaque_strings():
    tok = "${Token[TOKEN.123]}"
    objs = render.shared_objects(
        namespace="training",
        file_system_id=tok,
        dns_name=tok + ".dns",
        mount_name=tok + ".mnt",
        storage_capacity_gib=2400,
        image=tok,
    )
    kinds = [o["kind"] for o in objs]
    assert kinds == [
        "Namespace",
        "ServiceAccount",
        "ConfigMap",
        "PersistentVolume",
        "PersistentVolumeClaim",
        "PriorityClass",
        "Deployment",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "Service",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "Role",
        "RoleBinding",
    ]
    pv = objs[3]
    assert pv["spec"]["csi"] == {
        "driver": "fsx.csi.aws.com",
        "volumeHandle": tok,
        "volumeAttributes": {"dnsname": tok + ".dns", "mountname": tok + ".mnt"},
    }
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    pvc = objs[4]
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pvc["metadata"]["namespace"] == "training"


def _shared(**changes) -> dict[tuple[str, str], dict]:
    args = {"namespace": "ns", "image": "img:1", **render.PLACEHOLDER_FSX, **changes}
    return {_key(o): o for o in render.shared_objects(**args)}


def test_fsx_volume_and_claim_do_not_depend_on_the_file_systems_size():
    """Growing FSx (an in-place CloudFormation update) leaves the PV and PVC as they are: a
    statically bound claim cannot be resized, so a PV/PVC that followed the size would fail
    the stack update after the file system had grown. Only the ConfigMap tells the size."""
    small, big = _shared(storage_capacity_gib=1200), _shared(storage_capacity_gib=48000)
    for kind, name in (("PersistentVolume", render.PV_NAME), ("PersistentVolumeClaim", "")):
        (key,) = [k for k in small if k[0] == kind and (not name or k[1] == name)]
        assert small[key] == big[key], kind
    changed = {k for k in small if small[k] != big[k]}
    assert changed == {("ConfigMap", render.CONFIG_MAP)}
    assert big["ConfigMap", render.CONFIG_MAP]["data"]["FSX_STORAGE_CAPACITY"] == "48000Gi"
    pv = small["PersistentVolume", render.PV_NAME]
    pvc = small["PersistentVolumeClaim", render.PVC_NAME]
    # Kubernetes binds a claim only to a volume at least as big as its request.
    assert pv["spec"]["capacity"]["storage"] == render.FSX_NOMINAL_SIZE
    assert pvc["spec"]["resources"]["requests"]["storage"] == render.FSX_NOMINAL_SIZE
    # The kustomize base must not copy the real size into the PV either.
    replaced = [
        field
        for r in kustomize.kustomize_tree()["base/kustomization.yaml"]["replacements"]
        for t in r["targets"]
        for field in t["fieldPaths"]
    ]
    assert replaced and not any("capacity" in field for field in replaced)


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels AND matchExpressions; kubernetes.io/docs,
    "Labels and Selectors", set-based requirements)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for req in selector.get("matchExpressions", []):
        present, value = req["key"] in labels, labels.get(req["key"])
        ok = {
            "In": present and value in req.get("values", []),
            "NotIn": not present or value not in req.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[req["operator"]]
        if not ok:
            return False
    return True


def _pod_labels(obj: dict) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"]["labels"]


def test_the_store_is_one_pod_at_a_time_high_priority_and_not_drained():
    objs = _shared()
    deployment = objs["Deployment", render.RDZV_STORE]
    pod = deployment["spec"]["template"]["spec"]
    # Never two independent stores behind one Service.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    # Priority above every training pod's (they name no class: priority 0).
    priority = objs["PriorityClass", pod["priorityClassName"]]
    assert priority["value"] > 0 and priority["globalDefault"] is False
    assert priority["value"] < 1_000_000_000  # user classes stay below system-*-critical
    for overlay in render.OVERLAYS:
        job = _job(render.job_objects(overlay=overlay, namespace="ns", image="i"))
        assert "priorityClassName" not in job["spec"]["template"]["spec"]
    # The budget covers the store's pod and allows no voluntary eviction of a ready one.
    pdb = objs["PodDisruptionBudget", render.RDZV_STORE]
    assert _selects(pdb["spec"]["selector"], _pod_labels(deployment))
    assert pdb["spec"]["minAvailable"] == deployment["spec"]["replicas"]
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


def test_only_the_jobs_pods_reach_the_store():
    """The store's NetworkPolicy selects the store's pod and admits, on its port only, the pods
    of every overlay's training Job and of its preflight Job, and no other pod; the store itself
    opens no connection (egress denied: no IMDS from the system node)."""
    from manifests import preflight

    objs = _shared()
    deployment = objs["Deployment", render.RDZV_STORE]
    policy = objs["NetworkPolicy", render.RDZV_STORE]["spec"]
    assert _selects(policy["podSelector"], _pod_labels(deployment))
    assert policy["policyTypes"] == ["Ingress", "Egress"]
    assert policy["egress"] == []
    (rule,) = policy["ingress"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    service = objs["Service", render.RDZV_STORE]
    assert rule["ports"] == [{"protocol": "TCP", "port": render.RDZV_STORE_PORT}]
    assert container["ports"][0]["containerPort"] == service["spec"]["ports"][0]["targetPort"]
    assert service["spec"]["ports"][0]["targetPort"] == render.RDZV_STORE_PORT
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # no namespaceSelector: this namespace only

    def admitted(labels: dict[str, str]) -> bool:
        return _selects(peer["podSelector"], labels)

    for overlay in render.OVERLAYS:
        job = _job(render.job_objects(overlay=overlay, namespace="ns", image="i"))
        check = preflight.preflight_job(overlay=overlay, namespace="ns", image="i")
        assert admitted(_pod_labels(job)) and admitted(_pod_labels(check)), overlay
    assert not admitted(_pod_labels(deployment))
    assert not admitted({})
    assert not admitted({"app.kubernetes.io/name": "fsdp-train"})


def test_the_store_can_run_its_own_image():
    """A store image of its own: the trainer's image can change (every `make gpu-nodes`
    rebuilds it) while the store's pod template, and so the running store, stays."""
    default = _shared(image="trainer:1")["Deployment", render.RDZV_STORE]
    (container,) = default["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "trainer:1"  # callers without the keyword keep working
    one = _shared(image="trainer:1", store_image="store:1")
    two = _shared(image="trainer:2", store_image="store:1")
    assert one["Deployment", render.RDZV_STORE] == two["Deployment", render.RDZV_STORE]
    (container,) = one["Deployment", render.RDZV_STORE]["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "store:1"
    assert container["command"] == list(render.RDZV_STORE_COMMAND)


def test_unknown_overlay_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown overlay 'huge'.*smoke, 2node, 16node"):
        render.job_objects(overlay="huge", namespace="ns", image="img")


def _container(**kwargs) -> dict:
    job = _job(render.job_objects(namespace="ns", image="img", **kwargs))
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def _expand(container: dict, values: dict[str, str]) -> list[str]:
    """The kubelet's $(VAR) expansion of the container's args (env values + downward API)."""
    env = {**_env(container), **values}
    args = []
    for arg in container["args"]:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        assert "$(" not in arg, f"unexpanded variable in {arg!r}"
        args.append(arg)
    return args


POD_VALUES = {"JOB_UID": "0000-uid", "POD_IP": "10.0.0.7"}


def test_restart_and_train_args_overrides():
    container = _container(overlay="2node", restart="inprocess", train_args=["--train.steps=5"])
    args = _expand(container, POD_VALUES)
    assert args[0] == "torchrun"
    assert "--restart=inprocess" in args and args[-1] == "--train.steps=5"
    with pytest.raises(ValueError, match="restart must be one of injob, inprocess, nested"):
        render.job_objects(overlay="smoke", namespace="ns", image="img", restart="both")


def test_each_overlay_patch_turns_the_base_into_its_objects():
    """The committed patches, applied to the base Job and Service, give each overlay's objects
    (without kubectl: the patch files themselves, through jsonpatch)."""
    import jsonpatch

    tree = kustomize.kustomize_tree()
    base = render.job_objects(
        overlay=render.BASE_OVERLAY, namespace=render.DEFAULT_NAMESPACE, image=render.IMAGE_NAME
    )
    for overlay in render.OVERLAYS:
        want = render.job_objects(
            overlay=overlay, namespace=render.DEFAULT_NAMESPACE, image=render.IMAGE_NAME
        )
        for old, new in zip(base, want, strict=True):
            ops = tree.get(f"overlays/{overlay}/{old['kind'].lower()}-patch.yaml", [])
            assert jsonpatch.apply_patch(old, ops) == new, (overlay, old["kind"])


@pytest.mark.parametrize("restart", ["injob", "nested"])
@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_rendered_ft_launcher_command_parses_and_times_every_section(overlay, restart):
    """The Job's command passes ft_launcher's real parser, and every section the trainer opens
    has a timeout there (without one, NVRx raises `TimeoutsCalcError: Unknown section`)."""
    from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser

    from training.command import hang_check_interval_s, injob_timeout_floor_s
    from training.hooks import out_of_section_timeout_s, section_timeouts
    from training.modes import MODES
    from training.overrides import build_config

    container = _container(overlay=overlay, restart=restart)
    assert container["command"] == ["python", "-m", "training.launch.pod"]
    argv = _expand(container, POD_VALUES)
    assert argv[0] == "ft_launcher"
    ns = get_args_parser().parse_args(argv[1:])
    size = SIZES[overlay]
    assert int(ns.nnodes) == size.nodes and int(ns.nproc_per_node) == size.nproc_per_node
    assert ns.rdzv_endpoint == f"{render.RDZV_STORE}.ns:{render.RDZV_STORE_PORT}"
    assert "is_host=0" in ns.rdzv_conf and ns.rdzv_id == "0000-uid"
    assert ns.local_addr == "10.0.0.7"
    assert ns.module is True and ns.training_script == "training"
    config, _ = build_config(list(ns.training_script_args[1:]))
    r = config.resilience
    # The trainer in the pod takes memory snapshots exactly where its restarts keep the
    # processes (CheckpointManager.for_job's rule): nested, not injob.
    assert config.checkpoint.memory_interval > 0
    assert MODES[r.restart].keeps_processes == (restart == "nested")
    # Every resilience setting comes from the recipe's config (one owner), none from render.py.
    if restart == "injob":
        timed = dict(item.split(":") for item in ns.ft_rank_section_timeouts.split(","))
        assert set(timed) == set(section_timeouts(r))
        assert {k: float(v) for k, v in timed.items()} == section_timeouts(r)
        assert float(ns.ft_rank_out_of_section_timeout) == out_of_section_timeout_s(r)
        assert float(ns.ft_rank_heartbeat_timeout) == r.heartbeat_timeout_s
    else:
        # Nested opens no sections: an out-of-section timeout would kill healthy ranks, and
        # the heartbeat outlasts an in-process recovery (soft detection + hard limit).
        assert ns.ft_rank_out_of_section_timeout is None
        assert float(ns.ft_rank_heartbeat_timeout) == max(
            r.heartbeat_timeout_s, r.soft_timeout_s + r.hard_timeout_s
        )
    assert float(ns.ft_initial_rank_heartbeat_timeout) == r.initial_heartbeat_timeout_s
    assert int(ns.max_restarts) == r.max_restarts + 1
    assert float(ns.workers_stop_timeout) == r.stop_timeout_s
    # The rank monitors' check interval, as NVRx parses it (a float), leaves the calibrated
    # step timeout's floor room to detect a hang within hang_floor_s.
    check_s = ns.ft_workload_check_interval
    assert isinstance(check_s, float) and check_s == hang_check_interval_s(r) > 0
    assert injob_timeout_floor_s(r) + check_s == pytest.approx(r.hang_floor_s)
    # ft_launcher's SIGKILL comes before the kubelet's.
    assert float(ns.term_timeout) < size.grace_seconds
    policy = {"injob": "any-failed", "nested": "min-healthy"}[restart]
    assert ns.ft_restart_policy == policy


def test_submission_overrides_reach_the_launcher_flags():
    argv = _expand(
        _container(
            overlay="smoke", restart="injob", train_args=["--resilience.heartbeat_timeout_s=42"]
        ),
        POD_VALUES,
    )
    assert "--ft-rank-heartbeat-timeout=42" in argv


def test_inprocess_command_uses_torchrun_and_the_shared_store():
    from torch.distributed.run import get_args_parser

    argv = _expand(_container(overlay="16node", restart="inprocess"), POD_VALUES)
    ns = get_args_parser().parse_args(argv[1:])  # torchrun's real flag spellings
    assert argv[0] == "torchrun" and ns.max_restarts == 0
    assert ns.rdzv_endpoint == f"{render.RDZV_STORE}.ns:{render.RDZV_STORE_PORT}"
    assert ns.training_script_args[:2] == ["train", "--recipe=p5_70b"]


def test_pod_failure_policy_comes_from_the_exit_codes_module():
    from training import exits

    job = _job(render.job_objects(overlay="2node", namespace="ns", image="i"))
    (node, fail, _ignore) = job["spec"]["podFailurePolicy"]["rules"]
    assert fail["onExitCodes"]["values"] == list(exits.RETRY_CANNOT_HELP)
    assert exits.FAILED not in fail["onExitCodes"]["values"]  # a crash is retried
    assert exits.PREEMPTED not in fail["onExitCodes"]["values"]
    # A node that does not fit: counted and retried (the replacement may land elsewhere),
    # never FailJob, and matched before the FailJob rule (the first matching rule wins).
    assert node["action"] == "Count"
    assert node["onExitCodes"] == {
        "containerName": render.CONTAINER,
        "operator": "In",
        "values": [exits.NODE_UNFIT],
    }
    assert exits.NODE_UNFIT not in exits.RETRY_CANNOT_HELP
    assert exits.ENVIRONMENT in exits.RETRY_CANNOT_HELP


def test_pod_command_with_a_bad_trainer_flag_exits_2_before_any_launcher(tmp_path):
    """The container's exact command (kubelet-expanded) with a bad trainer flag: the pod's
    supervisor exits with the configuration code, which the pod failure policy turns into
    FailJob. No launcher is started (a stub on PATH would record it)."""
    from training import exits

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "launched"
    stub = bin_dir / "ft_launcher"
    stub.write_text(f"#!/bin/bash\ntouch {marker}\n")
    stub.chmod(0o755)
    container = _container(overlay="smoke")
    argv = [*_expand(container, POD_VALUES), "--train.stepz=5"]  # e.g. a hand-edited manifest
    env = {**os.environ, **_env(container), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    out = subprocess.run(
        [*container["command"], *argv], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == exits.USAGE, out.stderr
    assert "train.stepz" in out.stderr
    assert not marker.exists()
    rules = _job(render.job_objects(overlay="smoke", namespace="ns", image="i"))["spec"][
        "podFailurePolicy"
    ]["rules"]
    (fail,) = [r for r in rules if r["action"] == "FailJob"]
    assert exits.USAGE in fail["onExitCodes"]["values"]


def test_a_bad_trainer_flag_fails_at_render_time_naming_the_field():
    from training.exits import ConfigError

    with pytest.raises(ConfigError, match=r"train\.stepz"):
        render.job_objects(
            overlay="smoke", namespace="ns", image="i", train_args=["--train.stepz=5"]
        )


def test_rendezvous_store_is_shared_and_off_the_gpu_nodes():
    objs = render.shared_objects(namespace="ns", image="img:2", **render.PLACEHOLDER_FSX)
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    service = next(o for o in objs if o["kind"] == "Service")
    assert deployment["metadata"]["name"] == service["metadata"]["name"] == render.RDZV_STORE
    pod = deployment["spec"]["template"]["spec"]
    (store,) = pod["containers"]
    assert store["image"] == "img:2"
    assert store["command"] == ["python", "-m", "training.launch.rdzv_store"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"][0]["matchExpressions"][0]["operator"] == "DoesNotExist"
    assert service["spec"]["ports"][0]["port"] == render.RDZV_STORE_PORT


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_the_start_up_check_gets_the_fsx_mount_the_node_and_a_message_file(overlay):
    """training.startup_check reads FSX_MOUNT / FSX_FSTYPE (the fsx volume's mount and the
    CSI driver's file system), NODE_NAME (downward API) and TERMINATION_MESSAGE_PATH (the
    container's own terminationMessagePath): one owner each, in render.py."""
    container = _container(overlay=overlay)
    env = _env(container)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert env["FSX_MOUNT"] == mounts["fsx"] == render.FSX_MOUNT
    assert env["FSX_FSTYPE"] == "lustre"
    assert env["TERMINATION_MESSAGE_PATH"] == container["terminationMessagePath"]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    downward = {
        e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"]
        for e in container["env"]
        if "valueFrom" in e
    }
    assert downward["NODE_NAME"] == "spec.nodeName"


def test_prepare_script_has_no_kubernetes_variable_references():
    """Kubernetes expands $(NAME) in command/args: the script must not contain "$("."""
    assert "$(" not in render.PREPARE_SCRIPT
    subprocess.run(["bash", "-n", "-c", render.PREPARE_SCRIPT], check=True)


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_snapshot(overlay, snapshot):
    text = "---\n".join(render.to_yaml(o) for o in render.placeholder_objects(overlay=overlay))
    assert text == snapshot


def test_render_cli_show(capsys):
    assert kustomize.main(["show", "smoke"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs][-4:] == ["Service", "Job", "PriorityClass", "Deployment"]


def test_the_pods_shell_scripts_pass_shellcheck():
    """The scripts a pod runs are real files (manifests/scripts/), linted as such."""
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    scripts = sorted((ROOT / "scripts").glob("*.sh"))
    assert scripts
    proc = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    job = render.job_objects(overlay="smoke", namespace="ns", image="img")[1]
    (init,) = job["spec"]["template"]["spec"]["initContainers"]
    assert init["command"] == ["bash", "-c", (ROOT / "scripts" / "prepare-data.sh").read_text()]


# --- hot spares and node loss (docs/node-loss.md) -----------------------------------------------


def _spares(overlay: str) -> tuple[dict, dict]:
    objs = render.spare_objects(overlay=overlay, namespace="ns", image="img:1")
    (pclass,) = [o for o in objs if o["kind"] == "PriorityClass"]
    (deployment,) = [o for o in objs if o["kind"] == "Deployment"]
    return pclass, deployment


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_spares_hold_whole_nodes_that_a_trainer_pod_preempts(overlay):
    """One placeholder per spare node: the trainer's image and its exact requests, selector and
    tolerations (so it takes the node a replacement needs), a class below every trainer pod
    (priority 0: no class) that never preempts, and no grace period (SIGTERM is ignored by
    `sleep` as PID 1; a preempted spare frees its node at once)."""
    size = SIZES[overlay]
    pclass, deployment = _spares(overlay)
    job = _job(render.job_objects(overlay=overlay, namespace="ns", image="img:1"))
    job_pod = job["spec"]["template"]["spec"]
    (trainer,) = job_pod["containers"]
    pod = deployment["spec"]["template"]["spec"]
    (spare,) = pod["containers"]

    assert deployment["spec"]["replicas"] == size.spares
    assert size.node_count == size.nodes + size.spares
    assert pclass["value"] < 0 and "priorityClassName" not in job_pod
    assert pclass["preemptionPolicy"] == "Never" and pclass["globalDefault"] is False
    assert pod["priorityClassName"] == pclass["metadata"]["name"]
    assert pod["terminationGracePeriodSeconds"] == 0
    assert spare["image"] == trainer["image"]
    assert spare["command"] == ["sleep", "infinity"]
    assert spare["resources"] == trainer["resources"]
    assert pod["nodeSelector"] == job_pod["nodeSelector"]
    assert pod["tolerations"] == job_pod["tolerations"]
    (term,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    # The trainer's NetworkPolicy peer label is not the spares': they never reach the store.
    assert deployment["metadata"]["labels"]["app.kubernetes.io/component"] == render.SPARE


def test_spare_counts_per_overlay():
    """smoke keeps none; the multi-node overlays keep one (manifests/sizes.py says why)."""
    assert {o: SIZES[o].spares for o in render.OVERLAYS} == {"smoke": 0, "2node": 1, "16node": 1}


def test_a_negative_spare_count_is_refused_naming_the_field():
    from manifests.sizes import OverlaySize

    with pytest.raises(ValueError, match="overlay x: spares must be >= 0"):
        OverlaySize(name="x", nodes=2, recipe="p5_8b", spares=-1)


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_trainer_pods_leave_a_lost_node_after_30_s_not_300(overlay):
    """Their own NoExecute tolerations for the node lifecycle controller's taints replace the
    300 s ones the DefaultTolerationSeconds admission plugin would add; the Job keeps
    podReplacementPolicy Failed, the only value allowed with a podFailurePolicy, and the
    DisruptionTarget rule that keeps a taint eviction off backoffLimit."""
    job = _job(render.job_objects(overlay=overlay, namespace="ns", image="i"))
    tolerations = {t["key"]: t for t in job["spec"]["template"]["spec"]["tolerations"]}
    for key in ("node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"):
        assert tolerations[key] == {
            "key": key,
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": render.NODE_LOSS_TOLERATION_SECONDS,
        }
    assert render.NODE_LOSS_TOLERATION_SECONDS < 300
    assert job["spec"]["podReplacementPolicy"] == "Failed" and job["spec"]["podFailurePolicy"]
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} in rules


def test_the_trainer_may_only_cordon_its_own_node():
    """The one cluster permission (ops/cordon.py): `patch` on nodes, no read, bound to the
    trainer's ServiceAccount, narrowed by an admission policy to `spec.unschedulable` on the
    caller's own node; only the trainer's pods carry a token."""
    objs = {o["kind"]: o for o in render.node_cordon_objects(namespace="ns")}
    assert objs["ClusterRole"]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]}
    ]
    assert objs["ClusterRoleBinding"]["subjects"] == [
        {"kind": "ServiceAccount", "name": render.SERVICE_ACCOUNT, "namespace": "ns"}
    ]
    policy = objs["ValidatingAdmissionPolicy"]["spec"]
    assert policy["failurePolicy"] == "Fail"
    (condition,) = policy["matchConditions"]
    assert f"'system:serviceaccount:ns:{render.SERVICE_ACCOUNT}'" in condition["expression"]
    checks = " ".join(v["expression"] for v in policy["validations"])
    assert render.NODE_NAME_EXTRA in checks and "object.spec.unschedulable" in checks
    assert "object.spec.taints" in checks and "object.metadata.labels" in checks
    binding = objs["ValidatingAdmissionPolicyBinding"]["spec"]
    assert binding == {"policyName": render.NODE_CORDON, "validationActions": ["Deny"]}
    shared = render.shared_objects(namespace="ns", image="i", **render.PLACEHOLDER_FSX)
    (account,) = [o for o in shared if o["kind"] == "ServiceAccount"]
    assert account["automountServiceAccountToken"] is False
    _, job = render.job_objects(overlay="2node", namespace="ns", image="i")
    assert job["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    for o in [*shared, *render.spare_objects(overlay="2node", namespace="ns", image="i")]:
        if o["kind"] == "Deployment":
            assert "automountServiceAccountToken" not in o["spec"]["template"]["spec"]


@pytest.mark.parametrize("overlay", ["smoke", "16node"])
def test_pod_memory_figure_follows_the_jobs_peer_copy(overlay):
    """The Job's ``POD_MEMORY_BYTES`` (the start-up check's need) comes from the Job's own
    trainer arguments: its own two slots, and the peer copy's two more when
    ``--checkpoint.peer_copy=true`` is among them and there is a node before this one to hold
    (one node: the copy is off, so nothing more)."""
    from facts.checkpoint import snapshot_bytes_per_node
    from facts.recipes import RECIPES

    size = SIZES[overlay]
    params = RECIPES[size.recipe].params

    def needed(train_args: list[str]) -> int:
        _, job = render.job_objects(
            overlay=overlay, namespace="ns", image="img", train_args=train_args
        )
        (container,) = job["spec"]["template"]["spec"]["containers"]
        return int(next(e["value"] for e in container["env"] if e["name"] == "POD_MEMORY_BYTES"))

    own = snapshot_bytes_per_node(params=params, nodes=size.nodes, copies=1)
    assert needed([*size.train_args]) == int(own)
    with_peer = needed([*size.train_args, "--checkpoint.peer_copy=true"])
    assert with_peer == int(own * (2 if size.nodes > 1 else 1))
