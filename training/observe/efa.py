"""EFA traffic counters of this node, read from sysfs. Standard library only.

The EFA kernel driver registers each device with the RDMA core, which lists it under
``/sys/class/infiniband/<device>`` and shows the driver's port statistics as one file per
counter in ``ports/<port>/hw_counters/`` (amzn-drivers ``kernel/linux/efa/src/efa_verbs.c``,
``EFA_DEFINE_PORT_STATS``: tx_bytes, rx_bytes, rdma_read_bytes, rdma_write_bytes, ...). A trainer
pod that was given EFA devices sees them there. Devices without ``hw_counters`` (other RDMA
drivers) and counters an older driver lacks (rdma_write_bytes) are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SYSFS_ROOT = Path("/sys/class/infiniband")

# hw_counters file -> exported metric (training/observe/catalog.py).
COUNTERS: dict[str, str] = {
    "tx_bytes": "efa_transmitted_bytes_total",
    "rx_bytes": "efa_received_bytes_total",
    "rdma_read_bytes": "efa_rdma_read_bytes_total",
    "rdma_write_bytes": "efa_rdma_write_bytes_total",
}


@dataclass(frozen=True)
class Reading:
    device: str
    """The RDMA device's name (e.g. rdmap16s27), with ``:<port>`` when it has several ports."""
    metric: str
    value: float


def read_counters(root: Path = SYSFS_ROOT) -> list[Reading]:
    """Every known counter of every device under ``root`` (none when ``root`` does not exist)."""
    readings: list[Reading] = []
    if not root.is_dir():
        return readings
    for device in sorted(root.iterdir()):
        ports = sorted((device / "ports").glob("*"))
        for port in ports:
            name = device.name if len(ports) == 1 else f"{device.name}:{port.name}"
            for counter, metric in COUNTERS.items():
                try:
                    value = float((port / "hw_counters" / counter).read_text().strip())
                except (OSError, ValueError):
                    continue
                readings.append(Reading(device=name, metric=metric, value=value))
    return readings
