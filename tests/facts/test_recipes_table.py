"""facts/recipes.py against the real recipes: the one owner's guard. Each GPU recipe's model is
built on the meta device (no memory), given an AdamW step, and its model + optimizer state dict
is measured; the table the CDK stack sizes FSx from must match it.

Run: ``.venv/bin/pytest tests/facts`` (a few seconds).
"""

from __future__ import annotations

import pytest
import torch

from facts import checkpoint, recipes
from training.model import Transformer, count_parameters, flops_per_token
from training.recipes import RECIPES


def checkpointed_bytes(name: str) -> tuple[int, int]:
    """(parameters, bytes of fp32 tensors in the model + AdamW state dicts) of a recipe."""
    config = RECIPES[name].config
    with torch.device("meta"):
        model = Transformer(config.model)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    tensors = list(model.state_dict().values()) + [
        t
        for state in optimizer.state_dict()["state"].values()
        for k, t in state.items()
        if k != "step"
    ]
    return sum(p.numel() for p in params), sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("name", sorted(recipes.RECIPES))
def test_table_matches_the_recipe(name: str) -> None:
    row, recipe = recipes.RECIPES[name], RECIPES[name].config
    params, state_bytes = checkpointed_bytes(name)
    assert row.params == params == count_parameters(recipe.model)
    assert state_bytes == checkpoint.BYTES_PER_PARAM * params == row.checkpoint_bytes
    assert row.keep_last == recipe.checkpoint.keep_last
    assert row.checkpoint_interval_steps == recipe.checkpoint.interval
    tokens = recipe.train.micro_batch_size * recipe.train.grad_accum_steps * recipe.data.seq_len
    assert row.tokens_per_gpu_step == tokens
    assert row.flops_per_token == flops_per_token(recipe.model, seq_len=recipe.data.seq_len)


def test_every_gpu_recipe_is_in_the_table() -> None:
    gpu = {name for name, r in RECIPES.items() if r.gpus_per_node > 0}
    assert gpu == set(recipes.RECIPES)


def test_interval_in_seconds() -> None:
    row = recipes.RECIPES["p5_70b"]
    # 6N-style FLOPs x 8192 tokens at half of 989 TFLOP/s: about 8 s a step, 100 steps apart.
    assert 7 < row.step_time_s < 9
    assert row.checkpoint_interval_s == pytest.approx(100 * row.step_time_s)
