"""Plans in the formats people already use, and back.

Tensor parallelism in PyTorch is written as a ``parallelize_module`` plan (a
ParallelStyle per module FQN) and in Hugging Face as a ``tp_plan`` dict (a style
name per module pattern). Both describe one mesh axis: the TP axis. A plan is
expressible there when, on that axis, every weight is one of

=====================  ===============  ================  ==============
module                 weight on TP     torch style       HF style
=====================  ===============  ================  ==============
Linear (out, in)       S(0)             ColwiseParallel   ``colwise``
Linear (out, in)       S(1)             RowwiseParallel   ``rowwise``
Embedding (vocab, d)   S(0)             RowwiseParallel   ``rowwise``
Embedding (vocab, d)   S(1)             ColwiseParallel   ``colwise``
any                    R (all params)   (left out)        (left out)
=====================  ===============  ================  ==============

(HF GPT-2's ``Conv1D`` stores (in, out): its dims swap.) Anything else on the TP
axis (a sharded norm weight, a bias split without its weight) is not expressible
and is named in the error. Other mesh axes (data parallel, FSDP) are outside both
formats and are ignored by the exporters.

The importers go the other way: a hand-written plan becomes pins
(``{parameter FQN: spec}``) for :func:`autoshard.plan`, which then costs it with
the same model as ours (the other axes stay free for the solver unless pinned too).
"""

from __future__ import annotations

import re

import torch.nn as nn

from autoshard.errors import PlanError
from autoshard.planfile import Plan
from costmodel.spec import Spec

_COL, _ROW = "colwise", "rowwise"


def _style_of(mod: nn.Module, weight_placement: str) -> str | None:
    kind = type(mod).__name__
    out_dim, in_dim = (1, 0) if kind == "Conv1D" else (0, 1)
    if isinstance(mod, nn.Embedding):
        return {"S(0)": _ROW, "S(1)": _COL}.get(weight_placement)
    if isinstance(mod, nn.Linear) or kind == "Conv1D":
        return {f"S({out_dim})": _COL, f"S({in_dim})": _ROW}.get(weight_placement)
    return None


def tp_styles(plan: Plan, model: nn.Module, tp_axis: str = "tp") -> dict[str, str]:
    """``{module FQN: "colwise" | "rowwise"}`` for every module sharded on ``tp_axis``.

    Raises :class:`PlanError` naming every parameter whose TP placement has no style.
    """
    if tp_axis not in plan.axis_names:
        raise PlanError(f"tp_axis {tp_axis!r} is not a mesh axis of the plan {plan.axis_names}")
    styles, bad = {}, []
    for name, mod in model.named_modules():
        own = dict(mod.named_parameters(recurse=False))
        if not own:
            continue
        prefix = f"{name}." if name else ""
        placed = {k: plan.params[prefix + k].placements[tp_axis] for k in own if prefix + k in plan.params}
        if all(p == "R" for p in placed.values()):
            continue
        style = _style_of(mod, placed.get("weight", "R"))
        if style is None:
            bad += [f"{prefix}{k} {p}" for k, p in placed.items() if p != "R"]
            continue
        bias = placed.get("bias")
        if bias is not None and bias != ("S(0)" if style == _COL else "R"):
            bad.append(f"{prefix}bias {bias} (a {style} layer's bias is {'S(0)' if style == _COL else 'R'})")
            continue
        styles[name] = style
    if bad:
        raise PlanError(f"the plan is not expressible as tensor parallelism on axis {tp_axis!r}: "
                        f"{len(bad)} placements have no ParallelStyle, e.g. {bad[:5]}")
    return styles


