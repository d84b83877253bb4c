"""Render the training job's Kubernetes objects: the one entry point to the builders in
`manifests/objects/` (shared objects, cordon, rendezvous store, job, hot spares).

Three users, one source (`sizes.py` + the builders):
- the CDK app (`infra/`) calls `shared_objects(...)` and `job_objects(...)` and hands the dicts
  to `cluster.add_manifest`; arguments may be CDK tokens, used here as opaque strings;
- `python -m training.launch.eks` applies `job_objects(...)` with the kubernetes client;
- kubectl users run `kubectl apply -k manifests/overlays/<name>`; those YAML files are
  generated from the same builders by `python -m manifests.kustomize write` (placeholders for
  the image and FSx ids), and a test fails when they drift.
`spare_objects(...)` (an overlay's hot spares) is in the kustomize overlays, and the launcher
applies it before the Job (`training.launch.eks.submit`); the CDK app does not (docs/node-loss.md).

Pure Python + PyYAML: no kubectl, no cluster, no AWS.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from manifests.objects.common import (
    CONFIG_MAP,
    CONTAINER,
    FSX_MOUNT,
    OVERLAYS,
    PROJECT,
    PV_NAME,
    PVC_NAME,
    SERVICE_ACCOUNT,
    TRAINER,
    size_of,
)
from manifests.objects.cordon import NODE_CORDON, NODE_NAME_EXTRA, node_cordon_objects
from manifests.objects.job import (
    DATA_DIR,
    FSX_FSTYPE,
    NODE_LOSS_TOLERATION_SECONDS,
    NODE_SCRATCH,
    PREPARE_SCRIPT,
    SCRATCH,
    TERMINATION_MESSAGE_PATH,
    TTL_SECONDS_AFTER_FINISHED,
    job_objects,
    pod_command,
    pod_memory_env,
    pod_placement,
    trainer_args,
)
from manifests.objects.rdzv_store import (
    RDZV_PRIORITY,
    RDZV_PRIORITY_CLASS,
    RDZV_STORE,
    RDZV_STORE_COMMAND,
    RDZV_STORE_FILES,
    RDZV_STORE_PORT,
)
from manifests.objects.shared import EFA_NCCL_ENV, FSX_NOMINAL_SIZE, shared_objects
from manifests.objects.spares import (
    SPARE,
    SPARE_COMMAND,
    SPARE_PRIORITY,
    SPARE_PRIORITY_CLASS,
    SPARE_READER,
    SPARES,
    spare_objects,
    spare_reader_objects,
)
from manifests.sizes import RESTART_MODES

__all__ = [
    "BASE_OVERLAY",
    "CONFIG_MAP",
    "CONTAINER",
    "DATA_DIR",
    "DEFAULT_NAMESPACE",
    "EFA_NCCL_ENV",
    "FSX_FSTYPE",
    "FSX_MOUNT",
    "FSX_NOMINAL_SIZE",
    "IMAGE_NAME",
    "KUBERNETES_VERSION",
    "MANIFESTS_DIR",
    "NODE_CORDON",
    "NODE_LOSS_TOLERATION_SECONDS",
    "NODE_NAME_EXTRA",
    "NODE_SCRATCH",
    "OVERLAYS",
    "PLACEHOLDER_FSX",
    "PLACEHOLDER_IMAGE",
    "PLACEHOLDER_IMAGE_REPO",
    "PLACEHOLDER_IMAGE_TAG",
    "PREPARE_SCRIPT",
    "PROJECT",
    "PVC_NAME",
    "PV_NAME",
    "RDZV_PRIORITY",
    "RDZV_PRIORITY_CLASS",
    "RDZV_STORE",
    "RDZV_STORE_COMMAND",
    "RDZV_STORE_FILES",
    "RDZV_STORE_PORT",
    "RESTART_MODES",
    "SCRATCH",
    "SERVICE_ACCOUNT",
    "SPARE",
    "SPARES",
    "SPARE_COMMAND",
    "SPARE_PRIORITY",
    "SPARE_PRIORITY_CLASS",
    "SPARE_READER",
    "STORE_IMAGE_NAME",
    "TERMINATION_MESSAGE_PATH",
    "TRAINER",
    "TTL_SECONDS_AFTER_FINISHED",
    "job_objects",
    "node_cordon_objects",
    "placeholder_objects",
    "pod_command",
    "pod_memory_env",
    "pod_placement",
    "shared_objects",
    "size_of",
    "spare_objects",
    "spare_reader_objects",
    "to_yaml",
    "trainer_args",
]

KUBERNETES_VERSION = "1.35.0"
"""The Kubernetes API schema the objects are validated against (kubernetes-validate's newest);
not the cluster's version, which is infra/config.py's `kubernetesVersion`."""

# Placeholders in the committed kustomize YAML (the Python renderer gets the real values).
DEFAULT_NAMESPACE = "training"
IMAGE_NAME = "trainer"
STORE_IMAGE_NAME = "rdzv-store"
"""The store's image name in the kustomize base: its own `images:` entry (the trainer's image
by default, or the store's own image where the stack builds one)."""
PLACEHOLDER_IMAGE_REPO = "ACCOUNT.dkr.ecr.REGION.amazonaws.com/eks-fsdp-resilient"
PLACEHOLDER_IMAGE_TAG = "latest"
PLACEHOLDER_IMAGE = f"{PLACEHOLDER_IMAGE_REPO}:{PLACEHOLDER_IMAGE_TAG}"
PLACEHOLDER_FSX = {
    "file_system_id": "fs-0123456789abcdef0",
    "dns_name": "fs-0123456789abcdef0.fsx.REGION.amazonaws.com",
    "mount_name": "abcdefgh",
    "storage_capacity_gib": 1200,
}


# --- the committed kustomize tree, generated from the builders above ---------------------------

MANIFESTS_DIR = Path(__file__).resolve().parent
BASE_OVERLAY = "smoke"  # the base carries this size; each overlay patches the differences


def placeholder_objects(*, overlay: str) -> list[dict]:
    """What `kubectl kustomize manifests/overlays/<overlay>` yields (placeholders included)."""
    return [
        *shared_objects(namespace=DEFAULT_NAMESPACE, image=PLACEHOLDER_IMAGE, **PLACEHOLDER_FSX),
        *job_objects(overlay=overlay, namespace=DEFAULT_NAMESPACE, image=PLACEHOLDER_IMAGE),
        *spare_objects(overlay=overlay, namespace=DEFAULT_NAMESPACE, image=PLACEHOLDER_IMAGE),
    ]


def to_yaml(doc: Any) -> str:
    import yaml

    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True  # a shared labels dict is written out, not as &id001 / *id001

    def _str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    _Dumper.add_representer(str, _str)
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100)
