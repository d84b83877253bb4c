"""The NVMe tier's CPU-testable parts (training/checkpoint/local.py): which ranks replicate to
which (a rank on another node), and the per-file checksum that keeps a damaged local file out
of NVRx's ``find_latest`` (so the load falls back, with a warning).

Run: ``.venv/bin/pytest tests/training/checkpoint/test_local_checkpoint.py`` (seconds, CPU only).
Saving and loading through NVRx needs CUDA tensors:
tests/training/resilience/test_gpu_resilience.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training.checkpoint.local import (
    SIDECAR,
    LocalCheckpoints,
    replication_groups,
    session_id_for,
    verify_sidecar,
)


def test_replicas_go_to_the_same_local_rank_on_the_paired_node() -> None:
    groups = replication_groups(world_size=16, local_world_size=8)
    assert groups == [[r, r + 8] for r in range(8)]
    # 2 "nodes" of 2 ranks: rank 0's shard also on rank 2, rank 1's on rank 3.
    assert replication_groups(world_size=4, local_world_size=2) == [[0, 2], [1, 3]]
    # Four nodes: pairs (0,1) and (2,3) of nodes.
    assert [0, 8] in replication_groups(world_size=32, local_world_size=8)
    assert [16, 24] in replication_groups(world_size=32, local_world_size=8)
    for group in replication_groups(world_size=32, local_world_size=8):
        assert len({rank // 8 for rank in group}) == 2, "a replica on the same node is no replica"


@pytest.mark.parametrize(("world", "local"), [(8, 8), (1, 1), (24, 8), (12, 8)])
def test_no_replication_where_nodes_do_not_pair(world: int, local: int) -> None:
    assert replication_groups(world_size=world, local_world_size=local) is None


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_finalize_path_only_stats_and_the_restart_reads_the_step_it_loads(
    one_rank_group, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVRx's find_latest (run in every save's finalize, on the training path) offers a file by
    its sidecar and size alone: no CRC of any file. The restart's ``latest_step`` reads only the
    newest step's files against their CRC32s; a damaged one is renamed aside with a warning and
    the older step is loaded instead; a missing sidecar or a wrong size is never offered."""
    import training.checkpoint.local as local

    tier = LocalCheckpoints(
        root=tmp_path, session_id="run", world_size=1, local_world_size=1, require_cuda=False
    )
    assert not tier.replicated
    manager = tier._manager
    paths = {}
    for step in (3, 6):
        ckpt_id = manager._ckpt_id(step)
        manager._save({"w": torch.arange(1000.0) + step}, ckpt_id)  # what the forked writer runs
        paths[step] = manager._local_ckpt_path_from_id(ckpt_id)
        assert paths[step].with_name(paths[step].name + SIDECAR).is_file()
        assert verify_sidecar(paths[step]) is None
    data = bytearray(paths[6].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    paths[6].write_bytes(bytes(data))

    read: list[Path] = []
    real_crc = local.file_crc32
    monkeypatch.setattr(local, "file_crc32", lambda path: read.append(path) or real_crc(path))
    manager.latest_iteration = -1  # NVRx caches the answer until the next save
    assert manager.find_latest() == 6 and read == [], "the finalize path reads no file"
    with pytest.warns(UserWarning, match="damaged .*CRC32 mismatch"):
        assert tier.latest_step() == 3
    assert read == [paths[6], paths[3]], "only the step about to be loaded, then the fallback"
    assert not paths[6].exists() and paths[6].with_name(paths[6].name + ".damaged").exists()

    paths[3].with_name(paths[3].name + SIDECAR).unlink()
    with pytest.warns(UserWarning, match="no readable checksum"):
        assert manager._my_ckpt_ids() == []


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_local_tier_has_its_own_non_persistent_queue(one_rank_group, tmp_path: Path) -> None:
    """NVRx's docs: local checkpointing must use AsyncCallsQueue(persistent=False)."""
    tier = LocalCheckpoints(
        root=tmp_path, session_id="run", world_size=1, local_world_size=1, require_cuda=False
    )
    assert tier._queue.persistent is False
    assert tier.pending() == 0
    tier.close()


def test_cpu_is_refused_by_default(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("refusal is for CPU-only machines")
    from training.exits import ConfigError

    with pytest.raises(ConfigError):
        LocalCheckpoints(root=tmp_path, session_id="s", world_size=1, local_world_size=1)


def test_each_run_has_its_own_session_on_the_node_disk() -> None:
    """Local files live in ``<local_dir>/<session>/<rank>`` on a node disk that outlives pods:
    the session is the same for every pod and restart of one run, different for another run
    (before, every run's session was "checkpoints", the shared root's name)."""
    run_a = Path("/fsx/runs/llama8b/checkpoints")
    assert session_id_for(run_a) == session_id_for(Path("/fsx/runs/llama8b/checkpoints"))
    assert session_id_for(run_a).startswith("llama8b-")
    assert session_id_for(run_a) != session_id_for(Path("/fsx/runs/llama70b/checkpoints"))
    assert session_id_for(run_a) != session_id_for(Path("/fsx/other/llama8b/checkpoints"))


def test_buckets_hold_at_most_the_limit_or_one_bigger_item() -> None:
    from training.checkpoint.local import buckets

    assert buckets([4, 4, 4, 10, 1, 1], limit=8) == [[0, 1], [2], [3], [4, 5]]
    assert buckets([], limit=8) == []


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_replicas_are_exchanged_in_buckets_not_tensor_by_tensor(tmp_path: Path) -> None:
    """NVRx 0.4.1 broadcasts a replica's tensors one by one (82 broadcasts for 2 ranks of 41
    tensors here) and sends a shard to a restoring peer one tensor at a time; the bucketed
    exchange sends the same tensors, bit for bit, in one broadcast per bucket (1 MiB buckets
    here: a handful per rank), and a restore in one send per bucket (2 here, not 41)."""
    import json

    from support import REPO_ROOT, VENV_BIN, run_in_repo

    command = [
        str(VENV_BIN / "torchrun"),
        "--standalone",
        "--nproc-per-node=2",
        str(REPO_ROOT / "tests/training/probes/replication_probe.py"),
        str(tmp_path),
    ]
    proc = run_in_repo(command, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"replication_rank{rank}.json").read_text())
        assert report["strategy_group"] == "BucketedGroupWrapper"
        assert report["equal"] and report["from_each_rank"] == [True, True]
        assert report["broadcasts"]["nvrx"] == 82
        assert report["broadcasts"]["bucketed"] <= 6, report
        assert report["restore_equal"], "a shard restored from a peer equals what it sent"
    assert json.loads((tmp_path / "replication_rank0.json").read_text())["restore_sends"] == 2


def test_a_restore_removes_the_local_files_of_later_steps(one_rank_group, tmp_path: Path) -> None:
    """After a restore of step 4 (from any tier), the local files of steps 6 and 9, a dead
    timeline's, go with their sidecars: NVRx's ``find_latest`` would offer them to a later
    restart. The real NVRx manager on CPU tensors (its writer's ``_save``, as the forked writer
    runs it); the GPU save path needs CUDA."""
    tier = LocalCheckpoints(
        root=tmp_path, session_id="run", world_size=1, local_world_size=1, require_cuda=False
    )
    manager = tier._manager
    for step in (3, 6, 9):
        manager._save({"w": torch.arange(10.0) + step}, manager._ckpt_id(step))
    manager.latest_iteration = -1
    assert manager.find_latest() == 9
    assert tier.discard_newer(4) == [6, 9]
    assert manager.find_latest() == 3
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "iter_0000003_0_local.pt",
        "iter_0000003_0_local.pt.crc32.json",
    ]
