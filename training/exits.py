"""Exit codes of every process this project starts, and the configuration error that maps to
``USAGE``: one owner for the trainer, the launchers, the pod's launch script and the Job's pod
failure policy.

Standard library only, imported by `manifests/` too. `RETRY_CANNOT_HELP` is what the pod failure
policy turns into `FailJob`: a replacement pod would meet the same error.
"""

from __future__ import annotations

OK = 0
FAILED = 1
"""A fault: a replacement pod (or a new attempt) may succeed."""
USAGE = 2
"""Bad configuration or flag (argparse's own code too): fix the input, do not retry."""
NO_PROGRESS = 3
"""Restarts keep failing before the run gets past the same step: a deterministic fault."""
RESTARTS_EXHAUSTED = 4
"""The restart cap (`resilience.max_restarts`) was reached."""
ENVIRONMENT = 5
"""The pod's hardware or software does not fit the job (GPU count, CUDA, EFA provider). The
start-up check uses it for what every node would meet (the image, the Job's settings, /fsx) and
`NODE_UNFIT` for what is this node's own."""
NODE_UNFIT = 6
"""This node does not fit (GPUs missing, an old driver, no EFA device, a broken FSx client): a
replacement pod, which may land on another node, can succeed. Counted against backoffLimit."""
NOT_EXECUTABLE = 126
COMMAND_NOT_FOUND = 127
"""The shell's codes when the image lacks the command."""
PREEMPTED = 143
"""128 + SIGTERM: stopped on request after a final checkpoint."""

RETRY_CANNOT_HELP: tuple[int, ...] = (
    USAGE,
    NO_PROGRESS,
    RESTARTS_EXHAUSTED,
    ENVIRONMENT,
    NOT_EXECUTABLE,
    COMMAND_NOT_FOUND,
)


class ConfigError(ValueError):
    """A configuration value is invalid. ``str(err)`` is the one message shown to the user; the
    CLIs exit with ``USAGE``."""

    def __init__(self, field_path: str, problem: str) -> None:
        super().__init__(f"config error: {field_path}: {problem}")
        self.field_path = field_path
