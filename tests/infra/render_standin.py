"""A stand-in for manifests/render.py (issue 5) with the agreed interface, used by the infra tests
only while the real module has not landed. It renders the same kinds of objects, minimally."""

from __future__ import annotations

OVERLAYS: tuple[str, ...] = ("smoke", "2node", "16node")


def shared_objects(
    *,
    namespace: str,
    file_system_id: str,
    dns_name: str,
    mount_name: str,
    storage_capacity_gib: int,
    image: str,
) -> list[dict]:
    meta = {"namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": f"{namespace}-fsx"},
            "spec": {
                "capacity": {"storage": f"{storage_capacity_gib}Gi"},
                "accessModes": ["ReadWriteMany"],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": "",
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
            "metadata": {"name": "fsx", **meta},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": f"{namespace}-fsx",
                "resources": {"requests": {"storage": f"{storage_capacity_gib}Gi"}},
            },
        },
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "trainer", **meta}},
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "trainer", **meta},
            "data": {"IMAGE": image},
        },
    ]


def job_objects(*, overlay: str, namespace: str, image: str) -> list[dict]:
    if overlay not in OVERLAYS:
        raise ValueError(f"unknown overlay {overlay!r}: use one of {', '.join(OVERLAYS)}")
    name = f"train-{overlay}"
    return [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterIP": "None", "selector": {"job-name": name}},
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "completionMode": "Indexed",
                "completions": 1,
                "parallelism": 1,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [
                            {
                                "name": "trainer",
                                "image": image,
                                "command": ["python", "-m", "training", "train"],
                            }
                        ],
                    }
                },
            },
        },
    ]
