r"""Trace a deep model at the cost of a shallow one: trace three layers, unroll to N.

Tracing runs every op of the step through ``make_fx`` (about 1 ms an op here), so a
model of N identical layers costs N times one layer: 26 s for LLaMA-70B's 80. The
layers of a group (:func:`autoshard.graph.layers.layer_groups`) run the same code on
parameters of the same shapes, so the step's graph repeats: with ``L_u`` the nodes of
layer u's forward (or backward) and the nodes between two layers' blocks counted with
the block after them, the trace of an N-layer model is

    prefix, L_0, L_1, ..., L_(N-1), middle, L_(N-1)', ..., L_1', L_0', suffix

where every ``L_u`` (1 <= u <= N-2) is ``L_1`` with each argument that points into layer
``b`` moved to layer ``u + (b - 1)`` (its own layer, the one below, the one above), and
each parameter of layer 1 replaced by layer u's. FX names nodes by op in creation order,
so the names follow from the order.

:func:`unrolled_trace` traces each long group three layers deep (first, middle, last),
builds the four-layer graph that way and compares it with a real four-layer trace:
the same nodes, names, ops, arguments, shapes, strides and tags. Only when they agree
is the three-layer trace unrolled to the full depth; any difference, or a trace that
fails with fewer layers (a model that loops over ``range(config.num_layers)``), falls
back to tracing the whole model. What the check cannot see is a layer whose graph
depends on its index in a way the first four layers do not show (``if idx % 8 == 7``);
``PlanOptions(unroll_layers=False)`` traces such a model whole, and
:func:`autoshard.parallelize` always traces the whole model, so a plan can never run
on a graph that was not traced.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
import time
from collections import OrderedDict

import torch
import torch.fx as fx

from autoshard import _torch_compat as tc
from autoshard.errors import TraceError, first_line
from autoshard.graph.layers import layer_groups, node_layer, retagged
from autoshard.graph.tracing import RawTrace, TracedGraph, check_inputs, finish, raw_trace

log = logging.getLogger(__name__)

#: Groups shorter than this are traced whole: the check's two traces cost 3 + 4 layers.
MIN_LAYERS = 8

_PLACEHOLDER = re.compile(r"^arg(\d+)_1$")
_NUMBERED = re.compile(r"^(.*)_(\d+)$")
#: Where the nodes between two layers' blocks go: with the layer after them (hook residue,
#: a norm applied on entry) or before them (a residual added outside the layer module).
GAPS = ("next", "previous")
_CONSTANT = re.compile(r"^_tensor_constant\d+$")


class CannotUnroll(Exception):
    """The trace does not have the layered shape unrolling needs."""


@contextlib.contextmanager
def truncated(model: torch.nn.Module, groups: list[list[str]], depth: int):
    """Each group's container holds only its first ``depth`` layers for the duration."""
    mods = dict(model.named_modules())
    saved = []
    try:
        for g in groups:
            parent_name = g[0].rpartition(".")[0]
            parent = mods[parent_name] if parent_name else model
            saved.append((parent, parent._modules))
            parent._modules = OrderedDict(list(parent._modules.items())[:depth])
        yield
    finally:
        for parent, kids in reversed(saved):
            parent._modules = kids


def trace_unrolled(model: torch.nn.Module, example_inputs, loss_fn=None, example_kwargs=None,
                   input_grads: bool = False) -> TracedGraph:
    """:func:`autoshard.graph.tracing.trace` (layers tied), each group of :data:`MIN_LAYERS` or more
    layers unrolled from three when that reproduces the four-layer trace, else traced whole
    (always with ``input_grads``: the unrolled graph carries the parameters' gradients only)."""
    example_inputs = check_inputs(example_inputs)
    groups = layer_groups(model)
    if input_grads:
        return finish(raw_trace(model, example_inputs, loss_fn, example_kwargs, groups, input_grads=True))
    raw = unrolled_trace(model, example_inputs, loss_fn, example_kwargs, groups) if groups else None
    return finish(raw if raw is not None else raw_trace(model, example_inputs, loss_fn, example_kwargs, groups))


