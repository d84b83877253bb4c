"""The device check: everything in this project that needs a GPU, in one run of at most 8 minutes
on one H100 or H200, offline, ending in one JSON report (stdout, and ``--out``).

Run: ``make gpu-check`` on the lent machine (docs/gpu.md): its own ``python3`` and torch, the
carried wheels (``make gpu-wheels``: NVRx, ISA-L, defusedxml) installed with ``--no-index
--target``; nothing is fetched. The machine's torch may differ from the pin (2.11.0+cu130 there,
2.13.0 here): the ``environment`` check says so, and looks up every private torch name the trainer
uses; a check that needs a missing one is skipped with that name as its reason.

Checks, in order (each bounded by what is left of ``--budget-s``), each with a verdict:
- ``environment``: torch against the pin, the private torch names, NVRx and ISA-L importable.
- ``fsdp_step``: an FSDP2 bf16 training step of an 8B-class slice (Llama-3-8B's width,
  vocabulary and 4k sequence, ``--layers`` blocks, the p5_8b recipe's parallel settings) at
  world size 1: step time, tokens/s, MFU and peak memory. MFU counts FLOPs as torchtitan does
  (``training.model.flops_per_token``: 6N + 12LHQT, the causal mask NOT halved); the report
  gives the halved figure beside it.
- ``ac_compile``: full recompute against ``torch.compile`` + selective activation checkpointing
  on ``--ac-layers`` blocks of the same width: peak memory and step time of each.
- ``memory_snapshot``: a memory snapshot of device tensors (side stream, pinned buffers), the
  state changed in place after it, restored exactly.
- ``pod_memory_snapshot``: a pod-memory snapshot (``/dev/shm``) of ~1 GiB of device state:
  ``prepare`` (slots mapped, ``cudaHostRegister`` on a thread bound to the GPU), the first
  ``take`` (waits for the registration), the state changed in place after ``before_update``,
  published, restored exactly; the times of prepare, the first and the second take.
- ``peer_exchange``: tests/training/probes/peer_probe.py, two gloo ranks with CUDA state (one
  GPU cannot host two NCCL ranks): pod-memory snapshots, the exchange on its own thread and
  group while the ranks go on changing their state, then a lost node's shard restored from
  its peer, bit for bit.
- ``nvrx_snapshot``, ``torch_async``: tests/training/probes/snapshot_probe.py under torchrun on
  the GPUs there are (1 or 2): an asynchronous save (NVRx; torch's ``async_save`` over
  "cpu:gloo,cuda:nccl") with the state changed right after the call, loaded back equal; the
  cached and prepared plans write the same bytes; a damaged shard (the last rank's) is rejected
  and the previous checkpoint loaded.
- ``local_checkpoint``: NVRx local checkpoints every 3 steps; with the shared ones removed, a
  rerun restores step 6 from the local tier and ends at the same state.
- ``inprocess_restart``: ``python -m training.launch.local --restart=inprocess`` with an
  exception, then ``hang_kernel`` (a spinning CUDA kernel and a synchronize: the rank sits in
  C++); the calibrated hang detection's time, both restarts' times.
- ``pytest_gpu``: the ``gpu``-marked tests not covered above (``GPU_TESTS``), one entry each.

The device boundary: ``GPU_CHECK_FAKE_CUDA=1`` runs every check on CPU ranks with gloo and fp32
in place of CUDA, NCCL and bf16 (tests/training/test_gpu_check.py, so that the check's own code
runs in CI); what CPU cannot do is named in the report (``torch.compile``, NVRx local
checkpoints: CUDA tensors only). ``fake_cuda`` in the report says which it was.

Without CUDA (and without the fake) it refuses at once: exit code ``training.exits.ENVIRONMENT``.
Exit code 0 only when every check that ran passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as `python tests/gpu_check.py`, nothing installed
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_BUDGET_S = 480.0  # 8 minutes on one H100/H200, all checks together
FAKE_ENV = "GPU_CHECK_FAKE_CUDA"
CHECKS = (
    "environment",
    "fsdp_step",
    "ac_compile",
    "memory_snapshot",
    "pod_memory_snapshot",
    "peer_exchange",
    "nvrx_snapshot",
    "torch_async",
    "local_checkpoint",
    "inprocess_restart",
    "pytest_gpu",
)

# Every private torch name the trainer uses, where, and the checks that need it. torch 2.11.0
# (the lent machine's) and 2.13.0 (the pin) both have them all (read in both wheels' sources);
# ``environment`` looks them up on the machine at hand.
CHECKPOINTING = ("nvrx_snapshot", "torch_async", "local_checkpoint", "inprocess_restart")
PRIVATE_TORCH_NAMES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "torch.distributed._shard._utils",
        "narrow_tensor_by_index",
        "training/checkpoint/integrity.py",
        CHECKPOINTING,
    ),
    (
        "torch.distributed.checkpoint.filesystem",
        "_StorageWriterTransforms",
        "training/checkpoint/integrity.py",
        CHECKPOINTING,
    ),
    (
        "torch.distributed.checkpoint.filesystem",
        "_write_item",
        "training/checkpoint/integrity.py",
        CHECKPOINTING,
    ),
    (
        "torch.serialization",
        "_open_zipfile_reader",
        "training/checkpoint/integrity.py",
        CHECKPOINTING,
    ),
    ("torch.serialization", "_load", "training/checkpoint/integrity.py", CHECKPOINTING),
    (
        "torch.serialization",
        "_weights_only_unpickler",
        "training/checkpoint/integrity.py",
        CHECKPOINTING,
    ),
    (
        "torch.distributed.checkpoint.utils",
        "_DistWrapper",
        "training/checkpoint/nvrx_async.py",
        CHECKPOINTING,
    ),
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
        "training/parallel.py",
        ("fsdp_step", "ac_compile"),
    ),
    (
        "torch.distributed.distributed_c10d",
        "_abort_process_group",
        "training/run.py",
        ("inprocess_restart",),
    ),
    (
        "torch.distributed.distributed_c10d",
        "_get_default_group",
        "training/run.py",
        ("inprocess_restart",),
    ),
    ("torch.cuda", "_sleep", "training/resilience/inject.py", ("inprocess_restart",)),
)
# Keyword arguments of private functions the trainer passes.
PRIVATE_TORCH_PARAMETERS = (("torch.serialization", "_load", "overall_storage"),)

# gpu-marked tests the checks above do not already cover (node ids, from the repository root).
GPU_TESTS = (
    "tests/training/resilience/test_gpu_resilience.py::"
    "test_checkpoint_worker_is_bound_to_the_ranks_gpu",
    "tests/training/resilience/test_gpu_resilience.py::"
    "test_stage_copies_cuda_tensors_completely_before_returning",
    "tests/training/resilience/test_gpu_resilience.py::"
    "test_a_failed_attempt_aborts_nccl_before_ending_the_group",
    "tests/training/resilience/test_gpu_resilience.py::"
    "test_memory_snapshot_copies_on_a_side_stream_and_the_update_waits_for_them",
    "tests/training/checkpoint/test_memory.py::"
    "test_a_snapshot_of_cuda_tensors_is_the_state_at_its_step",
    "tests/training/test_allreduce_check.py::test_nccl_on_this_machines_gpus",
    "tests/training/test_step_stats.py::test_the_cuda_branch_reads_through_one_pinned_buffer",
)
# gpu-marked tests whose subject a check above runs (so pytest_gpu leaves them out).
COVERED_BY_CHECKS = {
    "test_cuda_bf16_fsdp_step": "fsdp_step",
    "test_local_checkpoint_is_preferred_when_newer": "local_checkpoint",
    "test_inprocess_restart_on_nccl_with_cuda_health_check": "inprocess_restart",
    "test_nvrx_async_save_is_an_exact_snapshot_on_cuda": "nvrx_snapshot",
}


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    name: str
    ok: bool
    seconds: float
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
        from training.runlog.metrics import peak_flops_for

        return peak_flops_for(self.device())

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

    def cannot(self, what: str) -> None:
        """Skip a check (or part) the CPU stand-in cannot run."""
        reasons = {
            "compile": "torch.compile per block is a GPU option (config refuses it on CPU)",
            "local_checkpoint": "NVRx local checkpoints take CUDA tensors only "
            "(BasicTensorAwareStateDict)",
        }
        if self.fake:
            raise Skip(f"fake CUDA: {reasons[what]}")

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


# --- arguments and the report -------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall-clock budget, all checks"
    )
    parser.add_argument(
        "--model",
        choices=("8b_slice", "tiny"),
        default="8b_slice",
        help="fsdp_step/ac_compile model: Llama-3-8B's width (default) or a tiny one (CPU)",
    )
    parser.add_argument("--layers", type=int, default=4, help="blocks in the fsdp_step slice")
    parser.add_argument("--ac-layers", type=int, default=2, help="blocks in the ac_compile slice")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after warm-up)")
    parser.add_argument("--only", choices=CHECKS, action="append", help="run only these")
    parser.add_argument(
        "--wheels",
        type=Path,
        default=None,
        help="install these carried wheels first (pip --no-index --target SITE), then run",
    )
    parser.add_argument("--site", type=Path, default=Path("/tmp/gpu-check-site"))
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or args.layers < 1 or args.ac_layers < 1 or args.steps < 1:
        parser.error("--budget-s, --layers, --ac-layers and --steps must be positive")
    if args.seq_len < 16:
        parser.error("--seq-len must be >= 16")
    return args


def build_report(
    results: list[CheckResult], *, device: dict[str, Any], budget_s: float, error: str = ""
) -> dict[str, Any]:
    """The JSON report: ok only when something ran and nothing failed."""
    ran = [r for r in results if not r.skipped]
    return {
        "ok": not error and bool(ran) and all(r.ok for r in ran),
        "error": error or None,
        "device": device,
        "budget_s": budget_s,
        "seconds": round(sum(r.seconds for r in results), 1),
        "checks": [asdict(r) for r in results],
    }


def parse_junit(xml_text: str) -> list[CheckResult]:
    """One result per test case of pytest's JUnit XML (skips kept, marked skipped)."""
    results = []
    for case in ET.fromstring(xml_text).iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped") is not None
        detail: dict[str, Any] = {}
        if failure is not None:
            detail["message"] = (failure.get("message") or "")[:2000]
        if skipped:
            detail["reason"] = case.find("skipped").get("message", "")
        results.append(
            CheckResult(
                name=f"pytest:{name}",
                ok=failure is None,
                seconds=round(float(case.get("time", "0") or 0), 1),
                detail=detail,
                skipped=skipped and failure is None,
            )
        )
    return results


