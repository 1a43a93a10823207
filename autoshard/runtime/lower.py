"""Lower a plan into per-rank programs: the model's forward and backward as FX graphs of
local aten ops and functional collectives.

The plan names a spec for every input of every node of the joint graph it was made on.
Lowering re-traces that graph (same nodes, same names), splits it into the model's
forward and its backward (the loss is the caller's), and runs each part once on DTensors
under ``make_fx``: before every op each tensor argument is moved to its planned spec by
the planner's own steps (:func:`costmodel.execute_plan`, DTensor's placement methods on
the planned mesh axes or flattened groups), then the op runs by DTensor's rule on
operands that already match one of its strategies. ``make_fx`` records what DTensor does
on the local shards: local aten ops and ``_c10d_functional`` collectives. The recorded
graph is this rank's program; running it involves no DTensor dispatch.

The split: the forward is every op the model's forward traced; the backward is what the
parameters' gradients need, starting from the gradient of each model output (a tangent)
and reading the forward's values it needs (the saved activations, explicit as graph
outputs of the forward). What the loss computed is left out: the caller computes the loss
on the outputs, and autograd hands back each output's gradient.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Replicate

from autoshard import _torch_compat as tc
from autoshard.errors import PlanError
from autoshard.graph import attention, rng
from autoshard.graph.recompute import NONE, Recompute, recomputed
from autoshard.graph.strategies import skipped_by_cat
from autoshard.graph.tracing import TracedGraph
from autoshard.planfile import Plan
from costmodel import MeshTopology, RedistributePlanner, Spec, execute_plan, group_mesh, load_profile, make_groups
from costmodel.profile import Profile
from costmodel.spec import local_bytes


@dataclass
class Split:
    """The plan's joint graph cut into the model's forward and backward."""

    forward: list[fx.Node]
    """The model's forward ops, in graph order."""
    backward: list[fx.Node]
    """The ops the parameters' gradients need, given the tangents and the saved values."""
    saved: list[fx.Node]
    """Forward values (ops or placeholders) the backward reads."""
    tangents: list[tuple[int, fx.Node]]
    """(model output leaf index, the node of that output's gradient), one per backward input;
    with the loss lowered, (0, the loss's gradient)."""
    grads: dict[str, fx.Node]
    """Parameter FQN -> the node of its gradient (only parameters the loss reaches)."""
    input_grads: dict[int, fx.Node] = field(default_factory=dict)
    """Tensor input index -> the node of its gradient, where the step was traced with them."""
    recomputed: frozenset = frozenset()
    """The backward's ops that run a forward op again (activation checkpointing)."""


#: Views whose result depends on the input's memory layout (:meth:`Lowering._call`).
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


class LowerError(PlanError):
    """A plan that cannot be lowered to per-rank programs (names the node and the reason)."""


def loss_seed(tg: TracedGraph) -> fx.Node:
    """The node autograd seeded the backward pass with: ``ones_like(loss)``, the loss's gradient."""
    seed = tg.loss_seed()
    if seed is None:
        raise LowerError("the traced step has no single seed of the loss's gradient (ones_like(loss)): the loss "
                         "cannot be lowered with the model")
    return seed


def _frontier(tg: TracedGraph, tangent_of: dict) -> dict:
    """The output gradients the backward starts from: those not computed from another one (a
    model that returns its loss and the logits it was computed from: the logits' gradient is
    the loss's backward, inside the model's backward, not an input of it)."""
    roots = {}
    for t, k in tangent_of.items():
        seen, stack = set(), list(t.all_input_nodes)
        derived = False
        while stack and not derived:
            n = stack.pop()
            if n in seen or tg.phase(n) != "backward":
                continue
            seen.add(n)
            derived = n in tangent_of
            stack.extend(n.all_input_nodes)
        if not derived:
            roots[t] = k
    return roots


