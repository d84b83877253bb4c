"""Unit tests of straggler scoring and the eviction policy (no training processes).

Run: ``.venv/bin/pytest tests/training/resilience/test_straggler_units.py -q`` (about a second).
"""

from __future__ import annotations

import math

import pytest
import torch

from training import exits
from training.config import JobConfig, apply_overrides
from training.exits import ConfigError
from training.hooks import HookChain, NodeEviction, StepHooks
from training.resilience.straggler import (
    EvictionPolicy,
    RankScore,
    StragglerHooks,
    node_name,
    node_scores,
)
from training.runlog.metrics import EventLog
from training.trainer import TrainResult


def test_a_node_scores_as_its_slowest_rank_and_ranks_without_timings_are_left_out() -> None:
    scores = [
        RankScore(rank=0, node="a", score=1.0),
        RankScore(rank=1, node="a", score=0.4),
        RankScore(rank=2, node="b", score=0.9),
        RankScore(rank=3, node="c", score=math.nan),
    ]
    assert node_scores(scores) == {"a": 0.4, "b": 0.9}


def test_a_node_is_evicted_only_after_m_slow_reports_in_a_row() -> None:
    policy = EvictionPolicy(threshold=0.5, reports=3)
    assert policy.observe({"a": 1.0, "b": 0.3}) is None
    assert policy.observe({"a": 1.0, "b": 0.3}) is None
    assert policy.streaks == {"b": 2}
    assert policy.observe({"a": 1.0, "b": 0.3}) == "b"


def test_one_normal_report_resets_the_count() -> None:
    policy = EvictionPolicy(threshold=0.5, reports=2)
    assert policy.observe({"a": 1.0, "b": 0.3}) is None
    assert policy.observe({"a": 1.0, "b": 0.5}) is None  # at the threshold is not below it
    assert policy.streaks == {}
    assert policy.observe({"a": 1.0, "b": 0.3}) is None
    assert policy.observe({"a": 1.0, "b": 0.3}) == "b"


def test_no_eviction_when_most_nodes_look_slow() -> None:
    """Scores are relative to the fastest rank: when most nodes fall below the threshold, the
    fast one is the odd one out (or the whole job slowed), and evicting would be wrong."""
    policy = EvictionPolicy(threshold=0.5, reports=1)
    assert policy.observe({"a": 1.0, "b": 0.3, "c": 0.2}) is None
    assert policy.observe({"only": 0.1}) is None  # a single node is never below itself
    assert policy.observe({"a": 1.0, "b": 0.2, "c": 0.9, "d": 0.3}) == "b"  # half: evict


