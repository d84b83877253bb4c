"""The Llama-style decoder (training/model.py): shapes, GQA, causality, rotary, counts.

Run: ``.venv/bin/pytest tests/training/test_model.py`` (a few seconds, CPU only).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from training.config import ModelConfig
from training.model import (
    Transformer,
    apply_rotary,
    count_parameters,
    flops_per_token,
    rotary_tables,
)

SMALL = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=16)


def _model(config: ModelConfig = SMALL, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(config)
    model.init_weights()
    return model.eval()


def test_forward_shapes() -> None:
    model = _model()
    tokens = torch.randint(0, SMALL.vocab_size, (3, 10))
    logits = model(tokens)
    assert logits.shape == (3, 10, SMALL.vocab_size)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    attn = model.layers[0].attention
    assert attn.wq.weight.shape == (SMALL.n_heads * SMALL.head_dim, SMALL.dim)
    assert attn.wk.weight.shape == (SMALL.n_kv_heads * SMALL.head_dim, SMALL.dim)
    assert attn.wv.weight.shape == (SMALL.n_kv_heads * SMALL.head_dim, SMALL.dim)
    assert model.layers[0].feed_forward.w1.weight.shape == (SMALL.ffn_dim, SMALL.dim)
    assert model.rope.shape == (SMALL.max_seq_len, SMALL.head_dim // 2, 2)
    assert "rope" not in model.state_dict()  # recomputed, never saved


def test_ffn_dim_derivation() -> None:
    assert ModelConfig(dim=128, multiple_of=32).ffn_dim == 352  # 8/3*128 = 341.3 -> 352
    assert ModelConfig(dim=4096, multiple_of=256).ffn_dim == 11008  # Llama-2 7B
    assert ModelConfig(dim=64, ffn_hidden=100).ffn_dim == 100


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    """GQA: query head h reads kv head h // (n_heads / n_kv_heads)."""
    gqa = _model()
    mha_config = dataclasses.replace(SMALL, n_kv_heads=SMALL.n_heads)
    mha = Transformer(mha_config).eval()
    group = SMALL.n_heads // SMALL.n_kv_heads
    state = gqa.state_dict()
    for key in list(state):
        if key.endswith(("attention.wk.weight", "attention.wv.weight")):
            per_head = state[key].view(SMALL.n_kv_heads, SMALL.head_dim, SMALL.dim)
            state[key] = per_head.repeat_interleave(group, dim=0).reshape(-1, SMALL.dim)
    mha.load_state_dict(state)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(mha(tokens), gqa(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("position", [0, 5, 11])
def test_causal(position: int) -> None:
    """Changing token t changes no logits before t (and does change t's)."""
    model = _model()
    tokens = torch.randint(1, SMALL.vocab_size, (2, 12))
    changed = tokens.clone()
    changed[:, position] = (changed[:, position] + 7) % SMALL.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :position], b[:, :position], rtol=0, atol=0)
    assert not torch.allclose(a[:, position], b[:, position])


def test_rotary_preserves_norm_and_is_relative() -> None:
    table = rotary_tables(head_dim=8, max_seq_len=32, theta=10000.0)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def at(x: torch.Tensor, pos: int) -> torch.Tensor:
        padded = torch.zeros(1, pos + 1, 1, 8)
        padded[:, pos] = x[:, 0]
        return apply_rotary(padded, table)[0, pos, 0]

    torch.testing.assert_close(at(q, 9).norm(), q.norm())
    score_a = at(q, 7) @ at(k, 3)  # distance 4
    score_b = at(q, 20) @ at(k, 16)  # distance 4
    torch.testing.assert_close(score_a, score_b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(apply_rotary(q, table), q)  # position 0: identity


def test_init_weights_is_seeded_and_shaped() -> None:
    a, b, c = _model(seed=1), _model(seed=1), _model(seed=2)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.output.weight, c.output.weight)
    assert torch.equal(a.norm.weight, torch.ones(SMALL.dim))
    big = _model(dataclasses.replace(SMALL, dim=256, n_heads=8, n_kv_heads=4), seed=0)
    assert big.output.weight.std().item() == pytest.approx(256**-0.5, rel=0.15)
    assert big.layers[0].attention.wq.weight.std().item() == pytest.approx(0.02, rel=0.15)


