"""Repeated layers: find them in the module tree and tag the traced nodes of each.

A *layer group* is a ``ModuleList`` / ``Sequential``, or any module whose children
are all named by integers (torchtitan's ``ModuleDict`` of layers, the layer container of a
pipeline stage split by ``torch.distributed.pipelining``), of two or more children of the
same class with the same parameter names and shapes (the decoder blocks of a transformer).
While tracing, forward hooks tag every node created inside a child's forward with
``(child fqn, "fwd")`` and backward hooks tag the nodes of its backward with
``(child fqn, "bwd")``, through ``node.meta["custom"]`` (the FX metadata channel that
``preserve_node_meta`` copies onto every node).

:func:`layer_ties` then matches the k-th node of one layer with the k-th node of
every other layer of its group, when the two sequences agree op by op and shape
by shape; those nodes are tied so that the solver sees one layer, not 80.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator

import torch
import torch.fx as fx
import torch.nn as nn

from autoshard import _torch_compat as tc

_TAG = "autoshard_layer"


def layer_groups(model: nn.Module) -> list[list[str]]:
    """FQNs of the children of each repeated-layer container, in order."""
    groups = []
    for name, mod in model.named_modules():
        kids = list(mod.named_children())
        listed = isinstance(mod, (nn.ModuleList, nn.Sequential)) or (kids and all(k.isdigit() for k, _ in kids))
        if not listed or len(kids) < 2:
            continue
        sigs = {(type(m), tuple((n, tuple(p.shape)) for n, p in m.named_parameters())) for _, m in kids}
        if len(sigs) == 1 and any(True for _ in kids[0][1].parameters()):
            groups.append([f"{name}.{k}" if name else k for k, _ in kids])
    # Only outermost groups: a repeated block inside a repeated layer is tied with its layer.
    members = [m for g in groups for m in g]
    return [g for g in groups if not any(g[0].startswith(m + ".") for m in members)]


@contextlib.contextmanager
def tag_layers(model: nn.Module, groups: list[list[str]]) -> Iterator[None]:
    """Hooks that tag the nodes each layer's forward and backward create."""
    mods = dict(model.named_modules())
    handles = []

    def enter(fqn, phase):
        def hook(*_args):
            tc.node_meta_custom()[_TAG] = (fqn, phase)
        return hook

    def leave(*_args):
        tc.node_meta_custom().pop(_TAG, None)

    for group in groups:
        for fqn in group:
            m = mods[fqn]
            handles += [m.register_forward_pre_hook(enter(fqn, "fwd")), m.register_forward_hook(leave),
                        m.register_full_backward_pre_hook(enter(fqn, "bwd")),
                        m.register_full_backward_hook(leave)]
    try:
        with tc.preserve_node_meta():
            yield
    finally:
        for h in handles:
            h.remove()
        tc.node_meta_custom().pop(_TAG, None)


def node_layer(node: fx.Node) -> tuple[str, str] | None:
    """``(layer fqn, "fwd" | "bwd")`` for a node created inside a tagged layer."""
    custom = node.meta.get("custom")
    return custom.get(_TAG) if isinstance(custom, dict) else None


def retagged(custom: dict | None, fqn: str) -> dict:
    """A copy of a node's ``meta["custom"]`` that says it was created in layer ``fqn`` (same phase)."""
    out = dict(custom or {})
    tag = out.get(_TAG)
    if tag is not None:
        out[_TAG] = (fqn, tag[1])
    return out


def _signature(node: fx.Node):
    val = node.meta.get("val")
    shapes = tuple(tuple(v.shape) for v in (val if isinstance(val, (tuple, list)) else [val])
                   if isinstance(v, torch.Tensor))
    return node.target, shapes, len(node.all_input_nodes)


def layer_ties(gm: fx.GraphModule, groups: list[list[str]], fqn_of: dict[str, str]) -> list[list[fx.Node]]:
    """Groups of corresponding nodes across the layers of each layer group.

    Parameter placeholders correspond by FQN with the layer prefix replaced;
    other nodes by position within their layer's forward or backward. A layer
    whose node sequence differs from the first layer's (shapes, ops) is left
    untied rather than tied wrongly.
    """
    per_layer: dict[tuple[str, str], list[fx.Node]] = {}
    for n in gm.graph.nodes:
        tag = node_layer(n)
        if tag is not None and n.op == "call_function":
            per_layer.setdefault(tuple(tag), []).append(n)
    by_fqn = {fqn: name for name, fqn in fqn_of.items()}
    nodes = {n.name: n for n in gm.graph.nodes}
    ties: list[list[fx.Node]] = []
    for group in groups:
        head = group[0]
        # Parameters and buffers: layers.0.attn.wq.weight <-> layers.7.attn.wq.weight.
        prefix = re.escape(head) + r"\."
        for fqn in by_fqn:
            if re.match(prefix, fqn):
                rest = fqn[len(head) + 1:]
                members = [by_fqn.get(f"{other}.{rest}") for other in group]
                if all(m is not None for m in members):
                    ties.append([nodes[m] for m in members])
        for phase in ("fwd", "bwd"):
            first = per_layer.get((head, phase), [])
            sig = [_signature(n) for n in first]
            same = [per_layer.get((other, phase), []) for other in group]
            same = [seq for seq in same if [_signature(n) for n in seq] == sig]
            if len(same) < 2:
                continue
            ties.extend([list(col) for col in zip(*same)])
    return ties
