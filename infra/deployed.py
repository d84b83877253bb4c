"""The deployed stack, read back at synth: its template (what `cdk diff` diffs against) and the
settings it was deployed with, so that every clone, operator and CI run keeps them.

Read through the AWS CLI (`aws cloudformation ...`), the same calls `cdk diff` makes:
`DescribeStacks` for the stack's status, `GetTemplate --template-stage Original` for the template
as deployed (aws-cdk's `readCurrentTemplate`; CloudFormation API reference, GetTemplate), and,
for the report `make destroy` writes, `ListStackResources` (the physical ids, page by page) and
FSx's `DescribeFileSystems` (a file system a zone move left behind). The CLI is already what
kubectl authenticates with (`aws eks get-token`), so it adds no dependency (boto3 cannot be
installed beside the pinned kubernetes client: botocore pins python-dateutil<3, kubernetes 37
needs >=3).

The settings live with the stack: `infra/stack.py` writes the deploy's settings that differ
from cdk.json's defaults into the `DeploySettings` SSM parameter the stack owns (a resource, so a
changed setting is always a stack update; template metadata alone may not be). A stack deployed
before that parameter existed has its settings derived from its resources (zone, capacity,
nodes, FSx, access, S3 link, alert address, image, system nodes, EFA layout).

`infra/guard.py` is what app.py runs around synthesis: read, layer the context, build, check
(infra/first_deploy.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from infra import sizing
from infra.config import ConfigError
from infra.first_deploy import GUARDED_KEYS
from manifests.sizes import SIZES

if TYPE_CHECKING:
    pass

SETTINGS_PARAMETER_ID = "DeploySettings"
"""Logical id of the stack's SSM parameter holding the deploy's settings (JSON)."""
NOT_SETTINGS = frozenset({"train"})
"""Context keys of cdk.json that are never kept (`train` is refused at synth)."""
USE_DEFAULT_KEY = "useDefault"
"""`-c useDefault=key[,key]`: take cdk.json's value for a kept setting. (A `-c` value equal to
cdk.json's string default cannot be told apart from no value: the CLI merges both.)"""

Status = Literal["deployed", "none", "unknown"]
Runner = Callable[..., subprocess.CompletedProcess]

# CloudFormation statuses in which the stack holds no deployed template worth keeping: a first
# create that failed (CDK deletes and recreates it) or a change set never executed.
NOT_CREATED = frozenset({"ROLLBACK_COMPLETE", "ROLLBACK_FAILED", "REVIEW_IN_PROGRESS"})


@dataclass(frozen=True)
class DeployedStack:
    """What CloudFormation holds for the app's stacks."""

    status: Status
    template: Mapping[str, Any] | None = None
    other_templates: Mapping[str, Mapping[str, Any] | None] = field(default_factory=dict)
    reason: str = ""
    """Why the stack could not be read (status `unknown`), in one line."""


class AwsCliError(RuntimeError):
    """An `aws` command failed; the message is its last line of error output."""