def split(tg: TracedGraph, with_loss: bool = False, recompute: Recompute = NONE) -> Split:
    """Forward, backward, saved values and tangents of a traced step (see :class:`Split`).

    ``with_loss``: the forward ends at the loss (``loss_fn`` of the outputs, as planned) and the
    backward starts from the loss's gradient; else at the model's outputs and their gradients.
    ``recompute``: the plan's activation checkpointing: its nodes are not saved but run again in
    the backward, each layer's just before the first backward op that reads one of them."""
    nodes = list(tg.gm.graph.nodes)
    phases = ("forward", "loss") if with_loss else ("forward",)
    forward = [n for n in nodes if n.op in ("call_function", "get_attr") and tg.phase(n) in phases]
    fwd = set(forward)
    tangent_of = {loss_seed(tg): 0} if with_loss else _frontier(tg, {n: k for k, n in tg.output_grads.items()})
    rec = recomputed(tg.gm, recompute)
    wanted: set[fx.Node] = set()
    saved: dict[fx.Node, None] = {}
    stack = [g for g in tg.grad_of.values()] + list(tg.input_grad_of.values())
    while stack:
        n = stack.pop()
        if n in wanted or n in saved or n in tangent_of:
            continue
        if n in rec:
            wanted.add(n)
            stack.extend(n.all_input_nodes)
            continue
        if n.op == "placeholder" or n in fwd:
            saved[n] = None
            continue
        if n.op == "get_attr":
            wanted.add(n)
            continue
        if tg.phase(n) != "backward":
            raise LowerError(f"the gradients read {n.name} ({n.target}) of the loss other than through the "
                             "model's outputs: the loss cannot be left to the caller")
        wanted.add(n)
        stack.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(nodes)}
    # A layer's recomputed ops run, in forward order, just before the first backward op reading one.
    backward = sorted((n for n in nodes if n in wanted),
                      key=lambda n: (order[rec[n]], 0, order[n]) if n in rec else (order[n], 1, 0))
    used = {a for n in backward for a in n.all_input_nodes} | set(tg.grad_of.values()) | set(tg.input_grad_of.values())
    tangents = sorted(((k, n) for n, k in tangent_of.items() if n in used), key=lambda kn: kn[0])
    return Split(forward=forward, backward=backward, saved=sorted(saved, key=order.__getitem__),
                 tangents=tangents, grads=dict(tg.grad_of), recomputed=frozenset(n for n in backward if n in rec),
                 input_grads=dict(tg.input_grad_of))


@dataclass
class RankProgram:
    """One part (forward or backward) of one rank's program, and the specs at its boundary."""

    gm: fx.GraphModule
    """Local aten ops and functional collectives; inputs and outputs are local shards."""
    in_specs: list[Spec | None]
    """The spec each input's local shard is in (None: a plain tensor, the same on every rank)."""
    out_specs: list[Spec | None]
    """The spec each output's local shard is in (None: a plain tensor, the same on every rank)."""
    out_meta: list[tuple] = field(default_factory=list)
    """(global shape, stride) of each output."""
    out_strides: list[tuple | None] = field(default_factory=list)
    """The stride of each output's local tensor as traced (None: not a tensor)."""
    in_strides: list[tuple] = field(default_factory=list)
    """The stride of each input's local tensor the program was traced with: a view in it (a
    bucket's flatten) may hold only for those strides."""

    def conform(self, locals_: list) -> list:
        """``locals_`` with each tensor whose strides differ from the traced ones copied into them
        (a program traced on a contiguous input cannot view a transposed one)."""
        out = []
        for t, stride in zip(locals_, self.in_strides):
            if isinstance(t, torch.Tensor) and _differ(t, stride):
                t = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)
            out.append(t)
        return out


def _mutates_constant(n: fx.Node, env: dict) -> bool:
    """Whether ``n`` writes in place into a plain (constant) tensor."""
    return (isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable and bool(n.args)
            and isinstance(n.args[0], fx.Node) and isinstance(env.get(n.args[0]), torch.Tensor)
            and not isinstance(env[n.args[0]], DTensor))


