"""Tests of the manifests: kustomize build, strict schema validation, size invariants, snapshots.

Run: .venv/bin/pytest tests/manifests/test_render.py
Update the snapshots after an intended change: .venv/bin/pytest tests/manifests --snapshot-update
Regenerate the YAML after changing manifests/sizes.py or render.py:
    .venv/bin/python -m manifests.render write

The kustomize tests need `kubectl` (its built-in kustomize) and are skipped without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from manifests import render
from manifests.sizes import SIZES

ROOT = Path(render.__file__).resolve().parent
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl (with built-in kustomize) is not installed"
)


def _key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _kustomize(overlay: str) -> list[dict]:
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
    for rel, text in render.generated_files().items():
        path = ROOT / rel
        assert path.exists(), f"{rel} missing: run python -m manifests.render write"
        assert path.read_text() == text, f"{rel} is stale: run python -m manifests.render write"
    committed = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.yaml")}
    assert committed == set(render.generated_files()), "stray YAML under manifests/"


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
    assert spec["parallelism"] == spec["completions"] == size.nodes == int(env["NNODES"])
    assert int(env["NPROC_PER_NODE"]) == gpus == 8  # p5.48xlarge
    assert int(res["limits"]["vpc.amazonaws.com/efa"]) == 32  # p5's network cards
    assert int(env["WORLD_SIZE_EXPECTED"]) == size.nodes * gpus
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

    # Rendezvous on rank 0's stable DNS name through the headless Service.
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    assert pod["subdomain"] == service["metadata"]["name"] == job["metadata"]["name"]
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    # Storage: FSx, memory-backed /dev/shm, node scratch.
    assert volumes[mounts["/fsx"]]["persistentVolumeClaim"]["claimName"] == render.PVC_NAME
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "emptyDir" in volumes[mounts["/scratch"]]
    assert "IPC_LOCK" in container["securityContext"]["capabilities"]["add"]
    assert container["envFrom"] == [{"configMapRef": {"name": render.CONFIG_MAP}}]
    assert container["image"] == "img:1"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    # Failure handling: config errors fail at once, disruptions do not count.
    rules = spec["podFailurePolicy"]["rules"]
    assert rules[0]["action"] == "FailJob"
    assert 2 in rules[0]["onExitCodes"]["values"]
    assert rules[1] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
    assert pod["restartPolicy"] == "Never"
    assert spec["backoffLimit"] >= 1
    assert spec["ttlSecondsAfterFinished"] > 0
    # The final checkpoint fits: ft_launcher's SIGKILL comes before the kubelet's.
    assert pod["terminationGracePeriodSeconds"] >= 300
    assert int(_env(container)["TERM_TIMEOUT"]) < pod["terminationGracePeriodSeconds"]


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
    ]
    pv = objs[3]
    assert pv["spec"]["csi"] == {
        "driver": "fsx.csi.aws.com",
        "volumeHandle": tok,
        "volumeAttributes": {"dnsname": tok + ".dns", "mountname": tok + ".mnt"},
    }
    assert pv["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    assert pv["spec"]["capacity"]["storage"] == "2400Gi"
    pvc = objs[4]
    assert pvc["spec"]["volumeName"] == pv["metadata"]["name"]
    assert pvc["metadata"]["namespace"] == "training"


def test_unknown_overlay_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown overlay 'huge'.*smoke, 2node, 16node"):
        render.job_objects(overlay="huge", namespace="ns", image="img")


def test_restart_and_train_args_overrides():
    job = _job(
        render.job_objects(
            overlay="2node",
            namespace="ns",
            image="img",
            restart="inprocess",
            train_args=["--train.steps=5"],
        )
    )
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert _env(container)["RESTART"] == "inprocess"
    assert container["args"] == ["--train.steps=5"]
    with pytest.raises(ValueError, match="restart must be one of injob, inprocess"):
        render.job_objects(overlay="smoke", namespace="ns", image="img", restart="both")


def test_json_patch_round_trip():
    old = {"a": 1, "b": [{"name": "X", "value": "1"}], "c/d": 2}
    new = {"a": 2, "b": [{"name": "X", "value": "3"}], "e": 4}
    ops = render.json_patch(old=old, new=new)
    assert {"op": "test", "path": "/b/0/name", "value": "X"} in ops
    assert {"op": "remove", "path": "/c~1d"} in ops
    assert {"op": "add", "path": "/e", "value": 4} in ops


def _run_launch_script(tmp_path: Path, *, overlay: str, restart: str, args: list[str]) -> list[str]:
    """Run the container's bash entry point with stub getent/ft_launcher/torchrun on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("getent", "ft_launcher", "torchrun"):
        stub = bin_dir / tool
        body = "exit 0" if tool == "getent" else f'printf "%s\\n" {tool} "$@"'
        stub.write_text(f"#!/bin/bash\n{body}\n")
        stub.chmod(0o755)
    job = _job(render.job_objects(overlay=overlay, namespace="ns", image="i", restart=restart))
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {**_env(container), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env["JOB_COMPLETION_INDEX"] = "1"  # set by Kubernetes in Indexed Jobs
    out = subprocess.run(
        [*container["command"], *args], env=env, capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_launch_script_injob_passes_ft_launcher_parser(tmp_path):
    argv = _run_launch_script(tmp_path, overlay="2node", restart="injob", args=["--train.steps=7"])
    assert argv[0] == "ft_launcher"
    from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser

    ns = get_args_parser().parse_args(argv[1:])  # the real flag spellings of ft_launcher
    assert ns.nnodes == "2"
    assert int(ns.nproc_per_node) == 8
    assert ns.rdzv_endpoint == "fsdp-2node-0.fsdp-2node:29500"
    assert ns.rdzv_backend == "c10d"
    assert ns.rdzv_id == "fsdp-2node"
    assert ns.module is True and ns.training_script == "training"
    assert ns.training_script_args == [
        "train",
        "--recipe",
        "p5_8b",
        "--run-dir",
        "/fsx/runs/fsdp-2node",
        "--restart",
        "injob",
        "--checkpoint.dir=/fsx/checkpoints/fsdp-2node",
        "--data.path=/fsx/data/stdlib",
        "--train.steps=7",
    ]


def test_launch_script_inprocess_uses_static_ranks(tmp_path):
    argv = _run_launch_script(tmp_path, overlay="16node", restart="inprocess", args=[])
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args(argv[1:])  # torchrun's real flag spellings
    assert ns.training_script == "training"
    assert ns.training_script_args[:3] == ["train", "--recipe", "p5_70b"]
    assert argv[:7] == [
        "torchrun",
        "--nnodes=16",
        "--nproc-per-node=8",
        "--node-rank=1",
        "--master-addr=fsdp-16node-0.fsdp-16node",
        "--master-port=29500",
        "--max-restarts=0",
    ]
    assert "inprocess" in argv


def test_launch_script_rejects_unknown_restart_with_exit_2(tmp_path):
    """Exit 2 is a configuration error: the pod failure policy fails the Job at once."""
    job = _job(render.job_objects(overlay="smoke", namespace="ns", image="i"))
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {**_env(container), "RESTART": "both", "PATH": os.environ["PATH"]}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    (tmp_path / "getent").write_text("#!/bin/bash\nexit 0\n")
    (tmp_path / "getent").chmod(0o755)
    out = subprocess.run(container["command"], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2
    assert "RESTART must be injob or inprocess" in out.stderr


def test_scripts_have_no_kubernetes_variable_references():
    """Kubernetes expands $(NAME) in command/args: the scripts must not contain "$("."""
    assert "$(" not in render.LAUNCH_SCRIPT
    assert "$(" not in render.PREPARE_SCRIPT
    subprocess.run(["bash", "-n", "-c", render.PREPARE_SCRIPT], check=True)


@pytest.mark.parametrize("overlay", render.OVERLAYS)
def test_snapshot(overlay, snapshot):
    text = "---\n".join(render.to_yaml(o) for o in render.placeholder_objects(overlay=overlay))
    assert text == snapshot


def test_render_cli_show(capsys):
    assert render.main(["show", "smoke"]) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs][-2:] == ["Service", "Job"]
    assert textwrap.dedent(render.LAUNCH_SCRIPT).startswith("set -euo pipefail")
