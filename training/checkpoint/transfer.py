"""Byte buffers sent rank to rank in buckets, over the job's own process group.

A transfer is a set of point-to-point messages, each a small ``meta`` (bytes) and a flat
``data`` buffer (a 1-D uint8 host tensor: a snapshot file mapped into memory). Every rank calls
:func:`transfer` with what it sends and what it receives, at the same point (it is collective
over the ranks that take part). Three rounds: the sizes (two int64s per message), the metas,
then the data in buckets of at most ``bucket_bytes``; every round is one
``dist.batch_isend_irecv`` (sends and receives of one round in one batch, so a ring of sends
never deadlocks). Data rounds are pipelined (:data:`IN_FLIGHT`): bucket k+1 is on the wire
while bucket k is copied back and handed to ``Incoming.landed`` (a running CRC32). A receiver
that cannot keep a message (``into`` returns None) still receives it, into scratch buckets, so
its sender is never left blocked.

Staging. gloo takes host tensors: with ``staging=None`` a bucket is sent straight from a view
of the source buffer and received straight into a view of the target, so no buffer beyond the
mapped files is needed (the peer exchange runs this way, on its own gloo group). NCCL (EFA in
the cluster) takes CUDA tensors only (``ProcessGroupNCCL``: "Tensors must be CUDA and dense"):
with ``staging=cuda`` every message gets two device buffers of one bucket, used in turn: a send
copies the bucket host-to-device into one before the send, a receive copies it device-to-host
after the wait. Ordering on the device needs no explicit synchronisation: NCCL's stream waits
for the current stream when an operation is issued, and ``Work.wait()`` makes the current
stream wait for NCCL's; a device-to-host copy into pageable (mapped) memory returns once the
bytes are there, and a buffer is reused only after the round that used it was waited for. The
same code runs with ``staging=cpu`` on gloo, which is how the tests pin the staged path without
a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

BUCKET_BYTES = 256 << 20
"""The most bytes one message moves per round: the staging memory per message on a GPU."""


@dataclass(frozen=True)
class Outgoing:
    dst: int
    meta: bytes
    data: torch.Tensor
    """1-D, uint8, contiguous, on the host."""


@dataclass(frozen=True)
class Incoming:
    src: int
    into: Callable[[bytes, int], torch.Tensor | None]
    """Called with the message's meta and data size once they have arrived: the 1-D uint8 host
    tensor of that size to receive the data into (e.g. a snapshot file just mapped), or None to
    receive and drop it (a message this rank cannot keep: the sender is still answered, so no
    rank is left blocked)."""
    landed: Callable[[torch.Tensor], None] | None = None
    """Called with each bucket of the data, in order, once it is in the target (a running
    CRC32 over it then runs while the next bucket is on the wire); not for dropped data."""


@dataclass(frozen=True)
class Received:
    src: int
    meta: bytes
    data: torch.Tensor
    """The target ``into`` gave (an empty tensor when the data was dropped)."""


def transfer_device(group: dist.ProcessGroup | None = None) -> torch.device | None:
    """The staging device for transfers on ``group``: the rank's GPU when the group has an NCCL
    backend (also a "cpu:gloo,cuda:nccl" group: its CPU tensors would go over gloo's TCP, not
    EFA), None (no staging) otherwise."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return None


IN_FLIGHT = 2
"""Data rounds on the wire at once: round k+1 is issued before round k is waited for, so the
copy-back and the checksum of one bucket overlap the next bucket's transfer (and each message
gets two staging buffers)."""


