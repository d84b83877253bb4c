"""Fine-grained assertions on the synthesized template: EFA launch template, placement group,
node groups, FSx, Pod Identity, Helm charts, cluster security, Kubernetes objects, outputs.

    .venv/bin/pytest tests/infra/test_infra_stack.py      # ~40 s (two syntheses, 2 cores)

Everything runs offline; whether AWS accepts the template (capacity, quotas, the charts being
reachable) can only be seen by `make deploy` in an account.
"""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any

import pytest
from infra_synth import VARIANT_CONTEXT, resources

from infra.addons import CHARTS, DCGM_EXPORTER, EFA_DEVICE_PLUGIN, NVIDIA_DEVICE_PLUGIN
from infra.gpu_nodegroup import hugepages_2mi_count
from infra.nag import CHECKOV_KUBECTL_PROVIDER, eks_cluster_findings
from infra.storage import AUTO_EXPORT_EVENTS, CHECKPOINTS_PATH
from manifests import render

Template = dict[str, Any]


def one(template: Template, type_: str, **match: Any) -> dict[str, Any]:
    """The single resource of a type whose properties include `match`."""
    found = [
        r["Properties"]
        for r in resources(template, type_).values()
        if all(r["Properties"].get(k) == v for k, v in match.items())
    ]
    assert len(found) == 1, f"{len(found)} {type_} resources match {match}"
    return found[0]


def logical_id(template: Template, type_: str, **match: Any) -> str:
    ids = [
        k
        for k, r in resources(template, type_).items()
        if all(r["Properties"].get(k2) == v for k2, v in match.items())
    ]
    assert len(ids) == 1
    return ids[0]


def launch_template(template: Template) -> dict[str, Any]:
    return one(template, "AWS::EC2::LaunchTemplate")["LaunchTemplateData"]


def gpu_nodegroup(template: Template) -> dict[str, Any]:
    return one(template, "AWS::EKS::Nodegroup", AmiType="AL2023_x86_64_NVIDIA")


def efa_group(template: Template) -> dict[str, Any]:
    return {"Fn::GetAtt": [logical_id_of_efa_sg(template), "GroupId"]}


def logical_id_of_efa_sg(template: Template) -> str:
    (sg,) = [
        k
        for k, r in resources(template, "AWS::EC2::SecurityGroup").items()
        if "EFA" in r["Properties"]["GroupDescription"]
    ]
    return sg


# --- GPU nodes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "secondary"), [("default_template", "efa-only"), ("variant_template", "efa")]
)
def test_all_32_network_cards_carry_efa(
    fixture: str, secondary: str, request: pytest.FixtureRequest
) -> None:
    template = request.getfixturevalue(fixture)
    data = launch_template(template)
    interfaces = data["NetworkInterfaces"]
    assert data["InstanceType"] == "p5.48xlarge"
    assert len(interfaces) == 32
    assert sorted(i["NetworkCardIndex"] for i in interfaces) == list(range(32))
    primary = next(i for i in interfaces if i["NetworkCardIndex"] == 0)
    assert (primary["DeviceIndex"], primary["InterfaceType"]) == (0, "efa")
    cluster_sg = {
        "Fn::GetAtt": [logical_id(template, "AWS::EKS::Cluster"), "ClusterSecurityGroupId"]
    }
    assert primary["Groups"] == [cluster_sg, efa_group(template)]
    for secondary_interface in interfaces[1:]:
        assert secondary_interface["DeviceIndex"] == 1
        assert secondary_interface["InterfaceType"] == secondary
        assert secondary_interface["Groups"] == [efa_group(template)]
    # A managed node group's launch template must leave these to EKS.
    for forbidden in ("SecurityGroupIds", "SubnetId", "IamInstanceProfile", "ImageId"):
        assert forbidden not in data


def test_placement_group_is_cluster_and_used(default_template: Template) -> None:
    placement_id = logical_id(default_template, "AWS::EC2::PlacementGroup", Strategy="cluster")
    data = launch_template(default_template)
    assert data["Placement"] == {"GroupName": {"Ref": placement_id}}