def aws_cli(args: Sequence[str], *, region: str, run: Runner = subprocess.run) -> Any:
    """Run `aws <args> --region R --output json` and return the parsed output."""
    if shutil.which("aws") is None and run is subprocess.run:
        raise AwsCliError("the AWS CLI (aws) is not installed")
    proc = run(
        ["aws", *args, "--region", region, "--output", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        raise AwsCliError(lines[-1] if lines else f"aws exited with {proc.returncode}")
    return json.loads(proc.stdout) if proc.stdout.strip() else {}


def _missing(err: AwsCliError, stack_name: str) -> bool:
    # CloudFormation answers ValidationError "Stack with id NAME does not exist".
    return "does not exist" in str(err) and stack_name in str(err)


def _template(stack_name: str, *, region: str, run: Runner) -> dict[str, Any]:
    body = aws_cli(
        [
            "cloudformation",
            "get-template",
            "--stack-name",
            stack_name,
            "--template-stage",
            "Original",
        ],
        region=region,
        run=run,
    )["TemplateBody"]
    return json.loads(body) if isinstance(body, str) else body


def read(
    *, stack_name: str, other_stacks: Sequence[str], region: str, run: Runner = subprocess.run
) -> DeployedStack:
    """The deployed templates of the stack and the app's other stacks (never raises: a stack
    that cannot be read is `unknown` with the reason). The CLI calls run side by side (each
    starts a Python interpreter)."""
    from concurrent.futures import ThreadPoolExecutor

    describe = ["cloudformation", "describe-stacks", "--stack-name", stack_name]
    names = (stack_name, *other_stacks)
    try:
        with ThreadPoolExecutor(max_workers=len(names) + 1) as pool:
            status_call = pool.submit(aws_cli, describe, region=region, run=run)
            template_calls = {
                name: pool.submit(_template, name, region=region, run=run) for name in names
            }
            try:
                status = status_call.result()["Stacks"][0]["StackStatus"]
            except AwsCliError as err:
                if _missing(err, stack_name):
                    return DeployedStack(status="none")
                raise
            if status in NOT_CREATED:
                return DeployedStack(status="none", reason=f"{stack_name} is {status}")
            if status.endswith("_IN_PROGRESS"):
                return DeployedStack(
                    status="unknown", reason=f"{stack_name} is {status}: wait for it to finish"
                )
            template = template_calls[stack_name].result()
            others: dict[str, Mapping[str, Any] | None] = {}
            for other in other_stacks:
                try:
                    others[other] = template_calls[other].result()
                except AwsCliError as err:
                    if not _missing(err, other):
                        raise
                    others[other] = None
    except (AwsCliError, OSError, subprocess.TimeoutExpired, KeyError, ValueError) as err:
        return DeployedStack(status="unknown", reason=str(err) or type(err).__name__)
    return DeployedStack(status="deployed", template=template, other_templates=others)


# --- settings --------------------------------------------------------------------------------


def stored_settings(template: Mapping[str, Any]) -> dict[str, Any] | None:
    """The settings the stack's DeploySettings parameter holds (None: a stack from before)."""
    resource = template.get("Resources", {}).get(SETTINGS_PARAMETER_ID)
    if resource is None:
        return None
    value = resource.get("Properties", {}).get("Value")
    return json.loads(value) if isinstance(value, str) else None


def _resources(template: Mapping[str, Any], rtype: str) -> list[Mapping[str, Any]]:
    return [
        r.get("Properties", {})
        for r in template.get("Resources", {}).values()
        if r.get("Type") == rtype
    ]


def derived_settings(template: Mapping[str, Any]) -> dict[str, Any]:
    """The settings a stack deployed before DeploySettings was built with, read from its
    resources: the GPU node group (the one with a launch template), its subnet's zone, the
    launch template's capacity target, the cluster, the admin access entry and FSx."""
    resources = template.get("Resources", {})
    found: dict[str, Any] = {}
    for cluster in _resources(template, "AWS::EKS::Cluster"):
        vpc = cluster.get("ResourcesVpcConfig", {})
        if isinstance(cluster.get("Name"), str):
            found["clusterName"] = cluster["Name"]
        if isinstance(cluster.get("Version"), str):
            found["kubernetesVersion"] = cluster["Version"]
        public = vpc.get("EndpointPublicAccess") is True
        found["endpointAllowedCidrs"] = list(vpc.get("PublicAccessCidrs", [])) if public else []
    admins = [
        e["PrincipalArn"]
        for e in _resources(template, "AWS::EKS::AccessEntry")
        if isinstance(e.get("PrincipalArn"), str)
    ]
    found["adminPrincipalArn"] = admins[0] if admins else None
    for group in _resources(template, "AWS::EKS::Nodegroup"):
        if "LaunchTemplate" not in group:
            continue  # the system node group
        scaling = group.get("ScalingConfig", {})
        found |= {
            "gpuNodesMin": scaling.get("MinSize", 0),
            "gpuNodesDesired": scaling.get("DesiredSize", 0),
            "gpuNodesMax": scaling.get("MaxSize", 1),
        }
        subnet = (group.get("Subnets") or [{}])[0]
        ref = subnet.get("Ref") if isinstance(subnet, dict) else None
        zone = resources.get(ref, {}).get("Properties", {}).get("AvailabilityZone")
        if isinstance(zone, str):
            found["gpuAvailabilityZone"] = zone
        block = group.get("CapacityType") == "CAPACITY_BLOCK"
        for lt in _resources(template, "AWS::EC2::LaunchTemplate"):
            data = lt.get("LaunchTemplateData", {})
            target = data.get("CapacityReservationSpecification", {}).get(
                "CapacityReservationTarget", {}
            )
            reservation = target.get("CapacityReservationId")
            group_name = data.get("Placement", {}).get("GroupName")
            if "InstanceType" not in data:
                continue
            found["capacityType"] = (
                "capacity-block"
                if block
                else "capacity-reservation"
                if reservation
                else "on-demand"
            )
            found["capacityReservationId"] = reservation
            found["capacityReservationPlacementGroup"] = (
                group_name if isinstance(group_name, str) and reservation else None
            )
            if block and found["gpuNodesDesired"]:
                found["capacityBlockActive"] = True
    for fs in _resources(template, "AWS::FSx::FileSystem"):
        found["fsxStorageCapacityGiB"] = fs.get("StorageCapacity")
        lustre = fs.get("LustreConfiguration", {})
        found["fsxThroughputPerUnit"] = lustre.get("PerUnitStorageThroughput")
        # CDK omits the retention when backups are off (config: 0 days).
        found["fsxBackupRetentionDays"] = lustre.get("AutomaticBackupRetentionDays", 0)
    for resource in resources.values():
        if resource.get("Type") == "AWS::FSx::FileSystem":
            policy = resource.get("DeletionPolicy", "Delete")
            found["fsxRemovalPolicy"] = "destroy" if policy == "Delete" else "retain"
    return {k: v for k, v in found.items() if v is not None or k in _NULLABLE} | _derived_more(
        template
    )


def _derived_more(template: Mapping[str, Any]) -> dict[str, Any]:
    """The settings whose loss would be silent: the S3 link (its data repository association
    would be removed), the alert address (its subscription), a prebuilt image, the root
    volume, the system nodes and the EFA layout."""
    found: dict[str, Any] = {}
    links = [
        d["DataRepositoryPath"]
        for d in _resources(template, "AWS::FSx::DataRepositoryAssociation")
        if isinstance(d.get("DataRepositoryPath"), str)
    ]
    found["fsxS3Link"] = links[0] if links else None
    emails = [
        s["Endpoint"]
        for s in _resources(template, "AWS::SNS::Subscription")
        if s.get("Protocol") == "email" and isinstance(s.get("Endpoint"), str)
    ]
    found["alertEmail"] = emails[0] if emails else None
    image = template.get("Outputs", {}).get("ImageUri", {}).get("Value")
    if isinstance(image, str):  # a prebuilt image (an asset's URI is a CloudFormation function)
        found["imageUri"] = image
    for group in _resources(template, "AWS::EKS::Nodegroup"):
        if "LaunchTemplate" in group:
            continue
        types = group.get("InstanceTypes") or []
        if types:
            found["systemInstanceType"] = types[0]
        desired = group.get("ScalingConfig", {}).get("DesiredSize")
        if isinstance(desired, int):
            found["systemNodeCount"] = desired
    for lt in _resources(template, "AWS::EC2::LaunchTemplate"):
        data = lt.get("LaunchTemplateData", {})
        if "InstanceType" not in data:
            continue
        for mapping in data.get("BlockDeviceMappings", []):
            size = mapping.get("Ebs", {}).get("VolumeSize")
            if mapping.get("DeviceName") == "/dev/xvda" and isinstance(size, int):
                found["gpuRootVolumeGiB"] = size
        interfaces = data.get("NetworkInterfaces", [])
        # Use case 2 (EC2 guide, efa-acc-inst-types.html): an ENA on device 1 of a card past 0.
        ena = [i for i in interfaces if i.get("InterfaceType") in (None, "interface")]
        if any(i.get("DeviceIndex") == 1 and i.get("NetworkCardIndex", 0) for i in ena):
            found["efaSecondaryInterfaceType"] = "ip-bandwidth"
        elif any(i.get("InterfaceType") == "efa-only" for i in interfaces):
            found["efaSecondaryInterfaceType"] = "efa-only"
    return found


_NULLABLE = frozenset(
    {"adminPrincipalArn", "capacityReservationId", "capacityReservationPlacementGroup"}
)
"""Derived as null when absent (the `_derived_more` keys are always derived, null included:
an absent link or address in the deployed stack is a setting too)."""


def kept_settings(template: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """The deployed stack's settings and where they came from (for the report)."""
    if template is None:
        return {}, "no deployed stack"
    stored = stored_settings(template)
    if stored is not None:
        return stored, "the stack's DeploySettings parameter"
    derived = derived_settings(template)
    if "fsxStorageCapacityGiB" in derived and "fsxThroughputPerUnit" in derived:
        derived["fsxSizedFor"] = _sized_for(
            derived["fsxStorageCapacityGiB"], derived["fsxThroughputPerUnit"]
        )
    return derived, "the deployed resources (a stack from before DeploySettings)"


def _sized_for(capacity_gib: int, tier: int) -> str | None:
    """The largest overlay a deployed file system fits (None: the largest of all), since a
    stack from before DeploySettings does not say which `fsxSizedFor` it was deployed with."""
    fits = {}
    for name, size in SIZES.items():
        try:
            sizing.check_fsx(capacity_gib=capacity_gib, tier_mbps_per_tib=tier, sized_for=name)
        except ConfigError:
            continue
        fits[name] = size
    if not fits or len(fits) == len(SIZES):
        return None
    return sizing.largest_overlay(fits)


COMPARED_FROM_RESOURCES = (
    *GUARDED_KEYS,
    "gpuNodesMin",
    "gpuNodesDesired",
    "gpuNodesMax",
)
"""The settings the day-two check compares (infra/first_deploy.py: the guarded ones, and the node
count a zone move is refused with), and the node bounds that validate it: read from the deployed
resources even where DeploySettings holds them, since it holds no untouched default."""


def deployed_context(template: Mapping[str, Any], *, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The context the deployed stack was built with, as the day-two check compares it: cdk.json's
    defaults, under its kept settings, under what its resources say for COMPARED_FROM_RESOURCES.

    DeploySettings holds no untouched default, so today's cdk.json would otherwise stand in for
    the value deployed: a changed default of a guarded setting (FSx growth, the endpoint's
    CIDRs) would pass as no change, where the resources show the change it is."""
    kept, _ = kept_settings(template)
    derived = derived_settings(template)
    return {
        **defaults,
        **{k: v for k, v in kept.items() if k in defaults},
        **{k: derived[k] for k in COMPARED_FROM_RESOURCES if k in derived and k in defaults},
    }


def given_context(get: Callable[[str], Any], *, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The context values the user gave (`-c`): those that differ from cdk.json's."""
    given = {}
    for key, default in defaults.items():
        value = get(key)
        if value is not None and value != default:
            given[key] = value
    return given


def layered(
    *,
    defaults: Mapping[str, Any],
    kept: Mapping[str, Any],
    given: Mapping[str, Any],
    use_default: Sequence[str] = (),
) -> dict[str, Any]:
    """cdk.json's defaults, under the deployed stack's settings, under the user's `-c` values.

    A new `overlay` without `gpuNodesDesired` clears a kept node-count override, so the
    overlay's size (nodes + spares) applies.
    """
    kept = {k: v for k, v in kept.items() if k in defaults and k not in use_default}
    context = {**defaults, **kept, **given}
    if "overlay" in given and "gpuNodesDesired" not in given:
        context["gpuNodesDesired"] = defaults.get("gpuNodesDesired")
    return context


def settings_to_store(context: Mapping[str, Any], *, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """What the DeploySettings parameter holds: the settings of this deploy that differ from
    cdk.json's defaults (given with -c now or kept from the stack), never an untouched default,
    so a later change of a default in cdk.json reaches the stacks that never set it (a guarded
    setting's change is still refused until acknowledged: infra/first_deploy.py). A -c value
    equal to the default is not stored: the CDK CLI merges the two, so it cannot be told apart."""
    return {
        k: context[k]
        for k in sorted(context)
        if k not in NOT_SETTINGS and k in defaults and context[k] != defaults[k]
    }


def split_list(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(str(v).strip() for v in value)
    return tuple(v.strip() for v in str(value).split(",") if v.strip())


# --- make destroy ----------------------------------------------------------------------------

RETAINED_DELETE = {
    "AWS::FSx::FileSystem": "aws fsx delete-file-system --file-system-id {id}",
    "AWS::EC2::SecurityGroupIngress": "deleted with its security group (next line)",
    "AWS::EC2::SecurityGroup": "aws ec2 delete-security-group --group-id {id}",
    "AWS::EC2::Subnet": "aws ec2 delete-subnet --subnet-id {id}",
    "AWS::EC2::VPC": "aws ec2 delete-vpc --vpc-id {id}",
    "AWS::KMS::Key": "aws kms schedule-key-deletion --key-id {id} --pending-window-in-days 7",
    "AWS::Logs::LogGroup": "aws logs delete-log-group --log-group-name {id}",
}
"""How to delete what `make destroy` keeps, in the order that works (the file system first:
its interfaces hold the security group and subnet; then the subnets, then the VPC)."""


def retained(
    template: Mapping[str, Any], physical_ids: Mapping[str, str]
) -> list[tuple[str, str, str]]:
    """(type, physical id, delete command) of each resource with DeletionPolicy Retain."""
    kept = []
    for lid, resource in template.get("Resources", {}).items():
        if resource.get("DeletionPolicy") not in ("Retain", "RetainExceptOnCreate"):
            continue
        rtype = resource.get("Type", "")
        pid = physical_ids.get(lid, lid)
        command = RETAINED_DELETE.get(rtype, "delete by hand").format(id=pid)
        kept.append((rtype, pid, command))
    order = list(RETAINED_DELETE)
    return sorted(kept, key=lambda k: order.index(k[0]) if k[0] in order else len(order))


_CLI_ERRORS = (AwsCliError, OSError, subprocess.TimeoutExpired, KeyError, TypeError, ValueError)
"""What an `aws` call can end in: its own error, no CLI, a timeout, an answer not as expected
(json.JSONDecodeError is a ValueError)."""


def _physical_ids(stack_name: str, *, region: str, run: Runner) -> dict[str, str]:
    """Logical -> physical id of every resource: ListStackResources, which the CLI pages through
    (DescribeStackResources returns the first 100 only: CloudFormation API reference)."""
    listed = aws_cli(
        ["cloudformation", "list-stack-resources", "--stack-name", stack_name],
        region=region,
        run=run,
    )
    return {
        r["LogicalResourceId"]: r.get("PhysicalResourceId", "")
        for r in listed.get("StackResourceSummaries", [])
    }


def _tagged_file_systems(stack_name: str, *, region: str, run: Runner) -> list[str]:
    """Ids of the file systems CloudFormation created for the stack: it tags each resource it
    creates with `aws:cloudformation:stack-name` (CloudFormation user guide, "Resource tags").
    A file system a zone move replaced is kept by UpdateReplacePolicy and is no longer one of
    the stack's resources; this tag still finds it."""
    listed = aws_cli(["fsx", "describe-file-systems"], region=region, run=run)
    return [
        fs["FileSystemId"]
        for fs in listed.get("FileSystems", [])
        if {"Key": "aws:cloudformation:stack-name", "Value": stack_name} in fs.get("Tags", [])
    ]


def retained_report(*, stack_name: str, region: str, run: Runner = subprocess.run) -> str:
    """What `make destroy` keeps of the deployed stack, and the commands that delete it. Never
    raises: what could not be read is said in the report (the destroy goes on)."""
    deployed = read(stack_name=stack_name, other_stacks=(), region=region, run=run)
    if deployed.status != "deployed" or deployed.template is None:
        return f"{stack_name}: {deployed.status} {deployed.reason}".strip()
    notes = []
    try:
        ids = _physical_ids(stack_name, region=region, run=run)
    except _CLI_ERRORS as err:
        ids = {}
        notes.append(f"physical ids unknown: {str(err) or type(err).__name__}")
    kept = retained(deployed.template, ids)
    try:
        in_stack = {pid for rtype, pid, _ in kept if rtype == "AWS::FSx::FileSystem"}
        replaced = [
            fs
            for fs in _tagged_file_systems(stack_name, region=region, run=run)
            if fs not in in_stack
        ]
    except _CLI_ERRORS as err:
        replaced = []
        notes.append(
            f"file systems a zone move left behind unknown: {str(err) or type(err).__name__}"
        )
    fsx_delete = RETAINED_DELETE["AWS::FSx::FileSystem"]
    kept = [
        *[("AWS::FSx::FileSystem", fs, fsx_delete.format(id=fs)) for fs in replaced],
        *kept,
    ]
    if not kept:
        return f"{stack_name}: nothing kept" + (f" ({'; '.join(notes)})" if notes else "")
    note = f" ({'; '.join(notes)})" if notes else ""
    lines = [f"Kept after `make destroy` of {stack_name}{note}; delete when the data is safe:"]
    lines += [f"  {rtype} {pid}: {command}" for rtype, pid, command in kept]
    return "\n".join(lines)
