"""Typed config (training/config.py): validation names the field, overrides coerce types,
unknown sections and fields are rejected.

Run: ``.venv/bin/pytest tests/training/test_config.py`` (about a second).
"""

from __future__ import annotations

import dataclasses

import pytest

from training.config import (
    CheckpointConfig,
    ConfigError,
    DataConfig,
    JobConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ResilienceConfig,
    TrainConfig,
    apply_overrides,
    to_dict,
)

BASE = JobConfig()


@pytest.mark.parametrize(
    ("cls", "kwargs", "path", "words"),
    [
        (ModelConfig, {"dim": 0}, "model.dim", ">= 1"),
        (ModelConfig, {"n_layers": -1}, "model.n_layers", ">= 1"),
        (ModelConfig, {"n_heads": 3}, "model.n_heads", "must divide model.dim=128"),
        (ModelConfig, {"n_kv_heads": 3}, "model.n_kv_heads", "must divide model.n_heads=4"),
        (ModelConfig, {"dim": 12, "n_heads": 4, "n_kv_heads": 1}, "model.dim", "even"),
        (ModelConfig, {"ffn_hidden": -5}, "model.ffn_hidden", ">= 0"),
        (ModelConfig, {"norm_eps": 0.0}, "model.norm_eps", "(0, 1)"),
        (ModelConfig, {"rope_theta": -1.0}, "model.rope_theta", "> 0"),
        (DataConfig, {"path": ""}, "data.path", "empty"),
        (DataConfig, {"seq_len": 1}, "data.seq_len", ">= 2"),
        (TrainConfig, {"steps": 0}, "train.steps", ">= 1, got 0"),
        (TrainConfig, {"micro_batch_size": 0}, "train.micro_batch_size", ">= 1"),
        (TrainConfig, {"grad_accum_steps": 0}, "train.grad_accum_steps", ">= 1"),
        (TrainConfig, {"seed": -1}, "train.seed", ">= 0"),
        (OptimConfig, {"lr": 0.0}, "optim.lr", "> 0"),
        (OptimConfig, {"min_lr_ratio": 1.5}, "optim.min_lr_ratio", "[0, 1]"),
        (OptimConfig, {"beta2": 1.0}, "optim.beta2", "[0, 1)"),
        (OptimConfig, {"grad_clip": -1.0}, "optim.grad_clip", ">= 0"),
        (OptimConfig, {"warmup_steps": -1}, "optim.warmup_steps", ">= 0"),
        (ParallelConfig, {"cpu_threads": 0}, "parallel.cpu_threads", ">= 1"),
        (ParallelConfig, {"pg_timeout_s": 0.0}, "parallel.pg_timeout_s", "> 0"),
        (CheckpointConfig, {"interval": -1}, "checkpoint.interval", ">= 0"),
        (CheckpointConfig, {"keep_last": 0}, "checkpoint.keep_last", ">= 1"),
        (CheckpointConfig, {"keep_every": -2}, "checkpoint.keep_every", ">= 0"),
        (ResilienceConfig, {"max_restarts": -1}, "resilience.max_restarts", ">= 0"),
        (ResilienceConfig, {"soft_timeout_s": 0.0}, "resilience.soft_timeout_s", "> 0"),
        (ResilienceConfig, {"hard_timeout_s": -1.0}, "resilience.hard_timeout_s", "> 0"),
    ],
)
def test_bad_values_name_the_field(cls: type, kwargs: dict, path: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        cls(**kwargs)
    assert info.value.field_path == path
    message = str(info.value)
    assert message.startswith(f"config error: {path}: ")
    assert words in message
    assert "\n" not in message


def test_job_level_checks() -> None:
    with pytest.raises(ConfigError) as info:
        JobConfig(model=ModelConfig(max_seq_len=64), data=DataConfig(seq_len=128))
    assert info.value.field_path == "model.max_seq_len"
    assert "data.seq_len=128" in str(info.value)
    with pytest.raises(ConfigError) as info:
        JobConfig(run_dir="")
    assert info.value.field_path == "job.run_dir"


def test_defaults_validate_and_checkpoint_dir() -> None:
    assert BASE.checkpoint_dir == "runs/local/checkpoints"
    custom = dataclasses.replace(BASE, checkpoint=CheckpointConfig(dir="/fsx/ck"))
    assert custom.checkpoint_dir == "/fsx/ck"
    assert to_dict(BASE)["train"]["steps"] == BASE.train.steps


def test_overrides_coerce_types() -> None:
    config = apply_overrides(
        BASE,
        {
            "train.steps": "1e3",
            "train.micro_batch_size": "2",
            "optim.lr": "5e-4",
            "optim.beta1": "0.8",
            "data.shuffle": "false",
            "parallel.activation_checkpointing": "yes",
            "parallel.device": "cpu",
            "checkpoint.engine": "sync",
            "resilience.restart": "inprocess",
            "train.progress": "plain",
            "run_dir": "/tmp/run",
            "data.path": "/data/x",
        },
    )
    assert config.train.steps == 1000 and isinstance(config.train.steps, int)
    assert config.train.micro_batch_size == 2
    assert config.optim.lr == 5e-4 and isinstance(config.optim.lr, float)
    assert config.optim.beta1 == 0.8
    assert config.data.shuffle is False
    assert config.parallel.activation_checkpointing is True
    assert config.parallel.device == "cpu"
    assert config.checkpoint.engine == "sync"
    assert config.resilience.restart == "inprocess"
    assert config.train.progress == "plain"
    assert config.run_dir == "/tmp/run"
    assert config.data.path == "/data/x"
    # Untouched fields keep their values, the input is not modified.
    assert config.model == BASE.model
    assert BASE.train.steps == 300


@pytest.mark.parametrize("value", ["1", "true", "True", "on", "YES"])
def test_bool_true_spellings(value: str) -> None:
    assert apply_overrides(BASE, {"data.shuffle": value}).data.shuffle is True


@pytest.mark.parametrize(
    ("overrides", "path", "words"),
    [
        ({"train.steps": "ten"}, "train.steps", "integer"),
        ({"train.steps": "1.5"}, "train.steps", "integer"),
        ({"train.micro_batch_size": "2.5e0"}, "train.micro_batch_size", "integer"),
        ({"train.seed": "1e-1"}, "train.seed", "integer"),
        ({"train.steps": "1e400"}, "train.steps", "integer"),
        ({"optim.lr": "fast"}, "optim.lr", "number"),
        ({"data.shuffle": "maybe"}, "data.shuffle", "true or false"),
        ({"parallel.device": "tpu"}, "parallel.device", "auto, cpu, cuda"),
        ({"checkpoint.engine": "s3"}, "checkpoint.engine", "nvrx, torch_async, sync"),
        ({"resilience.restart": "always"}, "resilience.restart", "none, injob, inprocess, nested"),
        ({"train.steps": "0"}, "train.steps", ">= 1"),
        ({"model.n_heads": "5"}, "model.n_heads", "must divide"),
        ({"data.seq_len": "512"}, "model.max_seq_len", "data.seq_len=512"),
        ({"bogus.field": "1"}, "bogus.field", "unknown section"),
        ({"train.stepz": "1"}, "train.stepz", "unknown field"),
        ({"steps": "1"}, "steps", "unknown setting"),
        ({"faults": "nonsense@@"}, "faults", "Format"),
    ],
)
def test_bad_overrides(overrides: dict, path: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(BASE, overrides)
    assert info.value.field_path == path
    assert words in str(info.value)


def test_unknown_field_lists_the_section_fields() -> None:
    with pytest.raises(ConfigError) as info:
        apply_overrides(BASE, {"optim.learning_rate": "1"})
    assert "lr" in str(info.value) and "warmup_steps" in str(info.value)


def test_configs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASE.train.steps = 5  # type: ignore[misc]


# --- a tier that would never take anything is refused at start-up --------------------------------


@pytest.mark.parametrize(
    ("args", "field", "words"),
    [
        # The issue's case on a restart mode that takes no snapshot at all.
        (
            ["--checkpoint.interval=10", "--checkpoint.peer_copy=true"],
            "checkpoint.peer_copy",
            "resilience.restart=none never takes (only injob, inprocess, nested, replica do): set "
            "--restart to one of them",
        ),
        (
            ["--restart=injob", "--checkpoint.peer_copy=true", "--checkpoint.pod_memory_dir="],
            "checkpoint.peer_copy",
            "set checkpoint.pod_memory_dir=/dev/shm/fsdp-snapshots, or checkpoint.peer_copy=false",
        ),
        (
            ["--checkpoint.local_dir=/scratch", "--checkpoint.local_interval=100"],
            "checkpoint.local_interval",
            "every local checkpoint step (a multiple of 100) is a shared save step "
            "(checkpoint.interval=50), which takes no local checkpoint, so none is ever taken: "
            "set it to a value that is not a multiple of 50 (e.g. 25), or 0 for none",
        ),
        (
            [
                "--checkpoint.local_dir=/s",
                "--checkpoint.local_interval=2",
                "--checkpoint.interval=1",
            ],
            "checkpoint.local_interval",
            "checkpoint.interval=1 saves every step to storage: set it to 0",
        ),
    ],
)
def test_a_tier_that_never_takes_anything_is_refused_by_the_cli(
    args: list[str], field: str, words: str
) -> None:
    """The CLI's own parser (``python -m training train``: ``overrides.build_config``)."""
    from training.overrides import build_config

    with pytest.raises(ConfigError) as caught:
        build_config(["--recipe=debug_cpu", *args])
    assert caught.value.field_path == field
    assert words in str(caught.value), str(caught.value)


def test_the_issues_configuration_is_refused_with_one_message_and_a_usage_exit() -> None:
    """The real command line, as a user runs it: one line naming the field and the fix, the
    usage exit code, nothing started."""
    import subprocess
    import sys

    from training import exits

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "train",
            "--recipe=debug_cpu",
            "--checkpoint.interval=10",
            "--checkpoint.peer_copy=true",
            "--print-config",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == exits.USAGE, out.stderr
    [line] = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: config error: checkpoint.peer_copy: copies the pod-memory")
    assert out.stdout == ""


def test_configurations_whose_tiers_all_take_something_pass() -> None:
    """Snapshots are taken at save steps too, so a memory interval that divides the save
    interval is not idle (the issue's ``interval=10`` with the recipe's ``memory_interval`` of
    10), and every shipped recipe passes."""
    from training.overrides import build_config
    from training.recipes import RECIPES

    config, _ = build_config(
        [
            "--recipe=debug_cpu",
            "--restart=injob",
            "--checkpoint.interval=10",
            "--checkpoint.peer_copy=true",
        ]
    )
    assert config.checkpoint.memory_interval == 10 and config.checkpoint.peer_copy
    for name in RECIPES:
        build_config([f"--recipe={name}"])
    # restart=none takes no snapshot and builds no memory tier: a recipe's interval is inert;
    # and a smoke run shorter than the intervals is a short run, not an idle configuration.
    build_config(["--recipe=debug_cpu", "--train.steps=5"])
    build_config(["--recipe=p5_smoke", "--restart=nested", "--train.steps=5"])
