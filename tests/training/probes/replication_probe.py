"""Probe for the bucketed replica exchange of local checkpoints (training/checkpoint/local.py),
run by tests/training/checkpoint/test_local_checkpoint.py under torchrun on 2 CPU ranks (gloo).

Each rank gathers every rank's tensors (mixed dtypes and shapes, one bigger than a bucket)
through NVRx 0.4.1's own ``GroupWrapper.all_gather_batch`` and through ``BucketedGroupWrapper``,
counting the broadcasts of each, and writes a JSON report: whether the results are equal and
the counts. Usage: torchrun --nproc-per-node 2 replication_probe.py RESULT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def tensors(rank: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(rank)
    out = []
    for index in range(40):
        shape = (index % 7 + 1, index % 5 + 3)
        dtype = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)[index % 4]
        out.append((torch.randn(shape, generator=generator) * 100).to(dtype))
    out.append(torch.randn(300_000, generator=generator))  # 1.2 MB: over the probe's bucket
    return out


def main() -> None:
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper

    import training.checkpoint.local as local

    result_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    local.BUCKET_BYTES = 1 << 20  # small buckets, so that the probe has several
    counts = {}

    def counting(wrapper):
        calls = []
        real = wrapper.broadcast

        def broadcast(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        wrapper.broadcast = broadcast
        return wrapper, calls

    plain, counts["nvrx"] = counting(GroupWrapper(dist.group.WORLD))
    bucketed, counts["bucketed"] = counting(local._bucketed_group_wrapper_class()(dist.group.WORLD))
    mine = tensors(rank)
    expected = plain.all_gather_batch(mine, target_device="cpu")
    got = bucketed.all_gather_batch(mine, target_device="cpu")

    def same(x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)

    equal = len(got) == len(expected) and all(
        len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        for a, b in zip(got, expected, strict=True)
    )
    sent = [torch.equal(got[r][0], tensors(r)[0]) for r in range(dist.get_world_size())]
    # A restore from a peer: rank 0 sends its whole shard to rank 1, point to point.
    from nvidia_resiliency_ext.checkpointing.local.basic_state_dict import (
        BasicTensorAwareStateDict,
    )

    sends: list[int] = []
    real_send = dist.send

    def counting_send(*args, **kwargs):
        sends.append(1)
        return real_send(*args, **kwargs)

    dist.send = counting_send
    restored_equal = None
    if rank == 0:
        shard = BasicTensorAwareStateDict({})  # CPU tensors: NVRx's constructor takes CUDA only
        shard.state_dict = {"model": {"w": mine[:20]}, "optim": mine[20:], "step": 7}
        bucketed.isend_state_dict(shard, 1)
        restored_equal = not shard.is_hollow and shard.state_dict["optim"][-1] is mine[-1]
    else:
        shard, _ = bucketed.irecv_state_dict(0)
        got = [*shard.state_dict["model"]["w"], *shard.state_dict["optim"]]
        restored_equal = shard.state_dict["step"] == 7 and all(
            same(x, y) for x, y in zip(got, tensors(0), strict=True)
        )
    dist.send = real_send
    # The strategy LocalCheckpoints builds for a job of two "nodes" (one rank each) uses it.
    tier = local.LocalCheckpoints(
        root=result_dir / "nvme",
        session_id="probe",
        world_size=2,
        local_world_size=1,
        require_cuda=False,
    )
    strategy = tier._manager.repl_strategy.replication_strategy  # built lazily (collective)
    report = {
        "strategy_group": type(strategy.local_group).__name__,
        "equal": equal,
        "restore_equal": restored_equal,
        "restore_sends": len(sends),
        "from_each_rank": sent,
        "broadcasts": {k: len(v) for k, v in counts.items()},
    }
    (result_dir / f"replication_rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
