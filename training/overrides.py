"""Trainer command-line arguments -> a validated `JobConfig`, without importing torch.

The trainer (`python -m training train`), the local launcher, the pod's supervisor and the
manifest renderer all build the config from the same arguments with `build_config`.
"""

from __future__ import annotations

import argparse

from training.config import JobConfig, apply_overrides
from training.exits import ConfigError
from training.modes import MODES
from training.recipes import RECIPES, get_recipe


def split_overrides(tokens: list[str]) -> dict[str, str]:
    """``--a.b=1 --c.d 2`` -> {"a.b": "1", "c.d": "2"}."""
    overrides: dict[str, str] = {}
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if not token.startswith("--"):
            raise ConfigError(
                token, "unexpected argument; overrides look like --section.field=value"
            )
        key = token[2:]
        if "=" in key:
            key, value = key.split("=", 1)
        elif index + 1 < len(tokens) and not tokens[index + 1].startswith("--"):
            index += 1
            value = tokens[index]
        else:
            raise ConfigError(key, "needs a value: --section.field=value")
        overrides[key.replace("-", "_")] = value
        index += 1
    return overrides


def build_config(argv: list[str]) -> tuple[JobConfig, bool]:
    """The config the trainer would run with these arguments, and whether --print-config."""
    parser = argparse.ArgumentParser(prog="python -m training train", add_help=True)
    parser.add_argument("--recipe", default="debug_cpu", help=f"one of {', '.join(RECIPES)}")
    parser.add_argument("--run-dir", help="run directory (metrics, events, checkpoints)")
    parser.add_argument(
        "--restart",
        choices=tuple(MODES),
        help="restart layer (default: the recipe's)",
    )
    parser.add_argument("--faults", help="fault injection spec (training/faults.py)")
    parser.add_argument("--print-config", action="store_true", help="print the config and exit")
    args, rest = parser.parse_known_args(argv)
    overrides = split_overrides(rest)
    if args.run_dir:
        overrides["run_dir"] = args.run_dir
    if args.restart:
        overrides["resilience.restart"] = args.restart
    if args.faults is not None:
        overrides["faults"] = args.faults
    config = apply_overrides(get_recipe(args.recipe).config, overrides)
    return config, args.print_config
