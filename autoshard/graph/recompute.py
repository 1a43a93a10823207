"""Activation checkpointing as a planning choice: which forward values each repeated layer
recomputes in its backward instead of keeping them alive from the forward.

Modes, one for every repeated layer (the layers are tied, so one choice serves all):

- ``none``: the backward reads every forward value it needs as saved by the forward;
- ``selective``: each layer keeps the outputs of its expensive ops (matmuls, attention,
  convolutions: :data:`EXPENSIVE`) and recomputes the cheap ones (norms, activations,
  elementwise ops, views) from them;
- ``full``: each layer keeps only what enters it (its input, the parameters, values made
  outside it) and recomputes its whole forward before its backward.

Random and in-place ops are always kept, never recomputed (a recomputed draw would differ),
and so is every value a layer hands to anything outside it (its output).

:func:`choose` finds, for one mode, the nodes each layer recomputes and where its backward
starts needing them. In the problem (:func:`autoshard.planning.problem.with_recompute`) each recomputed node gets a
*copy*: tied to the original (so it takes the same strategy), charged the original's compute
and its input redistributes once more, and live in the backward from the layer's recompute
point to its last backward use, while the original now dies at its last forward use. The
lowering (:func:`autoshard.runtime.lower.split`) runs the same nodes again in the backward program at
that point, with the planned specs, so what runs is what was costed.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoshard.graph import attention, rng
from autoshard.graph.layers import node_layer
from autoshard.graph.tracing import TracedGraph
from autoshard.planfile import RECOMPUTE_MODES

MODES = RECOMPUTE_MODES

_A = torch.ops.aten
#: Ops whose outputs ``selective`` keeps: the ones that dominate a layer's compute.
EXPENSIVE = {
    _A.mm.default, _A.addmm.default, _A.bmm.default, _A.baddbmm.default, _A.convolution.default,
    _A._scaled_dot_product_fused_attention_overrideable.default, *attention.FORWARD,
}
if hasattr(_A, "_grouped_mm"):
    EXPENSIVE.add(_A._grouped_mm.default)


@dataclass(frozen=True)
class Recompute:
    """What one mode recomputes: per repeated layer, the nodes and the point they run at."""

    mode: str
    nodes: dict[str, list[str]] = field(default_factory=dict)
    """Layer FQN -> names of the forward nodes its backward recomputes, in graph order."""
    at: dict[str, str] = field(default_factory=dict)
    """Layer FQN -> name of the first backward node that reads a recomputed value: the layer's
    recompute runs just before it."""

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"recompute mode: expected one of {MODES}, found {self.mode!r}")

    @property
    def count(self) -> int:
        return sum(len(v) for v in self.nodes.values())

    def to_json(self) -> dict:
        return {"mode": self.mode, "nodes": self.nodes, "at": self.at}


NONE = Recompute("none")


def _always_kept(n: fx.Node) -> bool:
    target = n.target
    return target in rng.RANDOM_OPS or (isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable)


def _kept_by(mode: str, n: fx.Node) -> bool:
    if n.target is operator.getitem:  # an output of a multi-output op: kept with its producer
        n = n.args[0]
    return _always_kept(n) or (mode == "selective" and n.target in EXPENSIVE)


def parameter_views(tg: TracedGraph) -> list[fx.Node]:
    """The views of a parameter or buffer (a linear layer's transposed weight), in graph order:
    what FSDP gathers and a step of several microbatches can gather once and keep
    (:func:`autoshard.planning.problem.gathered_once`)."""
    from autoshard.graph.pricing import is_view

    return [n for n in tg.gm.graph.nodes
            if n.op == "call_function" and is_view(n) and n.args and isinstance(n.args[0], fx.Node)
            and n.args[0].op == "placeholder" and tg.kinds.get(n.args[0].name) in ("param", "buffer")]


def choose(tg: TracedGraph, mode: str, keep=()) -> Recompute:
    """The nodes each tagged layer of ``tg`` recomputes under ``mode`` (see the module doc);
    never those of ``keep`` (values held anyway: a weight gathered once per step)."""
    if mode == "none":
        return NONE
    if mode not in MODES:
        raise ValueError(f"recompute mode: expected one of {MODES}, found {mode!r}")
    def _is_backward(n: fx.Node) -> bool:
        return tg.phase(n) == "backward"

    order = list(tg.gm.graph.nodes)
    pos = {n: k for k, n in enumerate(order)}
    layer: dict[fx.Node, str] = {}
    for n in order:
        tag = node_layer(n)
        if tag is not None and tag[1] == "fwd" and n.op == "call_function":
            layer[n] = tag[0]
    # A layer's outputs (read by a forward op outside it) are kept: they are the next one's input.
    kept = {n for n, fqn in layer.items()
            if _kept_by(mode, n) or any(not _is_backward(u) and layer.get(u) != fqn for u in n.users)} | set(keep)
    while True:
        chosen: dict[str, set[fx.Node]] = {}
        for n, fqn in layer.items():
            if n not in kept and any(_is_backward(u) for u in n.users):
                _close(n, fqn, layer, kept, chosen.setdefault(fqn, set()))
        # A value one layer recomputes and another's recompute reads is kept instead.
        shared = {a for fqn, nodes in chosen.items() for n in nodes for a in n.all_input_nodes
                  if a in layer and layer[a] != fqn and a not in kept}
        if not shared:
            break
        kept |= shared
    nodes, at = {}, {}
    for fqn in dict.fromkeys(layer.values()):  # layers in graph order
        group = chosen.get(fqn, set())
        readers = [u for n in group for u in n.users if _is_backward(u)]
        if readers:
            nodes[fqn] = [n.name for n in sorted(group, key=pos.__getitem__)]
            at[fqn] = min(readers, key=pos.__getitem__).name
    return Recompute(mode, nodes, at)


def _close(n: fx.Node, fqn: str, layer: dict, kept: set, into: set) -> None:
    """Add ``n`` and every value of its layer it is recomputed from (unless kept) to ``into``."""
    stack = [n]
    while stack:
        m = stack.pop()
        if m in into:
            continue
        into.add(m)
        stack.extend(a for a in m.all_input_nodes if layer.get(a) == fqn and a not in kept and a not in into)


def recomputed(gm: fx.GraphModule, rc: Recompute) -> dict[fx.Node, fx.Node]:
    """Recomputed node -> the backward node its layer's recompute runs before."""
    by_name = {n.name: n for n in gm.graph.nodes}
    return {by_name[name]: by_name[rc.at[fqn]] for fqn, names in rc.nodes.items() for name in names}
