"""Device, backend and FSDP2 wrapping.

``auto`` picks CUDA + NCCL with a bf16 mixed-precision policy when a GPU is present, else CPU +
gloo in fp32. FSDP2 (``fully_shard``) units, as torchtitan's ``apply_fsdp`` makes them: the token
embeddings, each transformer block, and the final norm with the output projection; the root
then holds no parameter of its own. (In the root unit, embeddings and output stayed unsharded
for the whole step: 2 x 128,256 x 8,192 = 2.1B parameters for the 70B recipe.) Parameters are
DTensors sharded on dim 0 across the data-parallel mesh. Any world size from 1 up works.

Per block, optionally: activation checkpointing (full, or selective: matmul and attention
outputs kept, the rest recomputed) and ``torch.compile`` of the wrapped block, as torchtitan
orders them (``Module.compile``: in place, so parameter names and checkpoints do not change).
The blocks' FSDP units do not cast their forward inputs: the hidden state arrives in the compute
dtype already, and the rotary table stays fp32 on every device (``model.apply_rotary``).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from training.config import ParallelConfig
from training.exits import ConfigError
from training.model import Transformer

# Selective activation checkpointing: outputs of these ops are saved, everything else in a
# block (norms, rotary, SwiGLU's pointwise ops) is recomputed in backward. torchtitan's
# ``_save_list`` (torchtitan/models/llama3/infra/parallelize.py) keeps the same compute-bound
# ops; unlike it we keep every matmul (simpler, a little more memory).
_SAC_SAVE = {
    getattr(torch.ops.aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(torch.ops.aten, name)
}


def _sac_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op in _SAC_SAVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def wrap_block(block: torch.nn.Module, *, config: ParallelConfig) -> torch.nn.Module:
    """Activation checkpointing (``parallel.activation_checkpointing`` and its mode: full or
    selective), then ``torch.compile`` (``parallel.compile``) of the wrapped block, before FSDP:
    torchtitan's order (``apply_ac`` before ``apply_compile``, torchtitan/models/llama3/infra/
    parallelize.py), so the compiled graph holds the recompute and the selective policy sees
    the block's own ops, not one opaque compiled call."""
    mode = config.activation_checkpointing_mode if config.activation_checkpointing else "none"
    wrapped = block
    if mode == "full":
        wrapped = checkpoint_wrapper(block)
    elif mode == "selective":
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        wrapped = checkpoint_wrapper(
            block, context_fn=partial(create_selective_checkpoint_contexts, _sac_policy)
        )
    if config.compile:
        wrapped.compile()  # in place: state-dict keys stay those of the uncompiled module
    return wrapped


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


def process_group_backend(device: torch.device, *, cpu_collectives: bool) -> str:
    """gloo on CPU; NCCL on a GPU, with gloo beside it for CPU tensors when
    ``cpu_collectives`` (torch's ``dcp.async_save`` refuses a group without a CPU backend:
    "A CPU backend must be enabled for async save", ``state_dict_saver.py``, 2.11 and 2.13)."""
    if device.type != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"


def dist_env_from_environment(config: ParallelConfig, *, cpu_collectives: bool) -> DistEnv:
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = resolve_device(config, local_rank=local_rank)
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=process_group_backend(device, cpu_collectives=cpu_collectives),
    )


STORE_POLL_S = 0.02
"""How often a rank polls for rank 0's store to listen: short beside TCPStore's own retry
backoff, and 50 connection attempts a second per rank while it waits (a refused connect is one
SYN and one RST)."""


def await_rank0_store(*, host: str, port: int, timeout_s: float) -> bool:
    """Wait until ``host:port`` accepts TCP connections (True), or ``timeout_s`` passes (False:
    the process group's own connect then fails with its timeout error, naming the store).

    Under ft_launcher (``TORCHELASTIC_USE_AGENT_STORE=False``: NVRx's launcher shares its
    rendezvous store only for the static backend, ``fault_tolerance/launcher.py``) rank 0
    creates the process group's TCPStore itself, after its imports, and every other rank
    connects to it. A TCPStore client that finds nothing listening retries only after its own
    backoff: 0.4-0.6 s after the server came up, measured here (torch 2.13), at every in-job
    restart, since the restarted ranks all race rank 0. A plain connect is cheap to repeat, so
    the client is only created once the port listens."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(1.0, timeout_s)):
                return True
        except OSError:  # refused (not listening yet), or the name not resolvable yet
            if time.monotonic() >= deadline:
                return False
            time.sleep(STORE_POLL_S)


def _rank0_hosts_store() -> bool:
    """env:// rendezvous where rank 0 creates the store (not torchrun's shared agent store)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "False") != "True"


