"""Typed configuration for the CDK app, read from the CDK context and validated at synth.

Every value comes from one context key (defaults in cdk.json, overrides with `-c key=value`).
A bad value raises `ConfigError` naming the key and the fix, before any construct is built.
Values given on the command line arrive as strings; values from cdk.json keep their JSON types,
so every reader accepts both.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from facts import fsx as fsx_facts
from facts.hardware import P5_48XLARGE
from training import exits

# The stack's name is part of the contract with the job launcher: `make deploy` writes the
# outputs to cdk-outputs.json under this key.
STACK_NAME = "EksFsdpResilient"
# The images stack (infra/images.py): the repository outlives the training stack.
IMAGES_STACK_NAME = f"{STACK_NAME}Images"

# Kubernetes versions this app can run: each needs a kubectl layer package of the same minor
# version (aws-cdk.lambda-layer-kubectl-v36) that aws-cdk-lib's eks_v2 also knows.
SUPPORTED_KUBERNETES_VERSIONS = ("1.36",)

# The launch template's network-card layout (32 cards) is specific to this instance type.
GPU_INSTANCE_TYPE = P5_48XLARGE.name

CAPACITY_TYPES = ("on-demand", "capacity-reservation", "capacity-block")
# The p5 network-card layouts of EC2's EFA guide ("EFA configuration for P5 and P5e instances"):
# `efa-only`: use case 1 (one ENA, 32 EFA-only interfaces, one IP); `ip-bandwidth`: use case 2
# (seven more ENA interfaces for up to 800 Gbps of IP traffic, eight IPs).
EFA_INTERFACE_TYPES = ("efa-only", "ip-bandwidth")
# What happens to the file system on `cdk destroy` (or when it leaves the stack). CloudFormation's
# Snapshot deletion policy does not cover AWS::FSx::FileSystem (DeletionPolicy docs list the
# types), so the choice is RETAIN (default: checkpoints survive) or an explicit opt-in to DESTROY;
# daily automatic backups (fsxBackupRetentionDays) cover the file system in both cases.
FSX_REMOVAL_POLICIES = ("retain", "destroy")


class ConfigError(exits.ConfigError):
    """A context value is missing or invalid; the message names the key and the fix. The
    trainer's ConfigError with a CDK context key for its field: one type to catch."""

    def __init__(self, key: str, problem: str, fix: str) -> None:
        ValueError.__init__(self, f"context '{key}': {problem}. Fix: {fix}")
        self.field_path = self.key = key


@dataclass(frozen=True)
class NetworkConfig:
    """Where the stack lives and how its VPC is laid out."""

    region: str
    """AWS region to deploy to, e.g. us-east-2 (the account comes from the credentials)."""
    availability_zones: tuple[str, ...]
    """At least two AZs of `region` for the VPC's public and private subnets (given explicitly,
    so synth never looks them up)."""
    gpu_availability_zone: str
    """The AZ of the GPU nodes and FSx: the AZ of the capacity reservation when there is one."""
    vpc_cidr: str
    """IPv4 CIDR of the VPC; pods take VPC addresses, so keep it large (/16)."""


@dataclass(frozen=True)
class ClusterConfig:
    """The EKS control plane and its system node group."""

    cluster_name: str
    """Name of the EKS cluster (used by `aws eks update-kubeconfig`)."""
    kubernetes_version: str
    """Kubernetes minor version, one of SUPPORTED_KUBERNETES_VERSIONS."""
    endpoint_allowed_cidrs: tuple[str, ...]
    """CIDRs allowed to reach the public API endpoint; empty means a private endpoint only."""
    admin_principal_arn: str | None
    """IAM role or user ARN given cluster-admin through an access entry (None: no extra admin)."""
    system_instance_type: str
    """Instance type of the small on-demand node group that runs the add-ons."""
    system_node_count: int
    """Number of system nodes (two, so that add-ons survive the loss of one)."""


