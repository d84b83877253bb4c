"""``step_hooks_for``: what every restart layer hands to ``run_training`` (the layer's own
hooks, then the injected faults, then the straggler policy), built from the rank's own
``DistEnv`` and event log. Real hooks, a CPU device; the loop itself is exercised by
tests/training/resilience/test_resilience.py (faults through each layer)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training.faults import InjectedFault
from training.hooks import HookChain, StepHooks
from training.overrides import build_config
from training.parallel import DistEnv
from training.resilience.inject import FaultInjector
from training.resilience.step_hooks import step_hooks_for
from training.resilience.straggler import StragglerHooks
from training.runlog.metrics import EventLog


class Closed(StepHooks):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def loop_ended(self) -> None:
        self.calls.append("loop_ended")


def _env(rank: int) -> DistEnv:
    return DistEnv(
        rank=rank, world_size=2, local_rank=0, device=torch.device("cpu"), backend="gloo"
    )


def _build(tmp_path: Path, *flags: str, layer: StepHooks | None = None, rank: int = 1):
    config, _ = build_config(["--run-dir", str(tmp_path / "run"), *flags])
    events = EventLog(run_dir=tmp_path / "run", rank=rank)
    return step_hooks_for(config, layer=layer)(_env(rank), events)


def test_the_layer_first_then_faults_then_stragglers(tmp_path: Path) -> None:
    layer = Closed()
    hooks = _build(tmp_path, "--straggler.enabled=true", layer=layer)
    assert isinstance(hooks, HookChain)
    assert [type(h) for h in hooks.hooks] == [Closed, FaultInjector, StragglerHooks]
    hooks.loop_ended()  # forwarded to every hook (the straggler timers are released)
    assert layer.calls == ["loop_ended"]


def test_no_straggler_policy_when_disabled_and_no_layer(tmp_path: Path) -> None:
    hooks = _build(tmp_path, "--straggler.enabled=false")
    assert [type(h) for h in hooks.hooks] == [FaultInjector]


def test_the_faults_are_this_ranks(tmp_path: Path) -> None:
    """The injector is built for the rank ``run_training`` passes (an in-process restart may
    renumber ranks), from the run's ``--faults``."""
    faults = "--faults=exception@1:3"
    _build(tmp_path, faults, rank=0).before_step(3)  # rank 0: nothing fires
    with pytest.raises(InjectedFault):
        _build(tmp_path, faults, rank=1).before_step(3)
