"""What a replica group's failure costs the other groups reaches the run report, TensorBoard and
the Prometheus exporter, from one definition (``training/runlog/replica.py``).

The recorded run (``recorded/sigkill-group1``) is the run directory of a real
``test_replica_fault.py`` run: 2 groups x 2 CPU ranks, rank 1 of group 1 SIGKILLed after step 4;
group 1's launcher restarted it, it healed from group 0 (step 0 -> 4, 788,436 bytes per rank),
and group 0's ranks discarded step 5 and waited ~12.4 s for it. A wait still going on (a group
out now) is appended the way the trainer writes it (``ReplicaTrainer._keeping_alive``), and
that code path itself is run below with a stand-in wait. The alert on a long wait is
``ReplicaGroupOut`` (``tests/observability/alerts_test.yaml``, ``promtool test rules``).
"""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from training.observe.view import RunView
from training.runlog import tensorboard as tb
from training.runlog.accounting import summarize
from training.runlog.files import EVENTS_FILE, append_jsonl
from training.runlog.replica import occurrences, summarize_replica
from training.runlog.report import format_summary, write_report

RECORDED = Path(__file__).with_name("recorded") / "sigkill-group1"
HEAL_BYTES_PER_RANK = 788_436


@pytest.fixture
def run(tmp_path: Path) -> Path:
    copy = tmp_path / "faulty"
    shutil.copytree(RECORDED, copy)
    return copy


def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_one_occurrence_is_every_ranks_line_of_it_and_a_repeat_is_another() -> None:
    lines = [
        {"time": 1.0, "rank": 0, "kind": "replica_stall", "step": 5, "stall_s": 1.0},
        {"time": 1.1, "rank": 1, "kind": "replica_stall", "step": 5, "stall_s": 2.0},
        {"time": 9.0, "rank": 1, "kind": "replica_stall", "step": 5, "stall_s": 3.0},
        {"time": 9.1, "rank": 0, "kind": "replica_stall", "step": 5, "stall_s": 0.5},
    ]
    assert [[e["stall_s"] for e in o] for o in occurrences(lines, "replica_stall")] == [
        [1.0, 2.0],
        [3.0, 0.5],
    ]
    summary = summarize_replica(lines)
    assert [s.stall_s for s in summary.stalls] == [2.0, 3.0]  # the slowest rank's, each


def test_the_survivor_and_the_healed_group_from_a_recorded_fault(run: Path) -> None:
    survivor = summarize(run_dir=run / "group-0").replica
    assert survivor.group == 0 and survivor.participants == 2
    assert survivor.steps_discarded == 1
    assert [(s.step, s.stall_s) for s in survivor.stalls] == [(5, pytest.approx(12.3926))]
    assert survivor.heals == () and survivor.waiting_since is None

    healed = summarize(run_dir=run / "group-1").replica
    assert healed.group == 1 and healed.stalls == () and healed.steps_discarded == 0
    (heal,) = healed.heals
    assert (heal.step, heal.from_step) == (4, 0)
    assert heal.bytes == 2 * HEAL_BYTES_PER_RANK  # both ranks' shards
    assert heal.heal_s == pytest.approx(0.1728)  # the slower rank's
    # Its quorums: the start, then the one it healed in (the restarted ranks' only one).
    assert [q.step for q in healed.quorum_changes] == [0, 4]


def test_a_run_without_replica_groups_has_no_replica_section(tmp_path: Path) -> None:
    append_jsonl(tmp_path / EVENTS_FILE, {"time": 1.0, "rank": 0, "kind": "run_start"})
    summary = summarize(run_dir=tmp_path)
    assert summary.replica is None
    text = format_summary(summary)
    assert "replica timeline" not in text and "survivors' stalls" not in text


def test_the_report_shows_each_groups_timeline(run: Path) -> None:
    survivor = write_report(run_dir=run / "group-0")
    text = format_summary(survivor)
    assert re.search(r"replica group\s+0 of", text), text
    assert re.search(r"survivors' stalls\s+1 \(p50 12.4 s, max 12.4 s\)", text), text
    timeline = text[text.index("replica timeline") :].splitlines()[2:]
    kinds = [re.search(r"\b(quorum|heal|stall)\b", line)[1] for line in timeline]
    assert kinds.count("quorum") >= 2 and kinds[-1] == "stall", timeline
    saved = json.loads((run / "group-0" / "summary.json").read_text())
    assert saved["replica"]["stall_p50_s"] == pytest.approx(12.3926)
    assert saved["replica"]["steps_discarded"] == 1
    assert (run / "group-0" / "timeline.png").stat().st_size > 0

    healed = format_summary(write_report(run_dir=run / "group-1"))
    assert re.search(r"heals\s+1 \(1.6 MB from peers\)", healed), healed
    assert "from step 0" in healed


