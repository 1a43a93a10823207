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

- ``fsdp_cp``: torchtitan's FSDP + context parallelism: every parameter sharded over every
  axis, the batch split over all axes but the last, the sequence (dim 1 of the tokens) over
  the last; ``fsdp_cp_ac`` with full activation checkpointing. They apply where the model has
  causal attention and the batch cannot be split over every rank (long sequences:
  :meth:`autoshard.planning.planner.Planner.baseline_names` adds them there).

Models with experts (3-D parameters of a module named ``experts``: expert, in, out
or expert, out, in) get two more, and the others treat expert weights as follows
(DDP: replicated; FSDP: split like any parameter; TP: split on the hidden width,
column-parallel up/gate and row-parallel down projections):

- ``ep_tp``: expert parallelism over the data axes (experts split over their
  product), Megatron TP on the last axis for the rest and for each expert's
  hidden width; batch split over the data axes.
- ``ep_fsdp``: expert parallelism on the last axis (one node's ranks exchange
  tokens), FSDP of the experts (their second dim) on the other axes, FSDP of
  every other parameter and the batch over every axis.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import torch.nn as nn

from autoshard.errors import ConfigError
from autoshard.graph.strategies import splits_fit
from autoshard.planfile import Plan
from costmodel.spec import Spec

#: Module-name patterns of Megatron column-parallel (split output features) linears.
COLUMN = re.compile(r"(^|\.)(wq|wk|wv|w1|w3|q_proj|k_proj|v_proj|gate_proj|up_proj|c_fc|c_attn|query|key|value|"
                    r"fc1|head|lm_head)$")
#: Row-parallel (split input features) linears.
ROW = re.compile(r"(^|\.)(wo|w2|o_proj|down_proj|c_proj|dense|fc2)$")
EMBED = re.compile(r"(^|\.)(embed|embed_tokens|wte|tok_embeddings)$")
#: Modules whose 3-D parameters are stacked experts (expert dim first).
EXPERTS = re.compile(r"(^|\.)experts$")
#: Expert weights that project down to the model width (row-parallel); the others project up.
EXPERT_DOWN = re.compile(r"(w2|down_proj|down|wo)$")

BASELINES = ("ddp", "fsdp", "tp", "fsdp_tp", "fsdp_tp_ac")
#: Hand-written plans for long sequences, asked for by name.
CONTEXT_BASELINES = ("fsdp_cp", "fsdp_cp_ac")
#: Baselines that exist only for models with experts.
EXPERT_BASELINES = ("ep_tp", "ep_fsdp")


def has_experts(model: nn.Module) -> bool:
    return any(kind == "expert" for *_, kind, _ in _param_dims(model))


def baselines_for(model: nn.Module) -> tuple[str, ...]:
    """The hand-written plans that apply to ``model``: the expert-parallel ones where it has experts."""
    return BASELINES + (EXPERT_BASELINES if has_experts(model) else ())


def baseline_recompute(name: str) -> str:
    """The activation checkpointing a hand-written plan uses (:mod:`autoshard.graph.recompute`)."""
    return "full" if name.endswith("_ac") else "none"


def _param_dims(model: nn.Module):
    """(fqn, param, out-feature dim, in-feature dim, kind, leaf name) per parameter; for an
    expert weight both dims are its hidden width's."""
    mods = dict(model.named_modules())
    width = next((p.shape[1] for fqn, p in model.named_parameters()
                  if EMBED.search(fqn.rpartition(".")[0]) and p.ndim == 2), None)
    for fqn, p in model.named_parameters():
        owner, _, leaf = fqn.rpartition(".")
        mod = mods.get(owner)
        conv1d = type(mod).__name__ == "Conv1D"  # HF GPT-2 stores (in, out)
        out_dim, in_dim = (1, 0) if conv1d else (0, 1)
        if EXPERTS.search(owner) and p.ndim == 3:
            kind = "expert"
            # The hidden width is the dim that is not the model's width (the other one).
            hidden = 1 if EXPERT_DOWN.search(leaf) else 2
            if p.shape[1] != p.shape[2] and width is not None and width in (p.shape[1], p.shape[2]):
                hidden = 2 if p.shape[1] == width else 1
            out_dim, in_dim = hidden, hidden
        elif COLUMN.search(owner):
            kind = "column"
        elif ROW.search(owner):
            kind = "row"
        elif EMBED.search(owner) and p.ndim == 2:
            kind = "embed"
        else:
            kind = "other"
        yield fqn, p, out_dim, in_dim, kind, leaf


def _tp_placement(p, out_dim, in_dim, kind, leaf) -> str:
    if kind == "expert":
        return f"S({out_dim})"
    if kind == "column":
        if p.ndim == 2:
            return f"S({out_dim})"
        return "S(0)" if leaf == "bias" else "R"  # a bias has its out-features as its only dim
    if kind == "row":
        return f"S({in_dim})" if p.ndim == 2 else "R"
    if kind == "embed":
        return "S(0)"  # vocabulary-parallel
    return "R"


def _fsdp_dim(p, mesh_shape: tuple[int, ...]) -> str:
    """FSDP's split of ``p`` over every axis of ``mesh_shape``: its first dim the split fits
    (:func:`~autoshard.graph.strategies.splits_fit`: FSDP2 splits dim 0 and pads, which one axis
    may do here; over several axes the ranks must divide the dim, so GPT-2's embedding of 50257
    rows is split on its hidden dim there)."""
    return next((f"S({d})" for d in range(p.ndim) if _fits(p, (f"S({d})",) * len(mesh_shape), mesh_shape)), "R")


