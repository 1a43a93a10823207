"""Bucketing and overlap on a lowered per-rank program, costed by the plan's profile.

A lowered program (:mod:`autoshard.runtime.lower`) issues each collective where DTensor's
redistribution put it and waits for it right away. Two of torch's own FX passes then
reorder it, with the same cost model the planner used as their runtime estimator:

- **bucketing** (``bucket_mb``): independent collectives of one kind, group, reduce op and
  dtype are merged into flat collectives of up to ``bucket_mb`` MiB (Inductor's
  ``bucket_all_reduce`` / ``bucket_all_gather`` / ``bucket_reduce_scatter``): the same bytes,
  one latency per bucket;
- **overlap** (``overlap=True``): Inductor's overlap scheduler
  (``schedule_overlap_bucketing``) starts each collective as early as its inputs allow and
  waits for it once the compute placed beside it covers its estimated time, so the gradient
  all-reduces (DDP's), reduce-scatters and parameter all-gathers (FSDP's) run beside
  independent compute.

Estimates (microseconds in, milliseconds out, as the scheduler wants them):

    compute(node)    = max(FLOPs / (peak * efficiency), bytes / bandwidth, launch)   (views: 0)
    collective(node) = the profile's fit for (kind, group size, link class) at the full
                       buffer's bytes (nccl-tests' convention: the gathered / reduced size)

Both depend only on shapes and group sizes, so every rank orders its program the same
way and the members of a group issue its collectives in one order.
"""

from __future__ import annotations

import heapq
import operator

import torch
import torch.fx as fx

from autoshard import _torch_compat as tc
from autoshard.graph.attention import kernel_of
from autoshard.graph.pricing import is_view, matmul_operands, matmul_side, node_flops, op_pricing
from autoshard.graph.strategies import is_tensor
from costmodel import compute_time_us
from costmodel.ops import host_kind
from costmodel.profile import Profile

_F = torch.ops._c10d_functional
KIND = {
    _F.all_reduce.default: "all_reduce",
    _F.all_gather_into_tensor.default: "all_gather",
    _F.all_gather_into_tensor_out.default: "all_gather",
    _F.reduce_scatter_tensor.default: "reduce_scatter",
    _F.all_to_all_single.default: "all_to_all",
    _F.broadcast.default: "broadcast",
}
"""Functional collective -> the cost model's collective kind."""


def _bytes(v) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def _val(node) -> object:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


class Estimator:
    """Runtime of a per-rank program's nodes by the plan's profile (see the module doc)."""

    def __init__(self, profile: Profile):
        self.profile = profile
        self._flops: dict = {}
        self._issue: dict = {}

    def issue_us(self, node: fx.Node) -> float:
        """Host time to issue ``node`` (:mod:`autoshard.planning.simulate`'s host stream)."""
        us = self._issue.get(node.target)
        if us is None:
            us = self._issue[node.target] = self.profile.host_us(host_kind(node.target))
        return us

    def compute_us(self, node: fx.Node) -> float:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            return 0.0
        if is_view(node):  # as the plan prices it
            return 0.0
        nbytes = sum(_bytes(_val(a)) for a in node.all_input_nodes)
        out = _val(node)
        nbytes += sum(_bytes(o) for o in (out if isinstance(out, (list, tuple)) else [out]))
        flops = node_flops(node, self._flops)
        mm = matmul_operands(node) if self.profile.matmul_shares else None
        side = None
        if mm is not None:  # a per-rank program's values are the local pieces
            args = [a for a in node.args if is_tensor(a)]
            side = matmul_side(tuple(_val(args[mm[0]]).shape), tuple(_val(args[mm[1]]).shape))
        return compute_time_us(flops, nbytes, self.profile, *op_pricing(node, flops), side, kernel_of(node.target))

    def collective_us(self, node: fx.Node, override_bytes: int | None = None) -> float:
        kind = KIND[node.target]
        inp, out = _bytes(_val(node.args[0])), _bytes(_val(node))
        full = out if kind == "all_gather" else inp
        if override_bytes is not None:
            # The scheduler sizes a would-be bucket in its own unit (inputs + outputs).
            full = override_bytes * full / max(1, inp + out)
        ranks = tc.group_ranks(node.args[-1])
        per_node = self.profile.devices_per_node
        intra = min(ranks) // per_node == max(ranks) // per_node
        return float(self.profile.collective_predictor(kind, len(ranks), intra)(full))

    def ms(self, node: fx.Node, override_bytes: int | None = None) -> float:
        if node.target in KIND:
            return self.collective_us(node, override_bytes) / 1e3
        return self.compute_us(node) / 1e3


