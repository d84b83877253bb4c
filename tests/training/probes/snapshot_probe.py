"""Probe for the snapshot guarantee, the cached save plan, the write-time CRCs and the one-pass
verified load (run by tests/training/checkpoint/test_checkpoint.py under torchrun).

1. Builds the trainer, saves asynchronously at step 1, then at once changes every parameter and
   optimizer tensor in place, as the next training steps would, and waits for the commit.
2. Saves the changed state at step 2 (a warm save: the cached plan) and, with a new manager (no
   cache), at step 3: the shard files of steps 2 and 3 must be byte-identical.
3. Checks every rank manifest: the CRCs recorded while writing equal a CRC of the final file,
   and the per-item CRCs cover the file exactly.
4. Flips one byte in the middle of the last rank's shard of step 4 (``__{world-1}_0.distcp``:
   rank 1's of two, rank 0's own when the probe runs on one rank, as on a one-GPU machine): a
   direct verified load of step 4 must fail on every rank and leave every rank's state
   untouched; ``load_latest`` must reject step 4 and load step 3, equal to the saved state.
5. Un-commits steps 2 and 3 and loads step 1: it must equal the state at save time.

Writes, per rank, a JSON report. Usage:
torchrun --nproc-per-node 2 snapshot_probe.py RESULT_DIR ENGINE -- overrides
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import torch
import torch.distributed as dist


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def flat_tensors(state, prefix=""):
    out = {}
    if isinstance(state, dict):
        for key, value in state.items():
            out.update(flat_tensors(value, f"{prefix}{key}."))
    elif isinstance(state, torch.Tensor):
        out[prefix[:-1]] = local(state).detach().clone()
    return out


def mismatches(expected: dict, trainer) -> list[str]:
    loaded = flat_tensors(trainer.state_dict())
    return sorted(k for k, v in expected.items() if not torch.equal(v, loaded[k]))


def manifest_problems(step_path: Path, world_size: int) -> list[str]:
    """Write-time CRCs against the final files (rank 0 reads them all)."""
    from training.checkpoint.layout import SHARDS, file_crc32

    problems = []
    for rank in range(world_size):
        manifest = json.loads((step_path / SHARDS / f"rank_{rank:05d}.json").read_text())
        for name, sums in manifest["files"].items():
            data = (step_path / name).read_bytes()
            if sums["size"] != len(data) or sums["crc32"] != file_crc32(step_path / name):
                problems.append(f"{step_path.name}/{name}: file CRC")
            covered = 0
            for offset, (length, crc) in sorted(sums["items"].items(), key=lambda i: int(i[0])):
                if int(offset) != covered or zlib.crc32(data[covered : covered + length]) != crc:
                    problems.append(f"{step_path.name}/{name}: item at {offset}")
                covered = int(offset) + length
            if covered != len(data):
                problems.append(f"{step_path.name}/{name}: items cover {covered}/{len(data)}")
    return problems


def damaged_shard_name(world_size: int) -> str:
    """The shard file the probe damages: the last rank's (DCP names them ``__<rank>_0``)."""
    return f"__{world_size - 1}_0.distcp"


