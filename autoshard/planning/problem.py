"""Turn a traced graph and its strategies into a ``solver.Problem``.

ILP nodes are the placeholders (parameters, buffers, inputs) and every
call_function node except ``getitem`` (which only selects an output of its
producer). Costs, all in microseconds:

- node cost: compute of the sharded op (roofline on its FLOPs divided by the
  number of ranks that split the work), plus for the loss the all-reduce to a
  replicated scalar;
- edge cost: the redistribute from the producer's output spec to the spec the
  consumer's strategy wants for that argument; one extra edge per parameter,
  from its gradient's producer to the parameter, costs the gradient's
  redistribute to the parameter's spec (data parallel's all-reduce, FSDP's
  reduce-scatter).

Memory (bytes per device), the terms of the solver's memory rows: each node's output shard
is live from the node to its last use; parameters, their optimizer state, their gradients'
shards (:data:`GRADIENT_SHARDS`) and buffers for the whole step; a gradient in the spec its op
gives it, from its op to its move to the parameter's spec (the lowered backward moves it with
its group, at most ``bucket_mb`` later: the rows read it at its op). View ops alias their input:
they add nothing, and reading a view keeps its source alive (:func:`node_intervals`), except a
forward view the backward reads whose argument arrives redistributed (``Strategy.moved``,
:func:`held_views`): it holds that buffer, its output's shard, until its last read (a gathered
weight kept for the backward). Recomputed activations (:mod:`autoshard.graph.recompute`) are
copies of their nodes, live in the backward only. What depends on a pair of choices beyond that
(a consumer's transient redistributed argument, a gradient reduced to its parameter's spec, the
optimizer step's temporaries) is counted on the chosen plan by :mod:`autoshard.planning.memory`,
whose peak the plan reports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

import solver
from autoshard.errors import AutoshardError
from autoshard.graph.attention import KERNEL_BACKWARD, kernel_messages, kernel_of, work_factor
from autoshard.graph.layers import layer_ties
from autoshard.graph.pricing import is_view, matmul_operands, matmul_side, memory_pattern, node_flops, op_pricing
from autoshard.graph.recompute import Recompute, parameter_views, recomputed
from autoshard.graph.strategies import NodeStrategies, Strategy, StrategyEnumerator, is_getitem, is_tensor
from autoshard.graph.tracing import TracedGraph, node_phase
from autoshard.planning.imbalance import expert_matmuls, imbalance_scale, move_scale, token_dims
from costmodel import MeshTopology, Profile, RedistributePlanner, Spec, compute_time_us
from costmodel.ops import host_kind
from costmodel.spec import local_bytes, on_mesh, shard_dim


@dataclass
class ArgEdge:
    """Where a consumer's tensor argument comes from."""

    consumer: int
    arg: int
    """Index into the consumer strategy's ``ins``; -1 for a gradient-to-parameter edge."""
    producer: int
    out: int
    """Which output of the producer (getitem index)."""


@dataclass
class GraphProblem:
    problem: solver.Problem
    nodes: list[fx.Node]
    """ILP node index -> graph node."""
    strategies: list[list[Strategy]]
    edges: list[ArgEdge]
    compute_us: list[np.ndarray]
    """Per ILP node, compute time of each strategy (the loss's reduction excluded)."""
    fallback_ops: dict[str, int] = field(default_factory=dict)
    index: dict[str, int] = field(default_factory=dict)
    """Graph node name -> ILP node index."""
    rule_errors: dict[str, str] = field(default_factory=dict)
    """Op name -> the error its DTensor rule raised, for ops that fell back because of it."""
    flops_uncounted: dict[str, str] = field(default_factory=dict)
    """Op name -> why its FLOPs could not be counted (costed as 0)."""
    copy_of: dict[int, int] = field(default_factory=dict)
    """Recomputed copy's ILP index -> its original's (:func:`with_recompute`);
    copies come after every original node."""
    recompute_at: dict[int, int] = field(default_factory=dict)
    """Recomputed copy's ILP index -> the backward node its layer's recompute runs just before
    (:attr:`Recompute.at <autoshard.graph.recompute.Recompute.at>`), where that is a node of
    the problem."""
    imbalance: dict = field(default_factory=dict)
    """``{"factor": f, "expert_matmuls": n}`` where the graph has expert matmuls
    (:mod:`autoshard.planning.imbalance`); empty otherwise."""
    host_by_kind: dict = field(default_factory=dict)
    """Host time to issue a node by its :func:`~costmodel.ops.host_kind` (the profile's
    :meth:`~costmodel.Profile.host_us`): :mod:`autoshard.planning.simulate`'s host stream; empty: none."""
    topo: MeshTopology | None = None
    """The mesh's link classes, where the problem was built for one: with ``profile``, what a
    redistribute's steps are (:func:`costmodel.plan_steps`)."""
    profile: Profile | None = None
    """The profile the problem was costed with."""
    bucket_mb: float = 0.0
    """The executor's bucket cap the plan's simulation assumes (:mod:`autoshard.runtime.buckets`); 0:
    none."""
    _issue: list | None = field(default=None, init=False, repr=False, compare=False)
    _order: list | None = field(default=None, init=False, repr=False, compare=False)

    def issue_us(self) -> list[float]:
        """Host time to issue each node, by index (0 for placeholders)."""
        if self._issue is None:
            self._issue = [self.host_by_kind.get(host_kind(n.target), 0.0) if n.op == "call_function" else 0.0
                           for n in self.nodes]
        return self._issue

    def run_order(self) -> list[int]:
        """The nodes in the order they run: originals in graph order, a layer's recomputed
        copies in graph order just before the backward node its recompute runs before (as the
        lowering runs them, :func:`autoshard.runtime.lower.split`). Computed once: every
        simulation of a plan walks it."""
        if self._order is None:
            n_orig = self.num_originals
            keys = [float(v) for v in range(len(self.nodes))]
            for c, o in self.copy_of.items():
                # In (at - 1, at), ordered by the original's place: a copy after the copies it reads.
                keys[c] = self.recompute_at.get(c, n_orig) - 1 + (o + 1) / (n_orig + 1)
            self._order = sorted(range(len(self.nodes)), key=keys.__getitem__)
        return self._order

    @property
    def num_originals(self) -> int:
        return len(self.nodes) - len(self.copy_of)