def unrolled_trace(model, example_inputs, loss_fn, example_kwargs, groups) -> RawTrace | None:
    """The raw trace of ``model`` built from three-layer traces of its long groups, checked
    against a four-layer trace; ``None`` (trace the whole model) when a group is short, the
    check fails or the shallow traces fail."""
    long = [g for g in groups if len(g) >= MIN_LAYERS]
    if not long:
        return None
    t0 = time.perf_counter()
    try:
        with truncated(model, long, 3):
            raw3 = raw_trace(model, example_inputs, loss_fn, example_kwargs, _short(groups, long, 3))
        with truncated(model, long, 4):
            raw4 = raw_trace(model, example_inputs, loss_fn, example_kwargs, _short(groups, long, 4))
            target4 = _names(model)
        if len(raw3.groups) != len(groups) or len(raw4.groups) != len(groups):
            raise CannotUnroll("the shallow traces could not tag the layers")
        want = finish(raw4)
        differences = []
        for gaps in GAPS:  # the four-layer trace says which reading of the gaps is the model's
            try:
                difference = compare(finish(unroll(raw3, _short(groups, long, 4), *target4, gaps=gaps)), want)
            except CannotUnroll as exc:
                difference = str(exc)
            if difference is None:
                break
            differences.append(f"gaps {gaps}: {difference}")
        else:
            raise CannotUnroll(f"three layers unrolled to four differ from four traced: {'; '.join(differences)}")
        full = unroll(raw3, groups, *_names(model), gaps=gaps)
    except (CannotUnroll, TraceError) as exc:  # the model's shape, or its forward needs every layer
        log.info(f"tracing every layer: {first_line(exc)}")
        return None
    except Exception as exc:  # a bug here only costs the shortcut, but must not pass unseen
        log.warning(f"unrolling the layers failed, tracing every layer: {first_line(exc)}")
        return None
    log.info(f"traced {', '.join(f'{g[0]}..{g[-1]}' for g in long)} three and four layers deep and unrolled "
             f"to {len(full.gm.graph.nodes)} nodes in {time.perf_counter() - t0:.2f}s")
    return full


def _short(groups, long, depth):
    return [g[:depth] if g in long else g for g in groups]


def _names(model):
    params = dict(model.named_parameters())
    return list(params), list(dict(model.named_buffers())), [i for i, p in enumerate(params.values())
                                                              if p.requires_grad]


class _Group:
    """Where each raw node of a three-layer group sits: its layer (0, 1, 2) or none."""

    def __init__(self, raw: RawTrace, members: list[str], target: list[str], gaps: str):
        self.n = len(target)
        nodes = list(raw.gm.graph.nodes)
        self.coord: dict[fx.Node, int] = {}
        self.phase: dict[fx.Node, str] = {}
        index = {m: k for k, m in enumerate(members)}
        tagged = []
        for pos, n in enumerate(nodes):
            tag = node_layer(n)
            if tag is not None and tag[0] in index:
                tagged.append((pos, index[tag[0]], tag[1]))
        # Nodes between two blocks of one phase belong to the block after them, or before them.
        for (p1, l1, ph1), (p2, l2, ph2) in zip(tagged, tagged[1:]):
            self.coord[nodes[p1]], self.phase[nodes[p1]] = l1, ph1
            if ph1 != ph2:
                continue
            for p in range(p1 + 1, p2):
                tag = node_layer(nodes[p])
                if tag is not None or nodes[p].op != "call_function":
                    raise CannotUnroll(f"{nodes[p].name} sits between layers of {members[0]}.. but is not theirs")
                self.coord[nodes[p]], self.phase[nodes[p]] = (l2 if gaps == "next" else l1), ph2
        if tagged:
            p, layer, ph = tagged[-1]
            self.coord[nodes[p]], self.phase[nodes[p]] = layer, ph
        # Each layer's block per phase: contiguous, and the three alike op by op.
        self.units: dict[tuple[int, str], list[fx.Node]] = {}
        for n in nodes:
            if n in self.coord:
                self.units.setdefault((self.coord[n], self.phase[n]), []).append(n)
        self.pos = {}
        position = {n: k for k, n in enumerate(nodes)}
        self.ascending: dict[str, bool] = {}
        for ph in {ph for _, ph in self.units}:
            units = [self.units.get((layer, ph), []) for layer in range(3)]
            if any(not u for u in units):
                raise CannotUnroll(f"layer group {members[0]}..: a layer has no {ph} nodes")
            for u in units:
                if position[u[-1]] - position[u[0]] + 1 != len(u):
                    raise CannotUnroll(f"layer group {members[0]}..: the {ph} nodes of a layer are not contiguous")
                for k, n in enumerate(u):
                    # Blocks align where the gap is not: at the end when gaps go before them.
                    self.pos[n] = k - len(u) if gaps == "next" else k
            # The layer with no gap (first in order, or last) is a suffix (or prefix) of the others,
            # which are alike whole.
            ordered = sorted(units, key=lambda u: position[u[0]])
            short, rest = (ordered[0], ordered[1:]) if gaps == "next" else (ordered[-1], ordered[:-1])
            sig = [[_op(raw.gm, n) for n in u] for u in rest]
            part = [_op(raw.gm, n) for n in short]
            if sig[0] != sig[1] or part != (sig[0][len(sig[0]) - len(part):] if gaps == "next" else sig[0][:len(part)]):
                raise CannotUnroll(f"layer group {members[0]}..: the layers' {ph} ops differ")
            self.ascending[ph] = position[units[0][0]] < position[units[2][0]]
        # Parameters and buffers by layer: "layers.1.attn.wq.weight" -> (1, "attn.wq.weight").
        self.leaf_coord: dict[str, tuple[int, str]] = {}
        for fqn in raw.param_fqns + raw.buffer_fqns:
            for k, m in enumerate(members):
                if fqn.startswith(m + "."):
                    self.leaf_coord[fqn] = (k, fqn[len(m) + 1:])

    def source(self, u: int) -> int:
        """The raw layer that layer u of the unrolled graph copies."""
        return 0 if u == 0 else 2 if u == self.n - 1 else 1