def _full(v):
    """``v`` as every rank's full value (a DTensor gathered; anything else as it is)."""
    return v.full_tensor() if isinstance(v, DTensor) else v


def _spec_of(t: DTensor) -> Spec:
    spec = tc.from_placements(t.placements, t.device_mesh)
    if spec is None:
        raise LowerError(f"a value with placements {t.placements} has no spec the planner knows")
    return spec


def _contiguous_stride(shape) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(tuple(shape)):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def view_refused(n: fx.Node, args, exc: Exception) -> bool:
    """Whether ``exc`` is a view op refusing its DTensor's layout: a view traced on its producer's
    own memory layout (a fused attention kernel's output, its heads inside its sequence) that
    the DTensor's strides (DTensor's rule's, or contiguous again after a move) do not allow."""
    return n.target in _VIEWS and isinstance(args[0], DTensor) and "view" in str(exc)


def contiguous(t: DTensor) -> DTensor:
    """``t`` contiguous, its shard too: DTensor.contiguous() makes the global strides contiguous,
    not a shard that a kernel laid out otherwise (CUDA's SDPA against the CPU kernel traced).
    The copy a view of it costs, as ``reshape`` would make."""
    t = t.contiguous()
    if not t.to_local().is_contiguous():
        t = DTensor.from_local(t.to_local().contiguous(), t.device_mesh, t.placements, run_check=False,
                               shape=t.shape, stride=t.stride())
    return t


def move(t, want: Spec, planner: RedistributePlanner, mesh):
    """``t`` in spec ``want`` by the planner's own steps (DTensor's placement methods on the
    planned axes or flattened groups); a plain tensor (a constant or a factory op's result, the
    same full value on every rank) by taking this rank's planned shard locally."""
    if not isinstance(t, torch.Tensor):
        return t
    if not isinstance(t, DTensor):
        from autoshard.runtime.shards import distribute

        return distribute(t, mesh, want, src_data_rank=None)
    have = _spec_of(t)
    if have == want:
        return t
    shape = tuple(t.shape)
    local = execute_plan(t.to_local(), planner.plan(have, want, shape, t.element_size()), mesh, shape)
    # A collective hands back a contiguous shard: so is the value now, whatever layout it was
    # traced in (a fused attention kernel's output keeps its heads inside its sequence), or a
    # view traced on that layout would be handed a shard it cannot view (:meth:`Lowering._call`).
    stride = _contiguous_stride(shape) if local.is_contiguous() else t.stride()
    return DTensor.from_local(local, mesh, tc.placements_for(want, mesh), run_check=False, shape=t.shape,
                              stride=stride)