def caching_allocator(profile: Profile | None) -> bool:
    """Whether the profile's device allocates through torch's caching allocator (a GPU: every
    profile but those of CPUs, whose descriptions start with "CPU")."""
    return profile is None or not str(profile.device).lower().startswith("cpu")


MIB = 2**20


def block_bytes(nbytes, caching: bool):
    """Bytes a tensor of ``nbytes`` holds (a number or an array): on a CPU its storage; in the
    caching allocator a request rounded up to 512 B, and a block over 1 MiB may keep up to 1 MiB
    it does not split off, counted at that bound (up to the next MiB; measured, the sharded
    programs of ``benchmarks/gpu_memory.py`` allocated 4-6% above their storage)."""
    if not caching:
        return nbytes
    if isinstance(nbytes, (int, float)):  # one tensor, on the strategy loop of a build: no array
        return float(math.ceil(nbytes / MIB) * MIB if nbytes > MIB else math.ceil(nbytes / 512) * 512)
    n = np.asarray(nbytes, dtype=np.float64)
    out = np.where(n > MIB, np.ceil(n / MIB) * MIB, np.ceil(n / 512) * 512)
    return out if out.ndim else float(out)


def _itemsize(t: torch.Tensor) -> int:
    return t.element_size()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _RedistCost:
    """Edge costs from one redistribute planner, which caches by (src, dst, shape, itemsize)."""

    def __init__(self, topo: MeshTopology, profile: Profile):
        self.planner = RedistributePlanner(topo, profile)
        self._mats: dict = {}

    def edge_matrix(self, src_strats, out: int, dst_strats, arg: int, t: torch.Tensor) -> np.ndarray:
        """The matrix of an edge, shared by every edge with the same strategy lists and tensor.

        Strategy lists come from the enumerator's cache, so the copies of an edge in
        repeated layers are the same two list objects: one matrix serves them all.
        """
        key = (id(src_strats), out, id(dst_strats), arg, tuple(t.shape), t.element_size())
        m = self._mats.get(key)
        if m is None:
            srcs = [s.outs[out] for s in src_strats]
            dsts = [s.ins[arg] for s in dst_strats] if arg >= 0 else [s.outs[0] for s in dst_strats]
            m = self._mats[key] = self.matrix(srcs, dsts, t)
        return m

    def cost(self, src: Spec, dst: Spec, t: torch.Tensor) -> float:
        return self.planner.plan(src, dst, tuple(t.shape), t.element_size()).us

    def matrix(self, srcs: list[Spec], dsts: list[Spec], t: torch.Tensor) -> np.ndarray:
        """Cost of every (producer strategy, consumer strategy) pair, planning each distinct spec pair once."""
        us, vs = list(dict.fromkeys(srcs)), list(dict.fromkeys(dsts))
        shape, item = tuple(t.shape), t.element_size()
        small = self.planner.cost_matrix(us, vs, shape, item)
        u_pos = {s: k for k, s in enumerate(us)}
        v_pos = {s: k for k, s in enumerate(vs)}
        return small[np.ix_([u_pos[s] for s in srcs], [v_pos[s] for s in dsts])]