_VIEW_CHAIN = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


#: Ops through which a bucket member is only viewed, and those that read any strides.
_VIEWS = frozenset({*_VIEW_CHAIN, torch.ops.aten.reshape.default, torch.ops.aten.t.default,
                    torch.ops.aten.transpose.int, torch.ops.aten.permute.default, torch.ops.aten.expand.default,
                    torch.ops.aten.unsqueeze.default, torch.ops.aten.squeeze.dim, torch.ops.aten.alias.default,
                    torch.ops.aten.detach.default})
_READ_STRIDED = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
                           torch.ops.aten.baddbmm.default, torch.ops.aten.clone.default,
                           torch.ops.aten._to_copy.default})


def _read_by_strided_ops(node: fx.Node) -> bool:
    """Whether every reader of ``node``, through views, is a matmul or a copy."""
    todo, seen = list(node.users), set()
    while todo:
        user = todo.pop()
        if user in seen:
            continue
        seen.add(user)
        if user.target in _VIEWS:
            todo.extend(user.users)
        elif user.target not in _READ_STRIDED:
            return False
    return True


def _copied_out(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """A contiguous copy of ``node`` that its readers read instead."""
    users = list(node.users)
    with gm.graph.inserting_after(node):
        out = gm.graph.call_function(torch.ops.aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    out.meta = dict(node.meta)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        out.meta["val"] = val.clone(memory_format=torch.contiguous_format)
    for user in users:
        user.replace_input_with(node, out)
    return out


def reshape_strided_bucket_slices(gm: fx.GraphModule) -> int:
    """A gathered bucket is split into its members along dim 1 (one row per rank): each member
    is a strided slice. A member read by anything but views, matmuls and copies is copied out
    contiguous (as FSDP2 copies gathered parameters out of its buffer): kernels that take a
    strided slice as if contiguous give wrong answers (torch's CPU ``native_group_norm_backward``,
    its gradient and statistics gathered in one bucket: Wav2Vec2's feature extractor's
    group-norm gradients off by 50); matmuls read strides, and weights that only they read stay
    views of the bucket, whose buffer lives while any of them is read (the memory account
    charges each member from its own reader, not the buffer: an under-count where one bucket
    spans many layers). A ``view``
    the program recorded on the contiguous tensor the member replaced becomes a ``reshape``,
    which copies only where a view cannot express the shape. Returns how many views were
    changed."""
    changed = 0
    for node in list(gm.graph.nodes):
        src = node.args[0] if node.target is operator.getitem else None
        if not (isinstance(src, fx.Node) and src.target is torch.ops.aten.split_with_sizes.default
                and (src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)) != 0):
            continue
        out = node if _read_by_strided_ops(node) else _copied_out(gm, node)
        todo = list(out.users)
        while todo:
            user = todo.pop()
            if user.target in _VIEW_CHAIN:
                user.target = torch.ops.aten.reshape.default
                changed += 1
                todo.extend(user.users)
    return changed


#: Ops that hand back a view of (part of) their input: what a member of a bucket goes through
#: before the program returns it.
_ALIASING = _VIEWS | {torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default,
                      torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.chunk.default,
                      torch.ops.aten._unsafe_view.default, operator.getitem}


def _returned(node: fx.Node) -> bool:
    """Whether the program returns ``node`` or a view of it."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.op == "output":
                return True
            if user.target in _ALIASING and user not in seen:
                seen.add(user)
                todo.append(user)
    return False


def copy_out_returned_members(gm: fx.GraphModule) -> int:
    """A reduced bucket hands its members back as views of one flat buffer, which lives while any
    of them does. A member the program returns (a gradient, moved to its parameter's spec as the
    backward makes it) lives into the optimizer step: where the bucket also holds members the
    program reads and drops (an activation's gradient, all-reduced over the same group), the
    returned one is copied out, so that the flat buffer dies with the others. Returns how many
    members were copied."""
    copied = 0
    for node in list(gm.graph.nodes):
        src = node.args[0] if node.target is torch.ops.aten.split_with_sizes.default else None
        if not (isinstance(src, fx.Node) and src.target is _F.wait_tensor.default):
            continue
        members = [u for u in node.users if u.target is operator.getitem]
        returned = [m for m in members if _returned(m)]
        if returned and len(returned) < len(members):
            for m in returned:
                _copied_out(gm, m)
            copied += len(returned)
    return copied


def _is_communication(node: fx.Node) -> bool:
    """A functional collective (:data:`KIND`) or its wait."""
    return node.op == "call_function" and (node.target in KIND or node.target is _F.wait_tensor.default)


def collective_order(gm: fx.GraphModule) -> list[tuple]:
    """``gm``'s collectives in issue order, each as its kind, reduce op and group size where it
    names them: what every rank must issue alike (the group itself differs by rank: rank 0's
    ``tp`` group is not rank 2's)."""
    return [(KIND[n.target], *(a for a in n.args if isinstance(a, int) and not isinstance(a, bool)
                               or isinstance(a, str) and a in _REDUCE_OPS))
            for n in gm.graph.nodes if n.op == "call_function" and n.target in KIND]


_REDUCE_OPS = frozenset({"sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"})


def recompute_segments(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Per node, how many recomputations (runs of nodes marked :data:`~autoshard._torch_compat.RECOMPUTED`)
    start at or before it in ``gm``'s order."""
    segment, k, inside = {}, 0, False
    for node in gm.graph.nodes:
        marked = tc.is_recomputed(node)
        k += marked and not inside
        inside = marked
        segment[node] = k
    return segment


def keep_recomputation_in_place(gm: fx.GraphModule, segment: dict[fx.Node, int]) -> None:
    """Undo what the overlap scheduler moved across a recomputation (``segment``: each node's
    :func:`recompute_segments` before it ran): ops run segment by segment, within one in the
    scheduler's order, each collective and its wait in the segment of the op the scheduler put
    after it (a wait no later than its first reader).

    The scheduler runs an op just before the first matmul it feeds and pulls independent ops
    ahead of waits to hide them: across a recomputation that runs the next layer's
    recomputation ahead of this layer's backward, holding both layers' activations at once,
    which the plan does not."""
    if not any(segment.values()):
        return
    nodes = list(gm.graph.nodes)
    sched = {n: k for k, n in enumerate(nodes)}
    key: dict[fx.Node, tuple] = {}
    following = None
    for node in reversed(nodes):
        if _is_communication(node) or node not in segment:
            seg = segment[following] if following is not None else max(segment.values())
            readers = [segment[u] for u in node.users if u in segment and not _is_communication(u)]
            key[node] = (min([seg, *readers]), sched[node])
        else:
            following = node
            key[node] = (segment[node], sched[node])
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(key[n], n) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, (key[u], u))
    if len(order) != len(nodes):
        raise RuntimeError(f"keep_recomputation_in_place: {len(nodes) - len(order)} nodes left unordered")
    cursor = order[0]
    for n in order[1:]:
        cursor.append(n)
        cursor = n


def optimize(gm: fx.GraphModule, profile: Profile, bucket_mb: float, overlap: bool,
             headroom_bytes: int = 0) -> fx.GraphModule:
    """``gm`` with its collectives bucketed (``bucket_mb`` > 0) and overlapped (``overlap``), no op
    moved across a recomputation (:func:`keep_recomputation_in_place`). The overlap scheduler may
    raise the program's peak by ``headroom_bytes`` to start a collective early or wait for it late:
    the plan's account says how far the program's peak lies below the step's (another program's,
    or the optimizer step's)."""
    # The passes trace their merge functions: an ambient LocalTensorMode would turn their
    # constants into per-rank tensors the graph module does not own.
    with tc.quiet_tracing():
        if bucket_mb > 0:
            # A bucket runs every reader of its members after its last member: one spanning a
            # layer's recomputation would run it ahead of the previous layer's backward.
            tc.bucket_collectives(gm, bucket_mb, recompute_segments(gm))
            reshape_strided_bucket_slices(gm)
            copy_out_returned_members(gm)
        if overlap:
            segment = recompute_segments(gm)
            gm = tc.schedule_overlap(gm, Estimator(profile).ms, headroom_bytes)
            keep_recomputation_in_place(gm, segment)
    gm.graph.lint()
    gm.recompile()
    return gm
