"""Step hooks: how restart layers and fault injection reach the training loop without the loop
knowing them. Standard library only."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext


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