def _fits(p, placements: tuple[str, ...], mesh_shape: tuple[int, ...]) -> bool:
    """Whether ``placements`` (one per mesh axis) split ``p`` as plans may (evenly, or unevenly by one axis)."""
    return splits_fit(Spec(placements), tuple(p.shape), mesh_shape)


def baseline_pins(name: str, model: nn.Module, mesh_ndim: int,
                  mesh_shape: tuple[int, ...] | None = None) -> tuple[dict[str, Spec], list[Spec]]:
    """(parameter pins by FQN, input specs) of a hand-written plan on a mesh of ``mesh_ndim`` axes
    (of ``mesh_shape``, where given: FSDP then splits a dim large enough for its ranks)."""
    known = BASELINES + EXPERT_BASELINES + CONTEXT_BASELINES
    if name not in known:
        raise ConfigError(f"baseline: expected one of {known}, found {name!r}")
    if name in EXPERT_BASELINES and not has_experts(model):
        raise ConfigError(f"baseline {name}: the model has no experts (3-D parameters of a module named "
                          f"'experts')")
    shape = tuple(mesh_shape) if mesh_shape is not None else (2,) * mesh_ndim
    name = name.removesuffix("_ac")
    batch_all = Spec(("S(0)",) * mesh_ndim)
    pins: dict[str, Spec] = {}
    if name in ("ddp", "fsdp", "fsdp_cp"):
        for fqn, p, *_ in _param_dims(model):
            pins[fqn] = Spec(("R",) * mesh_ndim) if name == "ddp" else Spec((_fsdp_dim(p, shape),) * mesh_ndim)
        if name == "fsdp_cp":
            return pins, [Spec(("S(0)",) * (mesh_ndim - 1) + ("S(1)",))]
        return pins, [batch_all]
    if name == "ep_fsdp":
        for fqn, p, *_, kind, _leaf in _param_dims(model):
            if kind == "expert":
                # Dim 0 is the experts' (split by EP): FSDP takes the next dim large enough.
                fsdp = next((f"S({d})" for d in (1, 2) if _fits(p, (f"S({d})",) * (mesh_ndim - 1) + ("S(0)",), shape)),
                            "R")
                pins[fqn] = Spec((fsdp,) * (mesh_ndim - 1) + ("S(0)",))
            else:
                pins[fqn] = Spec((_fsdp_dim(p, shape),) * mesh_ndim)
        return pins, [batch_all]
    batch = Spec(("S(0)",) * (mesh_ndim - 1) + ("R",))
    tp_axis = mesh_ndim - 1
    for fqn, p, out_dim, in_dim, kind, leaf in _param_dims(model):
        tp = _tp_placement(p, out_dim, in_dim, kind, leaf)
        tp = tp if _fits(p, ("R",) * (mesh_ndim - 1) + (tp,), shape) else "R"
        if name == "ep_tp" and kind == "expert":
            # Experts split over the data axes, each expert's hidden width over the last one.
            if mesh_ndim == 1:
                pins[fqn] = Spec(("S(0)",) if _fits(p, ("S(0)",), shape) else ("R",))
                continue
            ep = "S(0)" if _fits(p, ("S(0)",) * (mesh_ndim - 1) + (tp,), shape) else "R"
            pins[fqn] = Spec((ep,) * (mesh_ndim - 1) + (tp,))
            continue
        if name in ("tp", "ep_tp") or mesh_ndim == 1:
            pins[fqn] = Spec(("R",) * (mesh_ndim - 1) + (tp,))
            continue
        # FSDP on the data axes shards dim 0 after TP did (torchtitan's order: TP first).
        dp = "S(0)" if _fits(p, ("S(0)",) * (mesh_ndim - 1) + (tp,), shape) else "R"
        placements = (dp,) * (mesh_ndim - 1) + (tp,)
        order = ()
        if dp == "S(0)" and tp == "S(0)":
            order = ((0, (tp_axis,) + tuple(range(mesh_ndim - 1))),)
        pins[fqn] = Spec(placements, order)
    return pins, [batch_all if name == "ep_tp" and mesh_ndim == 1 else batch]


class HandWritten:
    """A plan solved (a hand-written one under its pins; a recompute mode's, compared with the
    others' before one is kept): its predicted step, the solver's choice and status, and the
    plan, assembled when first asked for (as a start for our solve only the choice is needed;
    assembling LLaMA-70B's plan takes 1-2 s). ``settled``: whether more time would not change it
    (:func:`autoshard.planning.planner.settled`); ``additive_us``: the cost of the additive
    solve's answer; ``memory_free_bound``: that solve's proved memory-free optimum (None: none)."""

    def __init__(self, step_us: float, choice, status: str, assemble, settled: bool = False,
                 additive_us: float | None = None, memory_free_bound: float | None = None):
        self.step_us, self.choice, self.status, self.settled = step_us, choice, status, settled
        self.additive_us, self.memory_free_bound = additive_us, memory_free_bound
        self.seeds: dict | None = None
        """The hand-written plans the solve started from, by name: their steps (None: failed)."""
        self._assemble = assemble

    @functools.cached_property
    def plan(self) -> Plan:
        return self._assemble()

    def as_ours(self, name: str, why: str) -> Plan:
        """This hand-written plan, ``name``, as the answer: without its pin count, its source
        saying why it was taken."""
        plan = self.plan
        summary = dataclasses.replace(plan.summary, pinned=None, extra=dict(plan.summary.extra),
                                      nulls=plan.summary.nulls - {"pinned"})
        return dataclasses.replace(plan, summary=summary, solver={**plan.solver, "source": f"baseline {name} ({why})"})
