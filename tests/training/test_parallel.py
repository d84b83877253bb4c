"""FSDP2 learning tests with real multi-process torch.distributed (gloo on CPU, no mocks).

Run: ``.venv/bin/pytest tests/training/test_parallel.py`` (about a minute on 2 cores).
The ``gpu`` test runs only where CUDA is available.

Four short runs of a tiny Llama on a learnable corpus share one module fixture:

- ``w2``:      2 ranks x micro 4 x accum 1 (the default NVRx async checkpoint engine)
- ``w2_again``: the same command again (determinism)
- ``w1``:      1 rank  x micro 4 x accum 2 (same global batch of 8, sync checkpoints)
- ``w2_accum``: 2 ranks x micro 2 x accum 2 (same global batch; exercises no-sync micro-batches),
  with activation checkpointing and ``reshard_after_forward=false`` (ZeRO-2): neither may
  change the math nor the checkpoint's keys

By the sampler's layout (training/data.py) all four see the same 8 samples at every step, so
their parameters after N steps must agree to float tolerance, and the repeated run bit for bit.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch
from support import TINY_MODEL, final_state, read_losses, read_metrics, run_torchrun

from training.config import ParallelConfig
from training.exits import ConfigError
from training.parallel import (
    DistEnv,
    build_sharded_model,
    dist_env_from_environment,
    mixed_precision_policy,
    resolve_device,
)
from training.trainer import lr_at

STEPS = 12


def _args(corpus: Path, *extra: str) -> list[str]:
    return [
        "--recipe",
        "debug_cpu",
        f"--data.path={corpus}",
        f"--train.steps={STEPS}",
        "--checkpoint.interval=0",
        "--optim.warmup_steps=2",
        *TINY_MODEL,
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fsdp_runs")
    plans = {
        "w2": (2, ["--train.micro_batch_size=4", "--train.grad_accum_steps=1"]),
        "w2_again": (2, ["--train.micro_batch_size=4", "--train.grad_accum_steps=1"]),
        "w1": (
            1,
            [
                "--train.micro_batch_size=4",
                "--train.grad_accum_steps=2",
                "--checkpoint.engine=sync",
            ],
        ),
        "w2_accum": (
            2,
            [
                "--train.micro_batch_size=2",
                "--train.grad_accum_steps=2",
                "--checkpoint.engine=sync",
                "--parallel.activation_checkpointing=true",
                "--parallel.reshard_after_forward=false",
            ],
        ),
    }
    done = {}
    for name, (nproc, extra) in plans.items():
        result = run_torchrun(
            nproc=nproc, run_dir=root / name, args=_args(corpus, *extra), timeout=100
        )
        assert result.returncode == 0, f"run {name} failed:\n{result.output[-4000:]}"
        done[name] = root / name
    return done


def _model_tensors(state: dict) -> dict[str, torch.Tensor]:
    model = {k: v for k, v in state.items() if k.startswith("trainer.model.")}
    assert model, f"no model tensors in {sorted(state)[:5]}"
    return model


@pytest.mark.distributed
@pytest.mark.timeout(420)  # includes the module fixture: four runs, 100 s each at most
def test_two_ranks_learn(runs: dict[str, Path]) -> None:
    records = read_metrics(runs["w2"])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in records]
    assert all(torch.isfinite(torch.tensor(losses)))
    first, last = statistics.mean(losses[:5]), statistics.mean(losses[-5:])
    assert last < first - 1.0, f"loss did not fall: first5={first:.3f} last5={last:.3f}"


@pytest.mark.distributed
@pytest.mark.timeout(420)  # includes the module fixture: four runs, 100 s each at most
def test_final_checkpoint_is_at_last_step(runs: dict[str, Path]) -> None:
    state = final_state(runs["w2"])
    assert int(state["trainer.step"]) == STEPS
    assert int(state["trainer.sampler.consumed_samples"]) == STEPS * 8


@pytest.mark.distributed
@pytest.mark.timeout(420)  # includes the module fixture: four runs, 100 s each at most
@pytest.mark.parametrize("other", ["w1", "w2_accum"])
def test_sharded_matches_single_process(runs: dict[str, Path], other: str) -> None:
    """Same global batch, different split over ranks and micro-batches: same model."""
    reference = _model_tensors(final_state(runs["w2"]))
    candidate = _model_tensors(final_state(runs[other]))
    assert sorted(reference) == sorted(candidate)
    for key, tensor in reference.items():
        torch.testing.assert_close(candidate[key], tensor, rtol=1e-4, atol=1e-5, msg=key)
    # The losses agree too (the mean over the same 8 samples, summed in another order).
    torch.testing.assert_close(
        torch.tensor(read_losses(runs[other])),
        torch.tensor(read_losses(runs["w2"])),
        rtol=1e-4,
        atol=1e-5,
    )


@pytest.mark.distributed
@pytest.mark.timeout(420)  # includes the module fixture: four runs, 100 s each at most
def test_same_seed_same_result(runs: dict[str, Path]) -> None:
    assert read_losses(runs["w2"]) == read_losses(runs["w2_again"])  # exact float equality
    a, b = final_state(runs["w2"]), final_state(runs["w2_again"])
    assert sorted(a) == sorted(b)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), key
        else:
            assert value == b[key], key


@pytest.mark.gpu
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_cuda_bf16_fsdp_step(corpus: Path, tmp_path: Path) -> None:
    """The same FSDP2 run on CUDA with bf16 mixed precision (fp32 reduce) learns too."""
    nproc = min(2, torch.cuda.device_count())
    micro = 8 // nproc
    result = run_torchrun(
        nproc=nproc,
        run_dir=tmp_path / "cuda",
        args=_args(
            corpus,
            "--parallel.device=cuda",
            "--parallel.mixed_precision=bf16",
            f"--train.micro_batch_size={micro}",
            "--checkpoint.engine=sync",
        ),
        timeout=280,
    )
    assert result.returncode == 0, result.output[-4000:]
    losses = read_losses(tmp_path / "cuda")
    assert len(losses) == STEPS
    assert all(torch.isfinite(torch.tensor(losses)))
    assert statistics.mean(losses[-5:]) < statistics.mean(losses[:5]) - 0.5
    state = final_state(tmp_path / "cuda")
    # Master weights stay fp32 under the bf16 policy.
    assert all(v.dtype == torch.float32 for v in _model_tensors(state).values())


# ---------------------------------------------------------------------------------------------
# unit tests (no processes)
# ---------------------------------------------------------------------------------------------


def _cpu_env(world_size: int = 2) -> DistEnv:
    return DistEnv(
        rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"), backend="gloo"
    )


def test_meta_init_is_refused_off_cuda() -> None:
    """On CPU, DTensor random init would give every rank's shard the same values."""
    config = ParallelConfig(device="cpu", mixed_precision="fp32", meta_init=True)
    with pytest.raises(ConfigError) as info:
        build_sharded_model(lambda: None, config=config, env=_cpu_env(), seed=0)
    assert info.value.field_path == "parallel.meta_init"