def transfer(
    *,
    outgoing: list[Outgoing],
    incoming: list[Incoming],
    group: dist.ProcessGroup | None = None,
    staging: torch.device | None = None,
    bucket_bytes: int = BUCKET_BYTES,
    keepalive: Callable[[], None] = lambda: None,
) -> list[Received]:
    """Send ``outgoing`` and receive ``incoming`` (see the module docstring); returns what was
    received, in the order of ``incoming``. Messages between one pair of ranks in one direction
    are matched in list order (``batch_isend_irecv``'s rule). ``keepalive`` is called after
    every round: a snapshot's transfer takes many rounds, seconds in all at 70B."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    for message in outgoing:
        data = message.data
        if data.dtype != torch.uint8 or data.dim() != 1 or not data.is_contiguous():
            raise ValueError("transfer data must be a contiguous 1-D uint8 tensor")
    device = staging or torch.device("cpu")

    # Round 1: the sizes of every meta and data.
    sizes_out = [
        torch.tensor([len(m.meta), m.data.numel()], dtype=torch.int64, device=device)
        for m in outgoing
    ]
    sizes_in = [torch.empty(2, dtype=torch.int64, device=device) for _ in incoming]
    _wait(
        _issue(
            group,
            sends=zip([m.dst for m in outgoing], sizes_out, strict=True),
            recvs=_pairs(incoming, sizes_in),
        )
    )
    sizes = [(int(s[0]), int(s[1])) for s in (t.cpu() for t in sizes_in)]

    # Round 2: the metas.
    metas_out = [_bytes_tensor(m.meta, device=device) for m in outgoing]
    metas_in = [torch.empty(n, dtype=torch.uint8, device=device) for n, _ in sizes]
    _wait(
        _issue(
            group,
            sends=((m.dst, t) for m, t in zip(outgoing, metas_out, strict=True) if t.numel()),
            recvs=((i.src, t) for i, t in zip(incoming, metas_in, strict=True) if t.numel()),
        )
    )
    metas = [bytes(t.cpu().numpy().tobytes()) for t in metas_in]
    targets = [
        _target(i.into(meta, nbytes), nbytes)
        for i, meta, (_, nbytes) in zip(incoming, metas, sizes, strict=True)
    ]
    lengths = [nbytes for _, nbytes in sizes]

    # Round 3: the data, bucket by bucket, IN_FLIGHT rounds on the wire at once.
    def buffers(nbytes: int, *, on: torch.device | None) -> list[torch.Tensor]:
        if on is None or nbytes == 0:
            return []
        size = min(nbytes, bucket_bytes)
        return [torch.empty(size, dtype=torch.uint8, device=on) for _ in range(IN_FLIGHT)]

    send_stages = [buffers(m.data.numel(), on=staging) for m in outgoing]
    # A dropped message lands in scratch buffers (on the host without staging).
    recv_stages = [
        buffers(n, on=device) if staging is not None or t is None else []
        for t, n in zip(targets, lengths, strict=True)
    ]
    rounds = max(
        [_buckets(m.data.numel(), bucket_bytes) for m in outgoing]
        + [_buckets(n, bucket_bytes) for n in lengths]
        + [0]
    )

    def issue(k: int) -> list:
        lo = k * bucket_bytes
        sends, recvs = [], []
        for message, stage in zip(outgoing, send_stages, strict=True):
            part = message.data[lo : lo + bucket_bytes]
            if part.numel() == 0:
                continue
            if stage:
                # Round k-IN_FLIGHT, the last user of this buffer, has been waited for.
                buffer = stage[k % IN_FLIGHT][: part.numel()]
                buffer.copy_(part)
                part = buffer
            sends.append((message.dst, part))
        for source, target, n, stage in zip(incoming, targets, lengths, recv_stages, strict=True):
            count = min(bucket_bytes, n - lo)
            if count <= 0:
                continue
            into = stage[k % IN_FLIGHT][:count] if stage else target[lo : lo + count]
            recvs.append((source.src, into))
        return _issue(group, sends=sends, recvs=recvs)

    def land(k: int) -> None:
        lo = k * bucket_bytes
        for source, target, n, stage in zip(incoming, targets, lengths, recv_stages, strict=True):
            count = min(bucket_bytes, n - lo)
            if count <= 0 or target is None:
                continue
            part = target[lo : lo + count]
            if stage:
                part.copy_(stage[k % IN_FLIGHT][:count])
            if source.landed is not None:
                source.landed(part)

    pending = [issue(k) for k in range(min(IN_FLIGHT - 1, rounds))]
    for k in range(rounds):
        if k + IN_FLIGHT - 1 < rounds:
            pending.append(issue(k + IN_FLIGHT - 1))
        _wait(pending.pop(0))
        land(k)
        keepalive()
    return [
        Received(src=i.src, meta=meta, data=_EMPTY if target is None else target)
        for i, meta, target in zip(incoming, metas, targets, strict=True)
    ]


def _pairs(incoming: list[Incoming], tensors: list[torch.Tensor]):
    return zip([i.src for i in incoming], tensors, strict=True)


def _issue(group, *, sends, recvs) -> list:
    """One batch of sends and receives, issued (not waited for): its works."""
    ops = [dist.P2POp(dist.isend, tensor, peer, group=group) for peer, tensor in sends]
    ops += [dist.P2POp(dist.irecv, tensor, peer, group=group) for peer, tensor in recvs]
    if not ops:
        return []
    return list(dist.batch_isend_irecv(ops))


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _buckets(nbytes: int, bucket_bytes: int) -> int:
    return -(-nbytes // bucket_bytes)


def _bytes_tensor(data: bytes, *, device: torch.device) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _target(tensor: torch.Tensor | None, nbytes: int) -> torch.Tensor | None:
    if tensor is None:
        return None
    if (
        tensor.dtype != torch.uint8
        or tensor.dim() != 1
        or tensor.numel() != nbytes
        or not tensor.is_contiguous()
        or tensor.device.type != "cpu"
    ):
        raise ValueError(
            f"a receive buffer must be a contiguous 1-D uint8 host tensor of {nbytes} bytes"
        )
    return tensor
