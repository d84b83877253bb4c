"""The device check: everything in this project that needs a GPU, in one run of at most 8 minutes
on one H100 or H200, offline, ending in one JSON report (stdout, and ``--out``).

Run: ``make gpu-check`` on the lent machine (docs/gpu.md): its own ``python3`` and torch, the
carried wheels (``make gpu-wheels``: NVRx, ISA-L, defusedxml) installed with ``--no-index
--target``; nothing is fetched. The machine's torch may differ from the pin (2.11.0+cu130 there,
2.13.0 here): the ``environment`` check says so, and looks up every private torch name the trainer
uses; a check that needs a missing one is skipped with that name as its reason.

The checks are the rows of ``CHECKS`` below (their functions are in tests/gpu_checks/): the row
order is the run's order and the report's, and the list at the end of this docstring and
``--list`` are printed from it. Each is bounded by what is left of ``--budget-s`` and gets a
verdict.

The device boundary: ``GPU_CHECK_FAKE_CUDA=1`` runs every check on CPU ranks with gloo and fp32
in place of CUDA, NCCL and bf16 (tests/training/test_gpu_check.py, so that the check's own code
runs in CI); what CPU cannot do is named in the report (a row's ``needs_gpu``, and
``torch.compile`` inside ``ac_compile``). ``fake_cuda`` in the report says which it was.

Without CUDA (and without the fake) it refuses at once: exit code ``training.exits.ENVIRONMENT``.
Exit code 0 only when every check that ran passed.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gpu_checks.checkpoints import (
    check_local_checkpoint,
    check_memory_snapshot,
    check_nvrx_snapshot,
    check_peer_exchange,
    check_pod_memory_snapshot,
    check_torch_async,
)
from gpu_checks.core import (
    FAKE_ENV,
    REPO_ROOT,
    Boundary,
    CheckResult,
    Context,
    Skip,
    build_corpus,
)
from gpu_checks.environment import (
    blocked_by_missing_names,
    check_environment,
    missing_private_names,
)
from gpu_checks.gpu_tests import parse_junit, run_gpu_tests
from gpu_checks.restart import check_inprocess_restart
from gpu_checks.steps import check_ac_compile, check_fsdp_step

# Run as `python tests/gpu_check.py` with nothing installed: the checks import training/ from
# the repository (gpu_checks, beside this file, imports only the standard library at first).
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

__all__ = ["FAKE_ENV", "CheckResult", "main", "missing_private_names", "parse_junit"]

DEFAULT_BUDGET_S = 480.0  # 8 minutes on one H100/H200, all checks together

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
"""The gpu-marked tests that no other check stands for: ``pytest_gpu`` runs them."""


@dataclass(frozen=True, kw_only=True)
class Check:
    """One row of the device check."""

    name: str
    proves: str
    """What a pass shows (the docstring's list, ``--list`` and the report's ``proves``)."""
    run: Callable[[Context], dict[str, Any] | list[CheckResult]]
    """The check: a detail dict with ``ok``, or (``pytest_gpu``) one result per test."""
    needs_gpu: str | None = None
    """None: the CPU stand-in runs it too; else why only a GPU can, the stand-in's skip reason."""
    tests: tuple[str, ...] = ()
    """The gpu-marked tests (node ids) it runs, or whose subject it runs: every gpu-marked test
    is in exactly one row (tests/training/test_gpu_check.py)."""