CONFIGS = [
    SMALL,
    ModelConfig(),  # debug_cpu's model
    ModelConfig(dim=64, n_layers=3, n_heads=8, n_kv_heads=8, ffn_hidden=200),  # MHA
    ModelConfig(dim=96, n_layers=1, n_heads=6, n_kv_heads=1, vocab_size=1000),  # MQA
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"d{c.dim}l{c.n_layers}kv{c.n_kv_heads}")
def test_count_parameters_matches_numel(config: ModelConfig) -> None:
    model = Transformer(config)
    assert count_parameters(config) == sum(p.numel() for p in model.parameters())


def test_flops_per_token() -> None:
    config = ModelConfig()
    n = count_parameters(config)
    non_embedding = n - config.vocab_size * config.dim
    f128 = flops_per_token(config, seq_len=128)
    f256 = flops_per_token(config, seq_len=256)
    assert 6 * non_embedding < f128 < 6 * n + 12 * config.n_layers * config.dim * 128 + 1
    # Attention work grows linearly with the sequence: 12 * layers * dim per extra token.
    assert f256 - f128 == pytest.approx(12 * config.n_layers * config.dim * 128)
    # 8B-class Llama at 8k: about 6 * 7.5e9 + attention, i.e. 4.5e10 .. 6e10 FLOPs per token.
    llama8b = ModelConfig(
        vocab_size=128256,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_hidden=14336,
        max_seq_len=8192,
    )
    assert 4.5e10 < flops_per_token(llama8b, seq_len=8192) < 6e10


def test_flops_per_token_by_hand() -> None:
    """6 N + 12 L H Q T, worked out by hand for a small GQA config (dim 64, 2 layers, 4 heads of
    16, 2 kv heads, ffn 256, vocab 1000) at T = 128."""
    config = ModelConfig(
        vocab_size=1000, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=256
    )
    assert config.head_dim == 16 and config.ffn_dim == 256
    # Per block: wq 64x64 + wo 64x64 = 8192; wk, wv 64x32 each = 4096; w1, w3, w2 64x256 each
    # = 49152; two norms 128: 61568. Two blocks 123136, final norm 64, output 64000.
    n_matmul = 2 * 61568 + 64 + 64000  # = 187200 (the 64000 embedding parameters excluded)
    attention = 12 * 2 * 4 * 16 * 128  # = 196608
    assert n_matmul == 187200 and attention == 196608
    assert flops_per_token(config, seq_len=128) == 6 * 187200 + 196608 == 1319808


def test_init_buffers_restores_the_rotary_table() -> None:
    """A model that is loaded rather than initialised still needs its (unsaved) rotary table."""
    model = _model()
    expected = model.rope.clone()
    model.rope.zero_()
    model.init_buffers()
    torch.testing.assert_close(model.rope, expected)
    assert "rope" not in model.state_dict()


def test_backward_reaches_every_parameter() -> None:
    model = _model().train()
    tokens = torch.randint(0, SMALL.vocab_size, (2, 9))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def _loss_and_grads(model: Transformer, tokens: torch.Tensor, *, chunk: int):
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], tokens[:, 1:], loss_chunk_tokens=chunk)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [1, 5, 8, 29])
def test_chunked_loss_equals_the_whole_batch_loss(chunk: int) -> None:
    """Chunks of any size (uneven last chunk, one token, more than the batch) give the loss and
    the gradients of the unchunked cross-entropy, which is the loss of the logits as before."""
    torch.manual_seed(3)
    model = _model().train()
    tokens = torch.randint(0, SMALL.vocab_size, (2, 13))
    whole, whole_grads = _loss_and_grads(model, tokens, chunk=0)
    logits = model(tokens[:, :-1])
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    assert torch.equal(whole, expected.detach())
    chunked, grads = _loss_and_grads(model, tokens, chunk=chunk)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-6)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_chunked_loss_keeps_no_logits_for_backward() -> None:
    """What autograd saves for backward, seen through saved-tensor hooks: the whole-batch loss
    keeps (tokens x vocab) logits, the chunked loss keeps none (each chunk is recomputed)."""
    config = dataclasses.replace(SMALL, vocab_size=4096)
    model = _model(config).train()
    tokens = torch.randint(0, config.vocab_size, (2, 65))

    def saved_logit_rows(chunk: int) -> list[int]:
        rows: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.ndim >= 2 and t.shape[-1] == config.vocab_size:
                rows.append(t.numel() // config.vocab_size)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens[:, :-1], tokens[:, 1:], loss_chunk_tokens=chunk)
        return rows

    assert max(saved_logit_rows(0)) == 2 * 64
    assert saved_logit_rows(16) == []
