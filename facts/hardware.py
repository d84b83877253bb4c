"""p5.48xlarge hardware figures that more than one part of the repository needs: the preflight's
bandwidth floor and the planner's restore times both come from here.

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

P5_GPUS = 8
"""H100 GPUs per p5.48xlarge."""
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
