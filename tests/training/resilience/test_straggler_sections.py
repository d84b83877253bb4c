"""The step's sections timed for the straggler scores where CUPTI cannot load.

On the shipped image (torch 2.13, CUDA 13) NVRx 0.4.1's CUPTI module (linked to
libcupti.so.12) cannot load, and the detector used to time the fused optimizer only. Now the
trainer opens forward, backward, communication and optimizer sections every step, and the
timer scores each with NVRx's ``ReportGenerator``. Real trainer, real gloo, real NVRx scoring,
on CPU; the CUDA-event timing itself needs a GPU (``gpu_check`` runs it), the choice of the
GPU's scored sections is pinned here.
Run: .venv/bin/pytest tests/training/resilience/test_straggler_sections.py -q
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import TINY_MODEL

from training.config import StragglerConfig
from training.hooks import StepHooks
from training.overrides import build_config
from training.resilience.straggler import (
    SCORED_SECTIONS,
    SECTIONS,
    StragglerHooks,
    _SectionTimer,
)
from training.run import run_training
from training.runlog.metrics import EventLog


class CountingTimings(StepHooks):
    def __init__(self) -> None:
        self.entered: Counter[str] = Counter()

    @contextlib.contextmanager
    def timing(self, name: str) -> Iterator[None]:
        self.entered[name] += 1
        yield


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_every_step_opens_each_section(tmp_path: Path, corpus: Path, one_rank_group) -> None:
    """forward and backward once per micro-batch, communication twice (the gradient norm's and
    the step stats' all-reduces), optimizer once. (Failed before: step and optimizer only.)"""
    steps, accum = 3, 2
    config, _ = build_config(
        [
            *TINY_MODEL,
            "--run-dir",
            str(tmp_path / "run"),
            f"--data.path={corpus}",
            f"--train.steps={steps}",
            f"--train.grad_accum_steps={accum}",
            "--checkpoint.interval=0",
            "--checkpoint.save_final=false",
            "--straggler.enabled=false",
        ]
    )
    hooks = CountingTimings()
    run_training(config, hooks=lambda _env, _events: hooks, rank=0, world_size=1)
    assert hooks.entered == {
        "step": steps,
        "forward": steps * accum,
        "backward": steps * accum,
        "communication": 2 * steps,
        "optimizer": steps,
    }


def test_sections_with_a_collective_are_reported_never_scored() -> None:
    """A section with a collective inside measures the slowest peer on every rank."""
    assert set(SCORED_SECTIONS["cpu"]) == {"optimizer"}
    assert set(SCORED_SECTIONS["cuda"]) == {"forward", "optimizer"}
    for scored in SCORED_SECTIONS.values():
        assert "communication" not in scored and set(scored) <= set(SECTIONS)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_report_scores_the_rank_local_sections_and_reports_them_all(
    one_rank_group, tmp_path: Path
) -> None:
    events = EventLog(run_dir=tmp_path, rank=0)
    hooks = StragglerHooks(
        config=StragglerConfig(report_every=2),
        rank=0,
        device=torch.device("cpu"),
        events=events,
        node="node-a",
    )
    assert isinstance(hooks._timer, _SectionTimer)
    for step in (1, 2):
        for name in SECTIONS:
            with hooks.timing(name):
                torch.ones(32, 32) @ torch.ones(32, 32)
        hooks.after_step(step)
    hooks.close()
    events.flush()
    (record,) = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert record["source"] == "sections:optimizer"
    assert set(record["sections"]) == set(SECTIONS)
    assert all(scores == {"0": 1.0} for scores in record["sections"].values())
    assert set(record["sections_ms"]) == set(SECTIONS)
    assert all(ms >= 0 for ms in record["sections_ms"].values())