def test_device_and_precision_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    env = dist_env_from_environment(ParallelConfig(device="cpu"), cpu_collectives=False)
    assert (env.rank, env.world_size, env.local_rank) == (3, 4, 1)
    assert env.device == torch.device("cpu") and env.backend == "gloo" and not env.is_cuda
    fp32 = mixed_precision_policy(ParallelConfig(mixed_precision="auto"), env)
    assert fp32.param_dtype is None and fp32.reduce_dtype is None
    bf16 = mixed_precision_policy(ParallelConfig(mixed_precision="bf16"), env)
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype == torch.float32
    if not torch.cuda.is_available():
        assert resolve_device(ParallelConfig(device="auto"), local_rank=0).type == "cpu"
        with pytest.raises(ConfigError) as info:
            resolve_device(ParallelConfig(device="cuda"), local_rank=0)
        assert info.value.field_path == "parallel.device"


def test_lr_schedule() -> None:
    kw = {"peak": 1.0, "warmup": 4, "total": 14, "min_ratio": 0.1}
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_at(9, **kw) == pytest.approx(0.55)  # half-way down the cosine
    assert lr_at(14, **kw) == pytest.approx(0.1)
    assert lr_at(100, **kw) == pytest.approx(0.1)  # past the end: stays at the floor
    values = [lr_at(s, **kw) for s in range(4, 15)]
    assert values == sorted(values, reverse=True)
    assert lr_at(0, peak=2.0, warmup=0, total=10, min_ratio=0.0) == pytest.approx(2.0)


