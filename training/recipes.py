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
    meta_init=True,
    pg_timeout_s=1800.0,
)
_GPU_RESILIENCE = ResilienceConfig(
    restart="injob",
    max_restarts=20,
    soft_timeout_s=120.0,
    hard_timeout_s=300.0,
    heartbeat_timeout_s=300.0,
    step_section_timeout_s=600.0,
    checkpoint_section_timeout_s=1800.0,
    calibrate_timeouts_after=50,
)

_RECIPES: tuple[Recipe, ...] = (
    Recipe(
        name="debug_cpu",
        description="Tiny Llama on CPU ranks (gloo, fp32); a few hundred steps in minutes.",
        config=JobConfig(
            recipe="debug_cpu",
            parallel=ParallelConfig(device="cpu", mixed_precision="fp32"),
        ),
        nodes=1,
        gpus_per_node=0,
    ),
    Recipe(
        name="p5_smoke",
        description="One p5.48xlarge, 8B-class Llama, 50 steps: proves GPUs, EFA and FSx.",
        config=JobConfig(
            recipe="p5_smoke",
            run_dir="/fsx/runs/smoke",
            model=LLAMA3_8B,
            data=DataConfig(path="/fsx/data/stdlib", seq_len=4096),
            train=TrainConfig(steps=50, micro_batch_size=1, log_every=5),
            optim=OptimConfig(lr=3e-4, warmup_steps=10),
            parallel=_GPU_PARALLEL,
            checkpoint=CheckpointConfig(
                dir="/fsx/checkpoints/smoke",
                interval=25,
                local_dir="/scratch/checkpoints",
                local_interval=10,
            ),
            resilience=_GPU_RESILIENCE,
        ),
        nodes=1,
        gpus_per_node=8,
    ),
    Recipe(
        name="p5_8b",
        description="8B-class Llama across p5 nodes (FSDP2 over NCCL/EFA).",
        config=JobConfig(
            recipe="p5_8b",
            run_dir="/fsx/runs/llama8b",
            model=LLAMA3_8B,
            data=DataConfig(path="/fsx/data/stdlib", seq_len=8192),
            train=TrainConfig(steps=10000, micro_batch_size=1, log_every=10),
            optim=OptimConfig(lr=3e-4, warmup_steps=200),
            parallel=_GPU_PARALLEL,
            checkpoint=CheckpointConfig(
                dir="/fsx/checkpoints/llama8b",
                interval=200,
                local_dir="/scratch/checkpoints",
                local_interval=50,
            ),
            resilience=_GPU_RESILIENCE,
        ),
        nodes=2,
        gpus_per_node=8,
    ),
    Recipe(
        name="p5_70b",
        description="70B-class Llama across 16 p5 nodes (128 H100).",
        config=JobConfig(
            recipe="p5_70b",
            run_dir="/fsx/runs/llama70b",
            model=LLAMA3_70B,
            data=DataConfig(path="/fsx/data/stdlib", seq_len=8192),
            train=TrainConfig(steps=20000, micro_batch_size=1, log_every=10),
            optim=OptimConfig(lr=1.5e-4, warmup_steps=500),
            parallel=_GPU_PARALLEL,
            checkpoint=CheckpointConfig(
                dir="/fsx/checkpoints/llama70b",
                interval=100,
                local_dir="/scratch/checkpoints",
                local_interval=25,
            ),
            resilience=_GPU_RESILIENCE,
        ),
        nodes=16,
        gpus_per_node=8,
    ),
)

RECIPES: dict[str, Recipe] = {r.name: r for r in _RECIPES}


def get_recipe(name: str) -> Recipe:
    from training.config import ConfigError

    if name not in RECIPES:
        raise ConfigError("recipe", f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name]


def recipe_config(name: str, *, run_dir: str | None = None) -> JobConfig:
    config = get_recipe(name).config
    return dataclasses.replace(config, run_dir=run_dir) if run_dir else config
