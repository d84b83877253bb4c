"""The device check: everything in this project that needs a GPU, in one run of at most 8 minutes
on one H200 (or H100), with no network and its own small data. Prints one JSON report.

Run: ``make gpu-check`` (or ``.venv/bin/python tests/gpu_check.py [--out report.json]``).

Checks, in order (each bounded by what is left of ``--budget-s``):
- ``fsdp_step``: an FSDP2 bf16 training step of an 8B-class model slice (Llama-3-8B's width,
  vocabulary and 4k sequence, ``--layers`` blocks) at world size 1: step time, tokens/s, MFU
  (training.model.flops_per_token against training.runlog.metrics.PEAK_BF16_FLOPS) and peak memory.
- ``pytest_gpu``: the ``gpu``-marked tests (tests/training): the NVRx async save from CUDA with
  the snapshot probe (tensors mutated right after save returns; the loaded checkpoint equals
  the state at save), the local (NVMe-tier) checkpoint save and restore, a memory snapshot of
  CUDA tensors (pinned buffers, asynchronous copy, restored), the in-process restart
  with the CUDA health check and NCCL abort at world size 1, the CUDA FSDP step. One entry per
  test, from pytest's JUnit XML.

Without CUDA it refuses at once: the report says why and the exit code is
``training.exits.ENVIRONMENT``. Exit code 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET_S = 480.0  # 8 minutes on one H200, all checks together


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    name: str
    ok: bool
    seconds: float
    detail: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument(
        "--budget-s", type=float, default=DEFAULT_BUDGET_S, help="wall-clock budget, all checks"
    )
    parser.add_argument("--layers", type=int, default=4, help="blocks in the 8B-class slice")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=4, help="timed steps (after one warm-up)")
    parser.add_argument(
        "--only", choices=("fsdp_step", "pytest_gpu"), action="append", help="run only these"
    )
    args = parser.parse_args(argv)
    if args.budget_s <= 0 or args.layers < 1 or args.steps < 1 or args.seq_len < 16:
        parser.error("--budget-s, --layers, --steps must be positive and --seq-len >= 16")
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


def device_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        info.update(
            name=torch.cuda.get_device_name(0),
            count=torch.cuda.device_count(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
        )
    return info


# --- checks -----------------------------------------------------------------------------------


def check_fsdp_step(*, layers: int, seq_len: int, steps: int) -> CheckResult:
    """FSDP2 bf16 step of an 8B-class slice at world size 1 (NCCL group, one GPU)."""
    import dataclasses
    import datetime

    import torch
    import torch.distributed as dist

    from training.model import Transformer, count_parameters, flops_per_token
    from training.parallel import DistEnv, build_sharded_model
    from training.recipes import LLAMA3_8B, get_recipe
    from training.runlog.metrics import peak_flops_for

    started = time.perf_counter()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    model_config = dataclasses.replace(LLAMA3_8B, n_layers=layers, max_seq_len=seq_len)
    store = dist.HashStore()
    dist.init_process_group(
        "nccl",
        store=store,
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=120),
        device_id=device,
    )
    try:
        env = DistEnv(rank=0, world_size=1, local_rank=0, device=device, backend="nccl")
        # The 8B recipe's own parallel settings (selective recompute, chunked loss), compile off:
        # its warm-up would take most of the check's time budget.
        parallel = dataclasses.replace(get_recipe("p5_8b").parallel, compile=False)
        model, _ = build_sharded_model(
            lambda: Transformer(model_config), config=parallel, env=env, seed=0
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        tokens = torch.randint(0, model_config.vocab_size, (1, seq_len + 1), device=device)

        def step() -> float:
            loss = model(
                tokens[:, :-1], tokens[:, 1:], loss_chunk_tokens=parallel.loss_chunk_tokens
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.item()

        first_loss = step()  # warm-up: allocator, NCCL, kernels
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        losses = [step() for _ in range(steps)]
        torch.cuda.synchronize()
        step_s = (time.perf_counter() - t0) / steps
        tokens_per_s = seq_len / step_s
        peak = peak_flops_for(device)
        fpt = flops_per_token(model_config, seq_len=seq_len)
        mfu = tokens_per_s * fpt / peak if peak else None
        finite = all(math.isfinite(x) for x in [first_loss, *losses])
        detail = {
            "layers": layers,
            "parameters": count_parameters(model_config),
            "seq_len": seq_len,
            "step_s": round(step_s, 4),
            "tokens_per_s": round(tokens_per_s, 1),
            "flops_per_token": fpt,
            "mfu": round(mfu, 4) if mfu is not None else None,
            "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "losses": [round(x, 4) for x in [first_loss, *losses]],
        }
        return CheckResult(
            name="fsdp_step",
            ok=finite,
            seconds=round(time.perf_counter() - started, 1),
            detail=detail,
        )
    finally:
        dist.destroy_process_group()


def check_pytest_gpu(*, timeout_s: float) -> list[CheckResult]:
    """The ``gpu``-marked tests, in a child pytest (its own CUDA contexts and processes)."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "tests/training",
        ]
        try:
            proc = subprocess.run(
                command,
                cwd=REPO_ROOT,
                capture_output=True,
                text=True,
                timeout=timeout_s,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        except subprocess.TimeoutExpired:
            return [
                CheckResult(
                    name="pytest_gpu",
                    ok=False,
                    seconds=round(time.perf_counter() - started, 1),
                    detail={"message": f"timed out after {timeout_s:.0f} s"},
                )
            ]
        if not junit.exists():
            return [
                CheckResult(
                    name="pytest_gpu",
                    ok=False,
                    seconds=round(time.perf_counter() - started, 1),
                    detail={"returncode": proc.returncode, "tail": proc.stdout[-3000:]},
                )
            ]
        results = parse_junit(junit.read_text())
    if not results:
        results = [
            CheckResult(name="pytest_gpu", ok=False, seconds=0.0, detail={"tail": "no test"})
        ]
    return results


def main(argv: list[str] | None = None) -> int:
    from training import exits

    args = parse_args(argv)
    deadline = time.monotonic() + args.budget_s
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError as err:  # pragma: no cover - the venv always has torch
        cuda, torch = False, None
        print(f"torch is not importable: {err}", file=sys.stderr)
    if not cuda:
        report = build_report(
            [],
            device=device_info() if torch else {},
            budget_s=args.budget_s,
            error="no CUDA device (torch.cuda.is_available() is False): run this on a GPU host",
        )
        _emit(report, args.out)
        return exits.ENVIRONMENT
    wanted = set(args.only or ("fsdp_step", "pytest_gpu"))
    results: list[CheckResult] = []
    if "fsdp_step" in wanted:
        try:
            results.append(
                check_fsdp_step(layers=args.layers, seq_len=args.seq_len, steps=args.steps)
            )
        except Exception as err:  # report, and go on with the other checks
            results.append(
                CheckResult(name="fsdp_step", ok=False, seconds=0.0, detail={"error": repr(err)})
            )
        torch.cuda.empty_cache()
    if "pytest_gpu" in wanted:
        left = deadline - time.monotonic()
        if left < 30:
            results.append(
                CheckResult(
                    name="pytest_gpu",
                    ok=False,
                    seconds=0.0,
                    detail={"message": f"budget spent ({left:.0f} s left)"},
                )
            )
        else:
            results.extend(check_pytest_gpu(timeout_s=left))
    report = build_report(results, device=device_info(), budget_s=args.budget_s)
    _emit(report, args.out)
    return exits.OK if report["ok"] else exits.FAILED


def _emit(report: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text, flush=True)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
