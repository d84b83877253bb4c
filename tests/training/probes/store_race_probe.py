"""Probe: one rank of a 2-rank gloo group formed by ``training.parallel.init_process_group``
over env://, where rank 0 creates the TCPStore itself (as under ft_launcher) and may start
after rank 1. Run by tests/training/test_parallel.py; usage:
``store_race_probe.py RANK PORT DELAY_S RESULT_DIR``.

Writes ``rank<R>.json``: the all-reduced sum and how many Python-level connects this rank made
to the store's port before its process group was up (the wait for rank 0's store; TCPStore's
own connects are C++ and raise no audit event).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    rank, port, delay_s, result_dir = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        float(sys.argv[3]),
        Path(sys.argv[4]),
    )
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="False",  # what ft_launcher sets for the c10d backend
    )
    import torch
    import torch.distributed as dist

    from training.config import ParallelConfig
    from training.parallel import dist_env_from_environment, init_process_group

    connects: list[tuple] = []

    def audit(event: str, args: tuple) -> None:
        address = args[1] if event == "socket.connect" and len(args) > 1 else None
        if isinstance(address, tuple) and address[1:2] == (port,):
            connects.append(address)

    sys.addaudithook(audit)
    time.sleep(delay_s)
    env = dist_env_from_environment(ParallelConfig(device="cpu"), cpu_collectives=False)
    init_process_group(env, timeout_s=60)
    before_group = len(connects)
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    (result_dir / f"rank{rank}.json").write_text(
        json.dumps({"sum": value.item(), "store_polls": before_group})
    )


if __name__ == "__main__":
    main()