def unroll(raw: RawTrace, groups: list[list[str]], param_fqns, buffer_fqns, trainable,
           gaps: str = "next") -> RawTrace:
    """``raw`` (each long group three layers deep) with every group of ``groups`` at its full
    depth; ``param_fqns`` etc. are those of the full model. Raises :class:`CannotUnroll`."""
    if any(len(g) > 3 and len(r) != 3 for g, r in zip(groups, raw.groups)) or len(groups) != len(raw.groups):
        raise CannotUnroll("each group to unroll must be traced three layers deep")
    grads = {param_fqns[i] for i in trainable}
    for k, (r, g) in enumerate(zip(raw.groups, groups)):
        if len(g) <= 3:
            continue
        # One group at a time: the groups after this one are still three layers deep.
        later = tuple(f"{m}." for later_group in groups[k + 1:] if len(later_group) > 3 for m in later_group[3:])
        ps = [f for f in param_fqns if not f.startswith(later)] if later else list(param_fqns)
        bs = [f for f in buffer_fqns if not f.startswith(later)] if later else list(buffer_fqns)
        raw = _unroll_group(raw, r, g, ps, bs, [i for i, f in enumerate(ps) if f in grads], gaps)
    return raw


def _unroll_group(raw: RawTrace, members, target, param_fqns, buffer_fqns, trainable, gaps: str) -> RawTrace:
    return _Unrolling(raw, members, target, gaps).run(param_fqns, buffer_fqns, trainable)


