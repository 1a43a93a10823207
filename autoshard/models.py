"""Reference models: small, dependency-free, traced to ops DTensor has rules for.

Attention is written as matmul + softmax (the math path): the CPU fused kernel
``_scaled_dot_product_flash_attention_for_cpu`` has no sharding rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Two linear layers with a ReLU."""

    def __init__(self, dim: int = 64, hidden: int = 256):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


@dataclass
class TransformerConfig:
    """Shape of a GPT-style decoder."""

    dim: int = 256
    """Model width."""
    n_heads: int = 8
    """Attention heads; must divide ``dim``."""
    n_layers: int = 2
    """Decoder blocks."""
    vocab_size: int = 1024
    """Vocabulary size (0: no embedding or head; inputs are features)."""
    ffn_mult: int = 4
    """FFN hidden width = ffn_mult * dim."""

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, found {self.n_layers}")


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        out = torch.matmul(F.softmax(scores, dim=-1), v)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class FeedForward(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_mult * cfg.dim)
        self.w2 = nn.Linear(cfg.ffn_mult * cfg.dim, cfg.dim)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class TransformerBlock(nn.Module):
    """Pre-norm attention + FFN block."""

    def __init__(self, cfg: TransformerConfig | None = None):
        super().__init__()
        cfg = cfg or TransformerConfig()
        self.attn_norm = nn.LayerNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.dim)
        self.ffn = FeedForward(cfg)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Transformer(nn.Module):
    """GPT-style decoder: embedding, blocks, norm, output head."""

    def __init__(self, cfg: TransformerConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or TransformerConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
