"""Load imbalance of expert parallelism, as an explicit cost factor.

Where a plan shards the expert dimension over a mesh axis (expert parallelism), each rank runs
its own experts on the tokens routed to them. With capacity-based dispatch (the reference
:class:`autoshard.moe.MoeLayer`) every expert processes exactly its capacity, padded, so every
rank does the same work: the factor 1.0 is exact. A dropless runtime, or routing measured to
be skewed, gives the busiest rank ``f`` times the mean load, and a step waits for that rank:

    expert matmul time   x f     for strategies whose expert dim is sharded,
    tokens moved into it x f     (the dispatch all_to_all and any other redistribute of the
                                  token operand into that strategy)

Where the expert dim is not sharded (experts replicated, or split on their hidden width) every
rank computes every expert on the padded capacity and the factor does not apply. Expert matmuls
are the batched matmuls (``bmm``, ``baddbmm``) one of whose operands is an expert weight (a
3-D parameter of a module named ``experts``, as the baselines read it) or whose result is such
a weight's gradient: the forward projections and both backward products. Their expert dim is
the batch dim, dim 0 of the result.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.fx as fx

from autoshard.baselines import EXPERTS
from costmodel.spec import shard_dim

aten = torch.ops.aten
_MATMULS = (aten.bmm.default, aten.baddbmm.default)
#: Ops that pass a tensor's storage along unchanged (a weight read transposed, a gradient viewed).
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
          aten.permute.default, aten.expand.default, aten.detach.default, aten.alias.default,
          aten.clone.default, aten.reshape.default)


def _through_views(n):
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _VIEWS:
        n = n.args[0]
    return n


def expert_matmuls(tg) -> dict[fx.Node, list[int]]:
    """Expert matmul node -> the positions of its token operands (those that are not an expert
    weight read through views)."""
    weights = {n for n in tg.placeholders if tg.kinds.get(n.name) == "param"
               and EXPERTS.search(tg.fqn_of[n.name].rpartition(".")[0]) and n.meta["val"].dim() == 3}
    if not weights:
        return {}
    grads = {_through_views(tg.grad_of[tg.fqn_of[w.name]]) for w in weights if tg.fqn_of[w.name] in tg.grad_of}
    found = {}
    for n in tg.gm.graph.nodes:
        if n.op != "call_function" or n.target not in _MATMULS:
            continue
        tensor_args = [a for a in n.args if isinstance(a, fx.Node)]
        is_weight = [_through_views(a) in weights for a in tensor_args]
        if any(is_weight) or n in grads:
            found[n] = [k for k, w in enumerate(is_weight) if not w]
    return found


def imbalance_scale(strategies, mesh_shape, factor: float) -> np.ndarray:
    """Per strategy of an expert matmul: ``factor`` where its result's dim 0 (the experts) is
    sharded on a mesh axis of more than one rank, else 1."""
    scale = np.ones(len(strategies))
    for i, s in enumerate(strategies):
        out = s.outs[0]
        if out is not None and any(shard_dim(p) == 0 and size > 1 for p, size in zip(out.placements, mesh_shape)):
            scale[i] = factor
    return scale
