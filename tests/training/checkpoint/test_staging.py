"""``training.checkpoint.staging``: the NVRx save's host staging buffer of CPU state.

Real tensors in real shared memory; the buckets have the shape NVRx 0.4.1's
``FileSystemWriterAsync.write_buckets`` gives them: ``(path, storage_key, (bytes, tensors))``.
"""

from __future__ import annotations

import torch

from training.checkpoint.staging import HostStaging, staged_bytes, unstage


def _buckets(tensors: list[torch.Tensor]) -> list:
    return [("__0_0.distcp", "key", ([], [(f"item{i}", t) for i, t in enumerate(tensors)]))]


def _staged_tensors(staging: HostStaging, buckets: list) -> list[torch.Tensor]:
    staged = staging.stage(buckets)
    assert staging.buffer is not None
    return [t for _, _, (_, items) in unstage(staged, staging.buffer) for _, t in items]


def test_a_reserved_buffer_is_what_the_first_save_stages_into() -> None:
    """The first save lays its slots out in the buffer reserved (and faulted in) beforehand,
    and the staged bytes are the state's."""
    tensors = [torch.randn(1000), torch.arange(37, dtype=torch.int64), torch.randn(3, 5)]
    nbytes = staged_bytes({"model": tensors[:2], "optim": {"x": tensors[2]}})
    assert nbytes is not None and nbytes >= sum(t.numel() * t.element_size() for t in tensors)
    staging = HostStaging()
    staging.reserve(nbytes)
    staging._reserving.join()  # the background allocation is done, as after a few steps
    reserved = staging._reserved
    assert reserved is not None and reserved.is_shared()
    staged = _staged_tensors(staging, _buckets(tensors))
    assert staging.buffer is reserved
    assert all(torch.equal(a, b) for a, b in zip(staged, tensors, strict=True))


def test_a_reservation_too_small_is_not_used() -> None:
    tensors = [torch.randn(4096)]
    staging = HostStaging()
    staging.reserve(64)
    staged = _staged_tensors(staging, _buckets(tensors))  # joins the reservation itself
    assert staging.buffer is not None and staging.buffer.numel() >= 4096 * 4
    assert torch.equal(staged[0], tensors[0])


def test_state_off_the_cpu_is_not_staged_here() -> None:
    assert staged_bytes({"a": torch.empty(3, device="meta")}) is None
