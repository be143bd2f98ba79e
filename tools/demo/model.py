"""A small GPT-style causal language model over byte tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    """Model shape; the vocabulary is bytes."""

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    layers: int = 4
    heads: int = 4


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.norm2(x))))


class GPT(nn.Module):
    """Token + position embedding, pre-norm blocks, final norm, head tied to the embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.heads:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by heads {cfg.heads}")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.apply(self._init)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance flat.
        for block in self.blocks:
            for layer in (block.proj, block.out):
                nn.init.normal_(layer.weight, std=0.02 / (2 * cfg.layers) ** 0.5)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: Tensor) -> Tensor:
        """Logits of shape (batch, time, vocab) for byte tokens of shape (batch, time)."""
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tok.weight.t()

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-byte cross-entropy in nats, computed in fp32 whatever the model's dtype."""
        logits = self(idx)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