class Lowering:
    """Lowers the parts of one traced step, as planned, for one rank at a time."""

    def __init__(self, tg: TracedGraph, plan: Plan, mesh, profile: Profile | str | None = None, ops=None,
                 bucket_mb: float = 0.0):
        self.tg, self.plan, self.mesh = tg, plan, mesh
        self.bucket_bytes = int(bucket_mb * 2**20)
        """The bucket cap the program's collectives are merged under (0: none): outputs are
        moved in groups of up to this many bytes (:meth:`lower`)."""
        self.profile = prof = plan_profile(plan, profile)
        self.position = {n: i for i, n in enumerate(tg.gm.graph.nodes)}
        self.planner = RedistributePlanner(MeshTopology(tuple(mesh.shape), prof.devices_per_node), prof)
        self.moves = 0
        """Redistributes the last lowering emitted (each as the planner's steps)."""
        self.off_plan: list[str] = []
        """Ops whose output DTensor's rule put in another spec than the plan's (the next move
        starts from the actual spec, so results are right; the plan's cost is not)."""
        missing = [n.name for n in (tg.gm.graph.nodes if ops is None else ops)
                   if n.op == "call_function" and n.target is not operator.getitem
                   and plan.nodes.get(n.name, {}).get("op") != str(n.target)]
        if missing and plan.nodes and all(name.startswith("loss_") for name in missing):
            # The model's own forward and backward agree; only the loss's nodes differ.
            raise PlanError(f"the plan has no specs for the loss's graph nodes {missing[:5]} ({len(missing)} in "
                            "all): the step was traced with another loss than the plan's; give parallelize the "
                            "loss_fn given to plan (a model that computes its loss from keyword inputs: the same "
                            "keywords too)")
        if missing and plan.nodes:
            raise PlanError(f"the plan has no specs for graph nodes {missing[:5]} ({len(missing)} in all): it was "
                            "made for another model or input shape")
        traced = {n.name for n in tg.gm.graph.nodes}
        # The loss's nodes are named apart (tracing.finish): a plan applies with another loss.
        absent = [name for name in plan.nodes if name not in traced and not name.startswith("loss_")]
        if absent:
            # Names alone can agree on graphs that differ (a node fewer shifts every later name of
            # its op): a plan's node this trace lacks says the two graphs are not the same.
            raise PlanError(f"the plan places graph nodes {absent[:5]} ({len(absent)} in all) that this trace of the "
                            f"model lacks ({len(plan.nodes)} planned nodes, {len(traced)} traced): the model traced "
                            "otherwise than when it was planned (state it keeps between calls, a cache), or the plan "
                            "was made for another model or input shape")

    def _move(self, t, want: Spec):
        out = move(t, want, self.planner, self.mesh)
        self.moves += out is not t and isinstance(t, DTensor)
        return out

    def _as_dtensor(self, v):
        if isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
            return self._move(v, Spec(("R",) * self.mesh.ndim))
        return v

    def _run(self, ops: list[fx.Node], env: dict, recomputed: frozenset = frozenset(),
             after: Callable[[fx.Node], None] | None = None) -> None:
        # Each lowered node names the planned node it runs (the moves into it and ``after`` it
        # included), and is marked where that node is recomputed (the bucketing pass reads the mark).
        custom = tc.node_meta_custom()
        try:
            for n in ops:
                custom[tc.PLANNED] = n.name
                if n in recomputed:
                    custom[tc.RECOMPUTED] = True
                self._run_node(n, env)
                custom.pop(tc.RECOMPUTED, None)
                if after is not None:
                    after(n)
        finally:
            custom.pop(tc.PLANNED, None)
            custom.pop(tc.RECOMPUTED, None)

    def _run_node(self, n: fx.Node, env: dict) -> None:
        plan = self.plan
        if n.op == "get_attr":
            env[n] = getattr(self.tg.gm, n.target)
            return
        if n.target is operator.getitem:
            env[n] = env[n.args[0]][n.args[1]]
            return
        entry = plan.nodes.get(n.name)
        if n.target in rng.RANDOM_OPS and isinstance(env.get(n.args[0]), DTensor):
            env[n] = self._random(n, env, entry)
            return
        if not any(isinstance(v, DTensor) for v in map(env.get, n.all_input_nodes)):
            # Only constants in (tensors built inside forward): every rank computes the same
            # full value; a consumer takes its planned shard of it locally.
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
            if n.target in rng.RANDOM_FACTORIES:
                key = rng.shard_key(self.position[n], [Replicate()] * self.mesh.ndim, self.mesh.get_coordinate(),
                                    tuple(self.mesh.shape))
                env[n] = rng.run_factory(n.target, args, kwargs, key)
            else:
                env[n] = n.target(*args, **kwargs)
            return
        if _mutates_constant(n, env):
            # In place into a constant (a view of one: ``shifted[:, 1:] = input_ids[:, :-1]`` in
            # Hugging Face's encoder-decoders): the write must land in the constant's own
            # storage, where its other views and later readers see it, so the op runs on every
            # rank's full values, the distributed ones gathered first.
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: _full(env[a]))
            env[n] = n.target(*args, **kwargs)
            return
        if entry is None:
            # A plan of parameter and input placements only (a hand-written one): DTensor's
            # own propagation shards the ops, constants replicated.
            entry = {}
            def arg(a):
                return self._as_dtensor(env[a])
        else:
            it = iter([Spec.parse(s) for s in entry["in"]])

            def arg(a, it=it):
                v = env[a]
                return self._move(v, next(it)) if isinstance(v, torch.Tensor) else v

        args, kwargs = fx.node.map_arg((n.args, n.kwargs), arg)
        if attention.splits_causal_queries(n.target, args, kwargs):
            env[n] = self._sequence_kernel(n, args, kwargs, entry)
            return
        kernel = attention.device_kernel(n.target, self.mesh.device_type)
        if kernel is not None:
            env[n] = self._local_kernel(n, kernel, args, kwargs, entry)
            return
        out = self._call(n, args, kwargs)
        if isinstance(out, DTensor) and "out" in entry and _spec_of(out) != Spec.parse(entry["out"]):
            self.off_plan.append(n.name)
        env[n] = out

    def _call(self, n: fx.Node, args, kwargs):
        """``n``'s op on DTensors. A view traced on its producer's own memory layout (a fused
        attention kernel's output, its heads inside its sequence) cannot view that value once a
        redistribute moved it (contiguous again): it views a contiguous copy, as ``reshape``
        does (one copy, where a move and such a view meet)."""
        skipped = skipped_by_cat(n)
        if skipped:  # cat skips them; planned replicated and empty, DTensor's rule would not
            args = ([v for a, v in zip(n.args[0], args[0]) if a not in skipped], *args[1:])
        try:
            return n.target(*args, **kwargs)
        except NotImplementedError as exc:
            if "sharding strategy" not in str(exc):
                raise
            return self._replicated_locally(n, args, kwargs)
        except (RuntimeError, ValueError) as exc:
            if "not supported with DTensor" in str(exc):  # as_strided: DTensor refuses it whatever the placements
                return self._replicated_locally(n, args, kwargs)
            if not view_refused(n, args, exc):
                raise
        return n.target(contiguous(args[0]), *args[1:], **kwargs)

    def _replicated_locally(self, n: fx.Node, args, kwargs):
        """An op DTensor has no sharding rule for (``aten.searchsorted``, ``aten.bincount``) or
        refuses (``aten.as_strided``: an adaptive pooling's backward): the planner gave it one
        strategy, every input and output replicated (a counted fallback), so each rank runs it on
        its full local inputs and its outputs are replicated DTensors."""
        replicated = [Replicate()] * self.mesh.ndim

        def local(v):
            if not isinstance(v, DTensor):
                return v
            if not all(p.is_replicate() for p in v.placements):
                v = v.redistribute(v.device_mesh, replicated)
            return v.to_local()

        def wrap(v):
            return DTensor.from_local(v, self.mesh, replicated, run_check=False) if isinstance(v, torch.Tensor) else v

        args, kwargs = torch.utils._pytree.tree_map(local, (args, kwargs))
        return torch.utils._pytree.tree_map(wrap, n.target(*args, **kwargs))

    def _local_kernel(self, n: fx.Node, kernel, args, kwargs, entry: dict) -> tuple:
        """A traced CPU attention kernel run by the mesh's device's kernel on each rank's shards
        (:func:`autoshard.graph.attention.device_kernel`), its outputs in the planned placements."""
        if "out" in entry:
            placements = [tc.placements_for(Spec.parse(s), self.mesh) for s in entry["out"]]
        else:
            bound = attention.bound_args(n.target, args, kwargs)
            placements = attention.local_placements(n.target, bound["query"].placements, bound["key"].placements)
        args, kwargs = torch.utils._pytree.tree_map(lambda v: v.to_local() if isinstance(v, DTensor) else v,
                                                    (tuple(args), dict(kwargs)))
        outs = kernel(*args, **kwargs)
        return tuple(DTensor.from_local(o, self.mesh, p, run_check=False, shape=v.shape, stride=v.stride())
                     for o, p, v in zip(outs, placements, n.meta["val"]))

    def _sequence_kernel(self, n: fx.Node, args, kwargs, entry: dict) -> tuple:
        """A causal attention kernel whose queries are split on the sequence (context parallelism,
        :mod:`autoshard.graph.attention`). Keys and values gathered by the planned moves: this
        rank's queries, at their global offset, against them, the key and value gradients
        partial sums. Keys and values split like the queries: ring attention. Balanced by the
        mirror exchange where the sequence cuts into two chunks per rank."""
        bound = attention.bound_args(n.target, args, kwargs)
        q, k = bound["query"], bound["key"]
        if bound.get("dropout_p"):
            raise LowerError(f"{n.name}: a causal attention kernel with dropout_p={bound['dropout_p']} split on the "
                             "sequence: the plan would need each rank's share of the dropout mask")

        def seq_axes(placements):
            return [a for a, pl in enumerate(placements) if isinstance(pl, tc.Shard) and pl.dim == 2
                    and self.mesh.size(a) > 1]

        axes, ring = seq_axes(q.placements), bool(seq_axes(k.placements))
        group = attention.mirror_axes(axes, q.shape[2], tuple(self.mesh.shape))
        if ring and (seq_axes(k.placements) != axes or group is None):
            raise LowerError(f"{n.name}: ring attention needs its keys split like its queries ({k.placements} against "
                             f"{q.placements}) and two chunks of the sequence per rank")
        if "out" in entry:
            placements = [tc.placements_for(Spec.parse(s), self.mesh) for s in entry["out"]]
        else:
            placements = attention.local_placements(n.target, q.placements, k.placements)
        forward = n.target is attention.CPU_FORWARD
        names = ("query", "key", "value") if forward else ("grad_out", "query", "key", "value", "out", "logsumexp")
        ins, scale = [bound[name].to_local() for name in names], bound.get("scale")
        if group is None:
            offset = tc.shard_offset(q.shape[2], 2, self.mesh, q.placements)
            kernel = attention.sequence_forward if forward else attention.sequence_backward
            outs = kernel(*ins, offset, scale=scale)
        else:
            # The rank's chunk: row-major over the split's axes, as in their flattened group.
            where = self.mesh.get_coordinate()
            coordinate, parts = 0, 1
            for a in group:
                coordinate, parts = coordinate * self.mesh.size(a) + where[a], parts * self.mesh.size(a)
            sub, i = group_mesh(self.mesh, group)

            def mirrored(t):  # its second half swapped with the mirror rank's
                h = t.shape[2] // 2
                other = tc.exchange(t[:, :, h:], 2, parts - 1 - coordinate, sub, i)
                return torch.cat([t[:, :, :h].transpose(1, 2), other.transpose(1, 2)], 1).transpose(1, 2)

            # Every tensor split on the sequence like the queries goes in mirrored and comes back so.
            ins = [mirrored(t) if seq_axes(bound[name].placements) else t for name, t in zip(names, ins)]
            if ring:
                kernel = attention.ring_forward if forward else attention.ring_backward
                outs = kernel(*ins, coordinate, parts, _Shift(coordinate, parts, sub, i), scale=scale)
            else:
                kernel = attention.mirror_forward if forward else attention.mirror_backward
                outs = kernel(*ins, coordinate, parts, scale=scale)
            outs = [mirrored(o) if seq_axes(pl) else o for o, pl in zip(outs, placements)]
        return tuple(DTensor.from_local(o, self.mesh, p, run_check=False, shape=v.shape, stride=v.stride())
                     for o, p, v in zip(outs, placements, n.meta["val"]))

    def _random(self, n: fx.Node, env: dict, entry: dict | None):
        """A random op on this rank's shard, keyed so that replicas draw alike (:mod:`autoshard.graph.rng`)."""
        x = env[n.args[0]]
        if entry is not None:
            x = self._move(x, Spec.parse(entry["in"][0]))
        if any(p.is_partial() for p in x.placements):
            have = _spec_of(x)
            x = self._move(x, Spec(tuple("R" if p.is_partial() else s for p, s in zip(x.placements, have.placements)),
                                   have.shard_order))
        args = fx.node.map_arg(n.args, lambda a: env[a])
        key = rng.shard_key(self.position[n], x.placements, self.mesh.get_coordinate(), tuple(self.mesh.shape))
        out = rng.run_local(n.target, x.to_local(), tuple(args), key)

        def wrap(local):
            return DTensor.from_local(local, self.mesh, x.placements, run_check=False, shape=x.shape,
                                      stride=x.stride())

        if isinstance(out, tuple):
            return tuple(wrap(o) for o in out)
        if n.target._schema.is_mutable:
            env[n.args[0]] = x  # in place: later readers of the input see the draw, as planned
            return x
        return wrap(out)

    def lower(self, inputs: list[fx.Node], in_specs: list[Spec], in_meta: list[tuple], ops: list[fx.Node],
              outputs: list[fx.Node], out_specs: list[Spec | None], rank: int,
              in_strides: list[tuple | None] | None = None, recomputed: frozenset = frozenset()) -> RankProgram:
        """Rank ``rank``'s program computing ``outputs`` from ``inputs`` by ``ops``.

        ``in_meta``: (global shape, stride, dtype) of each input. ``out_specs``: the spec to deliver
        each output in (None: as computed). ``in_strides``: the stride each input's local tensor
        arrives in (None, or None for one input: contiguous); the backward reads the forward's
        saved values in the strides the forward leaves them, transposed weights included.
        ``recomputed``: ops of ``ops`` that run a forward op again; their nodes in the program are
        marked (:data:`~autoshard._torch_compat.RECOMPUTED`): no bucket and no overlap reordering
        crosses a recomputation (:mod:`autoshard.runtime.passes`)."""
        mesh = self.mesh
        # An input of spec None is a plain tensor, the same full value on every rank (a constant
        # the forward built and the backward reads).
        placements = [None if s is None else tc.placements_for(s, mesh) for s in in_specs]
        delivered: list[Spec | None] = []
        meta: list[tuple] = []
        local_strides: list[tuple | None] = []
        self.moves, self.off_plan = 0, []

        # Outputs are moved to their specs as they are computed, in groups of up to the bucket
        # cap, as DDP's reducer fills its buckets (a gradient's reduction): a group is moved once
        # the next output would overflow it, before a recomputation starts (no bucket spans one)
        # and at the end. Its moves are adjacent, so the bucketing pass merges them into one
        # collective wherever they share a group, whatever the program runs between groups;
        # moved only at the end, every unreduced gradient would be held to the end of the backward.
        ran = set(ops)
        due: dict[fx.Node, list[int]] = {}
        for j, (node, want) in enumerate(zip(outputs, out_specs)):
            if want is not None and node in ran:
                due.setdefault(node, []).append(j)
        before_recompute = {a for a, b in zip(ops, ops[1:]) if b in recomputed and a not in recomputed}

        def program(*locals_):
            env, out = {}, {}
            for node, local, pl, (shape, stride, _) in zip(inputs, locals_, placements, in_meta):
                env[node] = local if pl is None else DTensor.from_local(local, mesh, pl, run_check=False,
                                                                        shape=shape, stride=stride)
            group: list[int] = []
            filled = [0]

            def move_group() -> None:
                for j in group:
                    out[j] = self._move(env[outputs[j]], out_specs[j])
                group.clear()
                filled[0] = 0

            def deliver(n: fx.Node) -> None:
                for j in due.get(n, ()):
                    v = env[n]
                    spec = _spec_of(v) if isinstance(v, DTensor) else None
                    if spec is None or spec == out_specs[j]:
                        out[j] = v
                        continue
                    # The same on every rank (an uneven shard's local size is not), so that every
                    # rank moves the same groups: their collectives must pair up.
                    nbytes = local_bytes(spec, v, mesh.shape)
                    if group and filled[0] + nbytes > self.bucket_bytes:
                        move_group()
                    group.append(j)
                    filled[0] += nbytes
                if n in before_recompute or self.bucket_bytes <= 0:
                    move_group()

            self._run(ops, env, recomputed, after=deliver if due else None)
            move_group()
            result = []
            delivered.clear()
            meta.clear()
            local_strides.clear()
            for j, (node, want) in enumerate(zip(outputs, out_specs)):
                v = out[j] if j in out else env[node]
                if isinstance(v, DTensor):
                    v = self._move(v, want) if want is not None and j not in out else v
                    delivered.append(_spec_of(v))
                    meta.append((tuple(v.shape), tuple(v.stride())))
                    v = v.to_local()
                else:
                    delivered.append(None)
                    meta.append((tuple(v.shape), tuple(v.stride())) if isinstance(v, torch.Tensor) else None)
                local_strides.append(tuple(v.stride()) if isinstance(v, torch.Tensor) else None)
                result.append(v)
            return result

        make_groups(mesh)
        device = torch.device(mesh.device_type)
        fm = tc.FakeTensorMode(allow_non_fake_inputs=True)
        with tc.quiet_tracing(), tc.as_rank(rank):
            shapes = [tuple(shape) if pl is None else tc.local_shape(shape, mesh, pl)
                      for pl, (shape, _, _) in zip(placements, in_meta)]
            strides = [_contiguous(s) if want is None or len(want) != len(s) else tuple(want)
                       for s, want in zip(shapes, in_strides or [None] * len(shapes))]
            with fm:
                examples = [torch.empty_strided(s, st, dtype=dtype, device=device)
                            for s, st, (_, _, dtype) in zip(shapes, strides, in_meta)]
            with fm, tc.preserve_node_meta():
                gm = tc.make_fx(program, pre_dispatch=False)(*examples)
        gm.graph.eliminate_dead_code()
        gm.recompile()
        return RankProgram(gm=gm, in_specs=list(in_specs), out_specs=list(delivered), out_meta=list(meta),
                           out_strides=list(local_strides), in_strides=strides)


