"""Reference models: small, dependency-free, traced to ops DTensor has rules for.

Attention is causal ``F.scaled_dot_product_attention`` (``attention="sdpa"``), as torchtitan's
models run it: the fused kernel (flash; on a CPU or the meta device torch's flash kernel for
CPUs), which keeps its output and the row log-sum-exp, not the ``s x s`` scores
(:mod:`autoshard.graph.attention`). ``attention="math"`` writes it as matmul + softmax + matmul instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.errors import ConfigError


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
    attention: str = "sdpa"
    """``"sdpa"``: causal ``F.scaled_dot_product_attention`` (a fused kernel); ``"math"``: the same
    attention as matmul + softmax + matmul (the scores materialized)."""

    def __post_init__(self):
        _check_attention(self.attention)
        if self.dim % self.n_heads:
            raise ConfigError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_layers < 1:
            raise ConfigError(f"n_layers must be >= 1, found {self.n_layers}")


ATTENTION = ("sdpa", "math")
"""How the reference models compute attention (their configs' ``attention``)."""


def _check_attention(attention: str) -> None:
    if attention not in ATTENTION:
        raise ConfigError(f"attention: expected one of {ATTENTION}, found {attention!r}")


def _math_attention(q, k, v, mask=None):
    """Softmax attention as matmul + softmax + matmul (``mask``: added to the scores)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores + mask
    return torch.matmul(F.softmax(scores, dim=-1), v)


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.attention = cfg.attention
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
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mask = torch.full((s, s), float("-inf"), device=x.device).triu(1)
            out = _math_attention(q, k, v, mask)
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


# ----------------------------------------------------------------------------------------------
# LLaMA style: RMSNorm, SwiGLU, RoPE, grouped-query attention.


@dataclass
class LlamaConfig:
    """Shape of a LLaMA-style decoder (pre-norm, RMSNorm, SwiGLU, RoPE, grouped-query attention)."""

    dim: int = 256
    """Model width."""
    n_layers: int = 2
    """Decoder blocks."""
    n_heads: int = 8
    """Query heads; must divide ``dim``."""
    n_kv_heads: int = 4
    """Key/value heads (grouped-query attention); must divide ``n_heads``."""
    ffn_dim: int = 688
    """SwiGLU hidden width."""
    vocab_size: int = 1024
    """Vocabulary size."""
    max_seq_len: int = 128
    """Longest sequence the RoPE tables and the causal mask cover."""
    rope_theta: float = 500000.0
    """RoPE base frequency."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    attention: str = "sdpa"
    """``"sdpa"``: causal ``F.scaled_dot_product_attention`` with grouped queries (a fused
    kernel); ``"math"``: matmul + softmax + matmul over a causal mask buffer, the key/value
    heads repeated."""

    def __post_init__(self):
        _check_attention(self.attention)
        if self.dim % self.n_heads:
            raise ConfigError(f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})")
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(f"head dim dim/n_heads = {self.dim // self.n_heads} must be even for RoPE")
        for name in ("n_layers", "ffn_dim", "vocab_size", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, found {getattr(self, name)}")


LLAMA_PRESETS: dict[str, dict] = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, vocab_size=256, max_seq_len=64),
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256, max_seq_len=2048),
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256, max_seq_len=2048),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256,
                max_seq_len=2048),
    "405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, vocab_size=128256,
                 max_seq_len=2048),
}
"""LLaMA-3 shapes (1B is LLaMA-3.2-1B's width with an 8192 FFN; 405B is LLaMA-3.1-405B's)."""

GPT2_PRESETS: dict[str, dict] = {
    "tiny": dict(dim=64, n_heads=4, n_layers=2, vocab_size=256),
    "small": dict(dim=768, n_heads=12, n_layers=12, vocab_size=50257),
    "medium": dict(dim=1024, n_heads=16, n_layers=24, vocab_size=50257),
}
"""GPT-2 shapes (vocabulary as released, not padded)."""


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope_tables(cfg: LlamaConfig):
    hd = cfg.dim // cfg.n_heads
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv)
    ang = torch.cat([ang, ang], dim=-1)
    # rotate_half(x) = x @ rot: a signed permutation, so RoPE traces to mul/add/matmul, all of
    # which have DTensor sharding rules (cat/stack of halves would fall back to replicate).
    rot = torch.zeros(hd, hd)
    half = hd // 2
    rot[torch.arange(half) + half, torch.arange(half)] = -1.0
    rot[torch.arange(half), torch.arange(half) + half] = 1.0
    return ang.cos(), ang.sin(), rot