@dataclass(frozen=True)
class GpuNodesConfig:
    """The p5.48xlarge managed node group."""

    min_size: int
    """Minimum number of GPU nodes."""
    desired_size: int
    """Number of GPU nodes to start with."""
    max_size: int
    """Maximum number of GPU nodes (also bounded by the reservation's size)."""
    capacity_type: str
    """`on-demand`, `capacity-reservation` (an ODCR) or `capacity-block` (EC2 Capacity Blocks)."""
    capacity_reservation_id: str | None
    """`cr-...` id of the reservation or capacity block; required unless on-demand."""
    efa_secondary_interface_type: str
    """Network-card layout (EFA_INTERFACE_TYPES): `efa-only` (the EC2 guide's use case 1) or
    `ip-bandwidth` (use case 2: ENA interfaces on cards 4, 8, ..., 28 as well)."""
    root_volume_gib: int
    """Size of the gp3 root volume: the OS, drivers and logs. Container images, the kubelet's
    pods and their logs live on the instance-store NVMe RAID0 that nodeadm builds
    (`localStorage: RAID0` bind-mounts /var/lib/containerd, /var/lib/kubelet and /var/log/pods
    onto it: amazon-eks-ami templates/shared/runtime/bin/setup-local-disks)."""
    capacity_block_active: bool = False
    """The Capacity Block has started (`-c capacityBlockActive=true`): only then may a
    capacity-block group have nodes (before its start EC2 cannot launch them)."""
    reservation_placement_group: str | None = None
    """Name of the cluster placement group a capacity reservation was created in (EC2: such a
    reservation is only usable by instances launched in that group). None: no group. On-demand
    capacity gets a new cluster placement group; Capacity Blocks take none (EC2 docs: "there is
    no need to use a cluster placement group with a Capacity Block")."""
    overlay: str | None = None
    """The overlay the nodes are sized for (`-c overlay=NAME`): desired_size defaults to its
    training nodes plus hot spares; `gpuNodesDesired` overrides it."""


@dataclass(frozen=True)
class FsxConfig:
    """The FSx for Lustre file system shared by every pod."""

    storage_capacity_gib: int
    """Capacity in GiB: 1200, 2400, or a multiple of 2400 (PERSISTENT_2)."""
    throughput_per_unit: int
    """Per-unit storage throughput in MB/s/TiB, one of facts.fsx.THROUGHPUT_TIERS_MBPS_PER_TIB."""
    s3_link: str | None
    """Optional `s3://bucket[/prefix]` linked to the file system root by a data repository
    association, so checkpoints, runs and data are exported there (None: no link)."""
    removal_policy: str = "retain"
    """`retain` (default: the file system and checkpoints survive `cdk destroy`) or `destroy`."""
    backup_retention_days: int = 7
    """Days of daily automatic backups (0 turns them off; FSx allows up to 90)."""
    sized_for: str | None = None
    """Overlay whose checkpoints the file system must hold and write in time (infra/sizing.py
    checks it at synth); None: the largest overlay."""


@dataclass(frozen=True)
class ImageConfig:
    """The trainer's container image."""

    repository_name: str
    """Name of the ECR repository created for trainer images pushed outside CDK (e.g. by CI)."""
    image_uri: str | None
    """A prebuilt image to run instead of building training/Dockerfile at deploy time."""


@dataclass(frozen=True)
class WorkloadConfig:
    """Kubernetes objects the stack applies to the cluster (the training Job is not one of them:
    `make train TARGET=eks` submits it, see infra/workloads.py)."""

    namespace: str
    """Namespace of the training job, its PVC, service account and configuration."""


@dataclass(frozen=True)
class ObservabilityConfig:
    """Where the alerts of the metrics workspace go (infra/observability.py)."""

    alert_email: str | None
    """E-mail address subscribed to the alerts topic (it must confirm the subscription); None:
    no subscription (subscribe anything to the topic named by the AlertTopicArn output)."""


@dataclass(frozen=True)
class StackConfig:
    """Everything the stack needs, validated."""

    network: NetworkConfig
    cluster: ClusterConfig
    gpu: GpuNodesConfig
    fsx: FsxConfig
    image: ImageConfig
    workload: WorkloadConfig
    observability: ObservabilityConfig


# --- readers: one per value type, each raising ConfigError with the key ----------------------

Getter = Callable[[str], Any]