def _replica_samples(view: RunView) -> dict[tuple[str, str], float]:
    return {
        (s.name, s.labels["replica_group"]): s.value
        for s in view.samples()
        if s.name.startswith("training_replica_")
    }


def _view(run_dir: Path) -> RunView:
    return RunView(
        run_dir=run_dir,
        job="faulty",
        node=0,
        nproc_per_node=4,
        reporter=True,
        stall_factor=10.0,
        stall_floor_s=60.0,
        checkpoint_interval=8,
        efa_root=run_dir / "no-sysfs",
        summary_every_s=0.0,
    )


def test_the_local_exporter_serves_every_groups_figures(run: Path) -> None:
    """A local replica run's exporter reads the job's directory; the groups write below it."""
    got = _replica_samples(_view(run))
    assert got[("training_replica_quorum_participants", "0")] == 2
    assert got[("training_replica_steps_discarded_total", "0")] == 1
    assert got[("training_replica_stalls_total", "0")] == 1
    assert got[("training_replica_stall_seconds", "0")] == pytest.approx(12.3926)
    assert got[("training_replica_stall_seconds_total", "0")] == pytest.approx(12.3926)
    assert got[("training_replica_heals_total", "0")] == 0
    assert got[("training_replica_heals_total", "1")] == 1
    assert got[("training_replica_heal_bytes_total", "1")] == 2 * HEAL_BYTES_PER_RANK
    assert got[("training_replica_heal_seconds", "1")] == pytest.approx(0.1728)
    assert got[("training_replica_waiting", "0")] == 0
    assert ("training_replica_waiting_since_timestamp_seconds", "0") not in got


def test_a_wait_for_an_out_group_is_served_until_the_quorum_forms(run: Path) -> None:
    """On EKS each group's exporter reads its own group's directory."""
    group0 = run / "group-0"
    view = _view(group0)
    assert _replica_samples(view)[("training_replica_waiting", "0")] == 0
    last = max(float(e["time"]) for e in _events(group0 / EVENTS_FILE))
    since = last + 10.0
    for rank in (0, 1):  # as ReplicaTrainer._keeping_alive writes it, on every rank
        line = {"time": since + 2.0, "rank": rank, "kind": "replica_waiting", "step": 14}
        append_jsonl(group0 / EVENTS_FILE, {**line, "group": 0, "since": since + rank * 0.01})
    waiting = _replica_samples(view)
    assert waiting[("training_replica_waiting", "0")] == 1
    # The earliest rank's start: the alert counts from when the group stopped.
    assert waiting[("training_replica_waiting_since_timestamp_seconds", "0")] == since
    # Rank 0's quorum formed; rank 1 still waits.
    quorum = {"kind": "replica_quorum", "step": 14, "group": 0, "participants": 2, "groups": 2}
    append_jsonl(group0 / EVENTS_FILE, {"time": since + 30.0, "rank": 0, **quorum})
    still = _replica_samples(view)
    assert still[("training_replica_waiting_since_timestamp_seconds", "0")] == since + 0.01
    append_jsonl(group0 / EVENTS_FILE, {"time": since + 30.1, "rank": 1, **quorum})
    back = _replica_samples(view)
    assert back[("training_replica_waiting", "0")] == 0
    assert ("training_replica_waiting_since_timestamp_seconds", "0") not in back
    assert back[("training_replica_quorum_changes_total", "0")] == 3
    assert back[("training_replica_groups", "0")] == 2


class _Recording:
    def __init__(self, *, log_dir: str, sink: list[tuple[str, float, int]]) -> None:
        self.sink = sink

    def add_scalar(self, tag: str, value: float, global_step: int, walltime: float) -> None:
        self.sink.append((tag, value, global_step))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    sink: list[tuple[str, float, int]] = []
    tailer = tb.Tailer(
        run_dir=run_dir, writer_factory=lambda **kw: _Recording(sink=sink, **kw), settle_s=0.0
    )
    tailer.close(raise_errors=True)
    out: dict[str, list[tuple[int, float]]] = {}
    for tag, value, step in sink:
        if tag.startswith("replica/"):
            out.setdefault(tag, []).append((step, value))
    return out


def test_tensorboard_plots_the_stall_and_the_heal(run: Path) -> None:
    survivor = _scalars(run / "group-0")
    assert survivor["replica/stall_s"] == [(5, pytest.approx(12.3926))]
    assert survivor["replica/step_discarded"] == [(5, 1.0)]
    assert survivor["replica/quorum_participants"] == [(0, 2.0), (4, 2.0)]  # rank 0's only
    healed = _scalars(run / "group-1")
    assert healed["replica/heal_bytes"] == [(4, 2.0 * HEAL_BYTES_PER_RANK)]
    assert healed["replica/heal_s"] == [(4, pytest.approx(0.1728))]
    assert "replica/stall_s" not in healed