class _Unrolling:
    """The raw trace of a few layers of a group (``members``) written out for the full model's
    layers (``target``): each raw node of a middle layer emitted once per middle layer."""

    def __init__(self, raw: RawTrace, members, target, gaps: str):
        self.raw, self.members, self.target = raw, members, target
        self.grp = _Group(raw, members, target, gaps)
        self.n = self.grp.n
        self.old = list(raw.gm.graph.nodes)
        self.placeholders = [x for x in self.old if x.op == "placeholder"]
        self.raw_leaves = raw.param_fqns + raw.buffer_fqns
        if len(self.placeholders) != len(self.raw_leaves) + len(raw.input_names) or any(
                not _PLACEHOLDER.match(x.name) for x in self.placeholders):
            raise CannotUnroll("placeholders are not the step's flat arguments")
        self.by_fqn = dict(zip(self.raw_leaves, self.placeholders))
        self.leaf_of = {x: f for f, x in self.by_fqn.items()}
        self.graph = fx.Graph()
        self.env: dict[tuple[fx.Node, int], fx.Node] = {}
        """(raw node, layer it stands for, -1 for a node outside the group) -> new node."""
        self.root = torch.nn.Module()
        self.constants = itertools.count()

    def target_leaf(self, fqn: str) -> tuple[fx.Node, int]:
        """The raw placeholder that the full model's parameter or buffer ``fqn`` copies."""
        for u, m in enumerate(self.target):
            if fqn.startswith(m + "."):
                return self.by_fqn[f"{self.members[self.grp.source(u)]}.{fqn[len(m) + 1:]}"], u
        return self.by_fqn[fqn], -1

    def layer_of(self, x: fx.Node) -> int | None:
        if x.op == "placeholder":
            c = self.grp.leaf_coord.get(self.leaf_of.get(x, ""))
            return None if c is None else c[0]
        return self.grp.coord.get(x)

    def counterpart(self, y: fx.Node, b: int, u: int) -> fx.Node:
        """Raw node at y's place in the raw layer that layer u copies (y is in raw layer b)."""
        grp = self.grp
        s = grp.source(u)
        if s == b:
            return y
        if y.op == "placeholder":
            return self.by_fqn[f"{self.members[s]}.{grp.leaf_coord[self.leaf_of[y]][1]}"]
        unit = grp.units[(s, grp.phase[y])]
        if not -len(unit) <= grp.pos[y] < len(unit):
            raise CannotUnroll(f"{y.name} has no counterpart in layer {s}")
        return unit[grp.pos[y]]

    def lookup(self, y: fx.Node, a: int | None, u: int) -> fx.Node:
        """The new node for argument y of a raw node in layer a emitted as layer u."""
        grp, n = self.grp, self.n
        b = self.layer_of(y)
        if b is None:
            return self.env[(y, -1)]
        if a is None:  # outside the group: the first and last layers are themselves, and the
            # middle one, read after the blocks (a residual added past the last layer), is the
            # one next to the block that ran last
            if b == 1 and y.op == "placeholder":
                raise CannotUnroll(f"{y.name}, a middle layer's parameter, is read outside the layers")
            ub = 0 if b == 0 else n - 1 if b == 2 else n - 2 if grp.ascending[grp.phase[y]] else 1
        else:
            ub = u + (b - a)
        if not 0 <= ub < n:
            raise CannotUnroll(f"{y.name} is read {b - a} layers away, past the group's ends")
        return self.env[(self.counterpart(y, b, ub), ub)]

    def emit(self, x: fx.Node, a: int | None, u: int) -> None:
        args = fx.node.map_arg(x.args, lambda y: self.lookup(y, a, u))
        kwargs = fx.node.map_arg(x.kwargs, lambda y: self.lookup(y, a, u))
        if x.op == "get_attr":
            # make_fx numbers the constants it lifts (a cache's empty tensor in each layer) in
            # creation order: each copy is a constant of its own.
            name = f"_tensor_constant{next(self.constants)}" if _CONSTANT.match(x.target) else x.target
            if "." in name:
                raise CannotUnroll(f"constant {x.target} is a nested attribute")
            setattr(self.root, name, getattr(self.raw.gm, x.target))
            new = self.graph.get_attr(name)
        else:
            # make_fx names a node by its op and numbers it by creation order, as this does.
            m = _NUMBERED.match(x.name)
            new = self.graph.create_node(x.op, x.target, args, kwargs, name=m.group(1) if m else x.name)
        new.meta = dict(x.meta)
        if a is not None:
            new.meta["custom"] = retagged(new.meta.get("custom"), self.target[u])
        self.env[(x, u if a is not None else -1)] = new

    def outside(self, y):
        return self.lookup(y, None, -1) if isinstance(y, fx.Node) else y

    def _emit_placeholders(self, param_fqns, buffer_fqns) -> None:
        """The full model's flat arguments, in order, named as make_fx names them."""
        inputs = self.placeholders[len(self.raw_leaves):]
        for k, fqn in enumerate(param_fqns + buffer_fqns):
            src, u = self.target_leaf(fqn)
            new = self.graph.placeholder(f"arg{k}_1")
            new.meta = dict(src.meta)
            self.env[(src, u)] = new
        for k, src in enumerate(inputs, start=len(param_fqns) + len(buffer_fqns)):
            new = self.graph.placeholder(f"arg{k}_1")
            new.meta = dict(src.meta)
            self.env[(src, -1)] = new

    def _emit_body(self) -> None:
        grp, n, done = self.grp, self.n, set()
        for x in self.old:
            if x.op in ("placeholder", "output") or x in done:
                continue
            a = grp.coord.get(x)
            if a is None:
                self.emit(x, None, -1)
            elif a == 0:
                self.emit(x, 0, 0)
            elif a == 2:
                self.emit(x, 2, n - 1)
            else:
                unit = grp.units[(1, grp.phase[x])]
                done.update(unit)
                layers = range(1, n - 1) if grp.ascending[grp.phase[x]] else range(n - 2, 0, -1)
                for u in layers:
                    for y in unit:
                        self.emit(y, 1, u)

    def _emit_output(self, param_fqns, trainable) -> None:
        """The loss, then each trainable parameter's gradient, the full model's order."""
        raw = self.raw
        out = next(x for x in self.old if x.op == "output")
        flat = list(out.args[0])
        raw_grad = {raw.param_fqns[i]: g for i, g in zip(raw.trainable, flat[1:])}
        new_flat = [self.outside(flat[0])]
        for i in trainable:
            src, u = self.target_leaf(param_fqns[i])
            g = raw_grad[self.leaf_of[src]]
            if not isinstance(g, fx.Node):
                new_flat.append(g)
            elif u < 0:
                new_flat.append(self.outside(g))
            else:
                new_flat.append(self.lookup(g, self.grp.leaf_coord[self.leaf_of[src]][0], u))
        self.graph.output(type(out.args[0])(new_flat) if isinstance(out.args[0], (tuple, list))
                          else new_flat).meta = dict(out.meta)

    def run(self, param_fqns, buffer_fqns, trainable) -> RawTrace:
        raw = self.raw
        self._emit_placeholders(param_fqns, buffer_fqns)
        self._emit_body()
        self._emit_output(param_fqns, trainable)
        gm = tc.lazy_graph_module(self.root, self.graph)
        groups = [self.target if g == self.members else g for g in raw.groups]
        outside = self.outside
        return RawTrace(gm=gm, param_fqns=list(param_fqns), buffer_fqns=list(buffer_fqns),
                        trainable=list(trainable), input_names=raw.input_names, groups=groups,
                        leaves=[outside(v) if isinstance(v, fx.Node) else v for v in raw.leaves], tree=raw.tree,
                        grads={k: outside(v) if isinstance(v, fx.Node) else v for k, v in raw.grads.items()},
                        fake_mode=raw.fake_mode)


