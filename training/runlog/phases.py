"""Restart phases: the one definition of the ``restart_phase`` event and its phase names.

Every layer that takes part in a restart (the restart layers in ``training/resilience``, the
launcher, ``training/run.py`` and the trainer) writes one ``restart_phase`` event per phase it
reaches, through ``EventLog.emit``; ``training/runlog/accounting.py`` reads them back.
Torch-free, so the launcher and the report can import it cheaply.

Event line (``events.jsonl``)::

    {"time": ..., "rank": r, "kind": "restart_phase", "step": null,
     "phase": "<one of PHASES>", "attempt": <attempt it starts>, "mode": "<optional>"}
"""

from __future__ import annotations

from typing import Any, Protocol

RESTART_PHASE = "restart_phase"

DETECTED = "detected"  # the layer saw the fault (exception, hang timeout, dead process)
SURVIVORS_STOPPED = "survivors_stopped"  # healthy ranks left their step
PROCESSES_UP = "processes_up"  # the ranks of the new attempt are running (fresh or reused)
RENDEZVOUS_DONE = "rendezvous_done"  # the new attempt's ranks agreed on membership
PROCESS_GROUP_UP = "process_group_up"  # init_process_group returned
MODEL_BUILT = "model_built"  # model, optimizer and data built
CHECKPOINT_LOADED = "checkpoint_loaded"  # state restored (or nothing to restore)
FIRST_STEP = "first_step"  # the attempt's first optimizer step finished

# In the order a restart passes through them; a phase may be missing (a cold start has no
# ``detected``; a layer may not see one), so readers must not assume all are present.
PHASES: tuple[str, ...] = (
    DETECTED,
    SURVIVORS_STOPPED,
    PROCESSES_UP,
    RENDEZVOUS_DONE,
    PROCESS_GROUP_UP,
    MODEL_BUILT,
    CHECKPOINT_LOADED,
    FIRST_STEP,
)


class _Emitter(Protocol):
    def emit(self, kind: str, *, step: int | None = None, **extra: Any) -> None: ...


def emit_phase(
    events: _Emitter,
    *,
    phase: str,
    attempt: int,
    mode: str | None = None,
    at: float | None = None,
    **details: Any,
) -> None:
    """Write one ``restart_phase`` event; ``attempt`` is the attempt the restart leads to; `at`
    (Unix time) when the phase was reached earlier than now (e.g. the process's start);
    ``details`` are recorded with it (``weights_initialized`` on ``model_built``)."""
    if phase not in PHASES:
        raise ValueError(f"restart phase {phase!r} is not one of {PHASES}")
    extra: dict[str, Any] = {**details, "phase": phase, "attempt": attempt}
    if mode is not None:
        extra["mode"] = mode
    if at is not None:
        extra["time"] = at  # EventLog.emit lets extra fields override its own
    events.emit(RESTART_PHASE, **extra)


def process_start_time(pid: int | None = None) -> float | None:
    """Unix time at which process `pid` (default: this one) started, from /proc (Linux; to the
    kernel's clock tick, 10 ms): its age is the uptime minus its start in ticks since boot."""
    import os
    import time

    try:
        with open(f"/proc/{pid or os.getpid()}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
