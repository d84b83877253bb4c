"""How many bytes a checkpoint of this trainer holds per model parameter: the stack's FSx sizing
check and the planner's checkpoint size both come from here.

The trainer checkpoints FSDP2's sharded state through ``torch.distributed.checkpoint``
(``training/trainer.py`` ``state_dict``): the parameters in fp32 (``MixedPrecisionPolicy`` casts
to bf16 only for compute, the sharded master copy stays fp32) and AdamW's two moments
(``exp_avg``, ``exp_avg_sq``), fp32 each; gradients are not saved. That is 4 + 4 + 4 = 12 bytes
per parameter, plus per-tensor scalars (AdamW's ``step``) and the data-loader position, which are
negligible at any real size. ``tests/facts/test_recipes_table.py`` builds each recipe's
model on the meta device and checks this against the state dict's real tensors.

A framework that also keeps bf16 parameters or fp32 gradients in the checkpoint stores 14-18 B;
the planner lets a user override the figure (``--bytes-per-param``).
"""

from __future__ import annotations

FP32_BYTES = 4
PARAM_BYTES = FP32_BYTES
"""fp32 master parameters."""
ADAMW_STATE_BYTES = 2 * FP32_BYTES
"""AdamW ``exp_avg`` and ``exp_avg_sq``, fp32."""
BYTES_PER_PARAM = PARAM_BYTES + ADAMW_STATE_BYTES
"""Checkpointed bytes per parameter for this trainer (12)."""


def checkpoint_bytes(*, params: float, bytes_per_param: float = BYTES_PER_PARAM) -> float:
    """Bytes of one full checkpoint (all shards together) of a `params`-parameter model."""
    if params <= 0 or bytes_per_param <= 0:
        raise ValueError("params and bytes_per_param must be positive")
    return params * bytes_per_param


SNAPSHOT_SLOTS = 2
"""Memory snapshots each rank keeps (training/checkpoint/snapshot_files.py ``SLOTS``)."""


def snapshot_bytes_per_node(
    *,
    params: float,
    nodes: int,
    copies: int = 1,
    bytes_per_param: float = BYTES_PER_PARAM,
) -> float:
    """Bytes of pod memory (``/dev/shm``) one node needs for the memory snapshots of a
    `params`-parameter model sharded over `nodes`: every node holds 1/`nodes` of the state, in
    ``SNAPSHOT_SLOTS`` slots, for `copies` nodes (1: its own; 2: its own and another node's,
    the peer copy)."""
    if nodes < 1 or copies < 1:
        raise ValueError("nodes and copies must be >= 1")
    per_node = checkpoint_bytes(params=params, bytes_per_param=bytes_per_param) / nodes
    return per_node * SNAPSHOT_SLOTS * copies