class _Events:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict]] = []

    def emit(self, kind: str, **extra: object) -> None:
        self.lines.append((kind, extra))


class _Hooks:
    def __init__(self) -> None:
        self.keepalives = 0

    def keepalive(self) -> None:
        self.keepalives += 1


def test_a_long_quorum_wait_is_announced_once_with_its_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ReplicaTrainer._keeping_alive`` (the survivors' wait at the quorum) with a stand-in
    for torchft's ``start_quorum``: a real Manager needs a Lighthouse and a peer group (the
    fault test runs those)."""
    from training.replica import trainer as replica_trainer
    from training.replica.topology import ReplicaTopology

    monkeypatch.setattr(replica_trainer, "WAITING_EVENT_S", 0.1)
    trainer = object.__new__(replica_trainer.ReplicaTrainer)
    trainer.events, trainer.hooks = _Events(), _Hooks()
    trainer.topology = ReplicaTopology(group=1, groups=2, lighthouse="http://lh:1")

    started = time.time()
    assert trainer._keeping_alive(lambda: time.sleep(0.5), step=7) is True
    ((kind, extra),) = trainer.events.lines
    assert kind == "replica_waiting" and extra["step"] == 7 and extra["group"] == 1
    # ``since`` is rounded to 0.1 ms: it may read just below ``started``.
    assert started - 1e-4 <= extra["since"] <= started + 0.1
    assert trainer.hooks.keepalives >= 3  # liveness all along (every 0.05 s on a quiet machine)

    trainer.events.lines.clear()
    assert trainer._keeping_alive(lambda: None, step=8) is False
    assert trainer.events.lines == []

    def fails() -> None:
        raise TimeoutError("quorum timed out")

    with pytest.raises(TimeoutError, match="quorum timed out"):
        trainer._keeping_alive(fails, step=9)


class _Manager:
    """torchft's ``Manager`` as ``ReplicaTrainer._quorum`` calls it: each quorum takes
    ``wait_s`` and ends with quorum id ``quorum_id`` (torchft's own changes when members do)."""

    def __init__(self) -> None:
        self.wait_s, self._quorum_id, self.step = 0.0, 0, 0

    def current_step(self) -> int:
        return self.step

    def start_quorum(self, timeout: object) -> None:
        time.sleep(self.wait_s)

    def num_participants(self) -> int:
        return 2


def test_a_survivors_stall_is_a_long_wait_that_ends_with_new_members(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Per failure: a long wait at the quorum counts as a stall when the quorum that ends it
    has new members (the failed group came back under a new replica id), not when the same
    members were only slow (the real fault run waited 5 and 25 s for a slow peer group after
    the heal, with the quorum id unchanged)."""
    from types import SimpleNamespace

    from training.replica import trainer as replica_trainer
    from training.replica.topology import ReplicaTopology

    monkeypatch.setattr(replica_trainer, "WAITING_EVENT_S", 0.05)
    trainer = object.__new__(replica_trainer.ReplicaTrainer)
    trainer.events, trainer.hooks = _Events(), _Hooks()
    trainer.topology = ReplicaTopology(group=0, groups=2, lighthouse="http://lh:1")
    trainer.config = SimpleNamespace(resilience=SimpleNamespace(replica_wait_s=60.0))
    trainer.manager = manager = _Manager()
    trainer.step, trainer._participants, trainer._quorum_id, trainer._healed = 0, 0, None, None

    def quorum(*, wait_s: float, quorum_id: int) -> list[str]:
        trainer.events.lines.clear()
        manager.wait_s, manager._quorum_id = wait_s, quorum_id
        trainer.begin_step()
        return [kind for kind, _ in trainer.events.lines]

    # The start: the first quorum, however long, is no stall.
    assert quorum(wait_s=0.2, quorum_id=1) == ["replica_waiting", "replica_quorum"]
    trainer.step = manager.step = 3
    assert quorum(wait_s=0.0, quorum_id=1) == []  # nothing changed
    # A slow peer: the wait is announced and closed, but no member changed.
    assert quorum(wait_s=0.2, quorum_id=1) == ["replica_waiting", "replica_quorum"]
    # A group out and back: a new quorum after the wait, a stall for this survivor.
    kinds = quorum(wait_s=0.2, quorum_id=2)
    assert kinds == ["replica_waiting", "replica_quorum", "replica_stall"]
    stall = trainer.events.lines[-1][1]
    assert stall["step"] == 4 and stall["stall_s"] >= 0.2
