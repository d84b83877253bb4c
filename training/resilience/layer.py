"""The restart layer of a run, chosen by ``resilience.restart``: each layer hands every step
hook to ``run_training`` (``step_hooks_for``: its own, the faults, the straggler policy)."""

from __future__ import annotations

from training.config import JobConfig
from training.modes import MODES
from training.resilience.injob import run_injob
from training.resilience.inprocess import run_inprocess
from training.resilience.step_hooks import step_hooks_for
from training.run import run_training


def run_with_restart_layer(config: JobConfig) -> int:
    mode = MODES[config.resilience.restart]
    if mode.keeps_processes:
        # Inside ft_launcher the in-process layer also heartbeats to its rank monitor.
        return run_inprocess(config, nested=mode.launcher == "ft_launcher")
    if mode.keeps_pod:
        return run_injob(config)
    result = run_training(config, hooks=step_hooks_for(config))
    return result.exit_code
