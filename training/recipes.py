"""Named recipes: complete, validated starting points that command-line overrides adjust.

- ``debug_cpu``: a tiny model on CPU ranks with gloo; what ``make train`` runs.
- ``p5_smoke``: one p5.48xlarge (8 H100), an 8B-class Llama, short: proves the cluster end to end.
- ``p5_8b``: the 8B-class model across several p5 nodes.
- ``p5_70b``: a 70B-class Llama across 16 p5 nodes (128 GPUs).

The large recipes are validated here (shapes, parameter counts, memory per GPU) and run on GPUs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from training.config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ResilienceConfig,
    TrainConfig,
)


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """A named configuration and the cluster shape it was sized for."""

    name: str
    description: str
    config: JobConfig
    nodes: int
    """Nodes the recipe is sized for (informational; any world size >= 1 works)."""
    gpus_per_node: int
    """0 for CPU recipes."""


LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    dim=4096,
    n_layers=32,
    n_heads=32,
    n_kv_heads=8,
    ffn_hidden=14336,
    max_seq_len=8192,
    rope_theta=500000.0,
)
LLAMA3_70B = ModelConfig(
    vocab_size=128256,
    dim=8192,
    n_layers=80,
    n_heads=64,
    n_kv_heads=8,
    ffn_hidden=28672,
    max_seq_len=8192,
    rope_theta=500000.0,
)

_GPU_PARALLEL = ParallelConfig(
    device="cuda",
    mixed_precision="bf16",
    activation_checkpointing=True,
    loss_chunk_tokens=1024,  # 128k vocabulary: 0.8 GB of logits per chunk instead of 6.3 GB
    meta_init=True,
    pg_timeout_s=1800.0,
)
_GPU_RESILIENCE = ResilienceConfig(
    restart="injob",
    max_restarts=20,
    soft_timeout_s=120.0,
    hard_timeout_s=300.0,
    heartbeat_timeout_s=300.0,
    initial_heartbeat_timeout_s=1800.0,  # image warm-up, NCCL init over EFA, 70B checkpoint load
    join_timeout_s=1800.0,  # every node of the Job scheduled and its image pulled
    step_section_timeout_s=600.0,
    checkpoint_section_timeout_s=1800.0,
    calibrate_timeouts_after=50,
)


def _p5_recipe(
    *,
    name: str,
    description: str,
    job: str,
    model: ModelConfig,
    nodes: int,
    seq_len: int,
    steps: int,
    lr: float,
    warmup: int,
    log_every: int,
    interval: int,
    local_interval: int,
    parallel: ParallelConfig = _GPU_PARALLEL,
) -> Recipe:
    """A p5.48xlarge recipe: data, runs and shared checkpoints on FSx under ``job``, local
    checkpoints on the node's NVMe (/scratch), bf16 FSDP2 with in-job restart."""
    return Recipe(
        name=name,
        description=description,
        config=JobConfig(
            recipe=name,
            run_dir=f"/fsx/runs/{job}",
            model=model,
            data=DataConfig(path="/fsx/data/stdlib", seq_len=seq_len),
            train=TrainConfig(steps=steps, micro_batch_size=1, log_every=log_every),
            optim=OptimConfig(lr=lr, warmup_steps=warmup),
            parallel=parallel,
            checkpoint=CheckpointConfig(
                dir=f"/fsx/checkpoints/{job}",
                interval=interval,
                local_dir="/scratch/checkpoints",
                local_interval=local_interval,
                # Restarts that keep the pod (nested, the overlays' default) restore from the
                # pod's memory, every half local interval (save steps included).
                memory_interval=max(1, local_interval // 2),
            ),
            resilience=_GPU_RESILIENCE,
        ),
        nodes=nodes,
        gpus_per_node=8,
    )


_RECIPES: tuple[Recipe, ...] = (
    Recipe(
        name="debug_cpu",
        description="Tiny Llama on CPU ranks (gloo, fp32); a few hundred steps in minutes.",
        config=JobConfig(
            recipe="debug_cpu",
            parallel=ParallelConfig(device="cpu", mixed_precision="fp32"),
            # Restarts that keep the pod restore a snapshot at most 10 steps old from /dev/shm
            # (pod_memory.py; training.modes.snapshot_plan).
            checkpoint=CheckpointConfig(memory_interval=10),
        ),
        nodes=1,
        gpus_per_node=0,
    ),
    _p5_recipe(
        name="p5_smoke",
        description="One p5.48xlarge, 8B-class Llama, 50 steps: proves GPUs, EFA and FSx.",
        job="smoke",
        model=LLAMA3_8B,
        nodes=1,
        seq_len=4096,
        steps=50,
        lr=3e-4,
        warmup=10,
        log_every=5,
        interval=25,
        local_interval=10,
        # No compile: the smoke run's point is a fast start (compiling 32 blocks costs minutes).
    ),
    _p5_recipe(
        name="p5_8b",
        description="8B-class Llama across p5 nodes (FSDP2 over NCCL/EFA).",
        job="llama8b",
        model=LLAMA3_8B,
        nodes=2,
        seq_len=8192,
        steps=10000,
        lr=3e-4,
        warmup=200,
        log_every=10,
        interval=200,
        local_interval=50,
        # 8B: selective recompute keeps ~25 GB of matmul outputs per GPU at 8k tokens (estimate),
        # well within 80 GB; compiled blocks pay their start-up once.
        parallel=dataclasses.replace(
            _GPU_PARALLEL, activation_checkpointing_mode="selective", compile=True
        ),
    ),
    _p5_recipe(
        name="p5_70b",
        description="70B-class Llama across 16 p5 nodes (128 H100).",
        job="llama70b",
        model=LLAMA3_70B,
        nodes=16,
        seq_len=8192,
        steps=20000,
        lr=1.5e-4,
        warmup=500,
        log_every=10,
        interval=100,
        local_interval=25,
        # 70B at 8k tokens on 128 GPUs needs full recompute to fit; compile still pays.
        parallel=dataclasses.replace(_GPU_PARALLEL, compile=True),
    ),
)

RECIPES: dict[str, Recipe] = {r.name: r for r in _RECIPES}


def get_recipe(name: str) -> Recipe:
    from training.exits import ConfigError

    if name not in RECIPES:
        raise ConfigError("recipe", f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_config(name: str, *, run_dir: str | None = None) -> JobConfig:
    config = get_recipe(name).config
    return dataclasses.replace(config, run_dir=run_dir) if run_dir else config