def test_imdsv2_root_volume_and_raid0(default_template: Template) -> None:
    data = launch_template(default_template)
    assert data["MetadataOptions"]["HttpTokens"] == "required"
    (root,) = data["BlockDeviceMappings"]
    assert root["DeviceName"] == "/dev/xvda"
    assert root["Ebs"] == {
        "DeleteOnTermination": True,
        "Encrypted": True,
        "Iops": 3000,
        "Throughput": 250,
        "VolumeSize": 500,
        "VolumeType": "gp3",
    }
    user_data = data["UserData"]["Fn::Base64"]
    assert "Content-Type: application/node.eks.aws" in user_data
    assert "strategy: RAID0" in user_data
    assert "CapacityReservationSpecification" not in data  # on-demand by default


def test_gpu_nodegroup(default_template: Template) -> None:
    group = gpu_nodegroup(default_template)
    assert "InstanceTypes" not in group  # in the launch template: eks_v2 rejects p5 here
    assert group["CapacityType"] == "ON_DEMAND"
    assert group["Taints"] == [
        {"Effect": "NO_SCHEDULE", "Key": "nvidia.com/gpu", "Value": "true"},
        # Removed by the FSx CSI node driver once its Lustre client is ready.
        {"Effect": "NO_EXECUTE", "Key": "fsx.csi.aws.com/agent-not-ready"},
    ]
    assert group["Labels"]["vpc.amazonaws.com/efa.present"] == "true"
    assert group["NodeRepairConfig"] == {"Enabled": True}
    # No p5 starts unless asked: -c gpuNodesDesired=N is the one command that asks.
    assert group["ScalingConfig"] == {"DesiredSize": 0, "MaxSize": 16, "MinSize": 0}
    # One subnet, the private subnet in the GPU AZ (a cluster placement group is single-AZ).
    (subnet,) = group["Subnets"]
    subnet_props = default_template["Resources"][subnet["Ref"]]["Properties"]
    assert subnet_props["AvailabilityZone"] == "us-east-2a"
    assert subnet_props["MapPublicIpOnLaunch"] is False


def test_capacity_block_targeting(variant_template: Template) -> None:
    data = launch_template(variant_template)
    assert data["CapacityReservationSpecification"] == {
        "CapacityReservationTarget": {
            "CapacityReservationId": VARIANT_CONTEXT["capacityReservationId"]
        }
    }
    assert data["InstanceMarketOptions"] == {"MarketType": "capacity-block"}
    assert gpu_nodegroup(variant_template)["CapacityType"] == "CAPACITY_BLOCK"


def test_efa_security_group_allows_all_traffic_to_and_from_itself(
    default_template: Template,
) -> None:
    sg_id = logical_id_of_efa_sg(default_template)
    sg = default_template["Resources"][sg_id]["Properties"]
    self_ref = {"Fn::GetAtt": [sg_id, "GroupId"]}
    # allow_all_outbound=False: no rule to the internet on the EFA interfaces.
    assert all(rule.get("CidrIp") != "0.0.0.0/0" for rule in sg.get("SecurityGroupEgress", []))
    ingress = one(default_template, "AWS::EC2::SecurityGroupIngress", GroupId=self_ref)
    assert (ingress["IpProtocol"], ingress["SourceSecurityGroupId"]) == ("-1", self_ref)
    egress = one(default_template, "AWS::EC2::SecurityGroupEgress", GroupId=self_ref)
    assert (egress["IpProtocol"], egress["DestinationSecurityGroupId"]) == ("-1", self_ref)


def test_system_nodegroup_is_small_and_on_demand(default_template: Template) -> None:
    group = one(default_template, "AWS::EKS::Nodegroup", AmiType="AL2023_x86_64_STANDARD")
    assert group["CapacityType"] == "ON_DEMAND"
    assert group["InstanceTypes"] == ["m7i.xlarge"]
    assert group["ScalingConfig"]["DesiredSize"] == 2


# --- network ---------------------------------------------------------------------------------


