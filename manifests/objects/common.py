"""What every object builder shares: the names the objects refer to each other by, their labels,
the overlay lookup and the PriorityClass shape."""

from __future__ import annotations

from manifests.sizes import SIZES, OverlaySize

PROJECT = "eks-fsdp-resilient"
"""Part-of label and the server-side apply field manager."""
OVERLAYS: tuple[str, ...] = tuple(SIZES)

SERVICE_ACCOUNT = "fsdp-trainer"
CONFIG_MAP = "fsdp-config"
PV_NAME = "fsdp-fsx"
PVC_NAME = "fsx-claim"
CONTAINER = "trainer"
FSX_MOUNT = "/fsx"
TRAINER = "trainer"
"""The component label of the training Job's pods (and the preflight Job's): the store's
NetworkPolicy admits exactly these."""


def labels(component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "fsdp-train",
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": PROJECT,
    }


def size_of(overlay: str) -> OverlaySize:
    """The sizes row of `overlay`; ValueError naming the allowed overlays."""
    try:
        return SIZES[overlay]
    except KeyError:
        raise ValueError(
            f"unknown overlay {overlay!r}: choose one of {', '.join(OVERLAYS)}"
        ) from None


def priority_class(
    *, name: str, component: str, value: int, preemption_policy: str, description: str
) -> dict:
    """A PriorityClass that no pod gets by default."""
    return {
        "apiVersion": "scheduling.k8s.io/v1",
        "kind": "PriorityClass",
        "metadata": {"name": name, "labels": labels(component)},
        "value": value,
        "globalDefault": False,
        "preemptionPolicy": preemption_policy,
        "description": description,
    }