def main() -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    from training.checkpoint.integrity import VerifyingReader
    from training.checkpoint.layout import COMMIT, step_dir
    from training.checkpoint.manager import CheckpointManager, needs_cpu_collectives
    from training.overrides import build_config
    from training.parallel import dist_env_from_environment, init_process_group
    from training.runlog.metrics import EventLog
    from training.trainer import Trainer

    result_dir, engine, *overrides = sys.argv[1:]
    overrides = [o for o in overrides if o != "--"]
    config, _ = build_config(
        [
            "--run-dir",
            result_dir,
            f"--checkpoint.engine={engine}",
            "--checkpoint.keep_last=5",
            *overrides,
        ]
    )
    env = dist_env_from_environment(
        config.parallel, cpu_collectives=needs_cpu_collectives(config.checkpoint)
    )
    init_process_group(env, timeout_s=120)
    events = EventLog(run_dir=Path(result_dir), rank=env.rank)
    root = Path(config.checkpoint_dir)

    def manager() -> CheckpointManager:
        return CheckpointManager.for_job(
            config=config,
            rank=env.rank,
            world_size=env.world_size,
            events=events,
        )

    def fresh_trainer() -> Trainer:
        trainer = Trainer(config=config, env=env, events=events)
        trainer.reduce_step_stats(trainer.train_step(), stop_requested=False)  # optimizer state
        return trainer

    trainer = Trainer(config=config, env=env, events=events)
    # One real step so the optimizer has state (exp_avg, exp_avg_sq) to snapshot too.
    trainer.reduce_step_stats(trainer.train_step(), stop_requested=False)
    trainer.step = 1
    saver = manager()
    saver.start()
    expected1 = flat_tensors(trainer.state_dict())
    saver.save(trainer, step=1, blocking=False)
    with torch.no_grad():  # what the next steps would do, while the write is under way
        for param in trainer.model.parameters():
            local(param).add_(1.0)
        for state in trainer.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    local(value).mul_(-3.0)
    saver.wait()
    trainer.step = 2
    saver.save(trainer, step=2, blocking=True)  # warm: the cached plan
    report: dict = {"step2_plan_reused": saver.last_plan_reused}
    saver.close()
    # trainer.step stays 2: the state of steps 2, 3 and 4 is the same, so must their bytes be
    prepared_saver = manager()  # plans in prepare, as the trainer does after its first step
    prepared_saver.start()
    prepared_saver.prepare(trainer)
    prepared_saver.save(trainer, step=3, blocking=True)  # the first save: the prepared plan
    report["step3_plan_reused"] = prepared_saver.last_plan_reused
    prepared_saver.close()
    fresh_saver = manager()  # no cache: plans from scratch
    fresh_saver.start()
    fresh_saver.save(trainer, step=4, blocking=True)
    fresh_saver.close()
    expected2 = flat_tensors(trainer.state_dict())
    dist.barrier()

    report["step4_plan_reused"] = fresh_saver.last_plan_reused
    if env.rank == 0:
        s2, s3, s4 = step_dir(root, 2), step_dir(root, 3), step_dir(root, 4)
        names = sorted(p.name for p in s2.glob("*.distcp"))
        report["shard_files"] = names
        report["cached_differs"] = [
            n for n in names if (s2 / n).read_bytes() != (s4 / n).read_bytes()
        ]
        report["prepared_differs"] = [
            n for n in names if (s3 / n).read_bytes() != (s4 / n).read_bytes()
        ]
        report["crc_problems"] = [
            p for s in (1, 2, 3, 4) for p in manifest_problems(step_dir(root, s), env.world_size)
        ]
        # Damage after commit, one bit in the middle of a shard that exists at any world size.
        shard = s4 / damaged_shard_name(env.world_size)
        report["damaged_shard"] = shard.name
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    dist.barrier()

    # A direct verified load of the damaged step: every rank fails, no rank's state changes.
    victim = fresh_trainer()
    before = flat_tensors(victim.state_dict())
    reader = VerifyingReader(step_dir(root, 4))
    try:
        dcp.load({"trainer": victim}, storage_reader=reader)
        report["damaged_load_raised"] = False
    except CheckpointException:  # a BaseException in torch's DCP
        report["damaged_load_raised"] = True
    report["damaged_load_problem"] = reader.problem
    report["touched_by_rejected_load"] = mismatches(before, victim)

    # The fallback: step 4 rejected, step 3 loaded, equal to what was saved.
    restored = fresh_trainer()
    report["fallback_step"] = manager().load_latest(restored)
    report["fallback_mismatched"] = mismatches(expected2, restored)
    dist.barrier()

    if env.rank == 0:  # leave step 1 the newest committed checkpoint
        for step in (2, 3, 4):
            (step_dir(root, step) / COMMIT).unlink()
    dist.barrier()
    fresh = fresh_trainer()
    report["step"] = manager().load_latest(fresh)
    report["tensors"] = len(expected1)
    report["mismatched"] = mismatches(expected1, fresh)
    Path(result_dir, f"probe_rank{env.rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":  # NVRx's worker and torch's async writer use spawn
    main()