def test_vpc_layout(default_template: Template) -> None:
    subnets = resources(default_template, "AWS::EC2::Subnet").values()
    public = [s for s in subnets if s["Properties"]["MapPublicIpOnLaunch"]]
    private = [s for s in subnets if not s["Properties"]["MapPublicIpOnLaunch"]]
    assert len({s["Properties"]["AvailabilityZone"] for s in public}) >= 2
    assert len({s["Properties"]["AvailabilityZone"] for s in private}) >= 2
    assert len(resources(default_template, "AWS::EC2::NatGateway")) >= 1
    (endpoint,) = resources(default_template, "AWS::EC2::VPCEndpoint").values()
    assert endpoint["Properties"]["VpcEndpointType"] == "Gateway"
    assert ".s3" in json.dumps(endpoint["Properties"]["ServiceName"])
    assert len(resources(default_template, "AWS::EC2::FlowLog")) == 1


# --- cluster ---------------------------------------------------------------------------------


def test_cluster_security(default_template: Template, variant_template: Template) -> None:
    cluster = one(default_template, "AWS::EKS::Cluster")
    assert cluster["Version"] == "1.36"
    vpc_config = cluster["ResourcesVpcConfig"]
    assert vpc_config["EndpointPublicAccess"] is False  # no CIDRs configured: private only
    assert vpc_config["EndpointPrivateAccess"] is True
    variant = one(variant_template, "AWS::EKS::Cluster")["ResourcesVpcConfig"]
    assert variant["EndpointPublicAccess"] is True
    assert variant["PublicAccessCidrs"] == ["203.0.113.7/32", "198.51.100.0/24"]
    assert eks_cluster_findings(default_template) == []
    assert eks_cluster_findings(variant_template) == []


def test_own_eks_checks_catch_an_open_cluster(default_template: Template) -> None:
    template = json.loads(json.dumps(default_template))
    cluster = one(template, "AWS::EKS::Cluster")
    cluster["ResourcesVpcConfig"].update(EndpointPublicAccess=True, PublicAccessCidrs=[])
    cluster["Logging"]["ClusterLogging"]["EnabledTypes"] = [{"Type": "api"}]
    del cluster["EncryptionConfig"]
    findings = " | ".join(eks_cluster_findings(template))
    assert "open to the internet" in findings
    assert "'audit'" in findings
    assert "not encrypted" in findings


def test_admin_access_entry(default_template: Template, variant_template: Template) -> None:
    def admin_entries(template: Template) -> list[dict[str, Any]]:
        return [
            r["Properties"]
            for r in resources(template, "AWS::EKS::AccessEntry").values()
            if r["Properties"]["PrincipalArn"] == VARIANT_CONTEXT["adminPrincipalArn"]
        ]

    assert admin_entries(default_template) == []
    (entry,) = admin_entries(variant_template)
    (policy,) = entry["AccessPolicies"]
    assert policy["AccessScope"] == {"Type": "cluster"}
    assert "AmazonEKSClusterAdminPolicy" in json.dumps(policy["PolicyArn"])


def test_core_addons(default_template: Template) -> None:
    names = {
        r["Properties"]["AddonName"]
        for r in resources(default_template, "AWS::EKS::Addon").values()
    }
    assert names == {"eks-pod-identity-agent", "eks-node-monitoring-agent", "aws-fsx-csi-driver"}


# --- storage ---------------------------------------------------------------------------------


def test_fsx_file_system(default_template: Template, variant_template: Template) -> None:
    fs = one(default_template, "AWS::FSx::FileSystem")
    assert fs["LustreConfiguration"] == {
        "AutomaticBackupRetentionDays": 7,
        "DataCompressionType": "LZ4",
        "DeploymentType": "PERSISTENT_2",
        "PerUnitStorageThroughput": 250,
    }
    # Sized for the largest overlay (16node, p5_70b): infra/sizing.py.
    assert fs["StorageCapacity"] == 4800
    # Same subnet as the GPU nodes.
    assert fs["SubnetIds"] == gpu_nodegroup(default_template)["Subnets"]
    variant = one(variant_template, "AWS::FSx::FileSystem")
    assert variant["StorageCapacity"] == 4800
    assert variant["LustreConfiguration"]["PerUnitStorageThroughput"] == 500
    assert resources(default_template, "AWS::FSx::DataRepositoryAssociation") == {}
    link = one(variant_template, "AWS::FSx::DataRepositoryAssociation")
    assert link["DataRepositoryPath"] == VARIANT_CONTEXT["fsxS3Link"]
    assert link["FileSystemPath"] == "/"  # the whole file system, checkpoints included


