"""Fault injection for tests, demos and benchmarks: real exceptions, hangs, signals, crashes.

Spec (``--faults`` / ``FAULTS=`` / ``TRAIN_FAULTS`` env), faults separated by ``;``::

    KIND@RANK:STEP[:POINT]        e.g. exception@1:40   sigkill@0:80   ckpt_crash@0:50:staged
    random:seed=S:every=N[:kinds=a|b|c][:ranks=R]
                                  about one fault per N steps, kind and rank drawn from seed S
    always:KIND@RANK:STEP         fire on every attempt, not once (tests the restart cap)

Kinds:
  exception      raise an error in the training step
  hang           stop before the step's collective (peers block in it)
  hang_compute   spin in compute forever
  sigkill        SIGKILL this rank (node loss, OOM killer)
  sigterm        SIGTERM this rank (drain/eviction: final checkpoint, exit 143)
  sigstop        SIGSTOP this rank: the process freezes, alive but silent (a wedged driver, a
                 stuck NFS/Lustre call); only a heartbeat timeout and SIGKILL end it
  abort          abort() (SIGABRT)
  segfault       a real segmentation fault (SIGSEGV)
  oom            raise torch.OutOfMemoryError, as the CUDA allocator does
  ckpt_crash     SIGKILL while a checkpoint of step STEP is being saved; POINT is staged (write
                 in flight), written (files durable, not committed) or commit (rank 0, before the
                 commit record)
  corrupt_shard  flip bytes in this rank's shard of the newest committed checkpoint, then raise
  truncate_shard truncate that shard to half its size, then raise

Each fault fires once per run (``always:`` ones excepted): a marker file in
``<run_dir>/.faults/`` records it, so replayed steps after a restart (in-process or a new
process) do not fire it again.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from training.config import ConfigError

KINDS = (
    "exception",
    "hang",
    "hang_compute",
    "sigkill",
    "sigterm",
    "sigstop",
    "abort",
    "segfault",
    "oom",
    "ckpt_crash",
    "corrupt_shard",
    "truncate_shard",
)
CKPT_POINTS = ("staged", "written", "commit")


class InjectedFault(RuntimeError):
    """Raised by an injected ``exception`` / ``corrupt_shard`` / ``truncate_shard`` fault."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    rank: int
    step: int
    point: str = ""
    index: int = 0
    """Position in the spec; names the fault's fired-marker file."""
    always: bool = False
    """Fire on every attempt that reaches the step (no once-per-run marker)."""


def _fail(problem: str) -> None:
    raise ConfigError(
        "faults",
        f"{problem}. Format: KIND@RANK:STEP[:POINT] joined by ';' or "
        "random:seed=S:every=N[:kinds=a|b]; kinds: " + ", ".join(KINDS),
    )


