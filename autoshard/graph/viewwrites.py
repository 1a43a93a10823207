"""Writes through views made functional: ``base[:, 1:] = x`` as ``base' = slice_scatter(base, x)``.

A traced step keeps in-place ops (``make_fx`` without functionalization: Hugging Face's masks
decide from fake tensors that they are traced). An in-place op on a *view* changes its base
through shared memory, and the graph says so nowhere: Hugging Face's encoder-decoders build
the decoder's input by ``shifted = input_ids.new_zeros(...)``, ``shifted[:, 1:] = input_ids[:, :-1]``,
``shifted[:, 0] = start``, the two writes' nodes unread. Once the view and its base are
DTensors in different placements (a redistribute between them makes a copy), the write lands
in the copy and the base stays zeros: the decoder reads a wrong input and every gradient is
wrong, silently. So each such write becomes what functionalization would make of it:

    v = view_k(... view_1(b))          op_(v, args)   (in place)
 -> v' = op(v, args)                                   (the op out of place)
    b' = scatter_1(b, scatter_2(..., v'))              (each view inverted, innermost first)

and every reader of ``b``, of ``op_``'s output or of a view in the chain that runs after the
write reads the rewritten value (a view of ``b`` made before the write and read after it is
made again from ``b'``). An in-place op on a base itself stays: the trace already gives its
readers the op's output; only views of the base made before it are made again from it.

Views are inverted by ``slice_scatter``, ``select_scatter``, ``as_strided_scatter``, or their
own inverse view (``view``, ``unsqueeze``, ``squeeze.dim``, ``transpose``, ``permute``, ``t``,
``alias``); a write through any other view is a :class:`~autoshard.errors.TraceError`.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from autoshard.errors import TraceError

_A = torch.ops.aten

#: View ops a write may go through, with how to put the written view back into its base.
INVERTIBLE = (_A.slice.Tensor, _A.select.int, _A.view.default, _A._unsafe_view.default, _A.unsqueeze.default,
              _A.squeeze.dim, _A.transpose.int, _A.permute.default, _A.t.default, _A.alias.default,
              _A.as_strided.default)
#: Other view ops (a write through them is refused with its name).
_OTHER_VIEWS = (_A.expand.default, _A.diagonal.default, _A.unfold.default,
                _A.split.Tensor, _A.split_with_sizes.default, _A.unbind.int, _A.narrow.default, _A.squeeze.default,
                _A.squeeze.dims, _A.view_as_real.default, _A.view_as_complex.default, _A.view.dtype)


def _is_view(n) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and (n.target in INVERTIBLE or n.target in _OTHER_VIEWS)


def _writes_in_place(n: fx.Node) -> bool:
    return _mutates(n) and n.target._schema.name.split("::")[-1].endswith("_") and _is_view(n.args[0])


def _out_of_place(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    name = op._schema.name.split("::")[-1]
    try:
        return getattr(getattr(_A, name[:-1]), op._overloadname)
    except AttributeError:
        raise TraceError(f"an in-place write through a view ({op}) has no out-of-place form "
                         f"aten.{name[:-1]}.{op._overloadname}: expected one to plan it") from None


def _inverse(view: fx.Node, base: fx.Node, written: fx.Node, graph: fx.Graph) -> fx.Node:
    """``base`` with ``written`` put where ``view`` (a view of ``base``) was."""
    op, args = view.target, view.args
    if op is _A.slice.Tensor:
        dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
        return graph.call_function(_A.slice_scatter.default, (base, written, dim, start, end, step))
    if op is _A.select.int:
        return graph.call_function(_A.select_scatter.default, (base, written, args[1], args[2]))
    if op in (_A.view.default, _A._unsafe_view.default):
        return graph.call_function(_A.view.default, (written, list(base.meta["val"].shape)))
    if op is _A.unsqueeze.default:
        return graph.call_function(_A.squeeze.dim, (written, args[1]))
    if op is _A.squeeze.dim:
        if base.meta["val"].shape[args[1]] != 1:
            return written  # squeezing a dim longer than 1 leaves the tensor as it is
        return graph.call_function(_A.unsqueeze.default, (written, args[1]))
    if op is _A.transpose.int:
        return graph.call_function(_A.transpose.int, (written, args[1], args[2]))
    if op is _A.permute.default:
        order = [d % len(args[1]) for d in args[1]]
        return graph.call_function(_A.permute.default, (written, [order.index(d) for d in range(len(order))]))
    if op is _A.t.default:
        return graph.call_function(_A.t.default, (written,))
    if op is _A.alias.default:
        return written
    if op is _A.as_strided.default:  # autograd's backward of strided views (Swin's windows)
        return graph.call_function(_A.as_strided_scatter.default, (base, written, *args[1:]))
    raise TraceError(f"an in-place write through the view {view.name} ({op}) cannot be planned: its base "
                     f"{base.name} would not see the write once they are placed apart; expected the write to "
                     f"go through one of {', '.join(str(v) for v in INVERTIBLE)}")


def functionalize_view_writes(gm: fx.GraphModule, fake_mode) -> dict[fx.Node, fx.Node]:
    """Rewrite every in-place op on a view of ``gm`` (module doc), and make again every view of an
    in-place op's base made before the op and read after it; returns each replaced node -> its
    replacement (the in-place op -> its out-of-place result, each base -> its rewritten value).
    New nodes carry fake values (under ``fake_mode``) and the write's meta."""
    replaced: dict[fx.Node, fx.Node] = {}
    graph = gm.graph
    for write in [n for n in graph.nodes if _mutates(n)]:
        if not _writes_in_place(write):
            # In place on a base itself: its readers after it read the op's output already
            # (the trace gives the mutated tensor the op's node); views made before it do not.
            if write.args[0].op != "placeholder":
                _remake_stale_views(graph, write.args[0], write, write, [], fake_mode)
            continue
        chain = [write.args[0]]
        while _is_view(chain[-1].args[0]):
            chain.append(chain[-1].args[0])
        base = chain[-1].args[0]
        order = _positions(graph)
        made: list[fx.Node] = []
        with graph.inserting_before(write.next):  # in creation order, right after the write
            value = graph.call_function(_out_of_place(write.target), write.args, write.kwargs)
            made.append(value)
            new_of = {chain[0]: value}
            for view in chain:  # innermost view first
                parent = view.args[0]
                value = _inverse(view, parent, value, graph)
                if value is not new_of[view]:
                    made.append(value)
                new_of[parent] = value
        _give_meta(made, write, fake_mode)
        after = order[write]
        for old, new in [(write, new_of[chain[0]]), *new_of.items()]:
            for user in list(old.users):
                if user not in made and order.get(user, len(order)) > after:
                    user.replace_input_with(old, new)
        _remake_stale_views(graph, base, new_of[base], write, made, fake_mode, order)
        replaced[write] = new_of[chain[0]]
        replaced[base] = new_of[base]
        graph.erase_node(write)
    return replaced


