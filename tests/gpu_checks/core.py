"""What the device check's checks share: their result, the device boundary (a GPU or its CPU
stand-in), the run's context, and the child processes the checks start."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
FAKE_ENV = "GPU_CHECK_FAKE_CUDA"


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    name: str
    ok: bool
    seconds: float
    proves: str = ""
    """What a pass shows (the check's row; empty for a test case of ``pytest_gpu``)."""
    detail: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False


class Skip(Exception):
    """A check that cannot run here, with the precise reason."""


# --- the device boundary ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Boundary:
    """Everything that differs between the GPU machine and its CPU stand-in: the device, the
    backend and precision the trainer gets, timing and memory read-outs. Nothing else in the
    check knows which it runs on."""

    fake: bool

    @classmethod
    def from_environment(cls) -> Boundary:
        return cls(fake=os.environ.get(FAKE_ENV, "") == "1")

    @property
    def device_type(self) -> str:
        return "cpu" if self.fake else "cuda"

    @property
    def backend(self) -> str:
        return "gloo" if self.fake else "nccl"

    def available(self) -> bool:
        import torch

        return self.fake or torch.cuda.is_available()

    def device(self):
        import torch

        return torch.device(self.device_type, 0) if not self.fake else torch.device("cpu")

    def gpus(self) -> int:
        import torch

        return 1 if self.fake else torch.cuda.device_count()

    def synchronize(self) -> None:
        import torch

        if not self.fake:
            torch.cuda.synchronize()

    def reset_peak_memory(self) -> None:
        import torch

        if not self.fake:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_memory_gib(self) -> float | None:
        import torch

        return None if self.fake else round(torch.cuda.max_memory_allocated() / 2**30, 2)

    def peak_flops(self) -> float | None:
        import torch

        from training.runlog.metrics import peak_flops_for

        device = self.device()
        return peak_flops_for(torch.cuda.get_device_name(device) if device.type == "cuda" else None)

    def parallel(self, config):
        """A recipe's parallel section on this device (the CPU stand-in: fp32, no meta init,
        no compile, all of which the trainer refuses or cannot do on CPU)."""
        if not self.fake:
            return dataclasses.replace(config, device="cuda", mixed_precision="bf16")
        return dataclasses.replace(
            config, device="cpu", mixed_precision="fp32", meta_init=False, compile=False
        )

    def trainer_args(self) -> tuple[str, ...]:
        if self.fake:
            return ("--parallel.device=cpu", "--parallel.mixed_precision=fp32")
        return ("--parallel.device=cuda", "--parallel.mixed_precision=bf16")

    def cannot(self, why: str) -> None:
        """Skip a check (or part) the CPU stand-in cannot run, naming ``why``."""
        if self.fake:
            raise Skip(f"fake CUDA: {why}")

    def info(self) -> dict[str, Any]:
        import torch

        info: dict[str, Any] = {
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": sys.version.split()[0],
            "fake_cuda": self.fake,
        }
        if not self.fake and torch.cuda.is_available():
            info.update(
                name=torch.cuda.get_device_name(0),
                count=torch.cuda.device_count(),
                nccl=".".join(map(str, torch.cuda.nccl.version())),
            )
        return info


# --- the run and its child processes ------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Context:
    boundary: Boundary
    args: argparse.Namespace
    work: Path
    deadline: float
    corpus: Path

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def child_env(boundary: Boundary) -> dict[str, str]:
    """The environment of the trainer processes: the repository importable (nothing is
    installed on the lent machine), the carried wheels' PYTHONPATH kept, and the NCCL/torch
    settings the pods get (manifests/render.py's EFA_NCCL_ENV: NVRx's in-process restart needs
    NVLS off and CUDA errors not rethrown) except the EFA and interface ones."""
    from manifests.render import EFA_NCCL_ENV

    env = dict(os.environ)
    paths = [str(REPO_ROOT), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        PYTHONWARNINGS="ignore::FutureWarning",
        CI="1",
        TRAINING_TENSORBOARD="0",
    )
    env.update(
        {k: v for k, v in EFA_NCCL_ENV.items() if k.startswith(("TORCH_NCCL_", "NCCL_NVLS"))}
    )
    if boundary.fake:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def run_child(
    ctx: Context, command: list[str], *, log: Path, cap_s: float
) -> subprocess.CompletedProcess:
    timeout = max(1.0, min(cap_s, ctx.left_s()))
    with open(log, "w") as handle:
        try:
            return subprocess.run(
                command,
                cwd=REPO_ROOT,
                env=child_env(ctx.boundary),
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired as err:
            raise TimeoutError(f"{command[2:5]} timed out after {timeout:.0f} s") from err


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def tiny_model_args() -> tuple[str, ...]:
    from bench.common import TINY_MODEL

    return TINY_MODEL


def torchrun(nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def build_corpus(work: Path) -> Path:
    from support import write_learnable_text

    from training.data import prepare

    source = work / "corpus_src"
    source.mkdir(parents=True, exist_ok=True)
    write_learnable_text(source / "words.txt")
    out = work / "corpus"
    prepare(sources=[source], out_dir=out)
    return out


# --- the checks ----------------------------------------------------------------------------------
