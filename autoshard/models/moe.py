"""Reference mixture-of-experts decoder: LLaMA attention, routed experts with static shapes.

Every shape is static under tracing: tokens go to experts by *capacity-based
dispatch* (GShard's), with one capacity group per sequence. For a sequence of
``s`` tokens, ``k`` experts per token and ``E`` experts, each expert takes at most

    C = ceil(capacity_factor * s * k / E)

tokens of that sequence; a token's ``k`` choices queue in token order and a choice
past its expert's ``C`` is dropped (its weight is lost, as in GShard and Switch).
The block is written with ops that DTensor has sharding rules for:

    scores  = softmax(x W_r) | sigmoid(x W_r)            (B, S, E)
    choice  = topk(scores, k).indices; gate = gather(scores, choice)   (B, S, k)
    slot    = choice * C + (position in the expert's queue), or E*C when dropped
    source  = scatter(full(S), slot, token)              (B, E*C + 1)  which token fills a slot
    x_e     = gather([x; 0], source)                     (B, E*C, D)   dispatch
            -> view (B, E, C, D) -> transpose (E, B, C, D) -> (E, B*C, D)
    y_e     = bmm(silu(bmm(x_e, W1)) * bmm(x_e, W3), W2)  (E, B*C, D)   the experts
    y       = sum_k gate * gather([y_e; 0], slot)        (B, S, D)     combine

Expert parallelism is then an ordinary choice of the plan: a batch-sharded x_e
(``S(1)`` after the transpose) meeting expert weights sharded on ``E`` (``S(0)``)
is a shard-dimension change, which DTensor runs as one ``all_to_all`` per mesh
axis, costed from the profile like every other collective; the way back is the
other ``all_to_all``. Data and tensor parallelism of the experts (weights
replicated or split on the hidden width) are the other choices, per mesh axis.

The load-balance loss (Switch Transformer's, ``E * sum_e f_e P_e``: f the share of
routed choices, P the mean score of each expert) is added, times
``aux_loss_coef``, to the cross-entropy when the model is given ``labels`` (it then
returns the loss, like Hugging Face models); without labels it returns the logits
and the loss is left to the caller.

Attention is the LLaMA block's grouped-query attention; the DeepSeek-V3 preset
keeps its widths, experts and router but stands in multi-head attention (128
heads) for its multi-head latent attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.errors import ConfigError
from autoshard.models.dense import LlamaAttention, LlamaBlock, LlamaConfig, RMSNorm, SwiGLU, init_decoder, rope_buffers


@dataclass
class MoeConfig(LlamaConfig):
    """Shape of a mixture-of-experts decoder: a LLaMA config (its attention; ``ffn_dim`` the
    SwiGLU width of the dense blocks; ``n_layers`` the mixture-of-experts blocks, after
    ``n_dense_layers`` dense ones) and its routed SwiGLU experts."""

    n_dense_layers: int = 0
    """Leading blocks with a dense SwiGLU of width ``ffn_dim`` instead of experts (DeepSeek-V3: 3)."""
    n_experts: int = 8
    """Routed experts per block."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_dim: int = 256
    """SwiGLU hidden width of one expert."""
    n_shared_experts: int = 0
    """Shared experts every token goes through (one SwiGLU of width ``n_shared_experts * expert_dim``)."""
    capacity_factor: float = 1.25
    """Slots per expert and sequence, as a multiple of an even share ``seq * top_k / n_experts``."""
    score: str = "softmax"
    """Router scores: ``softmax`` (Mixtral, Switch) or ``sigmoid`` (DeepSeek-V3)."""
    norm_topk: bool = True
    """Divide the top-k gates by their sum."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balance loss added to the cross-entropy when ``labels`` are given."""

    def __post_init__(self):
        super().__post_init__()
        for name in ("n_experts", "top_k", "expert_dim"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, found {getattr(self, name)}")
        if self.n_dense_layers < 0 or self.n_shared_experts < 0:
            raise ConfigError(f"n_dense_layers and n_shared_experts must be >= 0, found {self.n_dense_layers} "
                              f"and {self.n_shared_experts}")
        if self.top_k > self.n_experts:
            raise ConfigError(f"top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        if self.capacity_factor <= 0:
            raise ConfigError(f"capacity_factor must be > 0, found {self.capacity_factor}")
        if self.score not in ("softmax", "sigmoid"):
            raise ConfigError(f"score: expected 'softmax' or 'sigmoid', found {self.score!r}")

    def capacity(self, seq: int) -> int:
        """Slots per expert for a sequence of ``seq`` tokens (at least 1, at most ``seq``)."""
        return max(1, min(seq, math.ceil(self.capacity_factor * seq * self.top_k / self.n_experts)))


MOE_PRESETS: dict[str, dict] = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=176, n_experts=4, top_k=2, expert_dim=64,
                 n_shared_experts=1, vocab_size=256, max_seq_len=64),
    "mixtral-8x7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, n_experts=8, top_k=2, expert_dim=14336,
                         vocab_size=32000, max_seq_len=4096, rope_theta=1e6),
    "deepseek-v3": dict(dim=7168, n_layers=58, n_dense_layers=3, n_heads=128, n_kv_heads=128, ffn_dim=18432,
                        n_experts=256, top_k=8, expert_dim=2048, n_shared_experts=1, score="sigmoid",
                        vocab_size=129280, max_seq_len=4096, rope_theta=10000.0),
}
"""Mixtral-8x7B's shape, and DeepSeek-V3's (61 blocks: 3 dense, 58 with 256 routed experts and
one shared; multi-head attention in place of its latent attention)."""