def _tiny_model_config():
    from training.config import ModelConfig

    return ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def _build(config: ParallelConfig, *, initialize: bool = True):
    from training.model import Transformer

    model_config = _tiny_model_config()
    return build_sharded_model(
        lambda: Transformer(model_config),
        config=config,
        env=_cpu_env(world_size=1),
        seed=0,
        initialize=initialize,
    )[0]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_embeddings_and_head_are_their_own_fsdp_units(one_rank_group) -> None:
    """torchtitan's units: embeddings, each block, norm + output; the root owns no parameter
    (before, embeddings and output sat unsharded in the root for the whole step)."""
    from torch.distributed.fsdp import FSDPModule

    model = _build(ParallelConfig(device="cpu", mixed_precision="fp32"))
    for unit in (model.tok_embeddings, *model.layers, model.norm, model.output):
        assert isinstance(unit, FSDPModule), type(unit)
    root_group = model._get_fsdp_state()._fsdp_param_group
    assert root_group is None, "the root unit should hold no parameters"
    head = model.output._get_fsdp_state()._fsdp_param_group
    grouped = {id(p.sharded_param) for p in head.fsdp_params}
    assert grouped == {id(model.norm.weight), id(model.output.weight)}
    assert head.post_forward_mesh_info is None  # kept gathered from forward into backward


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_resume_build_skips_init_weights(one_rank_group, monkeypatch: pytest.MonkeyPatch) -> None:
    from training.model import Transformer

    calls: list[str] = []
    original = Transformer.init_weights
    monkeypatch.setattr(
        Transformer, "init_weights", lambda self: (calls.append("init"), original(self))[1]
    )
    _build(ParallelConfig(device="cpu", mixed_precision="fp32"), initialize=False)
    assert calls == []
    _build(ParallelConfig(device="cpu", mixed_precision="fp32"))
    assert calls == ["init"]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_chunked_loss_under_fsdp_gives_the_same_gradients(one_rank_group) -> None:
    """The chunked loss runs inside the FSDP head unit: its gradient reduce-scatter must wait
    for every chunk's backward. The sharded gradients equal the unchunked loss's."""
    config = ParallelConfig(device="cpu", mixed_precision="fp32")
    tokens = torch.randint(0, 97, (2, 15), generator=torch.Generator().manual_seed(2))

    def grads(chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model = _build(config)
        loss = model(tokens[:, :-1], tokens[:, 1:], loss_chunk_tokens=chunk)
        loss.backward()
        return loss.detach(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    whole_loss, whole = grads(0)
    chunked_loss, chunked = grads(6)
    torch.testing.assert_close(chunked_loss, whole_loss, rtol=1e-6, atol=1e-6)
    for name, grad in whole.items():
        torch.testing.assert_close(chunked[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("checkpointing", [False, True])
def test_initialize_weights_later_equals_initializing_at_build(
    one_rank_group, checkpointing: bool
) -> None:
    """A resume that finds nothing to load initialises the weights after the build: the result
    is bit-identical to a build that initialised them (and differs from the uninitialised one,
    so the comparison can fail)."""
    from training.model import Transformer
    from training.parallel import initialize_weights

    config = ParallelConfig(
        device="cpu", mixed_precision="fp32", activation_checkpointing=checkpointing
    )

    def full_state(model) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().clone() for n, p in model.named_parameters()}

    reference = full_state(_build(config))
    later = _build(config, initialize=False)
    torch.manual_seed(1234)  # whatever the RNG went through since the build
    for param in later.parameters():
        param.data.to_local().fill_(0.5)
    assert full_state(later).keys() == reference.keys()
    assert any(not torch.equal(v, reference[k]) for k, v in full_state(later).items())
    model_config = _tiny_model_config()
    initialize_weights(later, lambda: Transformer(model_config), config=config, seed=0)
    after = full_state(later)
    for name, value in reference.items():
        assert torch.equal(after[name], value), name
    assert torch.equal(torch.get_rng_state(), _rng_after_build(config))


def _rng_after_build(config: ParallelConfig) -> torch.Tensor:
    _build(config)
    return torch.get_rng_state()


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_the_gradients(one_rank_group, mode: str) -> None:
    """Full and selective recompute change memory, never the math: same loss and gradients as
    the plain blocks, and the same parameter names (checkpoints stay interchangeable)."""

    def grads(config: ParallelConfig) -> tuple[float, dict[str, torch.Tensor]]:
        model = _build(config)
        tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.item(), {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    plain_loss, plain = grads(ParallelConfig(device="cpu", mixed_precision="fp32"))
    ac_loss, ac = grads(
        ParallelConfig(
            device="cpu",
            mixed_precision="fp32",
            activation_checkpointing=True,
            activation_checkpointing_mode=mode,
        )
    )
    assert ac_loss == pytest.approx(plain_loss, rel=1e-6)
    strip = "._checkpoint_wrapped_module"
    assert {n.replace(strip, "") for n in ac} == set(plain)
    for name, grad in ac.items():
        torch.testing.assert_close(grad, plain[name.replace(strip, "")], rtol=1e-5, atol=1e-6)


def test_parallel_config_validates_the_new_options() -> None:
    with pytest.raises(ConfigError) as info:
        ParallelConfig(activation_checkpointing_mode="some")  # type: ignore[arg-type]
    assert info.value.field_path == "parallel.activation_checkpointing_mode"
    with pytest.raises(ConfigError) as info:
        ParallelConfig(device="cpu", compile=True)
    assert info.value.field_path == "parallel.compile"


# ---------------------------------------------------------------------------------------------
# rank 0's store: the other ranks wait for it to listen
# ---------------------------------------------------------------------------------------------


def test_await_rank0_store_returns_once_the_port_listens() -> None:
    """Nothing listening: False after the timeout. A listener that appears later: True."""
    import socket
    import threading

    from support import free_port

    from training.parallel import await_rank0_store

    port = free_port()
    assert await_rank0_store(host="127.0.0.1", port=port, timeout_s=0.2) is False
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(0.3)
        server.bind(("127.0.0.1", port))
        server.listen()

    thread = threading.Thread(target=listen_later)
    thread.start()
    try:
        assert await_rank0_store(host="127.0.0.1", port=port, timeout_s=30) is True
    finally:
        thread.join()
        server.close()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_rank1_before_rank0_waits_for_its_store_then_forms_the_group(tmp_path: Path) -> None:
    """Two real processes, gloo over env:// with rank 0 creating the store (as under
    ft_launcher), rank 1 started 1 s before rank 0: the group forms and all-reduces, and rank 1
    polled the store's port from Python before its TCPStore client connected (the wait that
    keeps the client out of TCPStore's retry backoff, 0.4-0.6 s here; ``bench.restart`` shows
    the process-group phase). Rank 0 creates the store and never polls."""
    import subprocess
    import sys

    from support import REPO_ROOT, free_port, subprocess_env

    port = free_port()
    probe = REPO_ROOT / "tests" / "training" / "probes" / "store_race_probe.py"
    env = subprocess_env(PYTHONPATH=str(REPO_ROOT))
    procs = [
        subprocess.Popen(
            [sys.executable, str(probe), str(rank), str(port), delay, str(tmp_path)], env=env
        )
        for rank, delay in ((1, "0"), (0, "1.0"))
    ]
    assert [p.wait(timeout=100) for p in procs] == [0, 0]
    results = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)}
    assert results[0]["sum"] == results[1]["sum"] == 3.0
    assert results[1]["store_polls"] >= 1
    assert results[0]["store_polls"] == 0


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_rotary_table_stays_fp32_under_bf16_mixed_precision(one_rank_group) -> None:
    """FSDP2 casts a unit's floating-point forward inputs to its param dtype by default: the
    blocks' rotary table (passed to each block's forward) became bf16 on a GPU and stayed fp32
    on CPU. The blocks' units no longer cast their inputs: the table reaches the attention in
    fp32 while the hidden state still computes in bf16 (checked here with the bf16 policy on
    CPU, the same FSDP2 code path as on a GPU)."""
    model = _build(ParallelConfig(device="cpu", mixed_precision="bf16"))
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def record(module, args) -> None:
        x, rope = args
        seen.append((x.dtype, rope.dtype))

    for block in model.layers:
        block.attention.register_forward_pre_hook(record)
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    model(tokens[:, :-1]).float().sum().backward()
    assert seen and all(rope == torch.float32 for _, rope in seen), seen
    assert all(x == torch.bfloat16 for x, _ in seen), "the block still computes in bf16"


def test_compile_wraps_the_activation_checkpoint_wrapper_as_torchtitan_does() -> None:
    """torchtitan applies activation checkpointing, then compiles the wrapped block: the
    compiled graph holds the recompute, and the selective policy sees the block's ops. (Before,
    the block was compiled first and then wrapped.) Names stay those of the plain block."""
    from training.model import Block
    from training.parallel import wrap_block

    for mode in ("full", "selective"):
        block = Block(_tiny_model_config())
        config = ParallelConfig(  # compile is a GPU option; wrapping touches no device
            device="cuda",
            activation_checkpointing=True,
            activation_checkpointing_mode=mode,
            compile=True,
        )
        wrapped = wrap_block(block, config=config)
        assert wrapped is not block and wrapped._checkpoint_wrapped_module is block
        assert wrapped._compiled_call_impl is not None, "the wrapper is what is compiled"
        assert block._compiled_call_impl is None, "not the block inside it"
        plain = {k.replace("_checkpoint_wrapped_module.", "") for k in wrapped.state_dict()}
        assert plain == set(block.state_dict())
    bare = Block(_tiny_model_config())
    compiled = wrap_block(bare, config=ParallelConfig(device="cuda", compile=True))
    assert compiled is bare and bare._compiled_call_impl is not None


def test_torch_async_gets_a_cpu_backend_beside_nccl() -> None:
    """torch's async_save refuses a process group without a CPU backend ("A CPU backend must be
    enabled for async save"): with engine torch_async a GPU job's group is
    "cpu:gloo,cuda:nccl"; every other engine keeps NCCL alone, and CPU jobs gloo."""
    from training.checkpoint.manager import needs_cpu_collectives
    from training.config import CheckpointConfig
    from training.parallel import process_group_backend

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    torch_async = needs_cpu_collectives(CheckpointConfig(engine="torch_async"))
    assert torch_async and not needs_cpu_collectives(CheckpointConfig(engine="nvrx"))
    assert process_group_backend(cuda, cpu_collectives=torch_async) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(cuda, cpu_collectives=False) == "nccl"
    assert process_group_backend(cpu, cpu_collectives=True) == "gloo"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compiled_checkpointed_block_keeps_the_math(mode: str) -> None:
    """The compiled activation-checkpoint wrapper (inductor, here on CPU; the config keeps
    compile for CUDA, the wrapping is the same) gives the plain block's output and input
    gradient: the recompute inside the compiled graph changes memory, not results."""
    from training.config import ModelConfig
    from training.model import Block, rotary_tables
    from training.parallel import wrap_block

    config = ModelConfig(dim=64, n_layers=1, max_seq_len=32)
    torch.manual_seed(0)
    block, plain = Block(config), Block(config)
    plain.load_state_dict(block.state_dict())
    wrapped = wrap_block(
        block,
        config=ParallelConfig(
            device="cuda",
            activation_checkpointing=True,
            activation_checkpointing_mode=mode,
            compile=True,
        ),
    )
    rope = rotary_tables(head_dim=config.head_dim, max_seq_len=32, theta=config.rope_theta)
    x = torch.randn(2, 16, 64, requires_grad=True)
    out = wrapped(x, rope)
    out.square().sum().backward()
    grad, x.grad = x.grad.clone(), None
    expected = plain(x, rope)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, x.grad, rtol=1e-4, atol=1e-4)
