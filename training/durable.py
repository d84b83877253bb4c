"""Durable files: a file is either absent or complete, and its directory entry survives a crash.

Standard library only; the one atomic writer of the checkpoint layout, the local tier's
sidecars and the run's verdict."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Temp file + fsync + rename + fsync(dir): the file is either absent or complete."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # several ranks may write one file
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