class Experts(nn.Module):
    """``n_experts`` SwiGLU experts as stacked weights, run as batched matmuls."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n, hidden, dim))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)

    def forward(self, x):  # (E, tokens, dim)
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)


class MoeLayer(nn.Module):
    """Router, capacity-based dispatch, experts, weighted combine, optional shared expert.
    Returns (output, load-balance loss or ``None`` where ``balance`` is false)."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.dim, cfg.expert_dim)
        self.shared = SwiGLU(cfg.dim, cfg.n_shared_experts * cfg.expert_dim) if cfg.n_shared_experts else None

    def forward(self, x, balance: bool = True):
        cfg = self.cfg
        b, s, d = x.shape
        e, k, cap = cfg.n_experts, cfg.top_k, cfg.capacity(s)
        logits = self.router(x)
        scores = logits.softmax(-1) if cfg.score == "softmax" else logits.sigmoid()
        choice = scores.topk(k, dim=-1).indices
        # The gate reads the scores through gather: its backward is a scatter_add with a sharding rule.
        gate = scores.gather(-1, choice)
        if cfg.norm_topk:
            gate = gate / gate.sum(-1, keepdim=True)
        flat = choice.reshape(b, s * k)
        hot = flat[..., None] == torch.arange(e, device=x.device)
        queue = (hot.long().cumsum(1) * hot).sum(-1) - 1  # place among the choices of the same expert
        kept = queue < cap
        slot = flat * cap + queue.clamp(max=cap - 1)
        token = torch.arange(s, device=x.device)[:, None].expand(s, k).reshape(s * k).expand(b, s * k)
        # Which token fills each slot: a kept choice is the only one to add its token to its slot
        # (a dropped one adds 0 to its clamped slot). An empty slot reads token 0: its expert
        # output is never combined, so it adds nothing, not even to a gradient.
        source = torch.zeros(b, e * cap, dtype=torch.long, device=x.device).scatter_add(1, slot, token * kept)
        xe = x.gather(1, source[..., None].expand(b, e * cap, d))
        xe = xe.view(b, e, cap, d).transpose(0, 1).reshape(e, b * cap, d)
        ye = self.experts(xe)
        ye = ye.view(e, b, cap, d).transpose(0, 1).reshape(b, e * cap, d)
        y = ye.gather(1, slot[..., None].expand(b, s * k, d)).view(b, s, k, d)
        y = (y * (gate * kept.view(b, s, k))[..., None]).sum(2)
        if self.shared is not None:
            y = y + self.shared(x)
        if not balance:
            return y, None
        # Switch's load-balance loss: experts' share of choices times their mean score.
        share = hot.sum((0, 1)) / (b * s * k)
        return y, e * (share * scores.mean((0, 1))).sum()


class MoeBlock(nn.Module):
    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoeLayer(cfg)

    def forward(self, x, aux, cos, sin, rot, mask):
        """(output, ``aux`` plus this block's load-balance loss; ``None`` where ``aux`` is: a
        loss nobody reads would be traced in every layer but the last, so layers would differ)."""
        x = x + self.attn(self.attn_norm(x), cos, sin, rot, mask)
        y, balance = self.moe(self.ffn_norm(x), balance=aux is not None)
        return x + y, None if aux is None else aux + balance


class Moe(nn.Module):
    """Mixture-of-experts decoder. Input: token ids (batch, seq); with ``labels`` (batch, seq) it
    returns the next-token cross-entropy plus ``aux_loss_coef`` times the load-balance loss."""

    def __init__(self, cfg: MoeConfig | None = None):
        super().__init__()
        self.cfg = cfg = cfg or MoeConfig()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        # Two lists, so that each is a group of identical layers that the planner ties.
        self.dense_layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_dense_layers))
        self.layers = nn.ModuleList(MoeBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        rope_buffers(self, cfg)

    def forward(self, tokens, labels=None):
        x = self.embed(tokens)
        tables = (self.rope_cos, self.rope_sin, self.rope_rot, getattr(self, "causal_mask", None))
        for layer in self.dense_layers:
            x = layer(x, *tables)
        aux = None if labels is None else x.new_zeros(())
        for layer in self.layers:
            x, aux = layer(x, aux, *tables)
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        ce = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return ce + self.cfg.aux_loss_coef * aux

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """(Re)initialize in place, sharded or not (the ``init_fn`` for a meta-device model)."""
        init_decoder(self, std)


def moe(preset: str = "tiny", **overrides) -> Moe:
    """A mixture-of-experts model from a preset (``tiny``, ``mixtral-8x7b``, ``deepseek-v3``)
    with field overrides."""
    if preset not in MOE_PRESETS:
        raise ConfigError(f"moe preset: expected one of {sorted(MOE_PRESETS)}, found {preset!r}")
    return Moe(MoeConfig(**{**MOE_PRESETS[preset], **overrides}))