# --- shared helpers ------------------------------------------------------------------------------


def pinned_torch() -> str:
    """The torch version pyproject.toml pins (its one owner)."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    match = re.search(r'"torch==([^"]+)"', text)
    return match.group(1) if match else "unknown"


def missing_private_names() -> dict[str, str]:
    """``module.name`` -> why, for every private torch name (or parameter) the trainer uses
    that this torch lacks."""
    missing: dict[str, str] = {}
    for module, name, where, _checks in PRIVATE_TORCH_NAMES:
        try:
            found = hasattr(import_module(module), name)
        except ImportError as err:
            found, why = False, f"{module} not importable ({err})"
        else:
            why = f"absent in torch (used by {where})"
        if not found:
            missing[f"{module}.{name}"] = why
    for module, name, parameter in PRIVATE_TORCH_PARAMETERS:
        function = getattr(import_module(module), name, None)
        if function is not None and parameter not in inspect.signature(function).parameters:
            missing[f"{module}.{name}({parameter}=)"] = "parameter absent"
    return missing


def blocked_by_missing_names(check: str, missing: dict[str, str]) -> list[str]:
    names = []
    for module, name, _where, checks in PRIVATE_TORCH_NAMES:
        if check in checks and f"{module}.{name}" in missing:
            names.append(f"{module}.{name}")
    if check in CHECKPOINTING:
        names += [k for k in missing if k.startswith("torch.serialization._load(")]
    return names


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


def check_environment(ctx: Context) -> dict[str, Any]:
    import importlib.metadata as metadata

    import torch

    pin = pinned_torch()
    missing = missing_private_names()
    detail: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_pin": pin,
        "torch_matches_pin": torch.__version__.split("+")[0] == pin,
        "private_torch_names_checked": len(PRIVATE_TORCH_NAMES) + len(PRIVATE_TORCH_PARAMETERS),
        "private_torch_names_missing": missing,
    }
    if not detail["torch_matches_pin"]:
        detail["note"] = (
            f"torch {torch.__version__} here, {pin} pinned: the checks run on this torch; "
            + (
                "every private torch name the trainer uses is present"
                if not missing
                else "checks needing a missing private name are skipped, naming it"
            )
        )
    versions, paths, problems = {}, {}, []
    for dist_name, module in (
        ("nvidia-resiliency-ext", "nvidia_resiliency_ext.inprocess"),
        ("isal", "isal.isal_zlib"),
        ("defusedxml", "defusedxml"),
    ):
        try:
            paths[dist_name] = str(Path(import_module(module).__file__).parent)
            versions[dist_name] = metadata.version(dist_name)
        except Exception as err:  # an import error names what is missing on the machine
            problems.append(f"{module}: {type(err).__name__}: {err}")
    for module in (  # the NVRx modules the trainer imports, against this torch
        "nvidia_resiliency_ext.checkpointing.async_ckpt.core",
        "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async",
        "nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager",
        "nvidia_resiliency_ext.fault_tolerance",
    ):
        try:
            import_module(module)
        except Exception as err:
            problems.append(f"{module}: {type(err).__name__}: {err}")
    detail["packages"] = versions
    detail["package_paths"] = paths
    detail["import_problems"] = problems
    detail["ok"] = not problems and not missing
    return detail


def _model_config(ctx: Context, *, layers: int):
    from training.config import ModelConfig
    from training.recipes import LLAMA3_8B

    seq = ctx.args.seq_len
    if ctx.args.model == "tiny":
        return ModelConfig(dim=64, n_layers=layers, max_seq_len=seq)
    return dataclasses.replace(LLAMA3_8B, n_layers=layers, max_seq_len=seq)


def _one_rank_group(boundary: Boundary):
    import datetime

    import torch
    import torch.distributed as dist

    kwargs: dict[str, Any] = {}
    if not boundary.fake:
        torch.cuda.set_device(boundary.device())
        kwargs["device_id"] = boundary.device()
    dist.init_process_group(
        boundary.backend,
        store=dist.HashStore(),
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
        **kwargs,
    )


def _time_steps(ctx: Context, *, model_config, parallel, steps: int, warmup: int):
    """Build, warm up and time ``steps`` training steps at world size 1."""
    import torch

    from training.model import Transformer
    from training.parallel import DistEnv, build_sharded_model

    boundary = ctx.boundary
    device = boundary.device()
    env = DistEnv(rank=0, world_size=1, local_rank=0, device=device, backend=boundary.backend)
    boundary.reset_peak_memory()
    model, _ = build_sharded_model(
        lambda: Transformer(model_config), config=parallel, env=env, seed=0
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=not boundary.fake)
    seq = model_config.max_seq_len
    tokens = torch.randint(0, model_config.vocab_size, (1, seq + 1), device=device)

    def step() -> float:
        loss = model(tokens[:, :-1], tokens[:, 1:], loss_chunk_tokens=parallel.loss_chunk_tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    started = time.perf_counter()
    losses = [step() for _ in range(warmup)]
    boundary.synchronize()
    warmup_s = time.perf_counter() - started
    t0 = time.perf_counter()
    losses += [step() for _ in range(steps)]
    boundary.synchronize()
    step_s = (time.perf_counter() - t0) / steps
    peak = boundary.peak_memory_gib()
    return {
        "step_s": round(step_s, 4),
        "warmup_s": round(warmup_s, 2),
        "peak_memory_gib": peak,
        "losses": [round(x, 4) for x in losses],
        "finite": all(math.isfinite(x) for x in losses),
    }


def check_fsdp_step(ctx: Context) -> dict[str, Any]:
    import torch.distributed as dist

    from training.model import count_parameters, flops_per_token
    from training.recipes import get_recipe

    boundary = ctx.boundary
    model_config = _model_config(ctx, layers=ctx.args.layers)
    # The 8B recipe's parallel settings (selective recompute, chunked loss); compile off: its
    # warm-up belongs to ac_compile.
    parallel = boundary.parallel(dataclasses.replace(get_recipe("p5_8b").config.parallel))
    parallel = dataclasses.replace(parallel, compile=False)
    _one_rank_group(boundary)
    try:
        timed = _time_steps(
            ctx, model_config=model_config, parallel=parallel, steps=ctx.args.steps, warmup=1
        )
    finally:
        dist.destroy_process_group()
    seq = model_config.max_seq_len
    tokens_per_s = seq / timed["step_s"]
    fpt = flops_per_token(model_config, seq_len=seq)
    causal_half = 6.0 * model_config.n_layers * model_config.n_heads * model_config.head_dim * seq
    peak = boundary.peak_flops()
    return {
        "ok": timed["finite"],
        "layers": model_config.n_layers,
        "dim": model_config.dim,
        "parameters": count_parameters(model_config),
        "seq_len": seq,
        "parallel": {
            "activation_checkpointing": parallel.activation_checkpointing_mode
            if parallel.activation_checkpointing
            else "none",
            "loss_chunk_tokens": parallel.loss_chunk_tokens,
            "mixed_precision": parallel.mixed_precision,
        },
        **timed,
        "tokens_per_s": round(tokens_per_s, 1),
        "flops_per_token": fpt,
        "mfu": round(tokens_per_s * fpt / peak, 4) if peak else None,
        "causal_mask_halved": False,
        "mfu_causal_halved": round(tokens_per_s * (fpt - causal_half) / peak, 4) if peak else None,
        "mfu_convention": "torchtitan/PaLM: 6N + 12LHQT per token, N without the embedding; "
        "the causal mask's half of the attention FLOPs is counted (mfu_causal_halved drops it)",
    }


def check_ac_compile(ctx: Context) -> dict[str, Any]:
    import torch.distributed as dist

    from training.config import ParallelConfig

    boundary = ctx.boundary
    model_config = _model_config(ctx, layers=ctx.args.ac_layers)
    # meta init: the 8B-wide blocks are initialised on the GPU, not on the host first.
    base = ParallelConfig(loss_chunk_tokens=1024, activation_checkpointing=True, meta_init=True)
    variants = {"full_recompute": boundary.parallel(base)}
    try:
        boundary.cannot("compile")
        compiled = True
    except Skip as why:
        compiled, compile_note = False, str(why)
    selective = dataclasses.replace(
        base, activation_checkpointing_mode="selective", compile=compiled
    )
    key = "compiled_selective" if compiled else "selective"
    variants[key] = dataclasses.replace(boundary.parallel(selective), compile=compiled)
    results = {}
    _one_rank_group(boundary)
    try:
        for name, parallel in variants.items():
            results[name] = _time_steps(
                ctx, model_config=model_config, parallel=parallel, steps=ctx.args.steps, warmup=2
            )
    finally:
        dist.destroy_process_group()
    full, other = results["full_recompute"], results[key]
    detail: dict[str, Any] = {
        "layers": model_config.n_layers,
        "seq_len": model_config.max_seq_len,
        **results,
        "step_time_ratio": round(other["step_s"] / full["step_s"], 3),
    }
    if full["peak_memory_gib"] and other["peak_memory_gib"]:
        detail["memory_ratio"] = round(other["peak_memory_gib"] / full["peak_memory_gib"], 3)
    finite = full["finite"] and other["finite"]
    if compiled:
        detail["faster_than_full_recompute"] = other["step_s"] < full["step_s"]
        detail["ok"] = finite and detail["faster_than_full_recompute"]
    else:
        detail["skipped_part"] = compile_note
        detail["ok"] = finite
    return detail


def check_memory_snapshot(ctx: Context) -> dict[str, Any]:
    import torch

    from training.checkpoint.memory import MemorySnapshots

    boundary = ctx.boundary
    device = boundary.device()
    numel = (256 << 20) // 4 if not boundary.fake else 1 << 20  # 1 GiB of fp32 on the GPU
    state = {
        "model": {"w": torch.randn(numel, device=device), "b": torch.randn(4096, device=device)},
        "step": 7,
    }
    expected = {k: v.cpu().clone() for k, v in state["model"].items()}
    snapshots = MemorySnapshots()
    snapshots.take(state, owner="gpu_check", step=7, rank=0, world_size=1)  # allocates buffers
    boundary.synchronize()
    started = time.perf_counter()
    snapshots.take(state, owner="gpu_check", step=7, rank=0, world_size=1)
    take_s = time.perf_counter() - started
    snapshots.before_update()
    for value in state["model"].values():
        value.mul_(-2.0)  # the optimizer's in-place update, right after the snapshot
    state["step"] = 99
    boundary.synchronize()
    complete_s = time.perf_counter() - started
    snapshots.restore(state, step=7)
    equal = all(torch.equal(state["model"][k].cpu(), v) for k, v in expected.items())
    nbytes = sum(v.numel() * v.element_size() for v in expected.values())
    return {
        "ok": equal and state["step"] == 7,
        "restored_equal": equal,
        "bytes": nbytes,
        "take_s": round(take_s, 4),
        "copy_complete_s": round(complete_s, 4),
        "gb_per_s": round(nbytes / complete_s / 1e9, 2),
        "side_stream": bool(snapshots._streams),
    }


def _shm_dir(ctx: Context, name: str) -> Path:
    """A directory on tmpfs (``/dev/shm``, as the pods' ``pod_memory_dir``): cudaHostRegister
    pins file mappings with FOLL_LONGTERM, which kernels >= 6.5 allow on shmem only."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else ctx.work
    path = base / f"gpu-check-{name}-{os.getpid()}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def check_pod_memory_snapshot(ctx: Context) -> dict[str, Any]:
    import torch

    from training.checkpoint.pod_memory import PodMemorySnapshots

    boundary = ctx.boundary
    device = boundary.device()
    numel = (256 << 20) // 4 if not boundary.fake else 1 << 20  # 1 GiB of fp32 on the GPU
    state = {
        "model": {"w": torch.randn(numel, device=device), "b": torch.randn(4096, device=device)},
        "step": 7,
    }
    expected = {k: v.cpu().clone() for k, v in state["model"].items()}
    root = _shm_dir(ctx, "pod-memory")
    snapshots = PodMemorySnapshots(root=root, owner="gpu_check", rank=0, world_size=1)
    try:
        started = time.perf_counter()
        snapshots.prepare(state)
        prepare_s = time.perf_counter() - started
        boundary.synchronize()
        started = time.perf_counter()
        snapshots.take(state, step=7)  # waits for its slot's registration
        first_take_s = time.perf_counter() - started
        snapshots.before_update()
        for value in state["model"].values():
            value.mul_(-2.0)  # the optimizer's in-place update, right after the snapshot
        state["step"] = 99
        snapshots.wait()
        first_complete_s = time.perf_counter() - started
        pinned = [f.wait_pinned() for f in snapshots._files.values()]
        path, problem = snapshots.check(state, step=7)
        restored_equal = False
        if problem is None and path is not None:
            snapshots.restore(state, path=path)
            restored_equal = all(
                torch.equal(state["model"][k].cpu(), v) for k, v in expected.items()
            )
        boundary.synchronize()
        started = time.perf_counter()
        snapshots.take(state, step=8)  # the other slot, registered by prepare meanwhile
        second_take_s = time.perf_counter() - started
        snapshots.wait()
        second_complete_s = time.perf_counter() - started
    finally:
        snapshots.close(remove=True)
        shutil.rmtree(root, ignore_errors=True)
    nbytes = sum(v.numel() * v.element_size() for v in expected.values())
    return {
        "ok": restored_equal and state["step"] == 7 and problem is None,
        "restored_equal": restored_equal,
        "problem": problem,
        "bytes": nbytes,
        "pinned": pinned,
        "prepare_s": round(prepare_s, 4),
        "first_take_s": round(first_take_s, 4),
        "first_complete_s": round(first_complete_s, 4),
        "second_take_s": round(second_take_s, 4),
        "second_complete_s": round(second_complete_s, 4),
        "stray_context_check": "needs 2 GPUs (a rank on GPU 1, no context of it on GPU 0); "
        "tests/training/checkpoint/test_device_threads.py pins the binding on CPU",
    }


def check_peer_exchange(ctx: Context) -> dict[str, Any]:
    numel = (128 << 20) // 4 if not ctx.boundary.fake else 1 << 16  # 512 MiB of fp32 per rank
    result_dir = ctx.work / "peer_probe"
    command = [
        sys.executable,
        str(REPO_ROOT / "tests/training/probes/peer_probe.py"),
        str(result_dir),
        str(numel),
    ]
    log = ctx.work / "peer_probe.log"
    proc = run_child(ctx, command, log=log, cap_s=180)
    if proc.returncode != 0:
        return {"ok": False, "returncode": proc.returncode, "tail": tail(log)}
    reports = [json.loads((result_dir / f"rank{rank}.json").read_text()) for rank in range(2)]
    problems = []
    for report in reports:
        rank = report["rank"]
        if not report["exchange_started"]:
            problems.append(f"rank {rank}: the exchange did not start")
        if report["problem"] or not report["restored"]:
            problems.append(f"rank {rank}: not restored ({report['problem']})")
        if not report["restored_equal"]:
            problems.append(f"rank {rank}: the restored state differs")
    if reports[1]["restored"] is not None and not reports[1]["restored"].startswith("peer"):
        problems.append(f"rank 1 restored from {reports[1]['restored']}, not its peer")
    keys = ("device", "pinned", "first_take_s", "blocked_s", "steps_s", "in_flight_after_steps")
    return {
        "ok": not problems,
        "problems": problems,
        "bytes_per_rank": numel * 4 * 5 // 4 + 4096 * 4,
        "exchange_s": [round(r["exchange_s"], 4) for r in reports],
        **{key: [r[key] for r in reports] for key in keys},
    }


def _snapshot_probe(ctx: Context, *, engine: str) -> dict[str, Any]:
    nproc = min(2, ctx.boundary.gpus())
    result_dir = ctx.work / f"probe_{engine}"
    command = [
        *torchrun(nproc),
        str(REPO_ROOT / "tests/training/probes/snapshot_probe.py"),
        str(result_dir),
        engine,
        "--",
        f"--data.path={ctx.corpus}",
        *tiny_model_args(),
        *ctx.boundary.trainer_args(),
    ]
    log = ctx.work / f"probe_{engine}.log"
    proc = run_child(ctx, command, log=log, cap_s=150)
    if proc.returncode != 0:
        return {"ok": False, "returncode": proc.returncode, "tail": tail(log)}
    reports = [
        json.loads((result_dir / f"probe_rank{rank}.json").read_text()) for rank in range(nproc)
    ]
    problems = []
    for rank, report in enumerate(reports):
        for key in ("mismatched", "touched_by_rejected_load", "fallback_mismatched"):
            if report[key]:
                problems.append(f"rank {rank}: {key} {report[key][:3]}")
        if not report["damaged_load_raised"]:
            problems.append(f"rank {rank}: the damaged checkpoint loaded")
        if report["fallback_step"] != 3:
            problems.append(f"rank {rank}: fallback loaded step {report['fallback_step']}")
    rank0 = reports[0]
    for key in ("crc_problems", "cached_differs", "prepared_differs"):
        if rank0[key]:
            problems.append(f"{key}: {rank0[key][:3]}")
    return {
        "ok": not problems,
        "ranks": nproc,
        "problems": problems,
        "tensors": rank0["tensors"],
        "damaged_shard": rank0["damaged_shard"],
        "damaged_load_problem": rank0["damaged_load_problem"],
    }


def check_nvrx_snapshot(ctx: Context) -> dict[str, Any]:
    return _snapshot_probe(ctx, engine="nvrx")


def check_torch_async(ctx: Context) -> dict[str, Any]:
    detail = _snapshot_probe(ctx, engine="torch_async")
    from training.checkpoint.manager import needs_cpu_collectives
    from training.config import CheckpointConfig
    from training.parallel import process_group_backend

    detail["process_group_backend"] = process_group_backend(
        ctx.boundary.device(),
        cpu_collectives=needs_cpu_collectives(CheckpointConfig(engine="torch_async")),
    )
    return detail


def _train(ctx: Context, run_dir: Path, *args: str, name: str, cap_s: float):
    command = [
        *torchrun(1),
        "-m",
        "training",
        "train",
        "--run-dir",
        str(run_dir),
        f"--data.path={ctx.corpus}",
        *tiny_model_args(),
        *ctx.boundary.trainer_args(),
        *args,
    ]
    log = ctx.work / f"{name}.log"
    return run_child(ctx, command, log=log, cap_s=cap_s), log


def check_local_checkpoint(ctx: Context) -> dict[str, Any]:
    ctx.boundary.cannot("local_checkpoint")
    import torch
    from support import final_state

    run_dir = ctx.work / "local_run"
    args = (
        "--train.steps=8",
        "--checkpoint.interval=0",
        f"--checkpoint.local_dir={ctx.work / 'nvme'}",
        "--checkpoint.local_interval=3",
    )
    first, log = _train(ctx, run_dir, *args, name="local_first", cap_s=120)
    if first.returncode != 0:
        return {"ok": False, "run": "first", "tail": tail(log)}
    reference = final_state(run_dir)
    shutil.rmtree(run_dir / "checkpoints")  # only the local tier (steps 3 and 6) is left
    second, log = _train(ctx, run_dir, *args, name="local_second", cap_s=120)
    if second.returncode != 0:
        return {"ok": False, "run": "second", "tail": tail(log)}
    loads = [e for e in read_events(run_dir) if e["kind"] == "checkpoint_load"]
    resumed = final_state(run_dir)
    differ = []
    for key, value in reference.items():
        if not (isinstance(value, torch.Tensor) and key.startswith("trainer.model.")):
            continue
        if not torch.allclose(resumed[key].float(), value.float(), rtol=2e-2, atol=2e-3):
            differ.append(key)
    source = (loads[-1]["source"], loads[-1]["step"]) if loads else None
    return {
        "ok": source == ("local", 6) and not differ,
        "loaded": source,
        "load_s": round(loads[-1]["seconds"], 3) if loads else None,
        "model_tensors_differ": differ[:5],
    }


def check_inprocess_restart(ctx: Context) -> dict[str, Any]:
    from training.faults import HANG_KERNEL_S

    nproc = min(2, ctx.boundary.gpus())
    run_dir = ctx.work / "inprocess_run"
    command = [
        sys.executable,
        "-m",
        "training.launch.local",
        f"--nproc={nproc}",
        "--run-dir",
        str(run_dir),
        f"--data.path={ctx.corpus}",
        *tiny_model_args(),
        *ctx.boundary.trainer_args(),
        "--restart=inprocess",
        "--train.steps=24",
        "--checkpoint.interval=5",
        "--resilience.calibrate_timeouts_after=5",
        "--resilience.soft_timeout_s=30",
        "--resilience.hard_timeout_s=60",
        f"--train.micro_batch_size={8 // nproc}",
        f"--faults=exception@0:6;hang_kernel@{nproc - 1}:14",
    ]
    log = ctx.work / "inprocess.log"
    proc = run_child(ctx, command, log=log, cap_s=180)
    events = read_events(run_dir)
    fired = [e for e in events if e["kind"] == "fault"]
    restarts = [e for e in events if e["kind"] == "restart_end"]
    detected = [e for e in events if e["kind"] == "hang_detected"]
    hang_fault = next((e for e in fired if e["step"] == 14), None)
    released = [e for e in events if e["kind"] == "restart_begin" and e.get("attempt") == 1]
    detail: dict[str, Any] = {
        "ranks": nproc,
        "returncode": proc.returncode,
        "restarts": sorted({e["attempt"] for e in restarts}),
        "restart_s": {str(e["attempt"]): round(e["seconds"] or 0, 2) for e in restarts},
        "hang_kernel_s": HANG_KERNEL_S,
        "faults_fired": len(fired),
    }
    if detected:
        detail["hang_detection_s"] = round(detected[0]["waited_s"], 2)
        detail["hang_timeout_s"] = detected[0]["timeout_s"]
    if hang_fault and released:
        # The first rank interrupted after the hang: with two GPUs the peer blocked in the
        # collective, released by NCCL's abort soon after the detection; with one, the hung
        # rank itself, once its kernel returns (hang_kernel_s).
        detail["first_rank_interrupted_after_s"] = round(
            min(e["time"] for e in released) - hang_fault["time"], 2
        )
    detail["ok"] = proc.returncode == 0 and detail["restarts"] == [1, 2] and bool(detected)
    if proc.returncode != 0:
        detail["tail"] = tail(log)
    return detail


def check_pytest_gpu(ctx: Context) -> list[CheckResult]:
    """The gpu-marked tests the checks above do not cover, in a child pytest."""
    started = time.perf_counter()
    junit = ctx.work / "junit.xml"
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        f"--junitxml={junit}",
        *GPU_TESTS,
    ]
    log = ctx.work / "pytest_gpu.log"
    try:
        proc = run_child(ctx, command, log=log, cap_s=ctx.left_s())
    except TimeoutError as err:
        return [
            CheckResult(
                name="pytest_gpu",
                ok=False,
                seconds=round(time.perf_counter() - started, 1),
                detail={"message": str(err)},
            )
        ]
    if not junit.exists():
        return [
            CheckResult(
                name="pytest_gpu",
                ok=False,
                seconds=round(time.perf_counter() - started, 1),
                detail={"returncode": proc.returncode, "tail": tail(log)},
            )
        ]
    results = parse_junit(junit.read_text())
    return results or [
        CheckResult(name="pytest_gpu", ok=False, seconds=0.0, detail={"tail": "no test"})
    ]