def to_parallelize_module_plan(plan: Plan, model: nn.Module, tp_axis: str = "tp") -> dict:
    """A ``torch.distributed.tensor.parallel.parallelize_module`` plan for ``tp_axis``."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {fqn: ColwiseParallel() if s == _COL else RowwiseParallel()
            for fqn, s in tp_styles(plan, model, tp_axis).items()}


def to_hf_tp_plan(plan: Plan, model: nn.Module, tp_axis: str = "tp") -> dict[str, str]:
    """An HF-style ``tp_plan``: module patterns (layer index as ``*`` where all layers agree) -> style."""
    styles = tp_styles(plan, model, tp_axis)
    grouped: dict[str, set] = {}
    for fqn, style in styles.items():
        grouped.setdefault(re.sub(r"\.\d+\.", ".*.", fqn), set()).add((fqn, style))
    out = {}
    for pattern, members in grouped.items():
        kinds = {s for _, s in members}
        if pattern != next(iter(members))[0] and len(kinds) == 1 and len(members) == _count(model, pattern):
            out[pattern] = kinds.pop()
        else:
            out.update({fqn: s for fqn, s in members})
    return dict(sorted(out.items()))


def _count(model: nn.Module, pattern: str) -> int:
    rx = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
    return sum(1 for name, _ in model.named_modules() if rx.match(name))


def _normalize_style(style) -> str:
    if isinstance(style, str):
        s = style.lower().replace("_", "")
        if s.startswith("colwise"):
            return _COL
        if s.startswith("rowwise"):
            return _ROW
        raise PlanError(f"tp style {style!r}: expected 'colwise' or 'rowwise' (or their torch ParallelStyle)")
    name = type(style).__name__
    if name == "ColwiseParallel":
        return _COL
    if name == "RowwiseParallel":
        return _ROW
    raise PlanError(f"tp style {name}: only ColwiseParallel and RowwiseParallel map to parameter placements")


def tp_plan_to_pins(model: nn.Module, tp_plan: dict, axis_names: list[str] | tuple[str, ...],
                    tp_axis: str = "tp", data_parallel: str = "ddp") -> dict[str, Spec]:
    """Pins (``{parameter FQN: spec}``) for a torch or HF tensor-parallel plan on ``tp_axis``.

    Keys may use ``*`` for a layer index (HF style). On the other mesh axes,
    ``data_parallel="ddp"`` replicates every parameter and ``"fsdp"`` shards dim 0
    after TP (torchtitan's FSDP + TP). Parameters the plan does not name are
    replicated on ``tp_axis``.
    """
    axis_names = list(axis_names)
    if tp_axis not in axis_names:
        raise PlanError(f"tp_axis {tp_axis!r} is not one of the mesh axes {axis_names}")
    if data_parallel not in ("ddp", "fsdp"):
        raise PlanError(f"data_parallel: expected 'ddp' or 'fsdp', found {data_parallel!r}")
    t = axis_names.index(tp_axis)
    others = [a for a in range(len(axis_names)) if a != t]
    mods = dict(model.named_modules())
    rules = []
    for key, style in tp_plan.items():
        rx = re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$")
        if not any(rx.match(name) for name in mods):
            raise PlanError(f"tp plan entry {key!r} matches no module of {type(model).__name__}")
        rules.append((rx, _normalize_style(style)))
    pins = {}
    for name, mod in mods.items():
        style = next((st for rx, st in rules if rx.match(name)), None)
        kind = type(mod).__name__
        out_dim, in_dim = (1, 0) if kind == "Conv1D" or isinstance(mod, nn.Embedding) else (0, 1)
        for leaf, p in mod.named_parameters(recurse=False):
            tp = "R"
            if style is not None and leaf == "weight":
                tp = f"S({out_dim})" if style == _COL else f"S({in_dim})"
            elif style == _COL and leaf == "bias":
                tp = "S(0)"
            placements = ["R"] * len(axis_names)
            placements[t] = tp
            order = ()
            if data_parallel == "fsdp" and p.shape[0] > 1:
                for a in others:
                    placements[a] = "S(0)"
                if tp == "S(0)" and others:
                    order = ((0, (t, *others)),)
            pins[f"{name}.{leaf}" if name else leaf] = Spec(tuple(placements), order)
    return pins
