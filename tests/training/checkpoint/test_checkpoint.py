"""Checkpoint commit protocol, verification, retention, and the exact-snapshot guarantee.

Run: ``.venv/bin/pytest tests/training/checkpoint/test_checkpoint.py`` (the snapshot probes start
real 2-rank torchrun jobs; about 30 s in all).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import REPO_ROOT, TINY_MODEL, VENV_BIN, subprocess_env

from training.checkpoint.layout import (
    COMMIT,
    CheckpointError,
    commit,
    committed_steps,
    file_crc32,
    retention_victims,
    step_dir,
    verify,
    write_rank_manifest,
)
from training.checkpoint.manager import collective_device
from training.durable import write_json_atomic


def test_collective_device_follows_the_group_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_async's commit all-reduce: CPU on gloo, the rank's GPU on NCCL (which rejects CPU
    tensors). The gloo answer comes from a real group; the NCCL one from its backend name."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert collective_device() == torch.device("cpu")
        done = torch.tensor([1], dtype=torch.int32, device=collective_device())
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        assert done.item() == 1
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
        assert collective_device() == torch.device("cuda", 3)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()


def _sums(*files: Path) -> dict:
    return {f.name: {"size": f.stat().st_size, "crc32": file_crc32(f)} for f in files}


def fake_checkpoint(root: Path, step: int, *, world_size: int = 2) -> Path:
    """A checkpoint directory with real files, manifests and commit record (no torch needed)."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    for rank in range(world_size):
        shard = path / f"__{rank}_0.distcp"
        shard.write_bytes(os.urandom(4096 + rank))
        write_rank_manifest(str(path), rank, files=_sums(shard))
    (path / ".metadata").write_bytes(b"metadata" * 10)
    commit(path, step=step, world_size=world_size, engine="sync")
    return path


def test_commit_record_lists_every_shard_with_size_and_checksum(tmp_path: Path) -> None:
    path = fake_checkpoint(tmp_path, 10)
    record = json.loads((path / COMMIT).read_text())
    assert record["step"] == 10 and record["world_size"] == 2
    assert set(record["files"]) == {"__0_0.distcp", "__1_0.distcp", ".metadata"}
    assert record["files"]["__1_0.distcp"]["size"] == 4097
    assert verify(path) is None
    assert not list(path.glob(".*.tmp")), "the atomic write left its temp file behind"


def test_commit_refuses_when_a_rank_manifest_is_missing(tmp_path: Path) -> None:
    path = step_dir(tmp_path, 5)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x")
    write_rank_manifest(str(path), 0, files=_sums(path / "__0_0.distcp"))
    (path / ".metadata").write_bytes(b"m")
    with pytest.raises(CheckpointError, match="rank 1 has no manifest"):
        commit(path, step=5, world_size=2, engine="sync")
    assert not (path / COMMIT).exists()
    assert committed_steps(tmp_path) == []


def test_torn_checkpoint_is_not_committed(tmp_path: Path) -> None:
    fake_checkpoint(tmp_path, 10)
    torn = step_dir(tmp_path, 20)
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"half a shard")
    assert committed_steps(tmp_path) == [10]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_verify_detects_damage(tmp_path: Path, damage: str) -> None:
    path = fake_checkpoint(tmp_path, 10)
    shard = path / "__1_0.distcp"
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[100] ^= 0xFF
        shard.write_bytes(bytes(data))
        expected = "fails its checksum"
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
        expected = "has 100 bytes"
    else:
        shard.unlink()
        expected = "is missing"
    problem = verify(path)
    assert problem is not None and expected in problem
    assert "__1_0.distcp" in problem


