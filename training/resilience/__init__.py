"""Restart layers. Exactly one runs per job (``--restart none|inprocess|injob``): upstream NVRx
documents combining in-process and in-job restart in one workload as unsupported for now."""

from __future__ import annotations

from training.config import JobConfig

EXIT_OK = 0


def run_with_restart_layer(config: JobConfig) -> int:
    mode = config.resilience.restart
    if mode == "inprocess":
        from training.resilience.inprocess import run_inprocess

        return run_inprocess(config)
    if mode == "injob":
        from training.resilience.injob import run_injob

        return run_injob(config)
    from training.run import run_training
    from training.trainer import EXIT_PREEMPTED

    result = run_training(config)
    return EXIT_PREEMPTED if result.preempted else EXIT_OK
