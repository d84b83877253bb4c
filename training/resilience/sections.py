"""Names of the rank-monitor sections the trainer opens (in-job restart).

`ft_launcher` refuses a section it has no timeout for (`TimeoutsCalcError: Unknown section`), so
the launcher's `--ft-rank-section-timeouts` is built from this same table
(`training.launch.command`), locally and in the EKS Job.
"""

from __future__ import annotations

from training.config import ResilienceConfig

STEP = "step"
"""Around each training step (forward, backward, optimizer)."""
CHECKPOINT = "checkpoint"
"""Around checkpoint loading and the blocking part of a save."""


def section_timeouts(resilience: ResilienceConfig) -> dict[str, float]:
    """Every section the trainer opens -> its timeout in seconds."""
    return {
        STEP: resilience.step_section_timeout_s,
        CHECKPOINT: resilience.checkpoint_section_timeout_s,
    }
