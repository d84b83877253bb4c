"""p5.48xlarge hardware figures that more than one part of the repository needs: the node type
the manifests request and the CDK node group launches (`P5_48XLARGE`), the launch template's
network cards, the preflight's bandwidth floor and the planner's restore times all come from here.

Standard library only. Sources:
- AWS, "Amazon EC2 P5 Instances" (aws.amazon.com/ec2/instance-types/p5/) and the EC2 User
  Guide, "Maximize network bandwidth on Amazon EC2 instances with multiple network cards"
  (efa-acc-inst-types): p5.48xlarge has 8 x H100, 32 network cards and 3,200 Gbps of EFA
  networking per node, 2 TiB of host memory and 8 x 3.84 TB of NVMe instance store.
- AWS, "Amazon EC2 P5 Instances": p5.48xlarge runs on 3rd Gen AMD EPYC processors (EPYC 7R13,
  "Milan", two sockets); AMD EPYC 7003 series: eight DDR4-3200 memory channels per socket,
  8 x 25.6 GB/s = 204.8 GB/s nominal per socket.
- PCI-SIG, PCI Express Base Specification 5.0: 32 GT/s per lane, a x16 link carries about
  64 GB/s per direction (nominal; the H100 SXM's host link is PCIe 5.0 x16).
"""

from __future__ import annotations

from dataclasses import dataclass

P5_GPUS = 8
"""H100 GPUs per p5.48xlarge."""
P5_NETWORK_CARDS = 32
"""Network cards per p5.48xlarge, one EFA interface each: the launch template's interfaces
(infra/gpu_nodegroup.py) and the pods' `vpc.amazonaws.com/efa` request."""
P5_EFA_GBITS = 3200
"""EFA networking per p5.48xlarge node, Gbit/s (32 network cards)."""
P5_EFA_BYTES_PER_S = P5_EFA_GBITS / 8 * 1e9
"""The same in bytes per second each way: 400 GB/s."""
P5_HOST_MEMORY_GIB = 2048
"""Host memory of one p5.48xlarge (2 TiB)."""
P5_HOST_MEMORY_BYTES_PER_S = 2 * 8 * 25.6e9
"""Host memory bandwidth of one p5.48xlarge, nominal: two sockets of eight DDR4-3200 channels
(409.6 GB/s), shared by the node's eight ranks."""
PCIE5_X16_BYTES_PER_S = 64e9
"""PCIe 5.0 x16, one direction, nominal: the GPU <-> host copy bandwidth's ceiling."""


@dataclass(frozen=True, kw_only=True)
class NodeType:
    """An EC2 GPU instance type and the devices its pods must request to own the whole node."""

    name: str
    """EC2 instance type, also the node selector (`node.kubernetes.io/instance-type`)."""
    gpus: int
    """NVIDIA GPUs per node: the `nvidia.com/gpu` request and the processes started per node."""
    efa: int
    """EFA interfaces per node (one per network card): the `vpc.amazonaws.com/efa` request."""
    cpu: str
    """CPU request: most of the node, leaving room for the kubelet and the daemon sets."""
    memory: str
    """Memory request, same reasoning as `cpu`."""
    hugepages_2mi: str
    """2 MiB huge pages for the EFA provider's registered buffers (libfabric)."""
    shm: str
    """Size limit of the memory-backed /dev/shm (NCCL and data loader shared memory)."""

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.efa < 0:
            raise ValueError(f"{self.name}: gpus must be >= 1 and efa >= 0")


# p5.48xlarge: 8 x H100, 32 network cards (EFA), 192 vCPU, 2 TiB memory.
P5_48XLARGE = NodeType(
    name="p5.48xlarge",
    gpus=P5_GPUS,
    efa=P5_NETWORK_CARDS,
    cpu="160",
    memory="1600Gi",
    hugepages_2mi="5120Mi",
    shm="256Gi",
)
"""The one GPU node type: manifests/sizes.py's overlays run on it, infra/ launches it."""
