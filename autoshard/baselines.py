"""Hand-written plans as pins, costed by the same model as ours.

Each baseline fixes the parameters' specs (and the batch's) the way people write
them by hand; the solver then chooses the rest of the graph (activations,
intermediate redistributes) at its best, so a baseline is never costed worse than
its best execution. Ours is unpinned, so it is never dearer than any baseline.

- ``ddp``: parameters replicated, batch split over every axis.
- ``fsdp``: ZeRO-3, every parameter sharded on tensor dim 0 over every axis.
- ``tp``: Megatron on the last axis (column-parallel Q/K/V/up projections on the
  output features, row-parallel output/down projections on the input features,
  vocabulary-parallel embedding and head), data parallel (replicated) on the others.
- ``fsdp_tp``: Megatron on the last axis, FSDP (dim 0, sharded after TP) on the others.
- ``fsdp_tp_ac``: ``fsdp_tp`` with full activation checkpointing of every repeated layer
  (torchtitan's setting for 70B and larger).
"""

from __future__ import annotations

import re

import torch.nn as nn

from autoshard.errors import ConfigError
from costmodel.spec import Spec

#: Module-name patterns of Megatron column-parallel (split output features) linears.
COLUMN = re.compile(r"(^|\.)(wq|wk|wv|w1|w3|q_proj|k_proj|v_proj|gate_proj|up_proj|c_fc|c_attn|query|key|value|"
                    r"fc1|head|lm_head)$")
#: Row-parallel (split input features) linears.
ROW = re.compile(r"(^|\.)(wo|w2|o_proj|down_proj|c_proj|dense|fc2)$")
EMBED = re.compile(r"(^|\.)(embed|embed_tokens|wte|tok_embeddings)$")

BASELINES = ("ddp", "fsdp", "tp", "fsdp_tp", "fsdp_tp_ac")


def baseline_recompute(name: str) -> str:
    """The activation checkpointing a hand-written plan uses (:mod:`autoshard.recompute`)."""
    return "full" if name.endswith("_ac") else "none"


def _param_dims(model: nn.Module):
    """(fqn, param, out-feature dim or None, in-feature dim or None, kind) per parameter."""
    mods = dict(model.named_modules())
    for fqn, p in model.named_parameters():
        owner, _, leaf = fqn.rpartition(".")
        mod = mods.get(owner)
        conv1d = type(mod).__name__ == "Conv1D"  # HF GPT-2 stores (in, out)
        out_dim, in_dim = (1, 0) if conv1d else (0, 1)
        if COLUMN.search(owner):
            kind = "column"
        elif ROW.search(owner):
            kind = "row"
        elif EMBED.search(owner) and p.ndim == 2:
            kind = "embed"
        else:
            kind = "other"
        yield fqn, p, out_dim, in_dim, kind, leaf


def _tp_placement(p, out_dim, in_dim, kind, leaf) -> str:
    if kind == "column":
        return f"S({out_dim})" if p.ndim == 2 or leaf == "bias" else "R"
    if kind == "row":
        return f"S({in_dim})" if p.ndim == 2 else "R"
    if kind == "embed":
        return "S(0)"  # vocabulary-parallel
    return "R"


def baseline_pins(name: str, model: nn.Module, mesh_ndim: int) -> tuple[dict[str, Spec], list[Spec]]:
    """(parameter pins by FQN, input specs) of a hand-written plan on a mesh of ``mesh_ndim`` axes."""
    if name not in BASELINES:
        raise ConfigError(f"baseline: expected one of {BASELINES}, found {name!r}")
    name = name.removesuffix("_ac")
    batch_all = Spec(("S(0)",) * mesh_ndim)
    pins: dict[str, Spec] = {}
    if name in ("ddp", "fsdp"):
        for fqn, p, *_ in _param_dims(model):
            if name == "ddp" or p.shape[0] < 2:
                pins[fqn] = Spec(("R",) * mesh_ndim)
            else:
                pins[fqn] = batch_all
        return pins, [batch_all]
    batch = Spec(("S(0)",) * (mesh_ndim - 1) + ("R",))
    tp_axis = mesh_ndim - 1
    for fqn, p, out_dim, in_dim, kind, leaf in _param_dims(model):
        tp = _tp_placement(p, out_dim, in_dim, kind, leaf)
        if name == "tp" or mesh_ndim == 1:
            pins[fqn] = Spec(("R",) * (mesh_ndim - 1) + (tp,))
            continue
        # FSDP on the data axes shards dim 0 after TP did (torchtitan's order: TP first).
        dp = "S(0)" if p.shape[0] >= 2 else "R"
        placements = (dp,) * (mesh_ndim - 1) + (tp,)
        order = ()
        if dp == "S(0)" and tp == "S(0)":
            order = ((0, (tp_axis,) + tuple(range(mesh_ndim - 1))),)
        pins[fqn] = Spec(placements, order)
    return pins, [batch]