def _parse_random(text: str, *, start_index: int, horizon: int = 100_000) -> list[Fault]:
    options = dict(part.split("=", 1) for part in text.split(":")[1:] if "=" in part)
    try:
        seed = int(options.get("seed", "0"))
        every = int(options["every"])
        ranks = int(options.get("ranks", "2"))
    except (KeyError, ValueError):
        _fail(f"bad random fault spec {text!r} (needs every=N, integers)")
    kinds = tuple(options.get("kinds", "exception|sigkill").split("|"))
    for kind in kinds:
        if kind not in KINDS:
            _fail(f"unknown fault kind {kind!r}")
    if every < 2:
        _fail("random faults need every >= 2")
    rng = random.Random(seed)
    faults, step, index = [], 0, start_index
    while step < horizon:
        step += rng.randint(every // 2, every + every // 2)
        faults.append(
            Fault(
                kind=rng.choice(kinds),
                rank=rng.randrange(ranks),
                step=step,
                point="staged",
                index=index,
            )
        )
        index += 1
    return faults


def parse_faults(spec: str) -> list[Fault]:
    faults: list[Fault] = []
    for text in (part.strip() for part in spec.split(";")):
        if not text:
            continue
        if text.startswith("random:"):
            faults.extend(_parse_random(text, start_index=len(faults)))
            continue
        always = text.startswith("always:")
        if always:
            text = text[len("always:") :]
        if "@" not in text:
            _fail(f"fault {text!r} has no '@'")
        kind, where = text.split("@", 1)
        if kind not in KINDS:
            _fail(f"unknown fault kind {kind!r}")
        parts = where.split(":")
        if len(parts) not in (2, 3):
            _fail(f"fault {text!r} needs RANK:STEP")
        try:
            rank, step = int(parts[0]), int(parts[1])
        except ValueError:
            _fail(f"fault {text!r}: RANK and STEP must be integers")
        point = parts[2] if len(parts) == 3 else ""
        if kind == "ckpt_crash":
            point = point or "staged"
            if point not in CKPT_POINTS:
                _fail(f"ckpt_crash point must be one of {', '.join(CKPT_POINTS)}, got {point!r}")
        elif point:
            _fail(f"only ckpt_crash takes a POINT, not {kind}")
        if rank < 0 or step < 1:
            _fail(f"fault {text!r}: RANK must be >= 0 and STEP >= 1")
        faults.append(
            Fault(kind=kind, rank=rank, step=step, point=point, index=len(faults), always=always)
        )
    return faults


class FaultInjector:
    """Fires the faults of one rank at their step (or checkpoint point), once per run."""

    def __init__(self, *, faults: list[Fault], rank: int, run_dir: Path, events=None) -> None:
        self.rank = rank
        self.events = events
        self.marker_dir = run_dir / ".faults"
        self.by_step: dict[int, list[Fault]] = {}
        for fault in faults:
            if fault.rank == rank:
                self.by_step.setdefault(fault.step, []).append(fault)
        self.checkpoint_root: Path | None = None

    @classmethod
    def from_spec(
        cls, spec: str, *, rank: int, events, run_dir: Path | None = None
    ) -> FaultInjector:
        spec = spec or os.environ.get("TRAIN_FAULTS", "")
        run_dir = run_dir or (events.path.parent if events is not None else Path("."))
        return cls(faults=parse_faults(spec), rank=rank, run_dir=run_dir, events=events)

    # -- bookkeeping -----------------------------------------------------------------------------
    def _claim(self, fault: Fault) -> bool:
        """True exactly once per fault per run, across processes and restarts."""
        if fault.always:
            self._record(fault)
            return True
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(
                self.marker_dir / f"{fault.index:05d}.fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY
            )
        except FileExistsError:
            return False
        os.close(fd)
        self._record(fault)
        return True

    def _record(self, fault: Fault) -> None:
        if self.events is not None:
            self.events.emit("fault", step=fault.step, fault=fault.kind, point=fault.point or None)

    # -- hooks called by the trainer ---------------------------------------------------------------
    def before_step(self, step: int) -> None:
        for fault in self.by_step.get(step, ()):
            if fault.kind != "ckpt_crash" and self._claim(fault):
                self._fire(fault)

    def checkpoint_point(self, point: str, step: int) -> None:
        for fault in self.by_step.get(step, ()):
            if fault.kind == "ckpt_crash" and fault.point == point and self._claim(fault):
                if point == "staged":
                    # Let the background write get under way, then die in the middle of it.
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)

    # -- the faults ----------------------------------------------------------------------------
    def _fire(self, fault: Fault) -> None:
        kind = fault.kind
        where = f"rank {self.rank} step {fault.step}"
        if kind == "exception":
            raise InjectedFault(f"injected exception at {where}")
        if kind == "oom":
            raise torch.OutOfMemoryError(f"injected out-of-memory at {where} (simulated)")
        if kind == "hang":
            while True:  # peers wait in the step's collective
                time.sleep(0.1)
        if kind == "hang_compute":
            x = torch.randn(64, 64)
            while True:
                x = torch.tanh(x @ x)
        if kind == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if kind == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            return  # handled by the trainer: final checkpoint, then exit 143
        if kind == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return  # only reached if someone sends SIGCONT
        if kind == "abort":
            os.abort()
        if kind == "segfault":
            ctypes.string_at(0)
        if kind in ("corrupt_shard", "truncate_shard"):
            self._damage_newest_shard(truncate=kind == "truncate_shard")
            raise InjectedFault(f"injected {kind} at {where}")

    def _damage_newest_shard(self, *, truncate: bool) -> None:
        from training.checkpoint import committed_steps, rank_files, step_dir

        if self.checkpoint_root is None:
            return
        steps = committed_steps(self.checkpoint_root)
        if not steps:
            return
        files = rank_files(step_dir(self.checkpoint_root, steps[-1]), self.rank)
        if not files:
            return
        target = files[0]
        size = target.stat().st_size
        with open(target, "r+b") as handle:
            if truncate:
                handle.truncate(size // 2)
            else:
                handle.seek(size // 2)
                chunk = handle.read(64)
                handle.seek(size // 2)
                handle.write(bytes(b ^ 0xFF for b in chunk))
            handle.flush()
            os.fsync(handle.fileno())