def _mutates(n: fx.Node) -> bool:
    return (n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
            and bool(n.args) and isinstance(n.args[0], fx.Node))


def _positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: k for k, n in enumerate(graph.nodes)}


def _remake_stale_views(graph, base, new_base, write, made, fake_mode, order=None) -> None:
    """Views of ``base`` (through any chain of views) made before ``write`` and read after it:
    made again, view by view, from ``new_base``, right after what ``made`` holds (else after
    ``write``), and appended to ``made``."""
    views, todo = [], [u for u in base.users if _is_view(u) and u.args[0] is base]
    while todo:  # every view of base, through views of views
        v = todo.pop()
        views.append(v)
        todo.extend(u for u in v.users if _is_view(u) and u.args[0] is v)
    if not views:
        return
    order = order if order is not None else _positions(graph)
    after = order[write]

    def late(n: fx.Node) -> list[fx.Node]:
        return [u for u in n.users if u not in made and order.get(u, len(order)) > after]

    again: dict[fx.Node, fx.Node] = {base: new_base}
    for view in [v for v in views if v not in made and order.get(v, len(order)) < after and late(v)]:
        path = [view]
        while path[-1].args[0] is not base:
            path.append(path[-1].args[0])
        for v in reversed(path):
            if v not in again:
                with graph.inserting_before((made[-1] if made else write).next):
                    again[v] = graph.call_function(v.target, (again[v.args[0]], *v.args[1:]), v.kwargs)
                _give_meta([again[v]], write, fake_mode)
                made.append(again[v])
        for user in late(view):
            user.replace_input_with(view, again[view])


def _give_meta(nodes: list[fx.Node], like: fx.Node, fake_mode) -> None:
    for n in nodes:
        for key in ("custom", "stack_trace", "nn_module_stack"):
            if key in like.meta:
                n.meta[key] = dict(like.meta[key]) if isinstance(like.meta[key], dict) else like.meta[key]
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
        with fake_mode:
            n.meta["val"] = n.target(*args, **kwargs)
