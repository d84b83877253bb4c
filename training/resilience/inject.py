"""Fires the faults of ``training.faults`` in a rank, as a step hook: once per run,
at their step or checkpoint point. Each fault fires once per run (``always:`` ones excepted): a
marker file in ``<run_dir>/.faults/`` records it, so replayed steps after a restart (in-process
or a new process) do not fire it again. Timed faults count from the run's first step, whose
time the first rank to start one records there (``clock_origin``)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import signal
import time
from pathlib import Path

import torch

from training.checkpoint.layout import COMMIT, SHARDS, committed_steps, rank_files, step_dir
from training.faults import HANG_KERNEL_S, Fault, InjectedFault, parse_faults
from training.hooks import StepHooks


class FaultInjector(StepHooks):
    """Fires the faults of one rank at their step (or checkpoint point), once per run."""

    def __init__(
        self,
        *,
        faults: list[Fault],
        rank: int,
        run_dir: Path,
        checkpoint_root: Path | None = None,
        events=None,
    ) -> None:
        self.rank = rank
        self.checkpoint_root = checkpoint_root
        self.events = events
        self.marker_dir = run_dir / ".faults"
        self.by_step: dict[int, list[Fault]] = {}
        self.timed: list[Fault] = []
        for fault in faults:
            if fault.rank != rank:
                continue
            if fault.after_s is None:
                self.by_step.setdefault(fault.step, []).append(fault)
            else:
                self.timed.append(fault)
        self.timed.sort(key=lambda fault: fault.after_s)
        self._origin: float | None = None

    @classmethod
    def from_spec(
        cls,
        spec: str,
        *,
        rank: int,
        events,
        run_dir: Path | None = None,
        checkpoint_root: Path | None = None,
    ) -> FaultInjector:
        spec = spec or os.environ.get("TRAIN_FAULTS", "")
        run_dir = run_dir or (events.path.parent if events is not None else Path("."))
        return cls(
            faults=parse_faults(spec),
            rank=rank,
            run_dir=run_dir,
            checkpoint_root=checkpoint_root,
            events=events,
        )

    # -- bookkeeping -----------------------------------------------------------------------------
    def _claim(self, fault: Fault, step: int | None = None) -> bool:
        """True exactly once per fault per run, across processes and restarts."""
        if fault.always:
            self._record(fault, step)
            return True
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(
                self.marker_dir / f"{fault.index:05d}.fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY
            )
        except FileExistsError:
            return False
        os.close(fd)
        self._record(fault, step)
        return True

    def _record(self, fault: Fault, step: int | None = None) -> None:
        if self.events is not None:
            self.events.emit(
                "fault", step=step or fault.step, fault=fault.kind, point=fault.point or None
            )
            self.events.flush()  # the fault may end the process before the writer's next flush

    def clock_origin(self) -> float:
        """The wall time of the run's first step: recorded once per run by whichever rank gets
        there first (written whole, then linked into place, so no reader sees it half-written),
        read by every later process."""
        if self._origin is None:
            self.marker_dir.mkdir(parents=True, exist_ok=True)
            origin = self.marker_dir / "clock_origin"
            draft = self.marker_dir / f".clock_origin.{os.getpid()}"
            draft.write_text(repr(time.time()))
            try:
                os.link(draft, origin)
            except FileExistsError:
                pass
            finally:
                draft.unlink()
            self._origin = float(origin.read_text())
        return self._origin

    # -- step hooks ---------------------------------------------------------------
    def before_step(self, step: int) -> None:
        for fault in self.by_step.get(step, ()):
            if fault.kind != "ckpt_crash" and self._claim(fault):
                self._fire(fault, step)
        if self.timed:
            elapsed = time.time() - self.clock_origin()
            while self.timed and self.timed[0].after_s <= elapsed:
                fault = self.timed.pop(0)
                if self._claim(fault, step):
                    self._fire(fault, step)

    def checkpoint_point(self, point: str, step: int) -> None:
        for fault in self.by_step.get(step, ()):
            if fault.kind == "ckpt_crash" and fault.point == point and self._claim(fault):
                if point == "staged":
                    # Let the background write get under way, then die in the middle of it.
                    time.sleep(0.05)
                os.kill(os.getpid(), signal.SIGKILL)

    # -- the faults ----------------------------------------------------------------------------
    def _fire(self, fault: Fault, step: int) -> None:
        kind = fault.kind
        where = f"rank {self.rank} step {step}"
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
        if kind == "hang_kernel":
            block_in_native_code(seconds=HANG_KERNEL_S)
            return
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

    def _await_commit_of_own_newest_write(self, *, timeout_s: float = 1.0) -> None:
        """Rank 0 commits on a thread of its own, a few milliseconds after the step that
        finalized the save (training/checkpoint/committer.py): give the newest checkpoint this
        rank has written that long to be committed, so "the newest committed" is the same one
        it would have been with the commit in the loop. Bounded below the hang floor (2 s): a
        save whose finalizing barrier needs this rank never commits while it waits here."""
        assert self.checkpoint_root is not None
        written = sorted(
            p
            for p in self.checkpoint_root.glob("step_*")
            if (p / SHARDS / f"rank_{self.rank:05d}.json").is_file()
        )
        if not written:
            return
        deadline = time.monotonic() + timeout_s
        while not (written[-1] / COMMIT).is_file() and time.monotonic() < deadline:
            time.sleep(0.01)

    def _damage_newest_shard(self, *, truncate: bool) -> None:
        if self.checkpoint_root is None:
            return
        self._await_commit_of_own_newest_write()
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


PROBES = 3
"""Timed probes that size a native block (their fastest)."""


def block_in_native_code(*, seconds: float) -> None:
    """Hold the calling thread in native code for about ``seconds``, with no Python code run
    meanwhile: on a GPU, kernels that spin (``torch.cuda._sleep``, present in torch 2.11 and
    2.13) and a synchronize behind them, as a rank waits behind a stuck kernel or collective;
    on CPU, one scrypt call (C, GIL released, no system call that a signal could interrupt)
    sized from short timed ones. The fastest of three probes sizes it: one probe that a busy
    machine preempted would measure a slower device and cut the block short (a 3 s block
    once held 1.5 s), where the fastest can only make it longer."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        probe = 1 << 24

        def timed_sleep() -> float:
            torch.cuda.synchronize()
            started = time.perf_counter()
            torch.cuda._sleep(probe)
            torch.cuda.synchronize()
            return time.perf_counter() - started

        cycles_per_s = probe / max(min(timed_sleep() for _ in range(PROBES)), 1e-6)
        torch.cuda._sleep(int(cycles_per_s * seconds))
        torch.cuda.synchronize()
        return
    scrypt = dict(salt=b"hang", n=1 << 14, r=8, maxmem=64 << 20, dklen=8)

    def timed_lane() -> float:
        started = time.perf_counter()
        hashlib.scrypt(b"probe", p=1, **scrypt)
        return time.perf_counter() - started

    per_lane = max(min(timed_lane() for _ in range(PROBES)), 1e-4)
    hashlib.scrypt(b"hang", p=max(1, round(seconds / per_lane)), **scrypt)
