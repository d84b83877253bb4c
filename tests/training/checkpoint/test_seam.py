"""The checkpoint seam: the manager knows tiers and engines only through their protocols
(``tiers.SnapshotTier``, ``engines.SaveEngine``) and the one registry (``registry.py``).

A tier that is off is absent from the list the manager iterates, so ``manager.py`` has no
``self._<tier> is None`` check and no engine-name branch; a new tier is its own module plus one
row in ``registry.TIER_ROWS`` (and its name in ``training.modes.TIERS``, the restore order),
shown here with a toy tier that is taken on the manager's schedule and restored through the real
manager on one gloo rank without any change to ``manager.py``."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest
import torch

from training.checkpoint import manager as manager_module
from training.checkpoint import registry, tiers
from training.checkpoint.manager import CheckpointManager
from training.checkpoint.tiers import Rejected, Restored, RestoreTier, SnapshotTier, TierContext
from training.config import CheckpointConfig, CheckpointEngine, JobConfig, ResilienceConfig
from training.runlog import writer
from training.runlog.files import read_jsonl
from training.runlog.metrics import EventLog

MANAGER = Path(inspect.getfile(manager_module))

# The modules that implement a tier or an engine: the manager reaches them through the registry.
IMPLEMENTATIONS = {
    "training.checkpoint.memory",
    "training.checkpoint.pod_memory",
    "training.checkpoint.peer",
    "training.checkpoint.local",
    "training.checkpoint.nvrx_async",
    "training.checkpoint.torch_async",
}


def seam_breaches(source: str) -> list[str]:
    """Where ``source`` (the manager's) branches on a particular tier or engine: a name of one
    compared (``engine == "sync"``, ``tier.name == "peer"``), an attribute named after one
    tested against None (``self._pod_memory is not None``), an ``isinstance`` check on a tier
    or engine class, or an import of a tier's or an engine's module."""
    names = {*registry.ENGINES, *tiers.TIERS} - {"storage"}  # the manager owns storage
    words = {*names, "nvrx", "local", "memory", "peer"}
    found = []
    for node in ast.walk(ast.parse(source)):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            literals = [o.value for o in operands if isinstance(o, ast.Constant)]
            if any(value in names for value in literals):
                found.append(f"{where}: compares with a tier or engine name {literals}")
            if None in literals:
                for operand in operands:
                    attr = operand.attr if isinstance(operand, ast.Attribute) else ""
                    if any(word in attr for word in words):
                        found.append(f"{where}: tests {attr} against None")
        elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "isinstance":
            kind = ast.unparse(node.args[1])
            if kind.endswith(("Tier", "Engine", "Queue", "Snapshots", "Copies", "Checkpoints")):
                found.append(f"{where}: isinstance check on {kind}")
        elif isinstance(node, ast.ImportFrom) and node.module in IMPLEMENTATIONS:
            found.append(f"{where}: imports {node.module}")
        elif isinstance(node, ast.ImportFrom) and node.module == "training.checkpoint":
            hit = {a.name for a in node.names} & {m.rsplit(".", 1)[1] for m in IMPLEMENTATIONS}
            if hit:
                found.append(f"{where}: imports {sorted(hit)}")
    return found


def test_the_manager_never_branches_on_a_tier_or_an_engine() -> None:
    assert seam_breaches(MANAGER.read_text()) == []


def test_the_seam_check_sees_each_kind_of_branch() -> None:
    """The shapes the manager had before the seam (manager.py at 8503ddd)."""
    old = """
from training.checkpoint import peer
from training.checkpoint.pod_memory import PodMemoryTier
class M:
    def close(self):
        if self._nvrx is not None:
            self._nvrx.close()
        if self.config.engine == "torch_async":
            pass
        self._peer = next(t for t in self.tiers if isinstance(t, peer.PeerTier))
"""
    found = seam_breaches(old)
    assert len(found) == 5, found


def test_the_manager_stays_small() -> None:
    lines = len(MANAGER.read_text().splitlines())
    assert lines <= 350, f"manager.py has {lines} lines: move a job out behind the seam"


def test_every_engine_name_has_one_engine() -> None:
    assert set(registry.ENGINES) == set(typing.get_args(CheckpointEngine))


# -- a new tier: one module (here, this one) and one registry row ----------------------------


class _Trainer:
    def __init__(self, fill: float = 0.0, *, step: int = 0) -> None:
        self.w = torch.full((64,), fill)
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w, "step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w.copy_(state["w"])
        self.step = int(state["step"])


HELD: dict[int, dict[str, Any]] = {}
"""The toy tier's store: outlives a manager, as a process's memory outlives an attempt."""


class ToyRestore:
    name = "toy"

    def steps(self) -> list[int]:
        return tiers.common_steps(list(HELD))

    def load(self, trainer: Any, *, step: int) -> Restored | Rejected:
        trainer.load_state_dict(
            {k: v.clone() if torch.is_tensor(v) else v for k, v in HELD[step].items()}
        )
        return Restored(path="toy", nbytes=tiers.state_bytes(HELD[step]))


class ToyTier(SnapshotTier):
    """Every 3rd step a copy of the state in a dict; records the manager's calls."""

    name = "toy"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def restore_tiers(self) -> list[RestoreTier]:
        return [ToyRestore()]

    def due(self, step: int, *, shared: bool) -> bool:
        return step % 3 == 0

    def take(self, trainer: Any, *, step: int) -> None:
        self.calls.append(f"take {step}")
        HELD[step] = {
            k: v.clone() if torch.is_tensor(v) else v for k, v in trainer.state_dict().items()
        }

    def before_update(self) -> None:
        self.calls.append("before_update")

    def discard_newer(self, step: int) -> None:
        for held in [s for s in HELD if s > step]:
            del HELD[held]

    def abandon(self) -> None:
        self.calls.append("abandon")


BUILT: list[ToyTier] = []


def toy_row(context: TierContext) -> ToyTier | None:
    tier = ToyTier()
    BUILT.append(tier)
    return tier


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_new_tier_is_one_module_and_one_registry_row(
    tmp_path: Path, one_rank_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Registered by one row (and its place in the restore order), the toy tier is taken on
    the manager's schedule beside the shared saves and restored through ``load_latest`` when
    it holds the newest state; manager.py is the same file throughout."""
    before = MANAGER.read_bytes()
    monkeypatch.setattr(registry, "TIER_ROWS", [*registry.TIER_ROWS, toy_row])
    monkeypatch.setattr(tiers, "TIERS", (*tiers.TIERS[:-1], "toy", tiers.TIERS[-1]))
    HELD.clear()
    BUILT.clear()
    config = JobConfig(
        run_dir=str(tmp_path),
        checkpoint=CheckpointConfig(engine="sync", interval=4, memory_interval=0),
        resilience=ResilienceConfig(restart="inprocess"),
    )

    def manager() -> CheckpointManager:
        events = EventLog(run_dir=tmp_path, rank=0)
        m = CheckpointManager.for_job(config=config, rank=0, world_size=1, events=events)
        m.start()
        return m

    first = manager()
    assert [t.name for t in first.tiers] == ["toy", "storage"]
    trainer = _Trainer()
    assert first.load_latest(trainer) is None
    for step in range(1, 8):
        trainer.w.fill_(float(step))
        trainer.step = step
        first.before_update()
        first.after_step(trainer, step=step)
        first.poll()
    assert first.latest_step() == 4, "the shared saves: every 4th step"
    assert sorted(HELD) == [3, 6], "the toy tier's takes: every 3rd step"
    first.abandon()  # a fault: an in-process restart follows
    assert BUILT[0].calls[-1] == "abandon" and "before_update" in BUILT[0].calls

    restarted = _Trainer()
    second = manager()
    assert second.load_latest(restarted) == 6
    assert restarted.step == 6 and torch.equal(restarted.w, torch.full((64,), 6.0))
    second.close()
    writer.flush()
    events, _ = read_jsonl(tmp_path / "events.jsonl")
    loads = [(e["step"], e["source"]) for e in events if e["kind"] == "checkpoint_load"]
    assert loads == [(6, "toy")]
    assert MANAGER.read_bytes() == before


SECTIONS: list[str] = []
"""The trainer's open sections (``StepHooks.section``), innermost last."""


class _Section:
    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        SECTIONS.append(self.name)

    def __exit__(self, *exc: object) -> None:
        SECTIONS.pop()


class _LocalFiles:
    """Stands in for ``LocalCheckpoints`` (NVRx local checkpoints need CUDA): logs its saves."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def save(self, trainer: Any, *, step: int) -> None:
        self.log.append(f"local {step} {SECTIONS}")

    def poll(self, *, blocking: bool, keepalive: Any = None) -> None:
        pass

    def pending(self) -> int:
        return 0

    def close(self) -> None:
        pass


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_the_schedule_is_the_trainers_old_one(tmp_path: Path, one_rank_group: None) -> None:
    """``after_step`` keeps the schedule the trainer had: a shared save every ``interval``
    steps; a local checkpoint every ``local_interval`` steps but not at a shared save's step
    (both in the ``checkpoint_save`` section); a memory snapshot every ``memory_interval``
    steps, also at a save's step, outside any section (the real local and memory tiers)."""
    from training.checkpoint.local import LocalSnapshotTier
    from training.checkpoint.memory import MemorySnapshots, ProcessMemorySnapshotTier

    log: list[str] = []

    class Snapshots(MemorySnapshots):
        def take(self, state: dict[str, Any], **kwargs: Any) -> None:
            log.append(f"memory {kwargs['step']} {SECTIONS}")
            super().take(state, **kwargs)

    events = EventLog(run_dir=tmp_path, rank=0)
    root = tmp_path / "checkpoints"
    local = LocalSnapshotTier(
        checkpoints=_LocalFiles(log),  # type: ignore[arg-type]
        path=tmp_path / "local",
        interval=3,
        events=events,
    )
    memory = ProcessMemorySnapshotTier(
        snapshots=Snapshots(), interval=2, owner=str(root), rank=0, world_size=1, events=events
    )
    manager = CheckpointManager(
        config=CheckpointConfig(engine="sync", interval=4, keep_last=10),
        root=root,
        rank=0,
        world_size=1,
        events=events,
        snapshot_tiers=[local, memory],
    )
    manager.start()
    trainer = _Trainer()
    for step in range(1, 13):
        trainer.step = step
        manager.after_step(trainer, step=step, section=_Section)
        manager.poll()
    manager.close()
    writer.flush()
    read, _ = read_jsonl(tmp_path / "events.jsonl")
    assert [e["step"] for e in read if e["kind"] == "checkpoint_committed"] == [4, 8, 12]
    assert log == [
        "memory 2 []",
        "local 3 ['checkpoint_save']",
        "memory 4 []",
        "local 6 ['checkpoint_save']",
        "memory 6 []",
        "memory 8 []",
        "local 9 ['checkpoint_save']",
        "memory 10 []",
        "memory 12 []",
    ]