def test_lustre_ports_open_only_from_the_nodes(default_template: Template) -> None:
    fs = one(default_template, "AWS::FSx::FileSystem")
    (fsx_sg,) = fs["SecurityGroupIds"]
    cluster_sg = {
        "Fn::GetAtt": [logical_id(default_template, "AWS::EKS::Cluster"), "ClusterSecurityGroupId"]
    }
    rules = [
        r["Properties"]
        for r in resources(default_template, "AWS::EC2::SecurityGroupIngress").values()
        if r["Properties"]["GroupId"] == fsx_sg
    ]
    inline = default_template["Resources"][fsx_sg["Fn::GetAtt"][0]]["Properties"]
    assert "SecurityGroupIngress" not in inline
    from_nodes = {
        (r["FromPort"], r["ToPort"]) for r in rules if r["SourceSecurityGroupId"] == cluster_sg
    }
    assert from_nodes == {(988, 988), (1018, 1023)}
    # Every other rule is the file system talking to itself.
    assert all(r["SourceSecurityGroupId"] in (cluster_sg, fsx_sg) for r in rules)
    assert all("CidrIp" not in r for r in rules)


def test_fsx_csi_driver_uses_pod_identity(default_template: Template) -> None:
    addon = one(default_template, "AWS::EKS::Addon", AddonName="aws-fsx-csi-driver")
    (association,) = addon["PodIdentityAssociations"]
    assert association["ServiceAccount"] == "fsx-csi-controller-sa"
    role_id = association["RoleArn"]["Fn::GetAtt"][0]
    trust = default_template["Resources"][role_id]["Properties"]["AssumeRolePolicyDocument"]
    actions = {
        a
        for s in trust["Statement"]
        for a in ([s["Action"]] if isinstance(s["Action"], str) else s["Action"])
    }
    assert {"sts:AssumeRole", "sts:TagSession"} <= actions
    assert {s["Principal"]["Service"] for s in trust["Statement"]} == {"pods.eks.amazonaws.com"}
    pod_identity = logical_id(
        default_template, "AWS::EKS::Addon", AddonName="eks-pod-identity-agent"
    )
    assert (
        pod_identity
        in default_template["Resources"][
            logical_id(default_template, "AWS::EKS::Addon", AddonName="aws-fsx-csi-driver")
        ]["DependsOn"]
    )


# --- Helm charts -----------------------------------------------------------------------------


