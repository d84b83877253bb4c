"""Restart phases: the one definition of the ``restart_phase`` event and its phase names.

Every layer that takes part in a restart (the restart layers in ``training/resilience``, the
launcher, ``training/run.py`` and the trainer) writes one ``restart_phase`` event per phase it
reaches, through ``EventLog.emit``; ``training/accounting.py`` reads them back. Torch-free, so the
launcher and the report can import it cheaply.

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


def emit_phase(events: _Emitter, *, phase: str, attempt: int, mode: str | None = None) -> None:
    """Write one ``restart_phase`` event; ``attempt`` is the attempt the restart leads to."""
    if phase not in PHASES:
        raise ValueError(f"restart phase {phase!r} is not one of {PHASES}")
    extra: dict[str, Any] = {"phase": phase, "attempt": attempt}
    if mode is not None:
        extra["mode"] = mode
    events.emit(RESTART_PHASE, **extra)