GPU_RESILIENCE = "tests/training/resilience/test_gpu_resilience.py::"
CHECKS: tuple[Check, ...] = (
    Check(
        name="environment",
        proves="torch against the pin, every private torch name the trainer uses present, "
        "NVRx, ISA-L and defusedxml importable (from the carried wheels) and NVRx's modules "
        "importable against this torch.",
        run=check_environment,
    ),
    Check(
        name="fsdp_step",
        proves="an FSDP2 bf16 training step of an 8B-class slice (Llama-3-8B's width, "
        "vocabulary and 4k sequence, ``--layers`` blocks, the p5_8b recipe's parallel "
        "settings) at world size 1 gives finite losses: step time, tokens/s, MFU and peak "
        "memory. MFU counts FLOPs as torchtitan does (``training.model.flops_per_token``: "
        "6N + 12LHQT, the causal mask NOT halved); the report gives the halved figure beside it.",
        run=check_fsdp_step,
        tests=("tests/training/test_parallel.py::test_cuda_bf16_fsdp_step",),
    ),
    Check(
        name="ac_compile",
        proves="``torch.compile`` + selective activation checkpointing beats full recompute "
        "on ``--ac-layers`` blocks of the same width: peak memory and step time of each.",
        run=check_ac_compile,
    ),
    Check(
        name="memory_snapshot",
        proves="a memory snapshot of device tensors (side stream, pinned buffers), the state "
        "changed in place after it, is restored exactly.",
        run=check_memory_snapshot,
    ),
    Check(
        name="pod_memory_snapshot",
        proves="a pod-memory snapshot (``/dev/shm``) of ~1 GiB of device state: ``prepare`` "
        "(slots mapped, ``cudaHostRegister`` on a thread bound to the GPU), the first ``take`` "
        "(waits for the registration), the state changed in place after ``before_update``, "
        "published, is restored exactly; the times of prepare, the first and the second take.",
        run=check_pod_memory_snapshot,
    ),
    Check(
        name="peer_exchange",
        proves="tests/training/probes/peer_probe.py, two gloo ranks with CUDA state (one GPU "
        "cannot host two NCCL ranks): pod-memory snapshots, the exchange on its own thread and "
        "group while the ranks go on changing their state, then a lost node's shard restored "
        "from its peer, bit for bit.",
        run=check_peer_exchange,
    ),
    Check(
        name="nvrx_snapshot",
        proves="tests/training/probes/snapshot_probe.py under torchrun on the GPUs there are "
        "(1 or 2): an NVRx asynchronous save with the state changed right after the call "
        "loads back equal; the cached and prepared plans write the same bytes; a damaged "
        "shard (the last rank's) is rejected and the previous checkpoint loaded.",
        run=check_nvrx_snapshot,
        tests=(f"{GPU_RESILIENCE}test_nvrx_async_save_is_an_exact_snapshot_on_cuda",),
    ),
    Check(
        name="torch_async",
        proves='the same probe with torch\'s ``async_save`` over "cpu:gloo,cuda:nccl".',
        run=check_torch_async,
    ),
    Check(
        name="local_checkpoint",
        proves="NVRx local checkpoints every 3 steps; with the shared ones removed, a rerun "
        "restores step 6 from the local tier and ends at the same state.",
        run=check_local_checkpoint,
        needs_gpu="NVRx local checkpoints take CUDA tensors only (BasicTensorAwareStateDict)",
        tests=(f"{GPU_RESILIENCE}test_local_checkpoint_is_preferred_when_newer",),
    ),
    Check(
        name="inprocess_restart",
        proves="``python -m training.launch.local --restart=inprocess`` restarts in process "
        "after an exception, then after ``hang_kernel`` (a spinning CUDA kernel and a "
        "synchronize: the rank sits in C++); the calibrated hang detection's time, both "
        "restarts' times.",
        run=check_inprocess_restart,
        tests=(f"{GPU_RESILIENCE}test_inprocess_restart_on_nccl_with_cuda_health_check",),
    ),
    Check(
        name="pytest_gpu",
        proves="the ``gpu``-marked tests no other row stands for pass, one entry each.",
        run=functools.partial(run_gpu_tests, tests=GPU_TESTS),
        tests=GPU_TESTS,
    ),
)
CHECK_NAMES = tuple(check.name for check in CHECKS)
BY_NAME = {check.name: check for check in CHECKS}


def checks_list() -> str:
    """The rows as the docstring and ``--list`` show them."""
    lines = []
    for check in CHECKS:
        gpu = f" GPU only: {check.needs_gpu}." if check.needs_gpu else ""
        text = f"- ``{check.name}``: {check.proves}{gpu}"
        lines.append(textwrap.fill(text, width=100, subsequent_indent="  "))
    return "\n".join(lines)


__doc__ += f"\nChecks, in order:\n{checks_list()}\n"


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
    parser.add_argument("--only", choices=CHECK_NAMES, action="append", help="run only these")
    parser.add_argument("--list", action="store_true", help="print the checks and exit")
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


# --- the run ------------------------------------------------------------------------------------

MIN_LEFT_S = 20.0
"""A check starts only with at least this much of the budget left."""


def run_check(name: str, ctx: Context | None, missing: dict[str, str]) -> list[CheckResult]:
    """The row ``name``: skipped when this torch lacks a private name it needs (before anything
    else, so ``ctx`` may be None then) or on the CPU stand-in when it needs a GPU; failed when
    the budget is spent; else run, its errors reported."""
    check = BY_NAME[name]
    started = time.perf_counter()

    def result(**kwargs: Any) -> list[CheckResult]:
        seconds = round(time.perf_counter() - started, 1)
        return [CheckResult(name=name, proves=check.proves, seconds=seconds, **kwargs)]

    blocked = blocked_by_missing_names(name, missing)
    if blocked:
        reason = f"torch {_torch_version()} lacks {', '.join(blocked)}"
        return result(ok=True, skipped=True, detail={"reason": reason})
    left = ctx.left_s()
    if left < MIN_LEFT_S:
        return result(ok=False, detail={"message": f"budget spent ({left:.0f} s left)"})
    try:
        if check.needs_gpu:
            ctx.boundary.cannot(check.needs_gpu)
        detail = check.run(ctx)
    except Skip as why:
        return result(ok=True, skipped=True, detail={"reason": str(why)})
    except Exception as err:  # report, and go on with the other checks
        return result(ok=False, detail={"error": f"{type(err).__name__}: {err}"[:2000]})
    finally:
        _release_device(ctx.boundary)
    if isinstance(detail, list):  # one result per test
        return detail
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
    from training import exits

    if args.list:
        print(checks_list())
        return exits.OK
    if args.wheels is not None:  # install, then run again with the wheels importable
        env = install_wheels(args.wheels, args.site)
        rest = [a for i, a in enumerate(argv) if not _is_wheel_option(argv, i)]
        return subprocess.run([sys.executable, __file__, *rest], env=env).returncode

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
    wanted = [c for c in CHECK_NAMES if c in set(args.only or CHECK_NAMES)]
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