def _rope_and_mask(cfg) -> dict[str, torch.Tensor]:
    cos, sin, rot = _rope_tables(cfg)
    out = {"rope_cos": cos, "rope_sin": sin, "rope_rot": rot}
    if getattr(cfg, "attention", "sdpa") == "math":  # a fused kernel masks by itself
        out["causal_mask"] = torch.full((cfg.max_seq_len, cfg.max_seq_len), float("-inf")).triu(1)
    return out


def rope_buffers(model: nn.Module, cfg) -> None:
    """Register a RoPE decoder's tables (and, for math attention, its causal mask) on ``model``."""
    for name, value in _rope_and_mask(cfg).items():
        # Non-persistent: derived from the config, never part of a checkpoint.
        model.register_buffer(name, value, persistent=False)


@torch.no_grad()
def init_decoder(model: nn.Module, std: float) -> None:
    """A RoPE decoder's weights normal(0, std), norms one, RoPE tables and mask recomputed;
    in place, on plain tensors or DTensors alike."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            p.normal_(0.0, std)
    for name, value in _rope_and_mask(model.cfg).items():
        buf = getattr(model, name)
        if hasattr(buf, "device_mesh"):  # a DTensor: hand it the same placements
            from torch.distributed.tensor import distribute_tensor

            value = distribute_tensor(value, buf.device_mesh, buf.placements)
        buf.copy_(value)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention = cfg.attention
        self.n_heads, self.n_kv = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, rot, mask):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos[:s], sin[:s]
        q = q * cos + torch.matmul(q, rot) * sin
        k = k * cos + torch.matmul(k, rot) * sin
        rep = self.n_heads // self.n_kv
        if self.attention == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)
            return self.wo(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))
        if rep > 1:
            k = k[:, :, None].expand(b, self.n_kv, rep, s, self.head_dim).reshape(b, self.n_heads, s, self.head_dim)
            v = v[:, :, None].expand(b, self.n_kv, rep, s, self.head_dim).reshape(b, self.n_heads, s, self.head_dim)
        out = _math_attention(q, k, v, mask[:s, :s])
        return self.wo(out.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = SwiGLU(cfg.dim, cfg.ffn_dim)

    def forward(self, x, cos, sin, rot, mask):
        x = x + self.attn(self.attn_norm(x), cos, sin, rot, mask)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """LLaMA-style decoder: embedding, blocks, RMSNorm, output head. Input: token ids (batch, seq)."""

    def __init__(self, cfg: LlamaConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or LlamaConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        rope_buffers(self, cfg)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin, self.rope_rot, getattr(self, "causal_mask", None))
        return self.head(self.norm(x))

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """(Re)initialize in place, sharded or not (the ``init_fn`` for a meta-device model)."""
        init_decoder(self, std)


def llama(preset: str = "tiny", **overrides) -> Llama:
    """A LLaMA-style model from a preset (``tiny``, ``1b``, ``8b``, ``70b``) with field overrides."""
    if preset not in LLAMA_PRESETS:
        raise ConfigError(f"llama preset: expected one of {sorted(LLAMA_PRESETS)}, found {preset!r}")
    return Llama(LlamaConfig(**{**LLAMA_PRESETS[preset], **overrides}))


def gpt2(preset: str = "tiny", **overrides) -> Transformer:
    """A GPT-2-style model from a preset (``tiny``, ``small``, ``medium``) with field overrides."""
    if preset not in GPT2_PRESETS:
        raise ConfigError(f"gpt2 preset: expected one of {sorted(GPT2_PRESETS)}, found {preset!r}")
    return Transformer(TransformerConfig(**{**GPT2_PRESETS[preset], **overrides}))
