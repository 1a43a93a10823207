"""Load imbalance of expert parallelism, as an explicit cost factor.

Where a plan shards the expert dimension over a mesh axis (expert parallelism), each rank runs
its own experts on the tokens routed to them. With capacity-based dispatch (the reference
:class:`autoshard.models.moe.MoeLayer`) every expert processes exactly its capacity, padded, so every
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

from autoshard.planning.baselines import EXPERTS
from costmodel.spec import shard_dim

aten = torch.ops.aten
_MATMULS = (aten.bmm.default, aten.baddbmm.default)
#: Ops that pass a tensor's storage along unchanged (a weight read transposed, a gradient viewed).
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.t.default, aten.transpose.int,
          aten.permute.default, aten.expand.default, aten.detach.default, aten.alias.default,
          aten.clone.default, aten.reshape.default)

#: Ops whose result keeps its operand's shape and dims (routed tokens summed or scaled).
_ELEMENTWISE = (aten.add.Tensor, aten.mul.Tensor)


def _through_views(n):
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _VIEWS:
        n = n.args[0]
    return n


def _shape(n) -> tuple | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _same_dim(src: tuple, dim: int, dst: tuple) -> int | None:
    """The dim of ``dst`` that holds ``src``'s ``dim`` outermost after a view from ``src`` to
    ``dst``: the same product of sizes before it, and a size that it divides or that divides it
    (a merge into ``experts x capacity``, or the split back); None where it is scattered."""
    before = 1
    for size in src[:dim]:
        before *= size
    acc = 1
    for j, size in enumerate(dst):
        # A merge that keeps the experts outermost (experts x capacity), or its split back.
        if acc == before and size and src[dim] and (size % src[dim] == 0 or src[dim] % size == 0):
            return j
        acc *= size
    return None


def _dim_through(n: fx.Node, dim: int, forward: bool) -> int | None:
    """Where ``dim`` of a view-like op's input lands in its output (``forward``) or the reverse."""
    t = n.target
    if t in (aten.detach.default, aten.alias.default, aten.clone.default, aten.expand.default):
        return dim
    if t is aten.t.default:
        return 1 - dim if _shape(n) and len(_shape(n)) == 2 else dim
    if t is aten.transpose.int:
        a, b = (d % len(_shape(n)) for d in n.args[1:3])
        return b if dim == a else a if dim == b else dim
    if t is aten.permute.default:
        dims = [d % len(_shape(n)) for d in n.args[1]]
        return dims.index(dim) if forward else dims[dim]
    src, dst = _shape(n.args[0]), _shape(n)
    if src is None or dst is None:
        return None
    return _same_dim(src, dim, dst) if forward else _same_dim(dst, dim, src)


def token_dims(tg, matmuls) -> dict[fx.Node, int]:
    """Node -> the dim of its output that indexes experts, for the expert matmuls' token operands
    and results and the chains of view-like ops that reshape them (dispatch's transpose into
    ``(experts, tokens, dim)``, combine's view back): the tensors whose moves carry routed tokens."""
    dims: dict[fx.Node, int] = {}
    for n, tokens in matmuls.items():
        dims[n] = 0
        for k in tokens:
            a, d = n.args[k], 0
            while isinstance(a, fx.Node) and d is not None and a not in dims:
                dims[a] = d
                if a.op != "call_function" or a.target not in _VIEWS:
                    break
                d = _dim_through(a, d, forward=False)
                a = a.args[0]
        todo = [(n, 0)]
        while todo:
            a, d = todo.pop()
            for user in a.users:
                if user in dims or user.op != "call_function":
                    continue
                if user.target in _ELEMENTWISE and _shape(user) == _shape(a):
                    dims[user] = d  # the gradients of the experts' inputs summed (w1's and w3's)
                    todo.append((user, d))
                elif user.target in _VIEWS and user.args[0] is a:
                    e = _dim_through(user, d, forward=True)
                    if e is not None:
                        dims[user] = e
                        todo.append((user, e))
    return dims


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
    return np.array([factor if _splits(s.outs[0], 0, mesh_shape) else 1.0 for s in strategies])


def _splits(spec, dim: int, mesh_shape) -> bool:
    return spec is not None and any(shard_dim(p) == dim and size > 1 for p, size in zip(spec.placements, mesh_shape))


def move_scale(srcs, dsts, dim: int, mesh_shape, factor: float) -> np.ndarray:
    """Per (producer spec, consumer spec) pair of a token tensor's edge: ``factor`` where either
    side splits the experts (the busiest rank sends or receives ``factor`` times the mean), else 1."""
    a = np.array([_splits(s, dim, mesh_shape) for s in srcs])
    b = np.array([_splits(s, dim, mesh_shape) for s in dsts])
    return np.where(a[:, None] | b[None, :], factor, 1.0)
