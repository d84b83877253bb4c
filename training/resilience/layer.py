"""The restart layer of a run, chosen by ``resilience.restart``."""

from __future__ import annotations

from training.config import JobConfig
from training.modes import MODES


def run_with_restart_layer(config: JobConfig) -> int:
    mode = config.resilience.restart
    if MODES[mode].keeps_processes:
        from training.resilience.inprocess import run_inprocess

        return run_inprocess(config, nested=mode == "nested")
    if mode == "injob":
        from training.resilience.injob import run_injob

        return run_injob(config)
    from training.run import run_training

    result = run_training(config)
    return result.exit_code
