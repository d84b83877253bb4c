"""The rendezvous store every training Job's launchers meet in: a one-replica TCPStore with its
PriorityClass, Deployment, disruption budget, NetworkPolicy and Service."""

from __future__ import annotations

from manifests.objects.system_service import system_service_objects

RDZV_STORE = "fsdp-rdzv"
"""The rendezvous store's Deployment and Service (shared by every training Job)."""
RDZV_STORE_PORT = 29400
RDZV_STORE_COMMAND = ("python", "-m", "training.launch.rdzv_store")
"""What the store's image runs, in /app: the trainer's image, or a small one of its own that
holds `python` with torch (a CPU build is enough) and RDZV_STORE_FILES under /app."""
RDZV_STORE_FILES = (
    "training/__init__.py",
    "training/launch/__init__.py",
    "training/launch/rdzv_store.py",
)
"""Every repository file the store imports (tests/training/test_rdzv_store.py runs the command
with these files alone): a store image built from them changes only when they do."""
RDZV_PRIORITY_CLASS = "fsdp-rdzv-store"
RDZV_PRIORITY = 1_000_000
"""Above every pod without a class (0); below the system-*-critical classes (2e9)."""
STORE = "rdzv-store"
"""The store's component label."""


def rdzv_store_objects(*, namespace: str, image: str) -> list[dict]:
    """A one-replica TCPStore on the system nodes, its Service, which every launcher joins as a
    client, and what keeps it single, in place and private (``system_service_objects``)."""
    return system_service_objects(
        name=RDZV_STORE,
        namespace=namespace,
        component=STORE,
        priority_class_name=RDZV_PRIORITY_CLASS,
        priority=RDZV_PRIORITY,
        description="The training jobs' rendezvous store: every running launcher needs it.",
        container={
            "name": "store",
            "image": image,
            "workingDir": "/app",
            "command": list(RDZV_STORE_COMMAND),
            "args": [f"--port={RDZV_STORE_PORT}"],
        },
        port=RDZV_STORE_PORT,
        port_name="rdzv",
    )