def init_process_group(env: DistEnv, *, timeout_s: float, store: dist.Store | None = None) -> None:
    """Create the default process group (env:// rendezvous unless a store is given)."""
    if env.is_cuda:
        torch.cuda.set_device(env.device)
    if store is None and env.rank != 0 and _rank0_hosts_store() and "MASTER_PORT" in os.environ:
        await_rank0_store(
            host=os.environ.get("MASTER_ADDR", "localhost"),
            port=int(os.environ["MASTER_PORT"]),
            timeout_s=timeout_s,
        )
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
    model_factory,
    *,
    config: ParallelConfig,
    env: DistEnv,
    seed: int,
    initialize: bool = True,
) -> tuple[Transformer, DeviceMesh]:
    """Build the model, apply activation checkpointing / compile and FSDP2, materialise it on
    the device.

    ``initialize=False`` when a checkpoint will be loaded into it right away (resume): the
    parameters are not initialised (a meta-built model's memory is left as allocated), only the
    non-persistent buffers (the rotary table) are computed, since no checkpoint holds them.
    """
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
        if initialize:
            model.init_weights()
    for index, block in enumerate(model.layers):
        model.layers[index] = wrap_block(block, config=config)
    policy = mixed_precision_policy(config, env)
    shard = partial(fully_shard, mesh=mesh, mp_policy=policy)
    shard(model.tok_embeddings, reshard_after_forward=config.reshard_after_forward)
    # A block's inputs are the hidden state (already in the compute dtype: the embedding unit's
    # output) and the fp32 rotary table, which FSDP2's default input cast would turn to bf16 on
    # a GPU and leave fp32 on CPU (``cast_forward_inputs``, ``_fsdp_state.py``).
    block_policy = dataclasses.replace(policy, cast_forward_inputs=False)
    for block in model.layers:
        fully_shard(
            block,
            mesh=mesh,
            mp_policy=block_policy,
            reshard_after_forward=config.reshard_after_forward,
        )
    # Norm + output: the last forward and the first backward, so their gathered parameters are
    # kept between the two (torchtitan does the same).
    shard([model.norm, model.output], reshard_after_forward=False)
    # The root owns no parameters now; it still drives the units' prefetch and the
    # gradient-sync switch (``set_requires_gradient_sync``).
    shard(model, reshard_after_forward=False)
    if config.meta_init:
        model.to_empty(device=env.device)
        torch.manual_seed(seed)
        if initialize:
            model.init_weights()
        else:
            model.init_buffers()
    elif env.is_cuda:
        model.to(env.device)
    return model, mesh


def initialize_weights(
    model: Transformer, model_factory, *, config: ParallelConfig, seed: int
) -> None:
    """Initialise a model built with ``initialize=False`` to exactly what ``initialize=True``
    gives (same seed, same RNG calls), for a resume that found nothing to load after all.

    Meta path (CUDA): the sharded parameters are initialised in place, as the build does.
    Otherwise the build initialises the full model before ``fully_shard`` keeps each rank's
    slice; here the same full model is built and initialised once more and loaded as a full
    state dict, each rank keeping its slice (torch's ``set_model_state_dict`` with
    ``full_state_dict=True``; it maps the activation-checkpoint and compile wrappers' names).
    """
    torch.manual_seed(seed)
    if config.meta_init:
        model.init_weights()
        return
    full = model_factory()
    full.init_weights()
    set_model_state_dict(
        model, full.state_dict(), options=StateDictOptions(full_state_dict=True, strict=True)
    )


def set_cpu_threads(config: ParallelConfig, env: DistEnv) -> None:
    if not env.is_cuda:
        torch.set_num_threads(config.cpu_threads)
