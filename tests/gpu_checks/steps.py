"""The training-step checks: ``fsdp_step`` (an FSDP2 step of an 8B-class slice: time, MFU,
memory) and ``ac_compile`` (full recompute against compile + selective checkpointing)."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from gpu_checks.core import Boundary, Context, Skip

COMPILE_ON_GPU = "torch.compile per block is a GPU option (config refuses it on CPU)"


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
        boundary.cannot(COMPILE_ON_GPU)
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