def _node_costs(n, strats, ns, outs_vals, mesh_shape, profile, flop_memo, flop_failures, pattern):
    """Compute time and output bytes per device of each strategy of a call_function node
    (``pattern``: its :func:`memory_pattern`)."""
    flops = node_flops(n, flop_memo, flop_failures)
    dtype, pattern = op_pricing(n, flops, pattern)
    view = is_view(n)
    kernel = kernel_of(n.target)
    ins_vals = [a.meta["val"] for a in ns.tensor_args]
    c = np.zeros(len(strats))
    usage = np.zeros(len(strats))
    caching = caching_allocator(profile)
    if view:
        # A view aliases its argument: no time, no memory, unless the argument was moved into it.
        usage = np.array([block_bytes(local_bytes(s.outs[0], outs_vals[0], mesh_shape), caching) if s.moved else 0.0
                          for s in strats])
        return c, usage
    # A matmul's rate follows the size of its local pieces, which each strategy sets.
    mm = matmul_operands(n) if profile.matmul_shares else None
    for i, s in enumerate(strats):
        outs_b = [local_bytes(o, t, mesh_shape) for o, t in zip(s.outs, outs_vals)
                  if o is not None and isinstance(t, torch.Tensor)]
        out_b = sum(outs_b)
        usage[i] = sum(block_bytes(b, caching) for b in outs_b)
        if kernel == KERNEL_BACKWARD and caching and outs_b:
            # The flash backward accumulates the query's gradient in float32 (and its softmax
            # row sums): a workspace of twice a half-precision gradient, charged with it.
            usage[i] += block_bytes(outs_b[0] * 4 // max(1, outs_vals[0].element_size()), caching)
        in_b = sum(local_bytes(sp, t, mesh_shape) for sp, t in zip(s.ins, ins_vals))
        split = 1
        for axis in range(len(mesh_shape)):
            sharded_in = any(shard_dim(sp.placements[axis]) is not None for sp in s.ins)
            if sharded_in or (not s.ins and any(o is not None and shard_dim(o.placements[axis]) is not None
                                                for o in s.outs)):
                split *= mesh_shape[axis]
        side = None if mm is None else matmul_side(
            s.ins[mm[0]].local_shape(tuple(ins_vals[mm[0]].shape), mesh_shape),
            s.ins[mm[1]].local_shape(tuple(ins_vals[mm[1]].shape), mesh_shape))
        if kernel is not None:  # a causal kernel split on its queries waits for its busiest rank
            flops_i = flops / split * work_factor(n, s.ins, mesh_shape, ns.tensor_args)
        else:
            flops_i = flops / split
        c[i] = compute_time_us(flops_i, in_b + out_b, profile, dtype, pattern, side, kernel)
        if kernel is not None:
            c[i] += _inside_us(n, s, mesh_shape, ns.tensor_args, profile, c[i])
    return c, usage


def _inside_us(n, s, mesh_shape, tensor_args, profile, compute_us: float) -> float:
    """Time a causal kernel split on the sequence spends on its own messages
    (:func:`autoshard.graph.attention.kernel_messages`) beyond its compute: the mirror exchange's
    whole, the ring's passes where they outlast the block attention they overlap. Each message
    is one rank's send to one other, an ``all_to_all`` whose other splits are empty (priced as
    the all_to_all whose per-rank share sent is those bytes)."""
    axes, exposed, passes = kernel_messages(n, s.ins, mesh_shape, tensor_args)
    if not axes:
        return 0.0
    parts = math.prod(mesh_shape[a] for a in axes)
    intra = MeshTopology(tuple(mesh_shape), profile.devices_per_node).group_is_intra_node(axes)
    send = profile.collective_predictor("all_to_all", parts, intra)

    def total(sizes):
        return float(sum(send(b * parts / (parts - 1)) for b in sizes))

    return total(exposed) + max(0.0, total(passes) - compute_us)


def live_root(a: fx.Node, recomputed=None, in_backward=None) -> tuple[fx.Node, bool]:
    """(the node whose output holds ``a``'s memory, whether that is its recomputed copy).

    Through ``getitem`` to the producer, through views to their source: a view aliases its
    source, so reading it keeps the source alive. ``recomputed``: the nodes a backward
    recomputes (:func:`autoshard.graph.recompute.recomputed`), read from the backward
    (``in_backward(node)`` tells the backward's own views, which alias what they view): a
    recomputed value is held by the recomputed copy of its source, unless the chain reaches
    a value that is kept."""
    copy = None if recomputed is not None else False
    while True:
        if copy is None and not in_backward(a):
            copy = a in recomputed
        elif copy:
            copy = a in recomputed
        if not (is_getitem(a) or (a.op == "call_function" and is_view(a) and a.args
                                  and isinstance(a.args[0], fx.Node))):
            return a, bool(copy)
        a = a.args[0]


def node_intervals(tg: TracedGraph, nodes: list[fx.Node], recomputed=None) -> tuple[np.ndarray, np.ndarray]:
    """Liveness ``[lo, hi)`` of each ILP node, and of the recomputed copy of each of ``nodes`` in
    ``recomputed`` (node -> the backward node its recompute runs before), in order.

    An output lives from its node to its last read (through views); parameters, optimizer state
    and buffers for the whole step, the loss to the end. Times are graph positions,
    each split into ``S`` slots when there is recomputation: a layer's recompute replays its
    nodes one slot apart, in forward order, just before the backward node that first needs them,
    so a recomputed value that only feeds the recompute dies as the replay moves on, and the
    ones the backward reads live from their slot to their last backward read."""
    order = list(tg.gm.graph.nodes)
    pos = {n: k for k, n in enumerate(order)}
    rec = recomputed or {}
    replays: dict[fx.Node, list[fx.Node]] = {}
    for n, at in rec.items():
        replays.setdefault(at, []).append(n)
    S = 1 + max((len(g) for g in replays.values()), default=0)
    slot = {}
    for at, group in replays.items():
        for k, n in enumerate(sorted(group, key=pos.__getitem__)):
            slot[n] = pos[at] * S - len(group) + k
    end = len(order) * S
    last: dict[fx.Node, int] = {}
    last_copy: dict[fx.Node, int] = {}

    def in_backward(n):
        return tg.phase(n) == "backward"

    last_view: dict[fx.Node, int] = {}
    last_view_copy: dict[fx.Node, int] = {}

    def read(a, at, by_backward):
        r, copy = live_root(a, rec, in_backward) if by_backward else live_root(a)
        into = last_copy if copy else last
        into[r] = max(into.get(r, -1), at)
        # A moved view holds its own buffer (Strategy.moved): the views between a and its root
        # (their recomputed copies where the backward reads those) live to this read too.
        while a is not r:
            views = last_view_copy if by_backward and a in rec else last_view
            views[a] = max(views.get(a, -1), at)
            a = a.args[0]

    # The program returns each gradient moved to its parameter's spec, moved with its group as the
    # backward makes it: the graph's output reads it at its op, not at the end.
    grads = set(tg.grad_of.values())
    for u in order:
        bwd = bool(rec) and tg.phase(u) == "backward"
        for a in u.all_input_nodes:
            read(a, pos[a] * S if u.op == "output" and a in grads else pos[u] * S, bwd)
    for n in rec:
        for a in n.all_input_nodes:
            read(a, slot[n], True)
    held = set()
    if tg.loss_node is not None:
        held.add(live_root(tg.loss_node)[0])
    out = []
    for n in nodes:
        if n.op == "get_attr" or (n.op == "placeholder" and tg.kinds[n.name] != "input"):
            out.append((0, end))
        elif n.op == "placeholder":
            out.append((0, last.get(n, 0) + 1))
        else:
            lo = pos[n] * S
            last_read = last_view.get(n, lo) if is_view(n) else last.get(n, lo)
            out.append((lo, end if n in held else max(last_read, lo) + 1))
    copies = [(slot[n], max((last_view_copy if is_view(n) else last_copy).get(n, slot[n]), slot[n]) + 1)
              for n in nodes if n in rec]
    return np.array(out, dtype=np.int64).reshape(-1, 2), np.array(copies, dtype=np.int64).reshape(-1, 2)


def _strategies_of(tg: TracedGraph, en: StrategyEnumerator):
    """The ILP's nodes (placeholders, tensor constants, every call_function but ``getitem``), their
    strategy lists (shared by nodes of one shape and op) and their enumerations (None for leaves)."""
    nodes: list[fx.Node] = []
    leaf_strats: dict = {}
    strategies: list[list[Strategy]] = []
    per_node: list[NodeStrategies | None] = []
    for n in tg.gm.graph.nodes:
        if n.op == "placeholder" or (n.op == "get_attr" and is_tensor(n)):
            val = n.meta["val"]
            key = (tuple(val.shape), val.dtype)
            if key not in leaf_strats:
                # Every shard order is offered: the order decides which gathers a consumer needs.
                leaf_strats[key] = [Strategy(outs=(s,), ins=())
                                    for s in en.specs_for(val, partial=False, orders=True)]
            nodes.append(n)
            strategies.append(leaf_strats[key])
            per_node.append(None)
        elif n.op == "call_function" and not is_getitem(n):
            ns = en.for_node(n)
            nodes.append(n)
            strategies.append(ns.strategies)
            per_node.append(ns)
    return nodes, strategies, per_node


GRADIENT_SHARDS = 1
"""Copies of a trainable parameter's shard its row holds for the whole step besides the
parameter and its optimizer state: its gradient in the parameter's spec, which the backward
makes as it makes the gradient. Over the forward that is an over-count
of at most every gradient's shard; the plan's account (:mod:`autoshard.planning.memory`) holds
each shard from its move."""


def _node_rows(tg, nodes, strategies, per_node, mesh_shape, profile, optimizer_states, scales, loss, redist):
    """Per node: its cost row (compute, plus the loss's move to a replicated scalar), its memory
    row, its compute row, and the ops whose FLOPs could not be counted."""
    loss_idx, loss_out = loss
    flop_memo: dict = {}
    flop_failures: dict[str, str] = {}
    node_memo: dict = {}
    costs, usages, compute = [], [], []
    caching = caching_allocator(profile)
    for v, (n, strats) in enumerate(zip(nodes, strategies)):
        val = n.meta["val"]
        outs_vals = list(val) if isinstance(val, (tuple, list)) else [val]
        if n.op == "get_attr":  # a constant: every rank has it, any shard of it is free
            usage = block_bytes(np.array([local_bytes(s.outs[0], val, mesh_shape) for s in strats], dtype=np.float64),
                                caching)
            c = np.zeros(len(strats))
        elif n.op == "placeholder":
            kind = tg.kinds[n.name]
            factor = 1 + (optimizer_states + GRADIENT_SHARDS if kind == "param" and tg.fqn_of[n.name] in tg.grad_of
                          else 0)
            usage = block_bytes(np.array([local_bytes(s.outs[0], val, mesh_shape) for s in strats], dtype=np.float64),
                                caching) * factor
            c = np.zeros(len(strats))
            if kind == "input":
                # Loading the batch: a rank that holds a shard reads less, so ties go to sharded inputs.
                c = np.array([local_bytes(s.outs[0], val, mesh_shape) / (profile.mem_bandwidth_gbps * 1e3)
                              for s in strats])
        else:
            # Strategies are shared by shapes and dtypes; an operand's strides set the access pattern.
            pattern = memory_pattern(n)
            memo_key = (id(strats), n.target, pattern)
            if memo_key in node_memo:
                c, usage = node_memo[memo_key]
            else:
                c, usage = node_memo.setdefault(memo_key, _node_costs(n, strats, per_node[v], outs_vals,
                                                                       mesh_shape, profile, flop_memo,
                                                                       flop_failures, pattern))
            if v in scales:
                c = c * scales[v]
        compute.append(c.copy())
        if v == loss_idx:
            # The loss is read replicated (logged, and the seed of its gradient); a multi-output
            # op (nll_loss_forward: loss, total weight) gives it as one of its outputs.
            r = Spec(("R",) * len(mesh_shape))
            lv = val[loss_out] if isinstance(val, (tuple, list)) else val
            c = c + np.array([redist.cost(s.outs[loss_out], r, lv) for s in strats])
        costs.append(c)
        usages.append(usage)
    return costs, usages, compute, flop_failures


def grad_views(tg: TracedGraph) -> set[fx.Node]:
    """The views (and ``getitem`` selections) between each gradient and the node whose output
    holds it: a gradient that a view of a redistributed value gives is that new buffer, held to
    the end of the step."""
    out = set()
    for g in tg.grad_of.values():
        root = live_root(g)[0]
        while g is not root:
            out.add(g)
            g = g.args[0]
    return out


def held_views(tg: TracedGraph, nodes: list[fx.Node]) -> list[int]:
    """The views that hold what they view for long: forward views read by the backward (through
    further views), the values a step keeps across its two halves (a gathered weight that a
    transpose keeps for the backward), and the views that give a gradient (:func:`grad_views`).
    Their argument may arrive redistributed: each is offered its strategies twice
    (:func:`_offer_moved`)."""
    grads = grad_views(tg)
    out = []
    for v, n in enumerate(nodes):
        if n.op == "call_function" and n in grads:
            out.append(v)
            continue
        if n.op != "call_function" or not is_view(n) or tg.phase(n) != "forward":
            continue
        stack, seen = [n], set()
        while stack:
            x = stack.pop()
            for w in x.users:
                if w in seen:
                    continue
                seen.add(w)
                if w.op == "call_function" and (is_getitem(w) or is_view(w)) and w.args and w.args[0] is x:
                    stack.append(w)
                elif tg.phase(w) == "backward":
                    out.append(v)
                    stack = []
                    break
    return out


def _offer_moved(tg, nodes, strategies, per_node) -> None:
    """Each held view (:func:`held_views`) gets its strategies twice: aliasing its argument as it
    comes (no memory; a producer in another spec is forbidden), and moved (its argument
    redistributed into a buffer of its own, the output's shard, live until the view's last
    read; a producer already in the spec is forbidden). The solver then sees what keeping a
    gathered weight for the backward costs in memory, against gathering it again there."""
    doubled: dict[int, list[Strategy]] = {}
    for v in held_views(tg, nodes):
        base = strategies[v]
        if id(base) not in doubled:
            doubled[id(base)] = base + [dataclasses.replace(s, moved=True) for s in base]
        strategies[v] = doubled[id(base)]
        per_node[v] = dataclasses.replace(per_node[v], strategies=strategies[v])


def _moved_or_aliased(m: np.ndarray, srcs: list[Spec], dst_strats: list[Strategy], mesh_shape) -> np.ndarray:
    """Edge matrix ``m`` into a held view with each pair forbidden whose producer spec contradicts
    the view's kind: an aliasing view takes its argument as it is, a moved one only when moved."""
    codes: dict[Spec, int] = {}
    src = np.array([codes.setdefault(on_mesh(s, mesh_shape), len(codes)) for s in srcs])
    dst = np.array([codes.setdefault(on_mesh(s.ins[0], mesh_shape), len(codes)) for s in dst_strats])
    moved = np.array([s.moved for s in dst_strats])
    same = src[:, None] == dst[None, :]
    return np.where(same == moved[None, :], solver.FORBIDDEN, m)


def _edges(tg, index, strategies, per_node, resolve, redist, tokens, mesh_shape, load_imbalance):
    """Every argument edge (producer output -> consumer argument) and every gradient edge
    (gradient -> its parameter), with their cost matrices."""
    edges: list[ArgEdge] = []
    mats = []
    scaled: dict = {}  # (matrix id, consumer) -> its scaled copy, shared again by tied layers
    for v, ns in enumerate(per_node):
        if ns is None:
            continue
        for k, a in enumerate(ns.tensor_args):
            u, o = resolve(a)
            edges.append(ArgEdge(v, k, u, o))
            m = redist.edge_matrix(strategies[u], o, strategies[v], k, a.meta["val"])
            if k == 0 and strategies[v][-1].moved:
                key = ("moved", id(m), id(strategies[u]), o, id(strategies[v]))
                if key not in scaled:
                    scaled[key] = (m, _moved_or_aliased(m, [s.outs[o] for s in strategies[u]], strategies[v],
                                                        mesh_shape))
                m = scaled[key][1]
            if a in tokens:
                key = (id(m), id(strategies[u]), id(strategies[v]), k)
                if key not in scaled:
                    scaled[key] = (m, m * move_scale([s.outs[o] for s in strategies[u]],
                                                     [s.ins[k] for s in strategies[v]], tokens[a], mesh_shape,
                                                     load_imbalance))
                m = scaled[key][1]
            mats.append(m)
    placeholder_of = {tg.fqn_of[x.name]: x for x in tg.placeholders}
    for fqn, g in tg.grad_of.items():
        u, o = resolve(g)
        v = index[placeholder_of[fqn].name]
        edges.append(ArgEdge(v, -1, u, o))
        mats.append(redist.edge_matrix(strategies[u], o, strategies[v], -1, g.meta["val"]))
    return edges, mats


def build_problem(
    tg: TracedGraph,
    mesh,
    profile: Profile,
    memory_budget: float | None,
    optimizer_states: int = 2,
    tie_layers: bool = True,
    partial_inputs: bool | None = None,
    load_imbalance: float = 1.0,
    bucket_mb: float = 0.0,
) -> GraphProblem:
    """The strategy graph of ``tg`` on ``mesh``, costed with ``profile``; ``load_imbalance``
    scales expert-parallel work (:mod:`autoshard.planning.imbalance`)."""
    mesh_shape = tuple(mesh.shape)
    topo = MeshTopology(mesh_shape, profile.devices_per_node)
    redist = _RedistCost(topo, profile)
    en = StrategyEnumerator(mesh, partial_inputs)
    nodes, strategies, per_node = _strategies_of(tg, en)
    _offer_moved(tg, nodes, strategies, per_node)
    index = {n.name: k for k, n in enumerate(nodes)}

    def resolve(a: fx.Node) -> tuple[int, int]:
        if is_getitem(a):
            return index[a.args[0].name], int(a.args[1])
        return index[a.name], 0

    intervals = node_intervals(tg, nodes)[0]
    loss = resolve(tg.loss_node) if tg.loss_node is not None else (None, 0)
    experts = expert_matmuls(tg)
    scales = {index[n.name]: imbalance_scale(strategies[index[n.name]], mesh_shape, load_imbalance)
              for n in experts if n.name in index and load_imbalance != 1.0}
    # Tensors carrying routed tokens, by the dim of theirs that indexes experts.
    tokens = token_dims(tg, experts) if scales else {}
    costs, usages, compute, flop_failures = _node_rows(tg, nodes, strategies, per_node, mesh_shape, profile,
                                                       optimizer_states, scales, loss, redist)
    edges, mats = _edges(tg, index, strategies, per_node, resolve, redist, tokens, mesh_shape, load_imbalance)
    ties = []
    if tie_layers:
        for group in layer_ties(tg.gm, tg.layer_groups, tg.fqn_of):
            members = [index[n.name] for n in group if n.name in index]
            if len(members) > 1 and len({len(strategies[m]) for m in members}) == 1:
                ties.append(members)
    problem = solver.Problem(
        node_costs=costs,
        node_usages=usages,
        intervals=intervals,
        edges=np.array([(e.producer, e.consumer) for e in edges], dtype=np.int64).reshape(-1, 2),
        edge_costs=mats,
        usage_limit=memory_budget,
        name="autoshard",
        node_names=[n.name for n in nodes],
        ties=ties,
    )
    return GraphProblem(problem, nodes, strategies, edges, compute, dict(en.stats.fallback_ops), index,
                        dict(en.stats.rule_errors), flop_failures,
                        imbalance={"factor": load_imbalance, "expert_matmuls": len(experts)} if experts else {},
                        host_by_kind={k: profile.host_us(k) for k in ("free", "view", "kernel")},
                        topo=topo, profile=profile, bucket_mb=float(bucket_mb))


def pin_indices(gp: GraphProblem, tg: TracedGraph, pins: dict[str, Spec] | None,
                input_specs: list[Spec | None] | None) -> dict[int, int]:
    """``solver.Problem.pins`` for parameter pins by FQN and input specs by position."""
    placeholder_of = {tg.fqn_of[x.name]: x for x in tg.placeholders}
    problem_pins: dict[int, int] = {}
    inputs = tg.input_nodes()
    wanted = [(placeholder_of[f], spec, f"pin {f!r}") for f, spec in (pins or {}).items()]
    if input_specs is not None:
        if len(input_specs) != len(inputs):
            raise AutoshardError(f"input_specs: expected {len(inputs)} specs (one per example input), "
                                 f"found {len(input_specs)}")
        wanted += [(x, spec, f"input {k}") for k, (x, spec) in enumerate(zip(inputs, input_specs))
                   if spec is not None]
    for node, spec, what in wanted:
        v = gp.index[node.name]
        hit = [i for i, st in enumerate(gp.strategies[v]) if st.outs[0] == spec]
        if not hit:
            raise AutoshardError(
                f"{what}: spec {spec} is not a valid spec for a tensor of shape {tuple(node.meta['val'].shape)} "
                f"here (a dim split unevenly over several mesh axes, or into an empty piece? those are not planned)"
            )
        problem_pins[v] = hit[0]
    return problem_pins


def backward_start(gp: GraphProblem) -> int | None:
    """The time the backward starts (its first op's; None: no backward). Nodes live from time 0
    are held over the whole step (:func:`amortized_moves`): their intervals say nothing of
    where they run."""
    lo = gp.problem.intervals[:, 0]
    starts = [lo[v] for v, n in enumerate(gp.nodes)
              if v not in gp.copy_of and lo[v] > 0 and node_phase(n) == "backward"]
    return int(min(starts)) if starts else None


def held_in_flight(gp: GraphProblem, times: int, shared=()) -> GraphProblem:
    """``gp`` whose forward values live when the backward starts (what a microbatch keeps for
    its backward) are charged ``times`` over in the memory rows: a pipeline stage holding
    ``times`` microbatches in flight (:mod:`autoshard.planning.pipeline`), so the solver weighs
    recomputation and sharding against all of them. ``shared``: nodes held once for every
    microbatch (:func:`gathered_once`), charged once. ``times <= 1``: ``gp``."""
    if times <= 1:
        return gp
    p = gp.problem
    lo, hi = p.intervals[:, 0], p.intervals[:, 1]
    t_b = backward_start(gp)
    if t_b is None:
        return gp
    shared = set(shared)
    usages = [u * times if v < gp.num_originals and v not in shared and lo[v] < t_b < hi[v]
              and node_phase(gp.nodes[v]) == "forward" else u for v, u in enumerate(p.node_usages)]
    return dataclasses.replace(gp, problem=p.with_usages(usages))


def gathered_once(gp: GraphProblem, tg: TracedGraph) -> list[int]:
    """The held views (:func:`held_views`: offered moved or aliasing) of a parameter or buffer,
    recomputed copies aside: a layer's weight as its matmuls read it (transposed), which FSDP
    gathers and keeps from the forward to the backward. A step of several microbatches can make
    that gather once and keep its buffer for all of them (FSDP's ``reshard_after_forward=False``
    under a pipeline schedule): :func:`amortized_moves`."""
    views = [gp.index[n.name] for n in parameter_views(tg) if n.name in gp.index]
    return sorted(v for v in views if any(s.moved for s in gp.strategies[v]))


def accumulated(gp: GraphProblem, tg: TracedGraph) -> list[int]:
    """The nodes whose outputs hold the gradients (:func:`node_intervals`' held gradients): a
    step of several microbatches adds each microbatch's to a buffer kept to the step's end."""
    holders = {live_root(g)[0] for g in tg.grad_of.values()} | grad_views(tg)
    return sorted(gp.index[n.name] for n in holders if n.name in gp.index)


def amortized_moves(gp: GraphProblem, microbatches: int, once=(), buffers=()) -> GraphProblem:
    """``gp`` as a step of ``microbatches`` microbatches runs it (a pipeline stage), the moves it
    makes once per step charged ``1 / microbatches`` each:

    - the gradients' moves to their parameters' specs (the edges into parameters): the step
      accumulates its gradients where its backward leaves them and moves them once;
    - the moves of a parameter into the views ``once`` (:func:`gathered_once`) where the view
      takes it moved: gathered on the step's first microbatch and kept to the step's end, so
      that view's buffer is live over the whole step (its interval ``[0, end)``); aliasing, the
      view costs nothing and its readers' moves stay per microbatch.

    ``buffers`` (:func:`accumulated`): the gradients, which the step accumulates unreduced over
    its microbatches, live over the whole step too, so the rows hold the accumulation buffers.
    ``microbatches <= 1``: ``gp``."""
    if microbatches <= 1:
        return gp
    amortized = set(once_per_step(gp, once))
    costs = [m / microbatches if k in amortized else m for k, m in enumerate(gp.problem.edge_costs)]
    problem = gp.problem.with_edge_costs(costs)
    whole = sorted(set(once) | set(buffers))
    if whole:
        iv = problem.intervals.copy()
        iv[whole] = (0, int(iv[:, 1].max()))
        problem = problem.with_intervals(iv)
    return dataclasses.replace(gp, problem=problem)


def once_per_step(gp: GraphProblem, once=()) -> list[int]:
    """The edges a step of several microbatches runs once (:func:`amortized_moves`): the
    gradients' moves to their parameters' specs and the parameters' moves into the views
    ``once``."""
    once = set(once)
    return [k for k, e in enumerate(gp.edges) if e.arg < 0 or (e.arg == 0 and e.consumer in once)]


def with_recompute(gp: GraphProblem, tg: TracedGraph, rc: Recompute) -> GraphProblem:
    """``gp`` with ``rc``'s recomputation: a tied copy per recomputed node (its compute and its
    input redistributes charged again, its memory live in the backward only) and every
    interval re-derived (:func:`node_intervals`)."""
    rec = recomputed(tg.gm, rc)
    if not rec:
        return gp
    nodes = gp.nodes[:gp.num_originals]
    originals, copy_iv = node_intervals(tg, nodes, rec)
    copied = [v for v, n in enumerate(nodes) if n in rec]
    copy_index = {v: len(nodes) + k for k, v in enumerate(copied)}
    p = gp.problem
    edges, mats = list(gp.edges), list(p.edge_costs)
    for e, ae in enumerate(gp.edges):
        if ae.arg >= 0 and ae.consumer in copy_index:
            # A recomputed op reads the recomputed value where its producer is recomputed too.
            u = copy_index.get(ae.producer, ae.producer)
            edges.append(ArgEdge(copy_index[ae.consumer], ae.arg, u, ae.out))
            mats.append(p.edge_costs[e])
    grouped = {v for group in p.ties for v in group}
    ties = [group + [copy_index[v] for v in group if v in copy_index] for group in p.ties]
    ties += [[v, copy_index[v]] for v in copied if v not in grouped]
    problem = dataclasses.replace(
        p,
        node_costs=p.node_costs + [gp.compute_us[v] for v in copied],  # a layer never holds the loss
        node_usages=p.node_usages + [p.node_usages[v] for v in copied],
        intervals=np.concatenate([originals, copy_iv]),
        edges=np.array([(e.producer, e.consumer) for e in edges], dtype=np.int64).reshape(-1, 2),
        edge_costs=mats,
        node_names=p.node_names + [f"{nodes[v].name}@recompute" for v in copied],
        ties=ties,
    )
    return dataclasses.replace(
        gp, problem=problem, nodes=nodes + [nodes[v] for v in copied],
        strategies=gp.strategies + [gp.strategies[v] for v in copied], edges=edges,
        compute_us=gp.compute_us + [gp.compute_us[v] for v in copied],
        copy_of={c: v for v, c in copy_index.items()},
        recompute_at={copy_index[v]: gp.index[rec[nodes[v]].name] for v in copied if rec[nodes[v]].name in gp.index})