def test_write_json_atomic_replaces_whole_file(tmp_path: Path) -> None:
    target = tmp_path / "record.json"
    write_json_atomic(target, {"a": 1})
    write_json_atomic(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["record.json"]


@pytest.mark.parametrize(
    ("steps", "keep_last", "keep_every", "victims"),
    [
        ([10, 20, 30, 40, 50], 3, 0, [10, 20]),
        ([10, 20, 30, 40, 50], 2, 20, [10, 30]),
        ([10], 1, 0, []),
        ([10, 20], 1, 0, [10]),
        ([], 3, 0, []),
    ],
)
def test_retention(steps, keep_last, keep_every, victims) -> None:
    assert retention_victims(steps, keep_last=keep_last, keep_every=keep_every) == victims
    if steps:
        assert steps[-1] not in victims, "the newest committed checkpoint must survive"


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("engine", ["nvrx", "torch_async", "sync"])
def test_async_save_is_an_exact_snapshot(tmp_path: Path, corpus: Path, engine: str) -> None:
    """Real 2-rank saves and loads (tests/training/probes/snapshot_probe.py), per engine:

    - every parameter and optimizer tensor is changed right after ``save`` returns; the loaded
      checkpoint equals the state at save time (on CPU nothing stages NVRx's live tensors
      unless we do: training/checkpoint/staging.py);
    - a warm save (cached plan, nvrx) and a first save with the plan made in ``prepare`` reuse
      that plan and write shard files byte-identical to a fresh manager's;
    - the CRCs recorded while writing equal CRCs of the final files, item by item;
    - a shard damaged after commit fails the one-pass verified load on every rank without
      changing any rank's state, and ``load_latest`` falls back to the previous checkpoint,
      which equals what was saved."""
    result_dir = tmp_path / engine
    command = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        str(REPO_ROOT / "tests/training/probes/snapshot_probe.py"),
        str(result_dir),
        engine,
        "--",
        f"--data.path={corpus}",
        *TINY_MODEL,
    ]
    proc = subprocess.run(
        command, cwd=REPO_ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=220
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = [json.loads((result_dir / f"probe_rank{r}.json").read_text()) for r in range(2)]
    for rank, report in enumerate(reports):
        assert report["step"] == 1
        assert report["tensors"] > 20
        assert report["mismatched"] == [], f"rank {rank}: state leaked into the checkpoint"
        assert report["damaged_load_raised"], f"rank {rank}: the damaged shard was loaded"
        assert "__1_0.distcp fails its checksum" in report["damaged_load_problem"]
        assert report["touched_by_rejected_load"] == [], f"rank {rank}: half-loaded state"
        assert report["fallback_step"] == 3
        assert report["fallback_mismatched"] == [], f"rank {rank}: fallback differs"
        assert report["step2_plan_reused"] == (engine == "nvrx")
        assert report["step3_plan_reused"] == (engine == "nvrx"), "prepare made no plan"
        assert report["step4_plan_reused"] is False
    assert reports[0]["shard_files"] == ["__0_0.distcp", "__1_0.distcp"]
    assert reports[0]["cached_differs"] == [], "a cached-plan save wrote different bytes"
    assert reports[0]["prepared_differs"] == [], "a prepared-plan save wrote different bytes"
    assert reports[0]["crc_problems"] == []
    events = [json.loads(line) for line in (result_dir / "events.jsonl").read_text().splitlines()]
    rejected = [e for e in events if e["kind"] == "checkpoint_rejected"]
    assert {e["step"] for e in rejected} == {4}


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a dead child its parent has not reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_nvrx_helper_processes_die_with_their_rank(tmp_path: Path) -> None:
    """A SIGKILLed rank (OOM killer, segfault) must not leave NVRx's helpers behind: the
    persistent checkpoint worker and the Manager serving NVRx's write-results queue each hold
    hundreds of MB, and an in-job restart would add another set every time. The queue must also
    exist before the first save (otherwise that save pays its start-up on the training path)."""
    result_dir = tmp_path / "probe"
    result_dir.mkdir()
    # Output to a file, not a pipe nobody reads: the probe's processes (its resource tracker's
    # leak warnings at exit among them) must never block on a full pipe and outlive the test.
    log = tmp_path / "probe.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                str(VENV_BIN / "python"),
                str(REPO_ROOT / "tests/training/probes/worker_lifetime_probe.py"),
                str(result_dir),
            ],
            cwd=REPO_ROOT,
            env=subprocess_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    report_path = result_dir / "children.json"
    try:
        deadline = time.monotonic() + 90
        while not report_path.exists():
            assert proc.poll() is None, f"probe exited early:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "probe never reported its children"
            time.sleep(0.2)
        report = json.loads(report_path.read_text())
    finally:
        proc.kill()
        proc.wait(timeout=30)
    # The resource tracker last: it exits once the helpers holding its pipe are gone.
    started = [*report["children"], *([report["tracker"]] if report["tracker"] else [])]
    deadline = time.monotonic() + 15
    while (alive := [pid for pid in started if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in alive:  # do not leak them into the rest of the test session
        os.kill(pid, signal.SIGKILL)
    assert alive == [], f"helper processes outlived their SIGKILLed rank: {alive}"
    assert report["tracker"], "the probe started no resource tracker: nothing checked its end"
    assert len(report["children"]) >= 2, report  # the persistent worker and the Manager
    assert report["queue_ready_at_start"], "NVRx's write-results queue was not started up front"