CHECK_FUNCTIONS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "environment": check_environment,
    "fsdp_step": check_fsdp_step,
    "ac_compile": check_ac_compile,
    "memory_snapshot": check_memory_snapshot,
    "pod_memory_snapshot": check_pod_memory_snapshot,
    "peer_exchange": check_peer_exchange,
    "nvrx_snapshot": check_nvrx_snapshot,
    "torch_async": check_torch_async,
    "local_checkpoint": check_local_checkpoint,
    "inprocess_restart": check_inprocess_restart,
}
MIN_LEFT_S = 20.0
"""A check starts only with at least this much of the budget left."""


def run_check(name: str, ctx: Context, missing: dict[str, str]) -> list[CheckResult]:
    started = time.perf_counter()

    def result(**kwargs: Any) -> list[CheckResult]:
        return [CheckResult(name=name, seconds=round(time.perf_counter() - started, 1), **kwargs)]

    blocked = blocked_by_missing_names(name, missing)
    if blocked:
        reason = f"torch {_torch_version()} lacks {', '.join(blocked)}"
        return result(ok=True, skipped=True, detail={"reason": reason})
    left = ctx.left_s()
    if left < MIN_LEFT_S:
        return result(ok=False, detail={"message": f"budget spent ({left:.0f} s left)"})
    if name == "pytest_gpu":
        return check_pytest_gpu(ctx)
    try:
        detail = CHECK_FUNCTIONS[name](ctx)
    except Skip as why:
        return result(ok=True, skipped=True, detail={"reason": str(why)})
    except Exception as err:  # report, and go on with the other checks
        return result(ok=False, detail={"error": f"{type(err).__name__}: {err}"[:2000]})
    finally:
        _release_device(ctx.boundary)
    ok = bool(detail.pop("ok"))
    return result(ok=ok, detail=detail)