def test_at_most_one_node_per_report_the_slowest() -> None:
    policy = EvictionPolicy(threshold=0.5, reports=1)
    scores = {"a": 1.0, "b": 0.4, "c": 0.2, "d": 0.9, "e": 0.95}
    assert policy.observe(scores) == "c"


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"straggler.threshold": "1.5"}, "straggler.threshold"),
        ({"straggler.threshold": "0"}, "straggler.threshold"),
        ({"straggler.reports": "0"}, "straggler.reports"),
        ({"straggler.report_every": "1"}, "straggler.report_every"),
        ({"straggler.evict": "maybe"}, "straggler.evict"),
    ],
)
def test_bad_straggler_settings_name_the_field(override: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        apply_overrides(JobConfig(), override)
    assert err.value.field_path == field


def test_the_policy_is_off_by_default_and_one_flag_turns_it_on() -> None:
    assert JobConfig().straggler.enabled
    assert not JobConfig().straggler.evict
    assert apply_overrides(JobConfig(), {"straggler.evict": "true"}).straggler.evict


def test_exit_codes_of_an_eviction() -> None:
    evicted = NodeEviction(node="b", cause="slow", this_node=True)
    survivor = NodeEviction(node="b", cause="slow", this_node=False)
    done = TrainResult(final_step=9, final_loss=1.0, preempted=False)
    assert done.exit_code == exits.OK
    assert TrainResult(final_step=9, final_loss=1.0, preempted=True).exit_code == exits.PREEMPTED
    result = TrainResult(final_step=9, final_loss=1.0, preempted=True, eviction=evicted)
    assert result.exit_code == exits.NODE_UNFIT
    result = TrainResult(final_step=9, final_loss=1.0, preempted=True, eviction=survivor)
    assert result.exit_code == exits.PREEMPTED


def test_hook_chain_passes_on_the_first_eviction_and_nests_timings() -> None:
    entered: list[str] = []

    class Timing(StepHooks):
        def timing(self, name: str):
            from contextlib import contextmanager

            @contextmanager
            def cm():
                entered.append(name)
                yield

            return cm()

    class Evicting(StepHooks):
        def eviction(self) -> NodeEviction | None:
            return NodeEviction(node="x", cause="c", this_node=False)

    chain = HookChain([StepHooks(), Timing(), Evicting()])
    with chain.timing("optimizer"):
        pass
    assert entered == ["optimizer"]
    assert chain.eviction() == NodeEviction(node="x", cause="c", this_node=False)
    assert HookChain([StepHooks()]).eviction() is None


def test_node_name_comes_from_the_downward_api_variable(monkeypatch) -> None:
    monkeypatch.setenv("NODE_NAME", "ip-10-0-0-7.ec2.internal")
    assert node_name() == "ip-10-0-0-7.ec2.internal"
    monkeypatch.delenv("NODE_NAME")
    import socket

    assert node_name() == socket.gethostname()


def test_one_rank_reports_with_nvrx_and_writes_the_event(one_rank_group, tmp_path) -> None:
    """NVRx's ReportGenerator on a real (one-rank) gloo group: the rank is its own reference."""
    from training.config import StragglerConfig

    events = EventLog(run_dir=tmp_path, rank=0)
    hooks = StragglerHooks(
        config=StragglerConfig(report_every=2, evict=True),
        rank=0,
        device=torch.device("cpu"),
        events=events,
        node="node-a",
    )
    for step in (1, 2):
        with hooks.timing("optimizer"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        hooks.after_step(step)
    hooks.close()
    events.flush()
    import json

    (record,) = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert record["kind"] == "straggler_report" and record["step"] == 2
    assert record["scores"] == [{"rank": 0, "node": "node-a", "score": 1.0}]
    assert record["nodes"] == {"node-a": 1.0}
    assert record["source"] == "sections:optimizer"
    assert set(record["sections"]) == {"optimizer"} and set(record["sections_ms"]) == {"optimizer"}
    assert hooks.eviction() is None


def test_a_gpu_without_nvrx_cupti_falls_back_to_the_event_timed_step_sections(
    one_rank_group,
) -> None:
    """NVRx 0.4.1's CUPTI extension links libcupti.so.12, absent here as it may be in the CUDA 13
    image: ``Detector.initialize`` raises ImportError, and the hook must not fail the run. (The
    CUPTI path itself needs a GPU and is not run here.)"""
    from nvidia_resiliency_ext.straggler import Detector

    from training.resilience.straggler import _SectionTimer, _timer_for

    timer = _timer_for(torch.device("cuda"), node="node-a")
    assert isinstance(timer, _SectionTimer) and timer._cuda
    assert timer.scored == ("forward", "optimizer")
    assert not Detector.initialized


def test_eviction_is_accepted_in_every_restart_mode() -> None:
    """Under ft_launcher (injob, nested) the evicted node's ranks ask their launcher to leave
    the rendezvous (training/resilience/injob.py, ``exclude_this_node``)."""
    from training.modes import MODES

    for mode in MODES:
        overrides = {"straggler.evict": "true", "resilience.restart": mode}
        assert apply_overrides(JobConfig(), overrides).straggler.evict
