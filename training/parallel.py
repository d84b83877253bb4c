"""Device, backend and FSDP2 wrapping.

``auto`` picks CUDA + NCCL with a bf16 mixed-precision policy when a GPU is present, else CPU +
gloo in fp32. FSDP2 (``fully_shard``) wraps each transformer block, then the root, so parameters
are DTensors sharded on dim 0 across the data-parallel mesh. Any world size from 1 up works.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from training.config import ConfigError, ParallelConfig
from training.model import Transformer


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Who this process is, as set by torchrun / ft_launcher / the in-process wrapper."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def resolve_device(config: ParallelConfig, *, local_rank: int) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("parallel.device", "cuda was asked for but no GPU is visible")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def dist_env_from_environment(config: ParallelConfig) -> DistEnv:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(config, local_rank=local_rank)
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend="nccl" if device.type == "cuda" else "gloo",
    )


def init_process_group(env: DistEnv, *, timeout_s: float, store: dist.Store | None = None) -> None:
    """Create the default process group (env:// rendezvous unless a store is given)."""
    if env.is_cuda:
        torch.cuda.set_device(env.device)
    kwargs: dict = {"backend": env.backend, "timeout": datetime.timedelta(seconds=timeout_s)}
    if store is not None:
        kwargs.update(store=store, rank=env.rank, world_size=env.world_size)
    if env.is_cuda:
        kwargs["device_id"] = env.device  # eager NCCL init: errors surface at start, not step 1
    dist.init_process_group(**kwargs)


def mixed_precision_policy(config: ParallelConfig, env: DistEnv) -> MixedPrecisionPolicy:
    precision = config.mixed_precision
    if precision == "auto":
        precision = "bf16" if env.is_cuda else "fp32"
    if precision == "bf16":
        # bf16 compute and communication of parameters; gradients reduced in fp32 for accuracy.
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def build_sharded_model(
    model_factory, *, config: ParallelConfig, env: DistEnv, seed: int
) -> tuple[Transformer, DeviceMesh]:
    """Build the model, apply activation checkpointing and FSDP2, materialise it on the device."""
    if config.meta_init and not env.is_cuda:
        # DTensor's RNG tracker only covers CUDA meshes: on CPU every rank would initialise its
        # shard with the same values (the halves of each weight would be identical).
        raise ConfigError("parallel.meta_init", "needs parallel.device=cuda; set it to false")
    mesh = init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("dp",))
    torch.manual_seed(seed)
    if config.meta_init:
        with torch.device("meta"):
            model = model_factory()
    else:
        # Every rank builds the same full model from the same seed; fully_shard keeps its slice.
        # init_weights as on the meta path: the same init whichever way the model is built.
        model = model_factory()
        model.init_weights()
    if config.activation_checkpointing:
        for index, block in enumerate(model.layers):
            model.layers[index] = checkpoint_wrapper(block)
    policy = mixed_precision_policy(config, env)
    for block in model.layers:
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=config.reshard_after_forward,
        )
    # The root holds embeddings, final norm and output; no resharding after forward for it
    # since backward needs it right away.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    if config.meta_init:
        model.to_empty(device=env.device)
        torch.manual_seed(seed)
        model.init_weights()
    elif env.is_cuda:
        model.to(env.device)
    return model, mesh


def set_cpu_threads(config: ParallelConfig, env: DistEnv) -> None:
    if not env.is_cuda:
        torch.set_num_threads(config.cpu_threads)