class _Shift:
    """Ring attention's pass: start sending a tensor to the next rank of the ring while receiving
    the previous rank's (``shift(x)``), and what arrived (``shift.wait(started)``)."""

    def __init__(self, coordinate: int, parts: int, mesh, axis: int):
        self.to, self.came_from = (coordinate + 1) % parts, (coordinate - 1) % parts
        self.mesh, self.axis = mesh, axis

    def __call__(self, x):
        return tc.shift_start(x, 2, self.to, self.came_from, self.mesh, self.axis)

    @staticmethod
    def wait(started):
        return tc.wait(started)


def _differ(t: torch.Tensor, stride: tuple) -> bool:
    """Whether ``t``'s layout differs from ``stride`` (a dim of size 1 has any stride)."""
    return any(size > 1 and a != b for size, a, b in zip(t.shape, t.stride(), stride))


def _contiguous(shape) -> tuple:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def plan_profile(plan: Plan, profile: Profile | str | None = None) -> Profile:
    """``profile`` where given (a profile, or a name or file), else the one ``plan`` was made
    with: its own copy, or the shipped profile it names."""
    if isinstance(profile, Profile):
        return profile
    if profile is None and plan.profile.get("data"):
        return Profile.from_json(plan.profile["data"])
    return _load(profile or plan.profile.get("name") or "h100-sxm")


def _load(name) -> Profile:
    try:
        return load_profile(name)
    except FileNotFoundError as exc:
        raise PlanError(f"the plan was made with profile {name!r}, which is neither shipped nor a file here: pass "
                        "that profile (the profile decides each redistribute's steps)") from exc


def collectives(gm: fx.GraphModule) -> list[fx.Node]:
    """The collective nodes of a per-rank program, in order."""
    from autoshard.runtime.spmd import collective_ops

    ops = collective_ops()
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops]
