"""Probe for the snapshot guarantee (run by tests/training/checkpoint/test_checkpoint.py under
torchrun).

Builds the trainer, saves asynchronously at step 0, then at once changes every parameter and
optimizer tensor in place, as the next training steps would, waits for the commit, loads the
checkpoint into a fresh trainer and writes, per rank, whether every tensor equals the state at
save time. Usage: torchrun --nproc-per-node 2 snapshot_probe.py RESULT_DIR ENGINE -- overrides
"""

from __future__ import annotations

import json
import sys
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


def main() -> None:
    from training.checkpoint.manager import CheckpointManager
    from training.overrides import build_config
    from training.parallel import dist_env_from_environment, init_process_group
    from training.runlog.metrics import EventLog
    from training.trainer import Trainer

    result_dir, engine, *overrides = sys.argv[1:]
    overrides = [o for o in overrides if o != "--"]
    config, _ = build_config(["--run-dir", result_dir, f"--checkpoint.engine={engine}", *overrides])
    env = dist_env_from_environment(config.parallel)
    init_process_group(env, timeout_s=120)
    events = EventLog(run_dir=Path(result_dir), rank=env.rank)
    trainer = Trainer(config=config, env=env, events=events)
    # One real step so the optimizer has state (exp_avg, exp_avg_sq) to snapshot too.
    trainer.reduce_step_stats(trainer.train_step(), stop_requested=False)
    trainer.step = 1
    manager = CheckpointManager(
        config=config.checkpoint,
        root=Path(config.checkpoint_dir),
        rank=env.rank,
        world_size=env.world_size,
        events=events,
    )
    manager.start()
    expected = flat_tensors(trainer.state_dict())
    manager.save(trainer, step=1, blocking=False)
    with torch.no_grad():  # what the next steps would do, while the write is under way
        for param in trainer.model.parameters():
            local(param).add_(1.0)
        for state in trainer.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    local(value).mul_(-3.0)
    manager.wait()
    manager.close()
    fresh = Trainer(config=config, env=env, events=events)
    fresh.reduce_step_stats(fresh.train_step(), stop_requested=False)  # create optimizer state
    loader = CheckpointManager(
        config=config.checkpoint,
        root=Path(config.checkpoint_dir),
        rank=env.rank,
        world_size=env.world_size,
        events=events,
    )
    step = loader.load_latest(fresh)
    loaded = flat_tensors(fresh.state_dict())
    mismatched = sorted(k for k, v in expected.items() if not torch.equal(v, loaded[k]))
    Path(result_dir, f"probe_rank{env.rank}.json").write_text(
        json.dumps({"step": step, "tensors": len(expected), "mismatched": mismatched})
    )
    dist.destroy_process_group()


if __name__ == "__main__":  # NVRx's worker and torch's async writer use spawn
    main()
