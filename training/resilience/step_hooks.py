"""The step hooks of one attempt, as every restart layer hands them to ``run_training``: the
layer's own (heartbeats, sections, progress reports), then the injected faults, then the
straggler policy. Built by ``run_training`` once the attempt knows its rank, device and event
log, at the point where the attempt's process group is up."""

from __future__ import annotations

from pathlib import Path

from training.config import JobConfig
from training.hooks import HookChain, StepHooks
from training.parallel import DistEnv
from training.resilience.inject import FaultInjector
from training.resilience.straggler import StragglerHooks
from training.run import StepHooksFor
from training.runlog.metrics import EventLog


def step_hooks_for(config: JobConfig, *, layer: StepHooks | None = None) -> StepHooksFor:
    """What ``run_training(hooks=...)`` takes: `layer`'s hooks, the faults of
    ``config.faults`` (or ``TRAIN_FAULTS``), and with ``straggler.enabled`` the straggler
    policy, whose timers are released when the loop ends (``StepHooks.loop_ended``)."""

    def build(env: DistEnv, events: EventLog) -> StepHooks:
        faults = FaultInjector.from_spec(
            config.faults,
            rank=env.rank,
            events=events,
            checkpoint_root=Path(config.checkpoint_dir),
        )
        stragglers = []
        if config.straggler.enabled:
            stragglers.append(
                StragglerHooks(
                    config=config.straggler, rank=env.rank, device=env.device, events=events
                )
            )
        # The layer's hooks first: a heartbeat or section is recorded before a fault fires.
        return HookChain([*([layer] if layer is not None else []), faults, *stragglers])

    return build
