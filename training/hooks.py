"""Step hooks: how restart layers and fault injection reach the training loop without the loop
knowing them; and the names of the rank-monitor sections the trainer opens (in-job restart).

`ft_launcher` refuses a section it has no timeout for (`TimeoutsCalcError: Unknown section`), so
the launcher's `--ft-rank-section-timeouts` is built from this same table
(`training.command`), locally and in the EKS Job. Torch-free."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

from training.config import ResilienceConfig
from training.modes import spec

STEP = "step"
"""Around each training step (forward, backward, optimizer)."""
CHECKPOINT = "checkpoint"
"""Around checkpoint loading and the blocking part of a save."""


def replica_wait_bound_s(resilience: ResilienceConfig) -> float:
    """The longest a healthy rank of a replica group may sit in one step: a failed group's
    restart awaited at the quorum (``replica_wait_s``), then torchft's commit or heal
    (``replica_timeout_s``); 0 outside replica groups. Neither the configured nor the calibrated
    step timeout may be below it, or the rank monitor would kill the survivors while they wait
    (training/replica/trainer.py redoes a discarded step inside the step section)."""
    if not spec(resilience.restart).replica_groups:
        return 0.0
    return resilience.replica_wait_s + resilience.replica_timeout_s


def section_timeouts(resilience: ResilienceConfig) -> dict[str, float]:
    """Every section the trainer opens -> its timeout in seconds."""
    return {
        STEP: max(resilience.step_section_timeout_s, replica_wait_bound_s(resilience)),
        CHECKPOINT: resilience.checkpoint_section_timeout_s,
    }


def out_of_section_timeout_s(resilience: ResilienceConfig) -> float:
    """NVRx's out-of-section timeout: between sections (loading, the blocking part of a save, and
    a replica group's quorum at the top of a step, ``Trainer.begin_step``, which no section
    covers). A survivor waiting there for a failed group must not be taken for hung: at least
    ``replica_wait_bound_s``."""
    return max(resilience.checkpoint_section_timeout_s, replica_wait_bound_s(resilience))


def liveness_report_interval_s(timeout_s: float) -> float:
    """How often to report liveness against ``timeout_s``: a tenth of it, at most once a second.
    A report per step (30 a second on a fast step) is a round trip to another process each,
    while only the newest one counts against the timeout."""
    return min(1.0, timeout_s / 10)


class Throttle:
    """``due()`` is True on its first call, then at most once per ``every_s``."""

    def __init__(self, *, every_s: float) -> None:
        self.every_s = every_s
        self._last: float | None = None

    def due(self) -> bool:
        now = time.monotonic()
        if self._last is not None and now - self._last < self.every_s:
            return False
        self._last = now
        return True


@dataclass(frozen=True, kw_only=True)
class NodeEviction:
    """A hook's decision that the run stops now, with a final checkpoint, because ``node`` does
    not keep up. Every rank reaches the same decision at the same step (the hook decides from
    numbers all ranks share); ``this_node`` says whether it is the deciding rank's own."""

    node: str
    cause: str
    this_node: bool


class StepHooks:
    """Called by the loop and the checkpoint manager; subclasses override what they need."""

    def before_step(self, step: int) -> None:  # step about to run (1-based)
        pass

    def after_step(self, step: int) -> None:
        pass

    def checkpoint_point(self, point: str, step: int) -> None:
        """A checkpoint of ``step`` reached ``point``: staged, written or commit."""

    def section(self, name: str) -> AbstractContextManager[None]:
        """Around checkpoint load and save staging."""
        return nullcontext()

    def keepalive(self) -> None:
        """Called by the checkpoint manager between the passes of its blocking waits (the NVRx
        worker's start, an earlier save's write, the commit, a pod-memory snapshot's publish,
        the peer exchange's rounds): this rank is waiting on progress it checks, not hung.
        Called often (every ~50 ms of a wait): an implementation that reports to another
        process throttles."""

    def loop_ended(self) -> None:
        """The training loop returned or raised (before ``finished`` and the run's clean-up):
        release what only the loop used (the straggler policy's CUPTI timers)."""

    def finished(self, result: object) -> None:
        """The run ended (completed, drained or a node evicted) with its final checkpoint
        committed, before the clean-up (``checkpoints.close``, the process group's teardown).
        An in-process restart can still strike during that clean-up; a layer that keeps the
        processes records ``result`` here so that such a restart ends with the same outcome
        instead of training on (an eviction or a drain would otherwise be lost)."""

    def timing(self, name: str) -> AbstractContextManager[None]:
        """Around parts of a step whose time says how fast this rank is: ``step`` (the whole
        step, peers' waits included) and its sections ``forward``, ``backward`` (each entered
        once per micro-batch), ``communication`` (the gradient norm's and the step stats'
        all-reduces) and ``optimizer`` (the optimizer's update: rank-local)."""
        return nullcontext()

    def eviction(self) -> NodeEviction | None:
        """After ``after_step``: a node to evict now, or None."""
        return None


class HookChain(StepHooks):
    """Several hooks called in order (sections nested in that order)."""

    def __init__(self, hooks: Sequence[StepHooks]) -> None:
        self.hooks = tuple(hooks)

    def before_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.before_step(step)

    def after_step(self, step: int) -> None:
        for hook in self.hooks:
            hook.after_step(step)

    def checkpoint_point(self, point: str, step: int) -> None:
        for hook in self.hooks:
            hook.checkpoint_point(point, step)

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        with ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.section(name))
            yield

    def keepalive(self) -> None:
        for hook in self.hooks:
            hook.keepalive()

    def loop_ended(self) -> None:
        for hook in self.hooks:
            hook.loop_ended()

    def finished(self, result: object) -> None:
        for hook in self.hooks:
            hook.finished(result)

    @contextmanager
    def timing(self, name: str) -> Iterator[None]:
        with ExitStack() as stack:
            for hook in self.hooks:
                stack.enter_context(hook.timing(name))
            yield

    def eviction(self) -> NodeEviction | None:
        return next((e for hook in self.hooks if (e := hook.eviction()) is not None), None)
