"""The fault spec: which real exception, hang, signal or crash fires where. Standard library
only, so that checking a config never imports torch; ``training.resilience.inject`` fires them.

Spec (``--faults`` / ``FAULTS=`` / ``TRAIN_FAULTS`` env), faults separated by ``;``::

    KIND@RANK:STEP[:POINT]        e.g. exception@1:40   sigkill@0:80   ckpt_crash@0:50:staged
    KIND@RANK:SECONDSs            at the first step RANK starts SECONDS of wall time after the
                                  run's first step (e.g. hang@1:90s): a fault rate in time,
                                  the same for every restart strategy however fast it recovers
    random:seed=S:every=N[:kinds=a|b|c][:ranks=R]
                                  about one fault per N steps, kind and rank drawn from seed S
    always:KIND@RANK:STEP         fire on every attempt, not once (tests the restart cap)

Kinds:
  exception      raise an error in the training step
  hang           stop before the step's collective (peers block in it)
  hang_compute   spin in compute forever
  hang_kernel    block in native code for HANG_KERNEL_S (a CUDA kernel that spins, then a
                 synchronize; on CPU one long C call): no Python code of this rank runs, so
                 neither a signal handler nor an asynchronous exception reaches it meanwhile
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
process) do not fire it again. The clock of timed faults starts at the run's first step (the
first ``before_step`` of any rank, any attempt; recorded in the same folder), so a restarted
process keeps the schedule.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from training.exits import ConfigError

KINDS = (
    "exception",
    "hang",
    "hang_compute",
    "hang_kernel",
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
HANG_KERNEL_S = 15.0
"""How long a ``hang_kernel`` fault holds its rank in native code: past the hang detection
(its floor is 2 s) and short of the GPU recipes' hard timeouts, so the rank comes back and
restarts in place."""


class InjectedFault(RuntimeError):
    """Raised by an injected ``exception`` / ``corrupt_shard`` / ``truncate_shard`` fault."""


@dataclass(frozen=True, kw_only=True)
class Fault:
    kind: str
    rank: int
    step: int
    """The step it fires at; 0 for a timed fault (``after_s``)."""
    after_s: float | None = None
    """Timed: fire at the first step starting this many seconds after the run's first step."""
    point: str = ""
    index: int = 0
    """Position in the spec; names the fault's fired-marker file."""
    always: bool = False
    """Fire on every attempt that reaches the step (no once-per-run marker)."""


def _fail(problem: str) -> None:
    raise ConfigError(
        "faults",
        f"{problem}. Format: KIND@RANK:STEP[:POINT] joined by ';' or "
        "KIND@RANK:SECONDSs, or random:seed=S:every=N[:kinds=a|b]; kinds: " + ", ".join(KINDS),
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
        after_s: float | None = None
        try:
            rank = int(parts[0])
            if parts[1].endswith("s"):
                after_s, step = float(parts[1][:-1]), 0
            else:
                step = int(parts[1])
        except ValueError:
            _fail(f"fault {text!r}: RANK must be an integer and STEP an integer or SECONDSs")
        if after_s is not None and (not after_s >= 0 or kind == "ckpt_crash" or always):
            _fail(f"fault {text!r}: a timed fault needs SECONDS >= 0, not ckpt_crash or always:")
        point = parts[2] if len(parts) == 3 else ""
        if kind == "ckpt_crash":
            point = point or "staged"
            if point not in CKPT_POINTS:
                _fail(f"ckpt_crash point must be one of {', '.join(CKPT_POINTS)}, got {point!r}")
        elif point:
            _fail(f"only ckpt_crash takes a POINT, not {kind}")
        if rank < 0 or (after_s is None and step < 1):
            _fail(f"fault {text!r}: RANK must be >= 0 and STEP >= 1")
        faults.append(
            Fault(
                kind=kind,
                rank=rank,
                step=step,
                after_s=after_s,
                point=point,
                index=len(faults),
                always=always,
            )
        )
    return faults