_REGION_RE = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d$")
_NAME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9-]{0,99}$")
_DNS_LABEL_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_RESERVATION_RE = re.compile(r"^cr-[0-9a-f]{8,17}$")
_PRINCIPAL_RE = re.compile(r"^arn:aws[a-z-]*:iam::\d{12}:(role|user)/[\w+=,.@/-]+$")
_S3_RE = re.compile(r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?$")
_INSTANCE_TYPE_RE = re.compile(r"^[a-z][a-z0-9-]*\.[a-z0-9]+$")
_EMAIL_RE = re.compile(r"^[^@\s]+@[^@\s]+\.[A-Za-z]{2,}$")
_ECR_NAME_RE = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*(?:/[a-z0-9]+(?:[._-][a-z0-9]+)*)*$")


def _str(get: Getter, key: str, *, fix: str) -> str:
    value = get(key)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ConfigError(key, "is missing", fix)
    if not isinstance(value, str):
        raise ConfigError(key, f"must be a string, got {value!r}", fix)
    return value.strip()


def _optional_str(get: Getter, key: str) -> str | None:
    value = get(key)
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if not isinstance(value, str):
        raise ConfigError(key, f"must be a string, got {value!r}", "give a string or leave it out")
    return value.strip()


def _int(get: Getter, key: str, *, minimum: int, fix: str) -> int:
    value = get(key)
    if isinstance(value, bool):  # bool is an int subclass; true/false is never a count
        raise ConfigError(key, f"must be an integer, got {value!r}", fix)
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ConfigError(key, f"must be an integer, got {value!r}", fix) from None
    if not isinstance(value, int):
        raise ConfigError(key, f"must be an integer, got {value!r}", fix)
    if value < minimum:
        raise ConfigError(key, f"must be >= {minimum}, got {value}", fix)
    return value


def _bool(get: Getter, key: str, *, fix: str) -> bool:
    """true/false from cdk.json, or the strings "true"/"false" from `-c`; missing is false."""
    value = get(key)
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ConfigError(key, f"must be true or false, got {value!r}", fix)


def _list(get: Getter, key: str, *, fix: str) -> tuple[str, ...]:
    """A list from cdk.json, or a JSON list / comma-separated string from `-c`."""
    value = get(key)
    if value is None:
        return ()
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except json.JSONDecodeError as err:
                raise ConfigError(key, f"is not a valid JSON list ({err.msg})", fix) from None
        else:
            value = [part for part in text.split(",") if part.strip()]
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ConfigError(key, f"must be a list of strings, got {value!r}", fix)
    return tuple(v.strip() for v in value)


def _choice(get: Getter, key: str, choices: Sequence[str]) -> str:
    fix = f"use one of: {', '.join(choices)}"
    value = _str(get, key, fix=fix)
    if value not in choices:
        raise ConfigError(key, f"{value!r} is not supported", fix)
    return value


# --- sections ---------------------------------------------------------------------------------


def _network(get: Getter) -> NetworkConfig:
    region = _str(get, "region", fix="set it to an AWS region, e.g. -c region=us-east-2")
    if not _REGION_RE.match(region):
        raise ConfigError("region", f"{region!r} is not an AWS region name", "e.g. us-east-2")
    azs = _list(get, "availabilityZones", fix=f"e.g. -c availabilityZones={region}a,{region}b")
    if len(azs) < 2 or len(set(azs)) != len(azs):
        raise ConfigError(
            "availabilityZones",
            f"needs at least two distinct AZs, got {list(azs)}",
            f"list two or more AZs of {region}, e.g. {region}a,{region}b",
        )
    for az in azs:
        if not re.match(rf"^{re.escape(region)}[a-z]$", az):
            raise ConfigError(
                "availabilityZones",
                f"{az!r} is not an AZ of region {region}",
                f"use AZ names of {region} ({region}a, {region}b, ...)",
            )
    gpu_az = _str(get, "gpuAvailabilityZone", fix=f"set it to one of {list(azs)}")
    if gpu_az not in azs:
        raise ConfigError(
            "gpuAvailabilityZone",
            f"{gpu_az!r} is not one of availabilityZones {list(azs)}",
            "use the AZ of your capacity reservation and list it in availabilityZones",
        )
    cidr = _str(get, "vpcCidr", fix="e.g. -c vpcCidr=10.0.0.0/16")
    try:
        network = ipaddress.IPv4Network(cidr)
    except ValueError:
        raise ConfigError("vpcCidr", f"{cidr!r} is not an IPv4 CIDR", "e.g. 10.0.0.0/16") from None
    if not 16 <= network.prefixlen <= 18:
        raise ConfigError(
            "vpcCidr",
            f"/{network.prefixlen} does not fit the subnet layout (public /24s, private /19s)",
            "use a /16 to /18 block",
        )
    return NetworkConfig(
        region=region, availability_zones=azs, gpu_availability_zone=gpu_az, vpc_cidr=cidr
    )


def _cluster(get: Getter) -> ClusterConfig:
    name = _str(get, "clusterName", fix="e.g. -c clusterName=fsdp-resilient")
    if not _NAME_RE.match(name):
        raise ConfigError(
            "clusterName", f"{name!r} is not a valid EKS cluster name", "letters, digits and -"
        )
    version = _choice(get, "kubernetesVersion", SUPPORTED_KUBERNETES_VERSIONS)
    cidrs_fix = 'list your CIDRs, e.g. -c endpointAllowedCidrs=203.0.113.7/32 (or "[]": private)'
    cidrs = _list(get, "endpointAllowedCidrs", fix=cidrs_fix)
    for cidr in cidrs:
        try:
            net = ipaddress.ip_network(cidr)
        except ValueError:
            raise ConfigError(
                "endpointAllowedCidrs", f"{cidr!r} is not a CIDR", cidrs_fix
            ) from None
        if net.prefixlen == 0:
            raise ConfigError(
                "endpointAllowedCidrs",
                f"{cidr} opens the Kubernetes API to the whole internet",
                cidrs_fix,
            )
    admin = _optional_str(get, "adminPrincipalArn")
    if admin is not None and not _PRINCIPAL_RE.match(admin):
        raise ConfigError(
            "adminPrincipalArn",
            f"{admin!r} is not an IAM role or user ARN",
            "e.g. arn:aws:iam::123456789012:role/Admin (an SSO role's ARN without the path)",
        )
    system_type = _str(get, "systemInstanceType", fix="e.g. -c systemInstanceType=m7i.xlarge")
    if not _INSTANCE_TYPE_RE.match(system_type):
        raise ConfigError(
            "systemInstanceType", f"{system_type!r} is not an instance type", "e.g. m7i.xlarge"
        )
    count = _int(get, "systemNodeCount", minimum=1, fix="use 2 (add-ons survive losing a node)")
    return ClusterConfig(
        cluster_name=name,
        kubernetes_version=version,
        endpoint_allowed_cidrs=cidrs,
        admin_principal_arn=admin,
        system_instance_type=system_type,
        system_node_count=count,
    )


def _desired(get: Getter, node_counts: Mapping[str, int], *, fix: str) -> tuple[int, str | None]:
    """The GPU node count: `gpuNodesDesired` when given (an override), else the overlay's
    training nodes plus hot spares (manifests/sizes.py's node_count), else 0."""
    overlay = _optional_str(get, "overlay")
    if overlay is not None and overlay not in node_counts:
        raise ConfigError(
            "overlay",
            f"{overlay!r} is not an overlay",
            f"use one of {', '.join(node_counts)} (or -c gpuNodesDesired=N)",
        )
    if get("gpuNodesDesired") is None:
        return (node_counts[overlay] if overlay else 0), overlay
    return _int(get, "gpuNodesDesired", minimum=0, fix=fix), overlay


def _gpu(get: Getter, node_counts: Mapping[str, int]) -> GpuNodesConfig:
    fix = "set gpuNodesMin <= gpuNodesDesired <= gpuNodesMax"
    low = _int(get, "gpuNodesMin", minimum=0, fix=fix)
    desired, overlay = _desired(get, node_counts, fix=fix)
    high = _int(get, "gpuNodesMax", minimum=1, fix=fix)
    if not low <= desired <= high:
        raise ConfigError(
            "gpuNodesDesired", f"min {low} <= desired {desired} <= max {high} does not hold", fix
        )
    capacity = _choice(get, "capacityType", CAPACITY_TYPES)
    reservation = _optional_str(get, "capacityReservationId")
    if capacity == "on-demand" and reservation is not None:
        raise ConfigError(
            "capacityReservationId",
            "is set but capacityType is on-demand",
            "set -c capacityType=capacity-reservation (or capacity-block), or drop the id",
        )
    if capacity != "on-demand":
        if reservation is None:
            raise ConfigError(
                "capacityReservationId",
                f"is required when capacityType is {capacity}",
                "give the reservation's id, e.g. -c capacityReservationId=cr-0123456789abcdef0",
            )
        if not _RESERVATION_RE.match(reservation):
            raise ConfigError(
                "capacityReservationId",
                f"{reservation!r} is not a capacity reservation id",
                "ids look like cr-0123456789abcdef0",
            )
    block_active = _bool(
        get, "capacityBlockActive", fix="-c capacityBlockActive=true once the block has started"
    )
    if block_active and capacity != "capacity-block":
        raise ConfigError(
            "capacityBlockActive",
            f"is set but capacityType is {capacity}",
            "only a capacity-block node group needs it; drop it",
        )
    if capacity == "capacity-block" and desired != 0 and not block_active:
        # EKS docs (capacity blocks for managed node groups): create the group with desired 0
        # and scale it up once the block is active; instances before the start cannot launch.
        raise ConfigError(
            "gpuNodesDesired",
            f"is {desired} but a capacity-block node group must start at 0",
            "deploy with -c gpuNodesDesired=0, and once the block has started scale up with "
            f"-c gpuNodesDesired={desired} -c capacityBlockActive=true",
        )
    group = _optional_str(get, "capacityReservationPlacementGroup")
    if group is not None and capacity != "capacity-reservation":
        raise ConfigError(
            "capacityReservationPlacementGroup",
            f"is set but capacityType is {capacity}",
            "only a capacity reservation created in a placement group names one; drop it",
        )
    if group is not None and not re.match(r"^[\w.-]{1,255}$", group):
        raise ConfigError(
            "capacityReservationPlacementGroup",
            f"{group!r} is not a placement group name",
            "give the name of the group the reservation was created in",
        )
    if get("efaSecondaryInterfaceType") == "efa":
        raise ConfigError(
            "efaSecondaryInterfaceType",
            "'efa' (an ENA on each of 31 cards) is the older layout the EC2 guide no longer shows",
            "use efa-only (one IP per node) or ip-bandwidth (8 ENA interfaces)",
        )
    efa = _choice(get, "efaSecondaryInterfaceType", EFA_INTERFACE_TYPES)
    root = _int(
        get,
        "gpuRootVolumeGiB",
        minimum=100,
        fix="use at least 100 (the OS and the AMI's drivers; images and pods' ephemeral storage "
        "live on the instance-store RAID0)",
    )
    return GpuNodesConfig(
        min_size=low,
        desired_size=desired,
        max_size=high,
        capacity_type=capacity,
        capacity_reservation_id=reservation,
        efa_secondary_interface_type=efa,
        root_volume_gib=root,
        reservation_placement_group=group,
        capacity_block_active=block_active,
        overlay=overlay,
    )


def _fsx(get: Getter) -> FsxConfig:
    fix = "use 1200, 2400 or a multiple of 2400"
    capacity = _int(get, "fsxStorageCapacityGiB", minimum=fsx_facts.MIN_CAPACITY_GIB, fix=fix)
    if not fsx_facts.is_valid_capacity(capacity):
        nearest = fsx_facts.smallest_capacity_gib(at_least_gib=capacity)
        raise ConfigError(
            "fsxStorageCapacityGiB",
            f"{capacity} is not a PERSISTENT_2 size",
            f"{fix} (e.g. {nearest})",
        )
    tiers = fsx_facts.THROUGHPUT_TIERS_MBPS_PER_TIB
    choices = ", ".join(map(str, tiers))
    throughput = _int(get, "fsxThroughputPerUnit", minimum=1, fix=f"use one of {choices}")
    if throughput not in tiers:
        raise ConfigError(
            "fsxThroughputPerUnit", f"{throughput} MB/s/TiB is not offered", f"use one of {choices}"
        )
    link = _optional_str(get, "fsxS3Link")
    if link is not None and not _S3_RE.match(link):
        raise ConfigError(
            "fsxS3Link", f"{link!r} is not an s3:// URI", "e.g. s3://my-bucket/datasets"
        )
    sized_for = _optional_str(get, "fsxSizedFor")
    removal = _choice(get, "fsxRemovalPolicy", FSX_REMOVAL_POLICIES)
    backups = _int(get, "fsxBackupRetentionDays", minimum=0, fix="use 0 to 90 days")
    if backups > 90:
        raise ConfigError("fsxBackupRetentionDays", f"{backups} exceeds 90", "use 0 to 90 days")
    return FsxConfig(
        storage_capacity_gib=capacity,
        throughput_per_unit=throughput,
        s3_link=link,
        removal_policy=removal,
        backup_retention_days=backups,
        sized_for=sized_for,
    )


def _image(get: Getter) -> ImageConfig:
    name = _str(get, "imageRepositoryName", fix="e.g. -c imageRepositoryName=fsdp-trainer")
    if not _ECR_NAME_RE.match(name):
        raise ConfigError(
            "imageRepositoryName", f"{name!r} is not an ECR repository name", "lowercase, . _ - /"
        )
    uri = _optional_str(get, "imageUri")
    pinned = uri is not None and (":" in uri.rsplit("/", 1)[-1] or "@" in uri)
    if uri is not None and (" " in uri or not pinned):
        raise ConfigError(
            "imageUri",
            f"{uri!r} is not a pinned image reference",
            "give registry/repository:tag or registry/repository@sha256:...",
        )
    return ImageConfig(repository_name=name, image_uri=uri)


def _workload(get: Getter, overlays: Sequence[str]) -> WorkloadConfig:
    namespace = _str(get, "trainingNamespace", fix="e.g. -c trainingNamespace=training")
    if not _DNS_LABEL_RE.match(namespace):
        raise ConfigError(
            "trainingNamespace",
            f"{namespace!r} is not a Kubernetes namespace name",
            "lowercase letters, digits and -, at most 63 characters",
        )
    train = _optional_str(get, "train")
    if train is not None:
        # The stack does not own the Job (infra/workloads.py says why): refuse at synth, before
        # anything changes, rather than ignore the request.
        fix_overlay = train if train in overlays else (overlays[0] if overlays else "smoke")
        raise ConfigError(
            "train",
            "the training Job is not part of the stack (CloudFormation would fail on, delete or "
            "rerun it)",
            f"deploy without it, then submit the Job: make train TARGET=eks OVERLAY={fix_overlay}",
        )
    return WorkloadConfig(namespace=namespace)


def _observability(get: Getter) -> ObservabilityConfig:
    email = _optional_str(get, "alertEmail")
    if email is not None and not _EMAIL_RE.match(email):
        raise ConfigError(
            "alertEmail",
            f"{email!r} is not an e-mail address",
            "give one address, e.g. -c alertEmail=oncall@example.com, or leave it null",
        )
    return ObservabilityConfig(alert_email=email)


def load_config(
    get: Getter, *, overlays: Sequence[str], node_counts: Mapping[str, int] | None = None
) -> StackConfig:
    """Read and validate every context value; `get` is e.g. `app.node.try_get_context`.

    `overlays` are the training job's overlays (manifests.render.OVERLAYS), passed in so that
    this module stays free of imports outside the standard library; `node_counts` maps each
    overlay to its GPU nodes with hot spares (manifests/sizes.py), for `-c overlay=NAME`.
    """
    return StackConfig(
        network=_network(get),
        cluster=_cluster(get),
        gpu=_gpu(get, node_counts or {}),
        fsx=_fsx(get),
        image=_image(get),
        workload=_workload(get, overlays),
        observability=_observability(get),
    )
