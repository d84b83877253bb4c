"""Command line: ``python -m training {train,prepare,recipes}`` and ``training.launch.local``.

Run: ``.venv/bin/pytest tests/training/launch/test_cli.py`` (~20 s: two tests start a Python process
to check real exit codes and stderr; the rest call ``main`` in-process).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import REPO_ROOT, subprocess_env

from training.__main__ import main
from training.exits import USAGE as EXIT_USAGE
from training.exits import ConfigError
from training.launch import local
from training.overrides import split_overrides


def _python(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=subprocess_env(PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(150)
def test_bad_value_exits_2_with_one_line_and_no_run_dir(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _python(
        "-m", "training", "train", "--train.steps=0", "--run-dir", str(run_dir), cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "train.steps" in lines[0] and ">= 1" in lines[0]
    assert proc.stdout == ""
    assert not run_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.timeout(150)
def test_launcher_rejects_nproc_0(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = _python(
        "-m", "training.launch.local", "--nproc", "0", "--run-dir", str(run_dir), cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr
    assert "--nproc" in proc.stderr and ">= 1" in proc.stderr
    assert not run_dir.exists()


def test_print_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(
        [
            "train",
            "--print-config",
            "--train.steps=7",
            "--optim.lr",
            "1e-3",
            "--run-dir",
            str(tmp_path / "r"),
            "--restart",
            "inprocess",
        ]
    )
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["train"]["steps"] == 7
    assert printed["optim"]["lr"] == 1e-3
    assert printed["run_dir"] == str(tmp_path / "r")
    assert printed["resilience"]["restart"] == "inprocess"
    assert printed["recipe"] == "debug_cpu"
    assert not (tmp_path / "r").exists()


def test_print_config_of_a_large_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--recipe", "p5_70b", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["model"]["n_layers"] == 80


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["train", "--train.stepz=3"], "train.stepz: unknown field"),
        (["train", "--nope.x=1"], "unknown section"),
        (["train", "--recipe", "p6_1t"], "recipe: unknown recipe"),
        (["train", "stray"], "unexpected argument"),
        (["train", "--train.steps"], "needs a value"),
        (["train", "--optim.lr=abc"], "optim.lr: must be a number"),
    ],
)
def test_train_usage_errors(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    assert captured.err.startswith("error: config error: ")
    assert words in captured.err
    assert len(captured.err.strip().splitlines()) == 1


def test_no_command_is_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == EXIT_USAGE
    assert main(["fly"]) == EXIT_USAGE
    assert "usage" in capsys.readouterr().err


def test_recipes_lists_all(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in ("debug_cpu", "p5_smoke", "p5_8b", "p5_70b"):
        assert name in out


def test_prepare_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "a.txt"
    src.write_text("some text\n" * 10)
    out = tmp_path / "shards"
    assert main(["prepare", str(src), "--out", str(out)]) == 0
    assert "prepared 101 tokens from 1 files" in capsys.readouterr().out
    assert (out / "meta.json").is_file()
    assert main(["prepare", str(src), "--out", str(out)]) == EXIT_USAGE
    assert "already holds shards" in capsys.readouterr().err
    assert main(["prepare", str(tmp_path / "missing"), "--out", str(tmp_path / "o2")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_split_overrides() -> None:
    assert split_overrides(["--a.b=1", "--c.d", "2", "--e-f.g-h=x=y"]) == {
        "a.b": "1",
        "c.d": "2",
        "e_f.g_h": "x=y",
    }
    assert split_overrides(["--train.seed", "-1"]) == {"train.seed": "-1"}
    with pytest.raises(ConfigError):
        split_overrides(["--a.b", "--c.d=1"])


def test_launcher_checks_data_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    code = local.main(
        ["--nproc", "2", "--run-dir", str(run_dir), f"--data.path={tmp_path / 'no-data'}"]
    )
    assert code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "data.path" in err and "prepare" in err
    assert not run_dir.exists()


def test_launcher_rejects_bad_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = local.main(["--run-dir", str(tmp_path / "run"), "--train.micro_batch_size=0"])
    assert code == EXIT_USAGE
    assert "train.micro_batch_size" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_rank_command_shapes() -> None:
    from training.recipes import recipe_config

    config = recipe_config("debug_cpu")
    command = local.rank_command(config=config, nproc=3, train_args=["--train.steps=5"], port=29999)
    assert Path(command[0]).name == "torchrun"
    assert "--nproc-per-node=3" in command and "--max-restarts=0" in command
    assert command[-2:] == ["train", "--train.steps=5"]
    assert command[command.index("-m") + 1] == "training"
