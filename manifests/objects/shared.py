"""The objects every training job shares, deployed with every `cdk deploy`: the namespace, the
FSx volume and its claim, the service account, the ConfigMap, the rendezvous store and the
trainer's permissions."""

from __future__ import annotations

from manifests.objects.common import (
    CONFIG_MAP,
    PV_NAME,
    PVC_NAME,
    SERVICE_ACCOUNT,
    TRAINER,
    labels,
)
from manifests.objects.cordon import node_cordon_objects
from manifests.objects.rdzv_store import rdzv_store_objects
from manifests.objects.spares import spare_reader_objects

FSX_NOMINAL_SIZE = "4800Gi"
"""The FSx PersistentVolume's capacity and its claim's request: a fixed nominal size, never the
file system's. Kubernetes binds a claim to a volume whose capacity is at least the request and
does not resize a statically bound claim (the PersistentVolumeClaimResize admission plugin
refuses claims that were not dynamically provisioned; a smaller request is refused too), so a
size that followed FSx growth would fail the stack update after CloudFormation had grown the
file system. 4800 GiB is what the stack deployed by default (cdk.json `fsxStorageCapacityGiB`)
before the size left the claim, so a stack first deployed with the default keeps its claim as
it is. Never change it: every deployed claim carries it. The real size is in FSx and in the
ConfigMap (FSX_STORAGE_CAPACITY); the FSx CSI driver ignores a static volume's capacity (its
static-provisioning example: aws-fsx-csi-driver, examples/kubernetes/static_provisioning)."""

# The EFA + NCCL environment every rank gets (via the ConfigMap: tune it without a new image).
EFA_NCCL_ENV = {
    "FI_PROVIDER": "efa",  # libfabric over EFA, never TCP sockets
    "FI_EFA_USE_DEVICE_RDMA": "1",  # GPUDirect RDMA on p5
    "FI_EFA_FORK_SAFE": "1",  # data loader workers fork
    "NCCL_DEBUG": "WARN",
    "NCCL_SOCKET_IFNAME": "^lo,docker",  # bootstrap over the pod's interface
    "NCCL_CROSS_NIC": "1",
    # A failed collective tears the process down (1) or raises (3): either way NVRx restarts it.
    # NVRx's in-process restart documents 3 ("tear down, but do not rethrow") as what it needs,
    # plus no NVLink SHARP (its abort cannot release NVLS buffers) and no rethrown CUDA errors.
    # Source: NVRx docs, "inprocess" usage guide / known issues.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


def shared_objects(
    *,
    namespace: str,
    file_system_id: str,
    dns_name: str,
    mount_name: str,
    storage_capacity_gib: int,
    image: str,
    store_image: str | None = None,
) -> list[dict]:
    """Namespace, FSx PV + PVC, ServiceAccount, ConfigMap and the rendezvous store: what every
    training job needs. `store_image` runs the rendezvous store (default: `image`, the
    trainer's, which has torch); a store image of its own keeps the store's pod unchanged
    when the trainer's image changes. `storage_capacity_gib` goes to the ConfigMap only."""
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": namespace, "labels": labels("namespace")},
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {
                "name": SERVICE_ACCOUNT,
                "namespace": namespace,
                "labels": labels(TRAINER),
            },
            # No token by default (the rendezvous store and the spares' placeholders use
            # this account too and call no API); the trainer's pod asks for one, for the
            # cordon (`node_cordon_objects`).
            "automountServiceAccountToken": False,
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": CONFIG_MAP, "namespace": namespace, "labels": labels("config")},
            "data": {
                **EFA_NCCL_ENV,
                # The stack's FSx file system; the kustomize base copies the ids into the PV.
                # The size is for people and tools: the PV and PVC carry FSX_NOMINAL_SIZE.
                "FSX_FILE_SYSTEM_ID": file_system_id,
                "FSX_DNS_NAME": dns_name,
                "FSX_MOUNT_NAME": mount_name,
                "FSX_STORAGE_CAPACITY": f"{storage_capacity_gib}Gi",
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": PV_NAME, "labels": labels("storage")},
            "spec": {
                "capacity": {"storage": FSX_NOMINAL_SIZE},
                "volumeMode": "Filesystem",
                "accessModes": ["ReadWriteMany"],
                # Static provisioning: the file system belongs to the stack, never to a claim.
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
                "mountOptions": ["flock"],
                "csi": {
                    "driver": "fsx.csi.aws.com",
                    "volumeHandle": file_system_id,
                    "volumeAttributes": {"dnsname": dns_name, "mountname": mount_name},
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": PVC_NAME, "namespace": namespace, "labels": labels("storage")},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": PV_NAME,
                "resources": {"requests": {"storage": FSX_NOMINAL_SIZE}},
            },
        },
        *rdzv_store_objects(namespace=namespace, image=store_image or image),
        *node_cordon_objects(namespace=namespace),
        *spare_reader_objects(namespace=namespace),
    ]
