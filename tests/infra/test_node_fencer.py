"""The node fencer's construct (infra/node_fencer.py): least privilege in IAM and Kubernetes, its
Deployment on the system nodes, and its image.

Run with the rest of the infra tests (the stack is synthesized once per session, tests/infra/
conftest.py). What cannot run here: IAM's evaluation of the tag condition (no AWS account; moto
does not enforce IAM), the Pod Identity agent, the kubectl handler.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from aws_cdk.assertions import Template
from infra_template import K8S_RESOURCE

from infra import node_fencer
from infra.fencer import __main__ as fencer_main
from infra.fencer.settings import FENCER
from infra.image import FENCER_CONTEXT, FENCER_DOCKERFILE
from ops.cordon import LUSTRE_MOUNT, UNFIT_LABEL, cordon_patch

REPO_ROOT = Path(__file__).resolve().parents[2]


def _one(template: dict[str, Any], type_: str, name_part: str) -> tuple[str, dict[str, Any]]:
    (found,) = [
        (k, r) for k, r in template["Resources"].items() if r["Type"] == type_ and name_part in k
    ]
    return found


def _gpu_nodegroup(template: dict[str, Any]) -> str:
    (gpu,) = [
        k
        for k, r in template["Resources"].items()
        if r["Type"] == "AWS::EKS::Nodegroup" and "LaunchTemplate" in r["Properties"]
    ]
    return gpu


def _objects(template: dict[str, Any]) -> list[dict]:
    _, resource = _one(template, K8S_RESOURCE, "NodeFencer")
    joined = resource["Properties"]["Manifest"]["Fn::Join"][1]
    text = "".join(p if isinstance(p, str) else "TOKEN" for p in joined)
    return json.loads(text)


def test_terminate_only_this_clusters_gpu_instances_and_describe(
    default_template: dict[str, Any],
) -> None:
    _, policy = _one(default_template, "AWS::IAM::Policy", "NodeFencer")
    terminate, describe = policy["Properties"]["PolicyDocument"]["Statement"]
    assert terminate["Action"] == "ec2:TerminateInstances"
    assert terminate["Resource"]["Fn::Join"][1][-1] == ":instance/*"
    (cluster,) = [
        k for k, r in default_template["Resources"].items() if r["Type"] == "AWS::EKS::Cluster"
    ]
    assert terminate["Condition"] == {
        "StringEquals": {
            "ec2:ResourceTag/eks:cluster-name": {"Ref": cluster},
            # The node group's name, not its Ref ("cluster/nodegroup": aws/aws-cdk#22442).
            "ec2:ResourceTag/eks:nodegroup-name": {
                "Fn::GetAtt": [_gpu_nodegroup(default_template), "NodegroupName"]
            },
        }
    }
    assert describe == {
        "Action": "ec2:DescribeInstances",
        "Effect": "Allow",
        "Resource": "*",
        "Sid": "ReadInstanceStates",
    }
    # No other policy on the role: no managed policy, nothing inline.
    role_id, role = _one(default_template, "AWS::IAM::Role", "NodeFencer")
    assert "ManagedPolicyArns" not in role["Properties"]
    assert "Policies" not in role["Properties"]
    assert policy["Properties"]["Roles"] == [{"Ref": role_id}]


def test_the_role_is_this_service_accounts_through_pod_identity(
    default_template: dict[str, Any], default_assertions: Template
) -> None:
    role_id, role = _one(default_template, "AWS::IAM::Role", "NodeFencer")
    (statement,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
    assert statement["Principal"] == {"Service": "pods.eks.amazonaws.com"}
    assert sorted(statement["Action"]) == ["sts:AssumeRole", "sts:TagSession"]
    tags = statement["Condition"]["StringEquals"]
    assert tags["aws:RequestTag/kubernetes-namespace"] == node_fencer.NAMESPACE
    assert tags["aws:RequestTag/kubernetes-service-account"] == node_fencer.NAME
    _, association = _one(default_template, "AWS::EKS::PodIdentityAssociation", "NodeFencer")
    props = association["Properties"]
    assert (props["Namespace"], props["ServiceAccount"]) == (
        node_fencer.NAMESPACE,
        node_fencer.NAME,
    )
    assert props["RoleArn"] == {"Fn::GetAtt": [role_id, "Arn"]}


def test_kubernetes_rights_are_nodes_only_and_it_runs_on_the_system_nodes(
    default_template: dict[str, Any],
) -> None:
    objects = {o["kind"]: o for o in _objects(default_template)}
    assert set(objects) == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "Deployment",
    }
    assert objects["ClusterRole"]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]}
    ]
    # In the training namespace only: list pods (is a training pod still on a node? which is
    # Pending on a failed mount?), list events (the kubelet's FailedMount), evict a pod (one
    # stuck on a failed FSx mount). No delete, no get/watch, nothing cluster-wide on pods.
    namespace = default_template["Outputs"]["TrainingNamespace"]["Value"]
    assert objects["Role"]["metadata"]["namespace"] == namespace
    assert objects["Role"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["events"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["pods/eviction"], "verbs": ["create"]},
    ]
    assert objects["RoleBinding"]["roleRef"]["name"] == objects["Role"]["metadata"]["name"]
    assert objects["RoleBinding"]["subjects"] == objects["ClusterRoleBinding"]["subjects"]
    spec = objects["Deployment"]["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert pod["nodeSelector"] == {"node-role": "system"}
    assert pod["serviceAccountName"] == node_fencer.NAME
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "infra.fencer"]
    env = {e["name"]: e["value"] for e in container["env"]}
    # Every variable the fencer requires, from its settings' one owner.
    assert set(env) == set(fencer_main.REQUIRED)
    assert env["FENCE_WAIT_S"] == str(FENCER.wait_s)
    assert env["FENCE_POLL_S"] == str(FENCER.poll_s)
    assert env["FENCE_MAX_BAD_FRACTION"] == str(FENCER.max_bad_fraction)
    assert env["FENCE_MAX_IN_FLIGHT"] == "1"
    assert env["FENCE_NODE_SELECTOR"].startswith(f"{node_fencer.NODEGROUP_LABEL}=")
    assert env["FENCE_JOIN_TIMEOUT_S"] == str(FENCER.join_timeout_s)
    # The product's unfit label from its one owner, the trainer's cordon (ops/cordon.py).
    assert env["FENCE_UNFIT_LABEL"] == UNFIT_LABEL
    assert env["FENCE_NAMESPACES"] == namespace
    assert env["FENCE_MOUNT_TIMEOUT_S"] == str(FENCER.lustre_mount_s)
    assert json.loads(env["FENCE_MOUNT_CORDON"]) == cordon_patch(LUSTRE_MOUNT)
    assert container["ports"] == [{"name": "metrics", "containerPort": FENCER.metrics_port}]
    assert env["FENCE_METRICS_PORT"] == str(FENCER.metrics_port)


def test_the_fencer_is_applied_after_the_training_namespace(
    default_template: dict[str, Any],
) -> None:
    """Its Role lives in the training namespace: applied before it exists, it fails."""
    _, fencer = _one(default_template, K8S_RESOURCE, "NodeFencer")
    (namespace_id,) = [
        k
        for k, r in default_template["Resources"].items()
        if r["Type"] == K8S_RESOURCE and "TrainingNamespace" in k
    ]
    assert namespace_id in fencer["DependsOn"]


def test_the_scraper_reads_the_fencers_metrics_port() -> None:
    from infra.observability import scrape_config

    (job,) = [
        j
        for j in scrape_config(training_namespace="training")["scrape_configs"]
        if j["job_name"] == node_fencer.NAME
    ]
    assert job["kubernetes_sd_configs"] == [
        {"role": "pod", "namespaces": {"names": [node_fencer.NAMESPACE]}}
    ]
    keep = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"] if r.get("action")}
    assert keep == {
        "__meta_kubernetes_pod_label_app_kubernetes_io_name": node_fencer.NAME,
        "__meta_kubernetes_pod_container_port_name": node_fencer.METRICS_PORT_NAME,
    }


def test_in_flight_follows_the_overlays_spares() -> None:
    from manifests.sizes import SIZES

    assert node_fencer.max_in_flight(None) == 1
    for name, size in SIZES.items():
        assert node_fencer.max_in_flight(name) == max(size.spares, 1)


def test_the_gpu_nodegroup_output_is_its_name(default_template: dict[str, Any]) -> None:
    value = default_template["Outputs"]["GpuNodegroupName"]["Value"]
    assert value == {"Fn::GetAtt": [_gpu_nodegroup(default_template), "NodegroupName"]}


def test_the_image_holds_every_fencer_module_at_the_locked_versions() -> None:
    modules = {f"infra/fencer/{p.name}" for p in (REPO_ROOT / "infra" / "fencer").glob("*.py")}
    assert modules <= set(FENCER_CONTEXT)
    dockerfile = (REPO_ROOT / FENCER_DOCKERFILE).read_text()
    for path in FENCER_CONTEXT[1:]:
        assert path in dockerfile, path
    lock = (REPO_ROOT / "requirements.lock").read_text()
    for package, arg in (
        ("kubernetes", "KUBERNETES_VERSION"),
        ("awscrt", "AWSCRT_VERSION"),
        ("prometheus-client", "PROMETHEUS_CLIENT_VERSION"),
    ):
        (locked,) = re.findall(rf"^{package}==(\S+)$", lock, re.M)
        assert f"ARG {arg}={locked}" in dockerfile


def test_the_fencer_exits_with_the_projects_usage_code() -> None:
    from infra.fencer.settings import USAGE
    from training import exits

    assert USAGE == exits.USAGE


def test_the_fence_wait_is_the_trainer_pods_own_toleration() -> None:
    """FENCER.wait_s is the blip tolerance (infra/fencer/settings.py): held equal to the trainer
    pod's toleration of the unreachable taint, so the fence never ends a node whose pod would
    have lived, and never waits past the moment that pod is evicted anyway."""
    from manifests.render import NODE_LOSS_TOLERATION_SECONDS

    assert FENCER.wait_s == NODE_LOSS_TOLERATION_SECONDS
