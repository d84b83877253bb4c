"""Recipes (training/recipes.py): every recipe builds and validates; the 8B/70B recipes have
8B/70B-class models (built on the meta device, no memory) that fit an 80 GB GPU under FSDP.

Run: ``.venv/bin/pytest tests/training/test_recipes.py`` (a few seconds).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from training.config import JobConfig
from training.exits import ConfigError
from training.model import Transformer, count_parameters
from training.recipes import RECIPES, Recipe, get_recipe, recipe_config

GPU_MEMORY_BYTES = 80e9  # H100 SXM (p5.48xlarge)
# fp32 master weights (4) + fp32 grads (4) + Adam exp_avg and exp_avg_sq (8) per parameter.
STATE_BYTES_PER_PARAM = 16


def test_expected_recipes_exist() -> None:
    assert {"debug_cpu", "p5_smoke", "p5_8b", "p5_70b"} <= set(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_builds_and_validates(name: str) -> None:
    recipe = get_recipe(name)
    assert recipe.name == name == recipe.config.recipe
    assert recipe.description
    assert recipe.nodes >= 1 and recipe.gpus_per_node >= 0
    # Re-running validation on a copy of every section must not raise.
    config = recipe.config
    rebuilt = JobConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(JobConfig)})
    assert rebuilt == config
    for section in ("model", "data", "train", "optim", "parallel", "checkpoint", "resilience"):
        value = getattr(config, section)
        assert dataclasses.replace(value) == value
    assert config.model.max_seq_len >= config.data.seq_len


def test_recipe_config_and_unknown_recipe() -> None:
    assert recipe_config("debug_cpu", run_dir="/tmp/x").run_dir == "/tmp/x"
    assert recipe_config("debug_cpu") == RECIPES["debug_cpu"].config
    with pytest.raises(ConfigError) as info:
        get_recipe("p5_405b")
    assert info.value.field_path == "recipe"
    assert "debug_cpu" in str(info.value)


def test_debug_cpu_runs_on_cpu() -> None:
    config = RECIPES["debug_cpu"].config
    assert config.parallel.device == "cpu"
    assert config.parallel.mixed_precision == "fp32"
    assert RECIPES["debug_cpu"].gpus_per_node == 0


def _meta_params(recipe: Recipe) -> int:
    with torch.device("meta"):
        model = Transformer(recipe.config.model)
    assert all(p.device.type == "meta" for p in model.parameters())
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("p5_smoke", 7.5e9, 8.5e9), ("p5_8b", 7.5e9, 8.5e9), ("p5_70b", 69e9, 72e9)],
)
def test_large_recipe_sizes_and_memory(name: str, low: float, high: float) -> None:
    recipe = get_recipe(name)
    config = recipe.config
    numel = _meta_params(recipe)
    assert low < numel < high, f"{name}: {numel / 1e9:.2f}B parameters"
    assert count_parameters(config.model) == numel
    assert config.parallel.device == "cuda"
    assert config.parallel.mixed_precision == "bf16"
    assert config.parallel.meta_init, "large models must be materialised shard by shard"
    gpus = recipe.nodes * 8
    assert recipe.gpus_per_node == 8
    per_gpu = numel * STATE_BYTES_PER_PARAM / gpus
    assert per_gpu < GPU_MEMORY_BYTES, f"{name}: {per_gpu / 1e9:.1f} GB per GPU"


def test_llama3_exact_parameter_counts() -> None:
    """The published Llama 3 sizes (tied nothing, vocab 128256)."""
    assert count_parameters(RECIPES["p5_8b"].config.model) == 8_030_261_248
    assert count_parameters(RECIPES["p5_70b"].config.model) == 70_553_706_496