def test_charts_are_pinned_in_one_place(default_template: Template) -> None:
    charts = {
        r["Properties"]["Chart"]: r["Properties"]
        for r in resources(default_template, "Custom::AWSCDK-EKS-HelmChart").values()
    }
    assert (
        set(charts)
        == {c.name for c in CHARTS}
        == {
            "nvidia-device-plugin",
            "aws-efa-k8s-device-plugin",
            "dcgm-exporter",
        }
    )
    assert {NVIDIA_DEVICE_PLUGIN, EFA_DEVICE_PLUGIN, DCGM_EXPORTER} == set(CHARTS)
    for pinned in CHARTS:
        chart = charts[pinned.name]
        assert (chart["Version"], chart["Repository"]) == (pinned.version, pinned.repository)
        assert re.fullmatch(r"v?\d+\.\d+\.\d+", chart["Version"]), chart["Version"]
    efa_values = json.loads(charts["aws-efa-k8s-device-plugin"]["Values"])
    assert efa_values["nodeSelector"] == {"vpc.amazonaws.com/efa.present": "true"}
    assert efa_values["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_dcgm_exporter_on_gpu_nodes_only(default_template: Template) -> None:
    (chart,) = [
        r["Properties"]
        for r in resources(default_template, "Custom::AWSCDK-EKS-HelmChart").values()
        if r["Properties"]["Chart"] == "dcgm-exporter"
    ]
    values = json.loads(chart["Values"])
    # The GPU nodes' label (set by the node group) and the GPU taint's toleration, nothing more.
    assert values["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert gpu_nodegroup(default_template)["Labels"]["nvidia.com/gpu.present"] == "true"
    assert values["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    # No ServiceMonitor: its CRD (Prometheus Operator) is not installed by this stack.
    assert values["serviceMonitor"] == {"enabled": False}


# --- Kubernetes objects ----------------------------------------------------------------------


def k8s_manifests(template: Template) -> dict[str, dict[str, Any]]:
    return resources(template, "Custom::AWSCDK-EKS-KubernetesResource")


def manifest_text(resource: dict[str, Any]) -> str:
    return json.dumps(resource["Properties"]["Manifest"])


def test_shared_objects_order_and_fsx_volume(default_template: Template) -> None:
    manifests = k8s_manifests(default_template)
    assert len(manifests) == 2  # no training job without -c train=...
    (namespace_id,) = [
        k for k, r in manifests.items() if '\\"kind\\":\\"Namespace\\"' in manifest_text(r)
    ]
    (shared_id,) = [k for k in manifests if k != namespace_id]
    csi = logical_id(default_template, "AWS::EKS::Addon", AddonName="aws-fsx-csi-driver")
    assert {namespace_id, csi} <= set(manifests[shared_id]["DependsOn"])
    text = manifest_text(manifests[shared_id])
    fs_id = logical_id(default_template, "AWS::FSx::FileSystem")
    for expected in (
        "PersistentVolume",
        "PersistentVolumeClaim",
        "fsx.csi.aws.com",
        fs_id,
        "LustreMountName",
    ):
        assert expected in text


@pytest.mark.parametrize("fixture", ["default_template", "variant_template"])
def test_the_stack_owns_no_job(fixture: str, request: pytest.FixtureRequest) -> None:
    """No stack operation can fail on, delete or rerun training: no Job is a stack resource
    (the Job is submitted by `make train TARGET=eks`; infra/workloads.py says why)."""
    template = request.getfixturevalue(fixture)
    manifests = k8s_manifests(template)
    assert len(manifests) == 2  # the namespace, then the shared objects
    for resource in manifests.values():
        kinds = set(re.findall(r'\\"kind\\":\\"(\w+)\\"', manifest_text(resource)))
        assert kinds
        assert "Job" not in kinds
        # The shared objects are the renderer's, applied on every deploy.
        assert kinds <= {o["kind"] for o in render.shared_objects(**SHARED_ARGS)}


SHARED_ARGS = {
    "namespace": "training",
    "file_system_id": "fs-0",
    "dns_name": "d",
    "mount_name": "m",
    "storage_capacity_gib": 1200,
    "image": "i:1",
}


# --- image and outputs -----------------------------------------------------------------------


def test_image_repository_and_asset(default_template: Template, variant_template: Template) -> None:
    repo = one(default_template, "AWS::ECR::Repository")
    assert repo["ImageTagMutability"] == "IMMUTABLE"
    assert repo["ImageScanningConfiguration"] == {"ScanOnPush": True}
    image = json.dumps(default_template["Outputs"]["ImageUri"]["Value"])
    assert "container-assets" in image  # built from training/Dockerfile at deploy time
    assert variant_template["Outputs"]["ImageUri"]["Value"] == VARIANT_CONTEXT["imageUri"]


def test_outputs_for_the_job_launcher(default_template: Template) -> None:
    outputs = default_template["Outputs"]
    for name in (
        "ClusterName",
        "UpdateKubeconfigCommand",
        "FsxFileSystemId",
        "FsxDnsName",
        "FsxMountName",
        "ImageUri",
        "TrainingNamespace",
        "Region",
    ):
        assert name in outputs, name
    assert outputs["ClusterName"]["Value"] == "fsdp-resilient"
    assert outputs["TrainingNamespace"]["Value"] == "training"
    assert outputs["UpdateKubeconfigCommand"]["Value"] == (
        "aws eks update-kubeconfig --region us-east-2 --name fsdp-resilient"
    )


def test_imds_hop_limit_is_one(default_template: Template) -> None:
    options = launch_template(default_template)["MetadataOptions"]
    assert options["HttpPutResponseHopLimit"] == 1
    assert options["HttpTokens"] == "required"


def test_no_placement_group_for_capacity_blocks(variant_template: Template) -> None:
    """EC2: a Capacity Block needs no cluster placement group; forcing one fails to launch."""
    assert resources(variant_template, "AWS::EC2::PlacementGroup") == {}
    assert "Placement" not in launch_template(variant_template)


def test_fsx_is_retained_with_backups(default_template: Template) -> None:
    (fs,) = resources(default_template, "AWS::FSx::FileSystem").values()
    assert fs["DeletionPolicy"] == "Retain"
    assert fs["UpdateReplacePolicy"] == "Retain"
    assert fs["Properties"]["LustreConfiguration"]["AutomaticBackupRetentionDays"] == 7


# --- node updates, huge pages ------------------------------------------------------------------


def test_gpu_updates_need_no_spare_capacity(default_template: Template) -> None:
    """A launch-template change replaces every GPU node: one at a time, the old instance
    terminated before its replacement launches (MINIMAL), so reservations, Capacity Blocks and
    a full placement group, which have no spare p5, can be updated."""
    assert gpu_nodegroup(default_template)["UpdateConfig"] == {
        "MaxUnavailable": 1,
        "UpdateStrategy": "MINIMAL",
    }
    # The node group follows the template's latest version: a change rolls the nodes.
    version = gpu_nodegroup(default_template)["LaunchTemplate"]["Version"]
    assert version["Fn::GetAtt"][1] == "LatestVersionNumber"


def user_data(template: Template) -> str:
    return launch_template(template)["UserData"]["Fn::Base64"]


def test_hugepages_allocated_at_boot_for_what_the_pods_request(
    default_template: Template,
) -> None:
    text = user_data(default_template)
    assert text.startswith("MIME-Version: 1.0\nContent-Type: multipart/mixed;")
    parts = text.split("--==NODEADM==")
    assert parts[-1].strip() == "--"  # closed multi-part document
    (script,) = [p for p in parts if "Content-Type: text/x-shellscript" in p]
    pages = hugepages_2mi_count()
    assert f"\nwant={pages}\n" in script
    assert 'sysctl -w vm.nr_hugepages="$want"' in script
    assert '"vm.nr_hugepages = $want" > /etc/sysctl.d/' in script  # persisted for reboots
    body = script.split("\n\n", 1)[1]  # after the part's headers
    checked = subprocess.run(["bash", "-n"], input=body, text=True, capture_output=True)
    assert checked.returncode == 0, checked.stderr
    # At least what every overlay's trainer pod requests (one pod per node), in 2 MiB pages.
    for overlay in render.OVERLAYS:
        for obj in render.job_objects(overlay=overlay, namespace="training", image="i:1"):
            if obj["kind"] != "Job":
                continue
            for container in obj["spec"]["template"]["spec"]["containers"]:
                requested = container["resources"]["requests"].get("hugepages-2Mi")
                if requested:
                    assert requested.endswith("Mi")
                    assert pages * 2 >= int(requested[:-2]), overlay


# --- FSx: S3 export, sizing --------------------------------------------------------------------


def test_s3_link_exports_the_checkpoints(variant_template: Template) -> None:
    link = one(variant_template, "AWS::FSx::DataRepositoryAssociation")
    assert link["DataRepositoryPath"] == VARIANT_CONTEXT["fsxS3Link"]
    path = link["FileSystemPath"]
    assert CHECKPOINTS_PATH.startswith(path)  # the association covers the checkpoints
    assert link["S3"]["AutoExportPolicy"]["Events"] == AUTO_EXPORT_EVENTS
    assert set(AUTO_EXPORT_EVENTS) == {"NEW", "CHANGED", "DELETED"}
    assert link["BatchImportMetaDataOnCreate"] is True
    # Every overlay's trainer writes its checkpoints there (the PV mounts the file system root).
    for overlay in render.OVERLAYS:
        (job,) = [
            o
            for o in render.job_objects(overlay=overlay, namespace="training", image="i:1")
            if o["kind"] == "Job"
        ]
        args = job["spec"]["template"]["spec"]["containers"][0]["args"]
        (ckpt,) = [a for a in args if a.startswith("--checkpoint.dir=")]
        assert ckpt.split("=", 1)[1].startswith(render.FSX_MOUNT + CHECKPOINTS_PATH + "/")


def test_flow_logs_encrypted_with_the_stacks_key(default_template: Template) -> None:
    (group,) = resources(default_template, "AWS::Logs::LogGroup").values()
    key_id = group["Properties"]["KmsKeyId"]["Fn::GetAtt"][0]
    flow_log = one(default_template, "AWS::EC2::FlowLog")
    assert flow_log["LogGroupName"] == {"Ref": logical_id_of(default_template, group)}
    statements = default_template["Resources"][key_id]["Properties"]["KeyPolicy"]["Statement"]
    (logs,) = [s for s in statements if s.get("Sid") == "CloudWatchLogsUseOfTheKey"]
    assert logs["Principal"]["Service"] == {
        "Fn::Join": ["", ["logs.", {"Ref": "AWS::Region"}, ".amazonaws.com"]]
    }
    assert "kms:GenerateDataKey*" in logs["Action"]
    assert "kms:EncryptionContext:aws:logs:arn" in logs["Condition"]["ArnLike"]


def logical_id_of(template: Template, resource: dict[str, Any]) -> str:
    (found,) = [k for k, r in template["Resources"].items() if r is resource]
    return found


# --- IaC scan (checkov) ------------------------------------------------------------------------


def test_checkov_findings_are_acknowledged_on_their_resources(default_template: Template) -> None:
    """checkov 3.3.30 over the default and variant templates found only these, on aws-cdk-lib's
    kubectl provider functions; each carries its acknowledgment (infra/nag.py) in the template,
    where `checkov -d cdk.out` reads it."""
    functions = resources(default_template, "AWS::Lambda::Function")
    assert functions
    for function in functions.values():
        (skips,) = [function["Metadata"]["checkov"]["skip"]]
        assert {s["id"] for s in skips} == set(CHECKOV_KUBECTL_PROVIDER)
        assert all(len(s["comment"]) > 40 for s in skips)
    # Fixed rather than acknowledged: ECR encrypted with KMS (CKV_AWS_136).
    repo = one(default_template, "AWS::ECR::Repository")
    assert repo["EncryptionConfiguration"] == {"EncryptionType": "KMS"}
    # Nothing else is skipped anywhere.
    skipped = [
        k for k, r in default_template["Resources"].items() if "checkov" in r.get("Metadata", {})
    ]
    assert set(skipped) == set(functions)


@pytest.mark.parametrize(("before", "after"), [(0, None), (4096, 4096)])
def test_hugepage_script_raises_the_count_never_lowers_it(
    default_template: Template, tmp_path: Any, before: int, after: int | None
) -> None:
    """The user data's script run against a stand-in /proc and /etc (sysctl stubbed)."""
    (script,) = [p for p in user_data(default_template).split("--==NODEADM==") if "#!/bin" in p]
    body = script.split("\n\n", 1)[1]
    nr, etc = tmp_path / "nr_hugepages", tmp_path / "sysctl.d"
    etc.mkdir()
    nr.write_text(f"{before}\n")
    stub = f'sysctl() {{ echo "${{2#*=}}" > {nr}; }}\n'
    body = body.replace("/proc/sys/vm/nr_hugepages", str(nr)).replace("/etc/sysctl.d/", f"{etc}/")
    subprocess.run(["bash", "-c", stub + body], check=True, capture_output=True, text=True)
    want = hugepages_2mi_count()
    assert int(nr.read_text()) == (after or want)
    persisted = list(etc.iterdir())
    assert [p.read_text() for p in persisted] == ([] if after else [f"vm.nr_hugepages = {want}\n"])
