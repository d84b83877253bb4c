"""The step's one stats all-reduce and its one device-to-host read (``Trainer.reduce_step_stats``).

Real gloo (a one-rank group), the real method. The CUDA branch (a non-blocking copy into a
pinned buffer and one stream synchronization) needs a GPU: here the test pins what reaches the
device boundary, the collective's count and shape and that no per-value ``.item()`` sync is left
(each is a synchronization and, before, a pageable copy). Run:
.venv/bin/pytest tests/training/test_step_stats.py -q
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from training.trainer import Trainer


def _trainer_stub(world_size: int) -> SimpleNamespace:
    stub = SimpleNamespace(env=SimpleNamespace(world_size=world_size), _stats_host=None)
    stub._stats_to_host = lambda stats: Trainer._stats_to_host(stub, stats)
    return stub


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("stop", [False, True])
def test_one_all_reduce_of_two_floats_and_one_read_per_step(one_rank_group, monkeypatch, stop):
    reduced: list[tuple[tuple[int, ...], torch.dtype]] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(tensor, *args, **kwargs):
        reduced.append((tuple(tensor.shape), tensor.dtype))
        return real_all_reduce(tensor, *args, **kwargs)

    def no_item(self):
        raise AssertionError(".item() in reduce_step_stats: one sync per value")

    monkeypatch.setattr(dist, "all_reduce", counting_all_reduce)
    monkeypatch.setattr(torch.Tensor, "item", no_item)
    loss = torch.tensor(2.5)
    mean_loss, stop_now = Trainer.reduce_step_stats(_trainer_stub(1), loss, stop_requested=stop)
    assert reduced == [((2,), torch.float32)]
    assert (mean_loss, stop_now) == (2.5, stop)
    assert isinstance(mean_loss, float) and isinstance(stop_now, bool)


@pytest.mark.gpu
def test_the_cuda_branch_reads_through_one_pinned_buffer() -> None:
    """On a GPU: the copy lands in one pinned buffer, reused by the next step."""
    stub = _trainer_stub(1)
    first = Trainer._stats_to_host(stub, torch.tensor([3.0, 1.0], device="cuda"))
    buffer = stub._stats_host
    assert buffer is not None and buffer.is_pinned()
    second = Trainer._stats_to_host(stub, torch.tensor([4.0, 0.0], device="cuda"))
    assert (first, second) == ([3.0, 1.0], [4.0, 0.0]) and stub._stats_host is buffer
