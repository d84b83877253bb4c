"""The ``environment`` check: torch against the pin, the private torch names the trainer uses,
NVRx and ISA-L importable; and the gate that skips a check whose private names are missing."""

from __future__ import annotations

import inspect
import re
from importlib import import_module
from pathlib import Path
from typing import Any

from gpu_checks.core import REPO_ROOT, Context

# Every private torch name the trainer uses, where, and the checks that need it. torch 2.11.0
# (the lent machine's) and 2.13.0 (the pin) both have them all (read in both wheels' sources);
# ``environment`` looks them up on the machine at hand.
CHECKPOINTING = ("nvrx_snapshot", "torch_async", "local_checkpoint", "inprocess_restart")
PRIVATE_TORCH_NAMES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "torch.distributed._shard._utils",
        "narrow_tensor_by_index",
        "training/checkpoint/integrity.py",
        CHECKPOINTING,
    ),
    (
        "torch.distributed.checkpoint.filesystem",
        "_StorageWriterTransforms",
        "training/checkpoint/integrity.py",
        CHECKPOINTING,
    ),
    (
        "torch.distributed.checkpoint.filesystem",
        "_write_item",
        "training/checkpoint/integrity.py",
        CHECKPOINTING,
    ),
    (
        "torch.serialization",
        "_open_zipfile_reader",
        "training/checkpoint/integrity.py",
        CHECKPOINTING,
    ),
    ("torch.serialization", "_load", "training/checkpoint/integrity.py", CHECKPOINTING),
    (
        "torch.serialization",
        "_weights_only_unpickler",
        "training/checkpoint/integrity.py",
        CHECKPOINTING,
    ),
    (
        "torch.distributed.checkpoint.utils",
        "_DistWrapper",
        "training/checkpoint/nvrx_async.py",
        CHECKPOINTING,
    ),
    (
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
        "training/parallel.py",
        ("fsdp_step", "ac_compile"),
    ),
    (
        "torch.distributed.distributed_c10d",
        "_abort_process_group",
        "training/run.py",
        ("inprocess_restart",),
    ),
    (
        "torch.distributed.distributed_c10d",
        "_get_default_group",
        "training/run.py",
        ("inprocess_restart",),
    ),
    ("torch.cuda", "_sleep", "training/resilience/inject.py", ("inprocess_restart",)),
)
# Keyword arguments of private functions the trainer passes.
PRIVATE_TORCH_PARAMETERS = (("torch.serialization", "_load", "overall_storage"),)


def pinned_torch() -> str:
    """The torch version pyproject.toml pins (its one owner)."""
    text = (REPO_ROOT / "pyproject.toml").read_text()
    match = re.search(r'"torch==([^"]+)"', text)
    return match.group(1) if match else "unknown"


def missing_private_names() -> dict[str, str]:
    """``module.name`` -> why, for every private torch name (or parameter) the trainer uses
    that this torch lacks."""
    missing: dict[str, str] = {}
    for module, name, where, _checks in PRIVATE_TORCH_NAMES:
        try:
            found = hasattr(import_module(module), name)
        except ImportError as err:
            found, why = False, f"{module} not importable ({err})"
        else:
            why = f"absent in torch (used by {where})"
        if not found:
            missing[f"{module}.{name}"] = why
    for module, name, parameter in PRIVATE_TORCH_PARAMETERS:
        function = getattr(import_module(module), name, None)
        if function is not None and parameter not in inspect.signature(function).parameters:
            missing[f"{module}.{name}({parameter}=)"] = "parameter absent"
    return missing


def blocked_by_missing_names(check: str, missing: dict[str, str]) -> list[str]:
    names = []
    for module, name, _where, checks in PRIVATE_TORCH_NAMES:
        if check in checks and f"{module}.{name}" in missing:
            names.append(f"{module}.{name}")
    if check in CHECKPOINTING:
        names += [k for k in missing if k.startswith("torch.serialization._load(")]
    return names


def check_environment(ctx: Context) -> dict[str, Any]:
    import importlib.metadata as metadata

    import torch

    pin = pinned_torch()
    missing = missing_private_names()
    detail: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_pin": pin,
        "torch_matches_pin": torch.__version__.split("+")[0] == pin,
        "private_torch_names_checked": len(PRIVATE_TORCH_NAMES) + len(PRIVATE_TORCH_PARAMETERS),
        "private_torch_names_missing": missing,
    }
    if not detail["torch_matches_pin"]:
        detail["note"] = (
            f"torch {torch.__version__} here, {pin} pinned: the checks run on this torch; "
            + (
                "every private torch name the trainer uses is present"
                if not missing
                else "checks needing a missing private name are skipped, naming it"
            )
        )
    versions, paths, problems = {}, {}, []
    for dist_name, module in (
        ("nvidia-resiliency-ext", "nvidia_resiliency_ext.inprocess"),
        ("isal", "isal.isal_zlib"),
        ("defusedxml", "defusedxml"),
    ):
        try:
            paths[dist_name] = str(Path(import_module(module).__file__).parent)
            versions[dist_name] = metadata.version(dist_name)
        except Exception as err:  # an import error names what is missing on the machine
            problems.append(f"{module}: {type(err).__name__}: {err}")
    for module in (  # the NVRx modules the trainer imports, against this torch
        "nvidia_resiliency_ext.checkpointing.async_ckpt.core",
        "nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async",
        "nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager",
        "nvidia_resiliency_ext.fault_tolerance",
    ):
        try:
            import_module(module)
        except Exception as err:
            problems.append(f"{module}: {type(err).__name__}: {err}")
    detail["packages"] = versions
    detail["package_paths"] = paths
    detail["import_problems"] = problems
    detail["ok"] = not problems and not missing
    return detail