def _torch_version() -> str:
    import torch

    return torch.__version__


def _release_device(boundary: Boundary) -> None:
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
    if not boundary.fake:
        import torch

        torch.cuda.empty_cache()


def install_wheels(wheels: Path, site: Path) -> dict[str, str]:
    """Install the carried wheels into ``site`` exactly as the device tool's README says
    (``pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade --target``): no
    index, nothing fetched. Returns the environment to run the check in (``site`` first on
    PYTHONPATH)."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise SystemExit(
            f"gpu_check: no wheels in {wheels}: run `make gpu-wheels` on the dev machine and "
            f"carry {wheels} (docs/gpu.md)"
        )
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(site),
        *map(str, found),
    ]
    subprocess.run(command, check=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(site), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]]
    )
    return env


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.wheels is not None:  # install, then run again with the wheels importable
        env = install_wheels(args.wheels, args.site)
        rest = [a for i, a in enumerate(argv) if not _is_wheel_option(argv, i)]
        return subprocess.run([sys.executable, __file__, *rest], env=env).returncode

    from training import exits

    deadline = time.monotonic() + args.budget_s
    boundary = Boundary.from_environment()
    try:
        import torch  # noqa: F401
    except ImportError as err:
        report = build_report([], device={}, budget_s=args.budget_s, error=f"no torch: {err}")
        _emit(report, args.out)
        return exits.ENVIRONMENT
    if not boundary.available():
        report = build_report(
            [],
            device=boundary.info(),
            budget_s=args.budget_s,
            error="no CUDA device (torch.cuda.is_available() is False): run this on a GPU host",
        )
        _emit(report, args.out)
        return exits.ENVIRONMENT
    wanted = [c for c in CHECKS if c in set(args.only or CHECKS)]
    results: list[CheckResult] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        ctx = Context(
            boundary=boundary,
            args=args,
            work=work,
            deadline=deadline,
            corpus=build_corpus(work),
        )
        missing = missing_private_names()
        for name in wanted:
            results.extend(run_check(name, ctx, missing))
            print(f"gpu_check: {name} done, {ctx.left_s():.0f} s left", file=sys.stderr)
    report = build_report(results, device=boundary.info(), budget_s=args.budget_s)
    _emit(report, args.out)
    return exits.OK if report["ok"] else exits.FAILED


def _is_wheel_option(argv: list[str], index: int) -> bool:
    """Whether ``argv[index]`` is ``--wheels``/``--site`` or its value."""
    options = ("--wheels", "--site")
    arg = argv[index]
    if arg in options or arg.startswith(tuple(f"{o}=" for o in options)):
        return True
    return index > 0 and argv[index - 1] in options


def _emit(report: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
