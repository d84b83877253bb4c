"""A Llama-style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention.

Plain PyTorch modules, no custom kernels. FSDP2 units (training/parallel.py): the token
embeddings, each ``Block``, and the final norm with the output projection.
``init_weights`` re-initialises parameters in place, so a model built on the meta device can be
materialised shard by shard after ``fully_shard``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from training.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 for stability under bf16 compute, then cast back.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


def rotary_tables(*, head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """cos/sin tables, shape (max_seq_len, head_dim // 2, 2), float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of x (batch, seq, heads, head_dim) by the position's angle."""
    seq = x.shape[1]
    cos = table[:seq, :, 0].view(1, seq, 1, -1)
    sin = table[:seq, :, 1].view(1, seq, 1, -1)
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        # (batch, heads, seq, head_dim); SDPA broadcasts the kv heads for GQA.
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))

    def init_weights(self, *, std: float, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=out_std)


class SwiGLU(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_dim, bias=False)
        self.w2 = nn.Linear(config.ffn_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, *, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.w3.weight, mean=0.0, std=std)
        nn.init.trunc_normal_(self.w2.weight, mean=0.0, std=out_std)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = SwiGLU(config)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))

    def init_weights(self, *, std: float, out_std: float) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(std=std, out_std=out_std)
        self.feed_forward.init_weights(std=std, out_std=out_std)


def _chunk_loss_sum(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h, weight).float()
    return F.cross_entropy(logits, targets, reduction="sum")


class LMHead(nn.Linear):
    """The output projection. Given targets it returns the mean cross-entropy instead of the
    logits, optionally over chunks of ``chunk_tokens`` tokens: each chunk's logits (and their
    fp32 copy) are recomputed in backward instead of kept, so one chunk's exist at a time. For a
    128k vocabulary that is 8192 x 128256 x (2 + 4) B = 6.3 GB per 8k-token micro-batch
    unchunked, 0.8 GB in 1024-token chunks (torchtune's chunked loss, with recompute).

    The loss is computed inside this module's forward, so FSDP2 has unsharded the weight (the
    head's unit keeps it gathered into backward, ``reshard_after_forward=False``) and the
    gradient reduce-scatter runs after the last chunk's backward (its hook sits on ``h``)."""

    def forward(
        self, h: torch.Tensor, targets: torch.Tensor | None = None, *, chunk_tokens: int = 0
    ) -> torch.Tensor:
        if targets is None:
            return super().forward(h)
        tokens = targets.numel()
        if chunk_tokens <= 0 or chunk_tokens >= tokens:
            return F.cross_entropy(super().forward(h).flatten(0, 1).float(), targets.flatten())
        h, targets = h.flatten(0, 1), targets.flatten()
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, tokens, chunk_tokens):
            end = start + chunk_tokens
            total = total + checkpoint(
                _chunk_loss_sum, h[start:end], self.weight, targets[start:end], use_reentrant=False
            )
        return total / tokens


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = LMHead(config.dim, config.vocab_size, bias=False)
        # Not a parameter and not saved: recomputed from the config wherever the model lives.
        self.register_buffer("rope", self._rope_table(), persistent=False)

    def _rope_table(self) -> torch.Tensor:
        c = self.config
        return rotary_tables(head_dim=c.head_dim, max_seq_len=c.max_seq_len, theta=c.rope_theta)

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        loss_chunk_tokens: int = 0,
    ) -> torch.Tensor:
        """The logits, or with ``targets`` the mean cross-entropy (see :class:`LMHead`)."""
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope)
        return self.output(self.norm(h), targets, chunk_tokens=loss_chunk_tokens)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter in place; works on sharded (DTensor) parameters."""
        # GPT-2/Llama-style: small normal init, residual projections scaled by depth.
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=1.0)
        for layer in self.layers:
            layer.init_weights(std=std, out_std=out_std)
        self.norm.init_weights()
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=self.config.dim**-0.5)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers (the rotary table): no checkpoint holds them, so
        a model that is loaded instead of initialised needs this (after ``to_empty``)."""
        self.rope = self._rope_table().to(self.rope.device)


def count_parameters(config: ModelConfig) -> int:
    """Parameter count computed from the shapes (no allocation)."""
    d, f, v = config.dim, config.ffn_dim, config.vocab_size
    kv = config.n_kv_heads * config.head_dim
    per_block = d * d * 2 + 2 * d * kv + 3 * d * f + 2 * d
    return v * d * 2 + config.n_layers * per_block + d


def flops_per_token(config: ModelConfig, *, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), the PaLM / torchtitan MFU convention::

        flops_per_token = 6 * N + 12 * L * H * Q * T

    - ``N``: parameters taking part in matmuls: every parameter except the token embedding
      (a lookup, no FLOPs); the output projection counts. 6 = 2 FLOPs per multiply-add x
      (1 forward + 2 backward) matmuls.
    - ``12 * L * H * Q * T``: causal self-attention's score (QK^T) and value (AV) matmuls, per
      token, over ``L`` layers of ``H`` heads of ``Q = head_dim``, with ``T = seq_len``: 2
      matmuls forward + 4 backward (6) x 2 FLOPs each. Following PaLM (Appendix B) and
      torchtitan (``get_nparams_and_flops``), the causal mask's sparsity is not subtracted and
      flash attention's backward recompute is not added, so MFU figures compare across
      projects. GQA changes N (smaller wk, wv), not this term: every query head attends.

    MFU = tokens/s x flops_per_token / (peak bf16 FLOP/s x GPUs) (training/runlog/metrics.py).
    """
    n_matmul = count_parameters(config) - config.vocab_size * config.dim
    attention = 12.0 * config.n_layers * config.n_heads * config.head_dim * seq_len
    return 6.0 * n_matmul + attention