def _op(gm: fx.GraphModule, n: fx.Node):
    """What a node computes, for matching layers: its target, or a constant's shape and dtype."""
    if n.op != "get_attr":
        return n.target
    c = getattr(gm, n.target, None)
    return ("get_attr", tuple(c.shape), c.dtype) if isinstance(c, torch.Tensor) else ("get_attr", n.target)


def compare(a, b) -> str | None:
    """``None`` when two traced graphs are the same node for node (names, ops, arguments,
    shapes, strides, dtypes, tags) and say the same of their placeholders and outputs; else
    the first difference."""
    na, nb = list(a.gm.graph.nodes), list(b.gm.graph.nodes)
    if len(na) != len(nb):
        return f"{len(na)} nodes against {len(nb)}"
    for x, y in zip(na, nb):
        if (x.op, x.name, x.target) != (y.op, y.name, y.target):
            return f"{x.op} {x.name} ({x.target}) against {y.op} {y.name} ({y.target})"
        if _text(x.args) != _text(y.args) or _text(x.kwargs) != _text(y.kwargs):
            return f"arguments of {x.name}: {_text(x.args)} against {_text(y.args)}"
        if _meta(x) != _meta(y):
            return f"value or tags of {x.name}: {_meta(x)} against {_meta(y)}"
    fields = [(t.param_fqns, t.buffer_fqns, t.kinds, t.fqn_of, _text(t.loss_node), _text(t.grad_of), t.layer_groups,
               _text(t.outputs), _text(t.output_grads)) for t in (a, b)]
    if fields[0] != fields[1]:
        return "placeholders or outputs differ"
    return None


def _text(v):
    if isinstance(v, fx.Node):
        return v.name
    if isinstance(v, dict):
        return {k: _text(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_text(x) for x in v]
    return repr(v)


def _meta(n: fx.Node):
    def one(v):
        if isinstance(v, torch.Tensor):
            return tuple(v.shape), tuple(v.stride()), v.dtype, v.requires_grad
        return repr(v) if not isinstance(v, (list, tuple)) else [one(x) for x in v]

    custom = n.meta.get("custom")
    return one(n.meta.get("val")), sorted((k, repr(v)) for k, v in (custom or {}).items())


__all__ = ["CannotUnroll", "MIN_LAYERS", "compare", "trace_unrolled", "truncated", "unroll", "unrolled_trace"]
