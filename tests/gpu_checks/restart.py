"""The ``inprocess_restart`` check: NVRx's in-process restart after an exception and after a
rank hung in a CUDA kernel."""

from __future__ import annotations

import sys
from typing import Any

from gpu_checks.core import Context, read_events, run_child, tail, tiny_model_args


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
