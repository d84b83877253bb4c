"""The restart layer of a run, chosen by ``resilience.restart``."""

from __future__ import annotations

from training.config import JobConfig
from training.modes import MODES


def run_with_restart_layer(config: JobConfig) -> int:
    mode = MODES[config.resilience.restart]
    if mode.keeps_processes:
        from training.resilience.inprocess import run_inprocess

        # Inside ft_launcher the in-process layer also heartbeats to its rank monitor.
        return run_inprocess(config, nested=mode.launcher == "ft_launcher")
    if mode.keeps_pod:
        from training.resilience.injob import run_injob

        return run_injob(config)
    from training.run import run_training

    result = run_training(config)
    return result.exit_code
