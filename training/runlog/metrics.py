"""Per-step metrics (JSONL), run events (JSONL), progress display, and MFU.

- ``metrics.jsonl``: rank 0, one line per optimizer step (loss, lr, step time, tokens/s, MFU).
- ``events.jsonl``: any rank appends one short line per event (start, checkpoint staged and
  committed, fault, restart begin/end, end).

Both are written off the training thread by the process's one buffered writer
(``training.runlog.writer``: whole lines, O_APPEND, flushed every half second and on every exit
path that runs code), so concurrent ranks never interleave within a line and no step waits on
the shared file system.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

from training.runlog import writer
from training.runlog.files import EVENTS_FILE, METRICS_FILE

# Peak dense bf16 tensor-core FLOP/s per GPU (vendor datasheets, SXM parts, without sparsity).
PEAK_BF16_FLOPS: dict[str, float] = {
    "H200": 989.4e12,
    "H100": 989.4e12,
    "A100": 312e12,
}


def peak_flops_for(device_name: str | None) -> float | None:
    """Peak bf16 FLOP/s of the GPU named ``device_name`` (``torch.cuda.get_device_name``), or
    None (no GPU: None; an unknown GPU): MFU is then not reported. Takes the name, not the
    device: this module stays torch-free for the local launcher, which writes events too."""
    if device_name is None:
        return None
    for key, value in PEAK_BF16_FLOPS.items():
        if key in device_name:
            return value
    return None


class EventLog:
    """Append-only run events shared by all ranks (and the launcher, with rank -1)."""

    def __init__(self, *, run_dir: Path, rank: int) -> None:
        self.path = run_dir / EVENTS_FILE
        self.rank = rank
        run_dir.mkdir(parents=True, exist_ok=True)

    def emit(self, kind: str, *, step: int | None = None, **extra: Any) -> None:
        record = {"time": time.time(), "rank": self.rank, "kind": kind, "step": step, **extra}
        writer.appender().append(self.path, record)

    def flush(self) -> None:
        """Write this process's queued lines now (before a fault, a restart, ``os._exit``)."""
        writer.flush()


class StepLogger:
    """Rank 0's metrics: JSONL every step, plus a progress bar or plain log lines."""

    def __init__(
        self,
        *,
        run_dir: Path,
        total_steps: int,
        start_step: int,
        log_every: int,
        progress: str,
        attempt: int,
    ) -> None:
        self.path = run_dir / METRICS_FILE
        self.log_every = log_every
        self.attempt = attempt
        use_bar = progress == "bar" or (
            progress == "auto" and sys.stderr.isatty() and not os.environ.get("CI")
        )
        self._bar = None
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(
        self,
        *,
        step: int,
        loss: float,
        lr: float,
        step_time_s: float,
        tokens: int,
        flops_per_token: float,
        peak_flops: float | None,
        world_size: int,
    ) -> dict[str, Any]:
        tokens_per_s = tokens / step_time_s if step_time_s > 0 else 0.0
        mfu = None
        if peak_flops:
            mfu = tokens_per_s * flops_per_token / (peak_flops * world_size)
        record = {
            "time": time.time(),
            "step": step,
            "loss": loss,
            "lr": lr,
            "step_time_s": step_time_s,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "attempt": self.attempt,
        }
        writer.appender().append(self.path, record)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        elif step % self.log_every == 0 or step == 1:
            mfu_text = f" mfu={mfu:.1%}" if mfu is not None else ""
            print(
                f"step {step:6d} loss={loss:.4f} lr={lr:.2e} step_time={step_time_s * 1e3:.1f}ms "
                f"tokens/s={tokens_per_s:,.0f}{mfu_text}",
                flush=True,
            )
        return record

    def close(self) -> None:
        writer.flush()
        if self._bar is not None:
            self._bar.close()
