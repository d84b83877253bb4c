"""What the stack needs to know about the trainer's GPU recipes, without importing the trainer:
parameter counts, checkpoint retention and cadence, and the work per step that turns a
checkpoint interval in steps into seconds. The CDK stack sizes FSx for Lustre from this table
(``infra/sizing.py``); ``infra/`` never imports ``training/``.

One owner: ``training/recipes.py`` defines the recipes; this table copies the few figures the
stack needs, and ``tests/facts/test_recipes_table.py`` builds each recipe's model on the meta
device and fails when a figure here drifts from the recipe (parameter count, 12 bytes per
parameter in the real model + AdamW state dict, keep_last, interval, tokens and FLOPs per step).

Step time is an estimate: FLOPs per GPU per step at an assumed model FLOPs utilisation of the
H100's dense bf16 peak. A faster step makes the interval shorter and the throughput needed
higher, so the assumed MFU is set above what FSDP2 reaches on H100 (about 40% in published
Llama 70B runs): the estimate errs towards a faster file system.
"""

from __future__ import annotations

from dataclasses import dataclass

from facts.checkpoint import checkpoint_bytes

H100_BF16_DENSE_FLOPS = 989e12
"""Peak dense bf16 tensor FLOP/s of one H100 SXM (NVIDIA H100 datasheet: 1,979 TFLOPS with
sparsity, half of it dense)."""
ASSUMED_MFU = 0.5
"""Model FLOPs utilisation assumed for the step-time estimate (an upper bound, see above)."""


@dataclass(frozen=True, kw_only=True)
class RecipeFacts:
    """The figures of one recipe that size its checkpoints and their cadence."""

    name: str
    """Recipe name (``python -m training train --recipe NAME``)."""
    params: int
    """Model parameters (``training.model.count_parameters``)."""
    keep_last: int
    """Committed checkpoints kept on shared storage (``checkpoint.keep_last``); a save in flight
    needs room for one more."""
    checkpoint_interval_steps: int
    """Steps between shared-storage checkpoints (``checkpoint.interval``)."""
    tokens_per_gpu_step: int
    """Tokens each GPU processes per optimizer step: micro batch x gradient accumulation x
    sequence length (FSDP2: every rank does the same work, whatever the world size)."""
    flops_per_token: float
    """Training FLOPs per token (``training.model.flops_per_token`` at the recipe's length)."""

    def __post_init__(self) -> None:
        if min(self.params, self.keep_last, self.checkpoint_interval_steps) < 1:
            raise ValueError(f"{self.name}: params, keep_last and interval must be >= 1")

    @property
    def checkpoint_bytes(self) -> float:
        """Bytes of one full checkpoint (facts.checkpoint: 12 bytes per parameter)."""
        return checkpoint_bytes(params=self.params)

    @property
    def step_time_s(self) -> float:
        """Estimated seconds per optimizer step on H100 at ASSUMED_MFU."""
        return (
            self.flops_per_token * self.tokens_per_gpu_step / (H100_BF16_DENSE_FLOPS * ASSUMED_MFU)
        )

    @property
    def checkpoint_interval_s(self) -> float:
        """Estimated seconds between two shared-storage checkpoints."""
        return self.checkpoint_interval_steps * self.step_time_s


RECIPES: dict[str, RecipeFacts] = {
    r.name: r
    for r in (
        RecipeFacts(
            name="p5_smoke",
            params=8_030_261_248,
            keep_last=3,
            checkpoint_interval_steps=25,
            tokens_per_gpu_step=4096,
            flops_per_token=51_471_998_976.0,
        ),
        RecipeFacts(
            name="p5_8b",
            params=8_030_261_248,
            keep_last=3,
            checkpoint_interval_steps=200,
            tokens_per_gpu_step=8192,
            flops_per_token=57_914_449_920.0,
        ),
        RecipeFacts(
            name="p5_70b",
            params=70_553_706_496,
            keep_last=3,
            checkpoint_interval_steps=100,
            tokens_per_gpu_step=8192,
            flops_per_token=481_442_709_504.0,
        ),
    )
}
