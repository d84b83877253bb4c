"""The rendezvous store's process (training/launch/rdzv_store.py), as its Deployment runs it.

Run: ``.venv/bin/pytest tests/training/test_rdzv_store.py -q``. The store's own image holds
torch and only `manifests.render.RDZV_STORE_FILES`; this test runs the Deployment's command in a
directory holding only those files (a stand-in for the image's /app), joins it as a client the
way the launchers do, and stops it with SIGTERM as the kubelet does.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from manifests import render

REPO = Path(render.__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_the_store_runs_from_its_files_alone_and_stops_on_sigterm(tmp_path: Path) -> None:
    import torch.distributed as dist

    app = tmp_path / "app"
    for rel in render.RDZV_STORE_FILES:
        (app / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, app / rel)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    python, *rest = render.RDZV_STORE_COMMAND
    assert python == "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    store = subprocess.Popen(
        [sys.executable, *rest, f"--port={port}"],
        cwd=app,  # the Deployment's workingDir, /app: `-m` imports from here only
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = store.stdout.readline()
        assert line.strip() == f"rendezvous store listening on port {port}", line
        client = dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=False,
            timeout=datetime.timedelta(seconds=30),
            use_libuv=True,
        )
        client.set("rdzv/probe", "1")
        assert client.get("rdzv/probe") == b"1"
        store.send_signal(signal.SIGTERM)
        assert store.wait(timeout=30) == 0
    finally:
        if store.poll() is None:
            store.kill()
            store.wait()
