"""Per node, the candidate specs DTensor's sharding rules allow.

For every call_function node, each tensor argument is offered every spec on the
mesh (R, S(d), P(sum) per axis) and DTensor's strategy function (full strategy
functions, or single-dim rules expanded to the mesh by DTensor) returns the
(input specs, output spec) pairs it can run without further communication.
Results are cached by (op, argument shapes and dtypes, non-tensor arguments), so
identical layers cost one enumeration. Ops with no rule fall back to
all-replicate and are reported.
"""

from __future__ import annotations

import itertools
import logging
import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autoshard import _torch_compat as tc
from autoshard.errors import first_line
from autoshard.graph import elementwise  # noqa: F401  (registers DTensor rules the graphs need)
from autoshard.graph.attention import (
    heads_split_evenly,
    is_causal_cpu_kernel,
    is_fused_attention,
    ring_strategies,
    rule_arguments,
    sequence_split_offered,
)
from costmodel.spec import Spec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: the spec of each output and of each tensor argument."""

    outs: tuple[Spec | None, ...]
    """Per output (one for single-output ops); None for non-tensor outputs."""
    ins: tuple[Spec, ...]
    """Per tensor argument, in ``tensor_args`` order."""
    moved: bool = False
    """A view whose argument arrives redistributed: it holds the new buffer (its output's shard)
    until its last read. A view that is not moved aliases its argument in the spec it comes in
    (:func:`autoshard.planning.problem.held_views`)."""


@dataclass
class NodeStrategies:
    node: fx.Node
    strategies: list[Strategy]
    tensor_args: list[fx.Node]
    """Tensor arguments (producer nodes), in the order of ``Strategy.ins``."""
    fallback: bool = False
    """No DTensor rule: all-replicate is the only strategy."""


@dataclass
class StrategyStats:
    enumerated: int = 0
    cache_hits: int = 0
    fallback_ops: dict[str, int] = field(default_factory=dict)
    """Op name -> nodes of that op with no strategy from DTensor (replicated instead)."""
    rule_errors: dict[str, str] = field(default_factory=dict)
    """Op name -> the first error its DTensor rule raised, for the ops that fell back."""


def is_tensor(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)


def output_val(node: fx.Node, out: int):
    """The traced value of ``node``'s output ``out`` (its only one where it has one)."""
    v = node.meta["val"]
    return v[out] if isinstance(v, (tuple, list)) else v


def _no_empty_piece(size: int, pieces: int) -> bool:
    """Whether DTensor's split of ``size`` into ``pieces`` (``ceil(size / pieces)`` each, the last
    ones less) gives every piece an element."""
    return -(-size // pieces) * (pieces - 1) < size


def splits_fit(spec: Spec, shape, mesh_shape) -> bool:
    """Whether every dim ``spec`` splits is split evenly, or unevenly by one axis into no empty piece."""
    axes: dict[int, list[int]] = {}
    for axis, d in enumerate(spec.shard_dims()):
        if d is not None and mesh_shape[axis] > 1:
            axes.setdefault(d, []).append(mesh_shape[axis])
    for d, sizes in axes.items():
        size, pieces = shape[d], math.prod(sizes)
        if size % pieces and (len(sizes) > 1 or not _no_empty_piece(size, pieces)):
            return False
    return True


def all_specs(ndim: int, mesh_ndim: int, partial: bool = True, shape=None, mesh_shape=None,
              orders: bool = False) -> list[Spec]:
    """Every spec with one of R, S(d), P(sum) per mesh axis.

    With ``orders``, every shard order of each tensor dim sharded on several axes
    (else only the default, ascending one). With ``shape`` and ``mesh_shape``, a tensor dim is
    split into pieces that do not divide it only by one mesh axis, and into no empty piece
    (DTensor's split: ``ceil(size / n)`` per rank, the last ones less): GPT-2's vocabulary of 50257
    may be split over one axis of 8. Split over several axes, uneven pieces are nested (10 over
    (2, 2): 5, 5, then 3, 2, 3, 2), and DTensor's own redistribution gathers those wrongly (torch
    2.13's flattened merge), so a loss computed eagerly on such an output would be wrong.
    """
    opts = ["R"] + [f"S({d})" for d in range(ndim)] + (["P(sum)"] if partial else [])
    out = []
    for combo in itertools.product(opts, repeat=mesh_ndim):
        spec = Spec(tuple(combo))
        if shape is not None:
            if not splits_fit(spec, shape, mesh_shape):
                continue
        out.append(spec)
        if orders:
            multi = [(d, [a for a, p in enumerate(combo) if p == f"S({d})"]) for d in range(ndim)]
            multi = [(d, axes) for d, axes in multi if len(axes) > 1]
            perms = [[(d, p) for p in itertools.permutations(axes)] for d, axes in multi]
            for choice in itertools.product(*perms):
                if any(list(p) != sorted(p) for _, p in choice):
                    out.append(Spec(tuple(combo), tuple(choice)))
    return out


def _val(node):
    return node.meta["val"]


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    found = []
    fx.node.map_arg((node.args, node.kwargs), lambda a: found.append(a) if is_tensor(a) else None)
    return found


def _key(node: fx.Node):
    def norm(a):
        if is_tensor(a):
            v = _val(a)
            return ("T", tuple(v.shape), v.dtype)
        if isinstance(a, fx.Node):
            return ("N", str(a.meta.get("val")))
        if isinstance(a, (list, tuple)):
            return tuple(norm(x) for x in a)
        return repr(a)

    return (node.target, norm(node.args), tuple(sorted((k, norm(v)) for k, v in node.kwargs.items())))


def _dim_products(shape) -> set[int]:
    """Every product of a run of adjacent dims of ``shape`` (a dim alone included): the sizes a
    view's rule splits or merges."""
    return {math.prod(shape[i:j]) for i in range(len(shape)) for j in range(i + 1, len(shape) + 1)}


def mesh_signature(node: fx.Node, targs: list[fx.Node], mesh_shape: tuple[int, ...]) -> tuple:
    """What a node's strategies depend on of the mesh beyond its number of axes: for each size
    ``s`` among its tensors' dims and runs of adjacent dims, and each product ``P`` of a subset
    of the mesh's axes, whether ``P`` divides ``s``, whether ``s >= P`` and whether DTensor's
    split of ``s`` into ``P`` pieces leaves none empty. DTensor's rules read the mesh's sizes only
    so (a dim shardable into ``P`` pieces, evenly, a view's split of a merged dim), as does
    :func:`all_specs`' filter (:func:`splits_fit`); two meshes of as many axes with the same
    signature give the node the same strategies."""
    vals = [_val(a) for a in targs]
    out = _val(node)
    vals += [v for v in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(v, torch.Tensor)]
    sizes = sorted(set().union(*(_dim_products(tuple(v.shape)) for v in vals)))
    products = [math.prod(mesh_shape[a] for a in range(len(mesh_shape)) if mask >> a & 1)
                for mask in range(1, 2 ** len(mesh_shape))]
    return tuple((s, tuple((s % p == 0, s >= p, _no_empty_piece(s, p)) for p in products)) for s in sizes)


#: Strategies enumerated in this process, for every mesh: (the node's key, the mesh's number of
#: axes, partial inputs, :func:`mesh_signature`) -> (strategies, fallback, the rule's first error
#: where it fell back), as :attr:`StrategyEnumerator.cache` holds them. A mesh search builds
#: a dozen meshes of three axes in each worker: their rules answer alike for most nodes, and the
#: rules are half of a build (LLaMA-8B on 512 ranks: 0.75 of 1.55 s per 3-D shape).
_SHARED: dict = {}
#: Past this many entries the shared cache starts over (a planning service sees many models).
SHARED_MAX = 200_000


def clear_shared_cache() -> None:
    """Forget the strategies enumerated for other meshes (:data:`_SHARED`)."""
    _SHARED.clear()


class StrategyEnumerator:
    """Enumerates and caches strategies on one mesh (and, by :func:`mesh_signature`, across the
    meshes this process builds)."""

    def __init__(self, mesh, partial_inputs: bool | None = None):
        self.mesh = mesh
        self.mesh_shape = tuple(mesh.shape)
        # Partial inputs let a reduction wait past linear ops (add, view, transpose), but they
        # add one option per mesh axis to every argument: on 3-D meshes that doubles the edge
        # variables (GPT-2 small on (2, 4, 8): 2.0M -> 1.0M) for a fraction of a percent of
        # step time (LLaMA-8B on (8, 8): +0.02%). Default: only up to 2-D meshes.
        self.partial_inputs = len(self.mesh_shape) <= 2 if partial_inputs is None else partial_inputs
        self.cache: dict = {}
        self.stats = StrategyStats()

    def specs_for(self, t: torch.Tensor, partial: bool = True, orders: bool = False) -> list[Spec]:
        return all_specs(t.ndim, len(self.mesh_shape), partial, tuple(t.shape), self.mesh_shape, orders)

    def for_node(self, node: fx.Node) -> NodeStrategies:
        targs = _tensor_args(node)
        try:
            key = _key(node)
            hash(key)
        except TypeError:
            key = None
        shared = None
        found = self.cache.get(key) if key is not None else None
        if found is None and key is not None:
            shared = (key, len(self.mesh_shape), self.partial_inputs, mesh_signature(node, targs, self.mesh_shape))
            found = self.cache[key] = _SHARED.get(shared)
        if found is not None:
            self.stats.cache_hits += 1
        else:
            errors: list[Exception] = []
            strategies = self._enumerate(node, targs, errors)
            # (strategies, fallback, the rule's error), the list shared by every node of the key:
            # an edge's matrix is cached by its lists' identity (problem._RedistCost).
            # Formatted only here: rules reject specs by raising on every view, a hot path.
            found = (strategies, False, None) if strategies else \
                ([self._replicate(node, targs)], True, first_line(errors[0]) if errors else None)
            self.stats.enumerated += 1
            if key is not None:
                if len(_SHARED) >= SHARED_MAX:
                    _SHARED.clear()
                self.cache[key] = _SHARED[shared] = found
        strategies, fallback, error = found
        if fallback:
            self._count_fallback(node, error)
        return NodeStrategies(node, strategies, targs, fallback)

    def _count_fallback(self, node: fx.Node, error: str | None) -> None:
        """Every node with no strategy is counted; the first error of a rule that raised is kept
        and logged (a rule that raised is a fallback, never silently an empty rule)."""
        name = str(node.target)
        self.stats.fallback_ops[name] = self.stats.fallback_ops.get(name, 0) + 1
        if error is not None and name not in self.stats.rule_errors:
            self.stats.rule_errors[name] = error
            log.warning(f"the sharding rule of {name} raised (its node {node.name} is replicated): {error}")

    def _replicate(self, node, targs) -> Strategy:
        r = Spec(("R",) * len(self.mesh_shape))
        val = _val(node)
        multi = isinstance(val, (tuple, list))
        outs = tuple(r if isinstance(v, torch.Tensor) else None for v in val) if multi else (r,)
        return Strategy(outs=outs, ins=tuple(r for _ in targs))

    def _schema(self, node: fx.Node, arg_specs):
        """An OpSchema whose tensor arguments carry the given candidate spec lists."""
        it = iter(arg_specs)

        def conv(a):
            if is_tensor(a):
                specs = next(it)
                return tc.OpStrategy([tc.OpSpec(tc.make_spec(self.mesh, s, _val(a))) for s in specs])
            if isinstance(a, fx.Node):
                return _val(a)
            return a

        def conv_list(a):
            items = [conv(x) for x in a]
            # As DTensor's dispatch does: a list that starts with a tensor (cat, stack) is one
            # TupleStrategy; others (index's optional tensors) stay lists.
            return tc.TupleStrategy(tuple(items)) if a and is_tensor(a[0]) else type(a)(items)

        args = tuple(conv(a) if not isinstance(a, (list, tuple)) else conv_list(a) for a in node.args)
        kwargs = {k: conv(v) for k, v in node.kwargs.items()}
        return tc.OpSchema(node.target, args, kwargs)

    def _out_meta(self, node):
        val = _val(node)
        if isinstance(val, torch.Tensor):
            return tc.tensor_meta(val)
        if isinstance(val, (tuple, list)):
            return tuple(tc.tensor_meta(v) if isinstance(v, torch.Tensor) else None for v in val)
        return None

    def _enumerate(self, node: fx.Node, targs: list[fx.Node], errors: list[Exception]) -> list[Strategy]:
        """The node's strategies from its DTensor rule; what the rule raised goes to ``errors``."""
        op = node.target
        val = _val(node)
        if not targs and isinstance(val, torch.Tensor):
            # Factory ops (zeros, arange, ...) read no tensor: each rank can make any shard of
            # the result locally, so every non-partial spec is free to produce.
            return [Strategy(outs=(s,), ins=()) for s in self.specs_for(val, partial=False)]
        if op is torch.ops.aten.lift_fresh_copy.default and len(targs) == 1:
            # A constant built inside forward, copied as it is: any spec in is the same spec out.
            return [Strategy(outs=(s,), ins=(s,)) for s in self.specs_for(_val(targs[0]), partial=False)]
        if not isinstance(op, torch._ops.OpOverload) or not tc.has_rule(op):
            return []
        cands = [self.specs_for(_val(a), partial=self.partial_inputs) for a in targs]
        out_meta = self._out_meta(node)
        planned = node
        if is_causal_cpu_kernel(node):  # the rule asked as if not causal: its query split included
            node = _Shim(node.target, *rule_arguments(node), node.meta)
        prop = tc.sharding_propagator()
        results: list = []
        lists = [a for a in node.args if isinstance(a, (list, tuple)) and any(is_tensor(x) for x in a)]
        single = op in prop.op_single_dim_strategy_funcs
        if lists and not single and not all(is_tensor(a[0]) for a in lists):
            return []  # an optional-tensor list an op-level rule reads: not planned (fallback replicate)
        skipped = skipped_by_cat(node)
        if skipped:
            return self._cat_without(node, targs, skipped, errors)
        if lists and not single:
            # A list of tensors (cat, stack): DTensor's rules merge the list's specs into one
            # strategy, so ask once per spec, every tensor argument of the same rank given it.
            # Tensors of other ranks in the list: DTensor's rule makes them follow the others'
            # specs and then cannot move them.
            ndim = _val(targs[0]).ndim
            if any(_val(a).ndim != ndim for a in targs):
                return []
            for s in cands[0]:
                if any(s not in c for c in cands):
                    continue
                try:
                    results.append(tc.op_strategy(op, self._schema(node, [[s]] * len(targs)), self.mesh, out_meta))
                except Exception as exc:  # a spec the rule rejects by raising
                    errors.append(exc)
        elif single:
            # Single-dim rules read one spec per argument only to learn which shard
            # kinds exist; the expansion itself covers every mesh axis.
            seed = [[next((s for s in c if any(d is not None for d in s.shard_dims())), c[0])] for c in cands]
            try:
                results.append(tc.op_strategy(op, self._schema(node, seed), self.mesh, out_meta))
            except Exception as exc:  # counted as a fallback with its error when nothing else is found
                errors.append(exc)
        else:
            try:
                results.append(tc.op_strategy(op, self._schema(node, cands), self.mesh, out_meta))
            except Exception as exc:
                errors.append(exc)
                # Some rules (nll_loss_backward) walk their arguments' candidate lists in step,
                # one strategy per index of the input's: ask with every list as long as the
                # longest (the others repeating their first spec; such rules derive the specs
                # they need from the input's, so the padding only stands in for a source).
                longest = max(len(c) for c in cands) if cands else 0
                aligned = [c + [c[0]] * (longest - len(c)) for c in cands]
                try:
                    results.append(tc.op_strategy(op, self._schema(node, aligned), self.mesh, out_meta))
                except Exception as exc2:
                    errors.append(exc2)
                # Some rules (views) reject whole candidate lists; ask per spec of the first argument.
                for s in cands[0] if cands else []:
                    try:
                        results.append(tc.op_strategy(op, self._schema(node, [[s]] + cands[1:]), self.mesh, out_meta))
                    except Exception as exc:  # a spec the rule rejects by raising
                        errors.append(exc)
        out = [st for st in self._collect(results, node, targs)
               if executable(planned, st, self.mesh_shape, targs) and self._fits(planned, st, targs)]
        out += ring_strategies(planned, out, targs, self.mesh_shape)
        if not self.partial_inputs:
            out = [st for st in out if not any(i.partial_axes() for i in st.ins)]
        return out

    def _fits(self, node: fx.Node, st: Strategy, targs: list[fx.Node]) -> bool:
        """Whether every spec of ``st`` splits its tensor as plans may (:func:`splits_fit`): a rule
        checks its inputs only for a shard per rank, and a view's output may split a dim its input
        did not (a (128, 32) value split 4 ways by rows viewed as (2, 64, 32) keeps the split on
        the 2: a piece empty, which no lowered view can make)."""
        val = _val(node)
        vals = list(val) if isinstance(val, (tuple, list)) else [val]
        pairs = list(zip(st.outs, vals)) + [(spec, _val(a)) for spec, a in zip(st.ins, targs)]
        return all(spec is None or not isinstance(v, torch.Tensor) or splits_fit(spec, tuple(v.shape), self.mesh_shape)
                   for spec, v in pairs)

    def _cat_without(self, node: fx.Node, targs: list[fx.Node], skipped: list[fx.Node],
                     errors: list[Exception]) -> list[Strategy]:
        """``cat``'s strategies with the empty 1-D tensors it skips left out (a KV cache's empty
        start: Hugging Face's decoders concatenate every layer's keys and values to one in
        training too): the others' strategies, each skipped tensor replicated (no bytes). The
        lowering runs the ``cat`` without them (:func:`autoshard.runtime.lower.Lowering`)."""
        kept = [a for a in targs if a not in skipped]
        if not kept:
            return []
        shim = _Shim(node.target, (list(kept), *node.args[1:]), node.kwargs, node.meta)
        r = Spec(("R",) * len(self.mesh_shape))
        out = []
        for st in self._enumerate(shim, kept, errors):
            it = iter(st.ins)
            out.append(Strategy(outs=st.outs, ins=tuple(r if a in skipped else next(it) for a in targs)))
        return out

    def _collect(self, results, node, targs) -> list[Strategy]:
        seen, out = set(), []
        multi = isinstance(_val(node), (tuple, list))
        for st in results:
            if st is None or not hasattr(st, "strategies"):
                continue
            for ospec in st.strategies:
                outs_raw = ospec.output_specs
                outs_raw = tuple(outs_raw) if isinstance(outs_raw, (tuple, list)) else (outs_raw,)
                outs = []
                ok = True
                for o in outs_raw:
                    if o is None:
                        outs.append(None)
                        continue
                    s = tc.from_placements(o.placements)
                    if s is None:
                        ok = False
                        break
                    outs.append(s)
                if not ok or (not multi and len(outs) != 1):
                    continue
                if ospec.input_specs is None:
                    ins = [outs[0]] * len(targs)
                else:
                    ins = [tc.from_placements(i.placements) for i in ospec.input_specs[: len(targs)]]
                if len(ins) != len(targs) or any(i is None for i in ins):
                    continue
                strat = Strategy(outs=tuple(outs), ins=tuple(ins))
                if strat not in seen:
                    seen.add(strat)
                    out.append(strat)
        return out


@dataclass
class _Shim:
    """A node's stand-in with other arguments (what the strategy enumeration reads of a node)."""

    target: object
    args: tuple
    kwargs: dict
    meta: dict


def skipped_by_cat(node) -> list:
    """The tensors of a ``cat`` node that ``cat`` skips: 1-D and empty, in a list of tensors of
    more dims (torch's legacy rule, which a KV cache's empty start relies on)."""
    if node.target is not torch.ops.aten.cat.default or not isinstance(node.args[0], (list, tuple)):
        return []
    vals = [(a, _val(a)) for a in node.args[0] if is_tensor(a)]
    empty = [a for a, v in vals if v.ndim == 1 and v.numel() == 0]
    if not empty or all(v.ndim == 1 for _, v in vals):
        return []
    return empty


_CONV = (torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default)


def _multi_axis(spec: Spec | None) -> bool:
    dims = [d for d in spec.shard_dims() if d is not None] if spec is not None else []
    return len(dims) != len(set(dims))


def _shards_beyond(spec: Spec | None, dim: int) -> bool:
    return spec is not None and any(d is not None and d > dim for d in spec.shard_dims())


def executable(node: fx.Node, st: Strategy, mesh_shape: tuple[int, ...] | None = None,
               tensor_args: list[fx.Node] | None = None) -> bool:
    """Whether DTensor runs ``node`` under ``st`` as the rule says (on a mesh of ``mesh_shape``).

    Fused attention with grouped queries runs by its rule only where its query heads and its
    key heads are split into equal parts (:func:`autoshard.graph.attention.heads_split_evenly`);
    a causal kernel's queries split on the sequence only into one run per rank and where the batch
    could not take those axes (:func:`autoshard.graph.attention.sequence_split_offered`).

    Most ops run by their rule. Convolutions run by a handler of their own
    (``torch.distributed.tensor._tp_conv``) that reads each spec as one mesh axis per tensor
    dim (a dim split by two axes is refused), exchanges halos along the width by the global
    rank whenever padding is set and any non-batch dim is sharded (right only for a width split
    on a 1-D mesh), and in the backward moves the output's gradient to the input's spec
    whatever the plan says. Strategies outside what it runs correctly are dropped here.
    """
    if is_fused_attention(node.target):
        targs = _tensor_args(node) if tensor_args is None else tensor_args
        if not sequence_split_offered(node, st.ins, targs, mesh_shape):
            return False
        return mesh_shape is None or heads_split_evenly(node, st.ins, mesh_shape, targs)
    if node.target not in _CONV:
        return True
    specs = list(st.ins) + list(st.outs)
    if any(_multi_axis(s) for s in specs):
        return False
    backward = node.target is torch.ops.aten.convolution_backward.default
    activation = st.ins[1] if backward else st.ins[0]  # the convolution's input
    result = st.ins[1] if backward else st.outs[0]  # what the handler reads the sharding of
    if backward and st.ins[0] != st.ins[1]:
        return False  # the handler would move the gradient to the input's spec, unplanned
    if _shards_beyond(activation, 1) or _shards_beyond(st.outs[0], 1):
        return False  # spatial splits need the halo exchange
    padding = node.args[5 if backward else 4]
    return not padding or padding[-1] == 0 or not _shards_beyond(result, 0)


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem
