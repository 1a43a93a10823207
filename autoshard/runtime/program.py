"""Run a lowered plan as the model's forward and backward.

:class:`PlannedProgram` owns the per-rank programs of one (plan, mesh, input signature)
(:mod:`autoshard.runtime.lower`): the forward maps the local shards of the parameters, buffers and
inputs to the model's outputs and the saved activations; the backward maps the saved
activations and the outputs' gradients to the parameters' gradients, each in its
parameter's planned spec. :class:`StepFunction` makes the pair one autograd function, so
``loss.backward()`` on any loss computed from the outputs runs the planned backward.

On real processes a rank lowers and runs its own program. Under LocalTensorMode every
rank's program is lowered and all run side by side (:func:`autoshard.runtime.spmd.run_ranks`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import DTensor

from autoshard import _torch_compat as tc
from autoshard.errors import PlanError
from autoshard.graph import rng
from autoshard.graph.recompute import Recompute
from autoshard.graph.tracing import TracedGraph
from autoshard.mesh import several_processes
from autoshard.planfile import Plan
from autoshard.runtime.lower import Lowering, RankProgram, split
from autoshard.runtime.passes import collective_order, optimize
from autoshard.runtime.spmd import run_ranks
from costmodel import Spec

log = logging.getLogger(__name__)


def _meta(node: fx.Node) -> tuple:
    v = node.meta["val"]
    return tuple(v.shape), tuple(v.stride()), v.dtype


def _tensor_args(node: fx.Node) -> list:
    """A node's tensor arguments in the order the plan lists their specs."""
    out: list = []
    fx.node.map_arg((node.args, node.kwargs),
                    lambda a: out.append(a) if isinstance(a.meta.get("val"), torch.Tensor) else None)
    return out


class PlannedProgram:
    """The lowered forward and backward of one traced step, per rank, built on first use."""

    def __init__(self, tg: TracedGraph, plan: Plan, mesh, profile=None, bucket_mb: float = 25.0,
                 overlap: bool = True, with_loss: bool = False, compile: bool | str = False,
                 accumulate: bool = False):
        self.tg, self.plan, self.mesh = tg, plan, mesh
        self.accumulate = accumulate
        """The backward leaves each gradient unreduced (its node's planned spec, not its
        parameter's) and adds it to :attr:`pending` instead of returning it: a pipeline stage's
        microbatches accumulate their gradients and reduce them once
        (:meth:`autoshard.apply._PlannedForward.reduce_gradients`)."""
        self.pending: dict[str, DTensor] = {}
        self.compile = compile
        self._callables: dict[tuple[str, int], object] = {}
        self._warned_eager = False
        self.bucket_mb, self.overlap, self.with_loss = bucket_mb, overlap, with_loss
        memory = getattr(plan.summary, "memory", None) or {}
        # A pipeline stage holds several microbatches' forwards at once: the one-microbatch
        # account's headroom does not hold there.
        self.headroom = {} if accumulate else dict(memory.get("headroom_bytes") or {})
        """Per program, how far its peak lies below the step's in the plan's account: what the
        overlap scheduler may hold above the program's peak (a plan that does not say: nothing)."""
        self.split = split(tg, with_loss, Recompute(**plan.recompute))
        self.lowering = Lowering(tg, plan, mesh, profile, ops=self.split.forward + self.split.backward,
                                 bucket_mb=bucket_mb)
        ph = tg.placeholders
        self.inputs = ph
        specs = []
        k = 0
        for n in ph:
            kind = tg.kinds[n.name]
            if kind in ("param", "buffer"):
                specs.append(plan.param_spec(tg.fqn_of[n.name]))
            else:
                specs.append(Spec.parse(plan.inputs[k]))
                k += 1
        self.in_specs = specs
        self.leaves = [(0, tg.loss_node)] if with_loss else \
            [(k, v) for k, v in enumerate(tg.outputs) if isinstance(v, fx.Node)]
        """(output leaf index, node) of each tensor the forward returns: the model's outputs, or the loss."""
        self.outputs = [v for _, v in self.leaves]
        self.trainable = [f for f in tg.param_fqns if f in self.split.grads]
        by_name = {n.name: n for n in self.split.forward}
        missing = [h for h in plan.held if h not in by_name]
        if missing:
            raise PlanError(f"plan holds views {missing[:4]} the traced forward does not have: a plan made for "
                            "another model or another trace of it")
        self.held = [by_name[h] for h in plan.held] if accumulate else []
        """The views whose parameter the first microbatch of a step gathers and the others reuse
        (``plan.held``, a step of several microbatches: ``accumulate``): the forward returns them
        after the saved values, and :meth:`forward_held_program` takes them as inputs."""
        self.held_values: list | None = None
        """This step's gathered views (:attr:`held`), from its first forward to :meth:`end_step`."""
        self.returned = self.outputs + self.split.saved + [h for h in self.held if h not in self.split.saved]
        """What the forward programs return: the outputs, the saved values, the held views not among them."""
        self._forward: dict[int, RankProgram] = {}
        self._forward_held: dict[int, RankProgram] = {}
        self._base_seed: int | None = None
        """Rank 0's initial seed, broadcast on the first forward; set beforehand where this
        program's mesh is a slice of the world's (a pipeline stage's ranks run their first
        forward when their stage does, not all at once)."""
        self._runs = 0
        self._backward: dict[int, RankProgram] = {}
        self._orders: dict[str, tuple[int, list]] = {}
        """Per program part, the first rank lowered and its collectives in issue order (:meth:`_optimize`)."""

    def forward_program(self, rank: int) -> RankProgram:
        if rank not in self._forward:
            s = self.split
            # The loss comes out replicated (the plan costs that all-reduce before its backward
            # seed), so `loss.backward()` seeds the gradient in the spec the backward reads.
            out_specs = [Spec(("R",) * self.mesh.ndim)] if self.with_loss else [None] * len(self.outputs)
            self._forward[rank] = self.lowering.lower(
                self.inputs, self.in_specs, [_meta(n) for n in self.inputs], s.forward,
                self.returned, out_specs + [None] * (len(self.returned) - len(self.outputs)), rank)
            self._optimize(self._forward[rank], "forward", rank)
        return self._forward[rank]

    def forward_held_program(self, rank: int) -> RankProgram:
        """The forward of a step's later microbatches: the held views (:attr:`held`) are inputs,
        after the parameters, buffers and inputs, in the specs and strides the first forward
        returned them in; it runs none of their gathers."""
        if rank not in self._forward_held:
            fwd = self.forward_program(rank)
            at = [self.returned.index(h) for h in self.held]
            held = set(self.held)
            self._forward_held[rank] = self.lowering.lower(
                self.inputs + self.held, self.in_specs + [fwd.out_specs[k] for k in at],
                [_meta(n) for n in self.inputs + self.held], [n for n in self.split.forward if n not in held],
                self.returned, [None] * len(self.returned), rank,
                in_strides=[None] * len(self.inputs) + [fwd.out_strides[k] for k in at])
            self._optimize(self._forward_held[rank], "forward", rank, "later forward")
        return self._forward_held[rank]

    def end_step(self) -> None:
        """Drop the step's held views (the parameters change in the optimizer step)."""
        self.held_values = None

    def backward_program(self, rank: int) -> RankProgram:
        if rank not in self._backward:
            s, fwd = self.split, self.forward_program(rank)
            saved = slice(len(self.outputs), len(self.outputs) + len(s.saved))
            saved_specs = fwd.out_specs[saved]
            tangent_specs = [self._tangent_spec(k, d, fwd) for k, d in s.tangents]
            grads = [s.grads[f] for f in self.trainable] + [s.input_grads[k] for k in sorted(s.input_grads)]
            # An input's gradient leaves in the spec its node is planned in (None).
            self._backward[rank] = self.lowering.lower(
                s.saved + [d for _, d in s.tangents], list(saved_specs) + tangent_specs,
                [_meta(n) for n in s.saved] + [_meta(d) for _, d in s.tangents], s.backward, grads,
                [None if self.accumulate else self.plan.param_spec(f) for f in self.trainable]
                + [None] * len(s.input_grads), rank,
                in_strides=fwd.out_strides[saved] + [None] * len(s.tangents), recomputed=s.recomputed)
            self._optimize(self._backward[rank], "backward", rank)
        return self._backward[rank]

    def _optimize(self, program: RankProgram, part: str, rank: int, name: str | None = None) -> None:
        """Bucket and overlap the program's collectives (:mod:`autoshard.runtime.passes`): the same bytes
        in fewer collectives (DDP's gradient buckets, FSDP's per-layer gathers), each started
        early and waited for late. Where this process lowers several ranks (LocalTensorMode, a
        fake process group), every rank's program must issue the same collectives in the same
        order: torch's passes read each rank's own sizes, which an uneven shard makes differ."""
        program.gm = optimize(program.gm, self.lowering.profile, self.bucket_mb, self.overlap,
                              int(self.headroom.get(part, 0)))
        name = name or part
        order = collective_order(program.gm)
        first = self._orders.setdefault(name, (rank, order))
        if first[1] != order:
            at = next((i for i, (a, b) in enumerate(zip(first[1], order)) if a != b), min(len(first[1]), len(order)))
            said = lambda o: o[at] if at < len(o) else "nothing"  # noqa: E731
            raise RuntimeError(f"the {name} programs of ranks {first[0]} and {rank} issue different "
                               f"collectives: {len(first[1])} and {len(order)}, the {at + 1}-th "
                               f"{said(first[1])} on rank {first[0]} and {said(order)} on rank {rank} "
                               f"(the passes ordered or bucketed them by each rank's own sizes: try bucket_mb=0 "
                               f"or overlap=False)")

    def _tangent_spec(self, k: int, d: fx.Node, fwd: RankProgram) -> Spec:
        """The spec an output's gradient enters the backward in: the one its first consumer in the
        model's backward is planned to read (the gradient node itself belongs to the loss, which
        the caller computes); the output's own spec when nothing plans it."""
        wanted = set(self.split.backward)
        for user in d.users:
            entry = self.plan.nodes.get(user.name)
            if user in wanted and entry:
                flat = _tensor_args(user)
                if d in flat:
                    return Spec.parse(entry["in"][flat.index(d)])
        return fwd.out_specs[[j for j, _ in self.leaves].index(k)]

    def collective_counts(self, rank: int | None = None) -> dict[str, int]:
        """Collectives per kind (``all_reduce`` ...) in one rank's lowered forward and backward."""
        from autoshard.runtime.lower import collectives

        rank = self._any_rank() if rank is None else rank
        counts: dict[str, int] = {}
        for prog in (self.forward_program(rank), self.backward_program(rank)):
            for n in collectives(prog.gm):
                kind = n.target._opname.removesuffix("_out")  # a bucket's flat-buffer variant
                counts[kind] = counts.get(kind, 0) + 1
        return counts

    def describe(self, rank: int | None = None) -> str:
        """One rank's programs in a few lines: sizes, then every collective in program order with
        its group, bytes, and how many nodes run between it and its wait (the overlap window)."""
        from autoshard.runtime.lower import collectives
        from autoshard.runtime.passes import KIND

        rank = self._any_rank() if rank is None else rank
        lines = []
        for name, prog in (("forward", self.forward_program(rank)), ("backward", self.backward_program(rank))):
            nodes = list(prog.gm.graph.nodes)
            at = {n: i for i, n in enumerate(nodes)}
            colls = collectives(prog.gm)
            lines.append(f"{name} (rank {rank}): {len(nodes)} nodes, {len(colls)} collectives")
            for c in colls:
                v = c.args[0].meta.get("val")
                nbytes = v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0
                waits = [at[u] for u in c.users]
                window = f", waited {min(waits) - at[c]} nodes later" if waits else ""
                ranks = tc.group_ranks(c.args[-1])
                lines.append(f"  {at[c]:5d} {KIND.get(c.target, c.target._opname):14s} group {ranks} "
                             f"{nbytes / 2**20:9.3f} MiB{window}")
        return "\n".join(lines)

    def tangent_specs(self) -> list[Spec]:
        return self.backward_program(self._any_rank()).in_specs[len(self.split.saved):]

    def _any_rank(self) -> int:
        ranks = tc.local_tensor_ranks()
        return ranks[0] if ranks else (dist.get_rank() if dist.is_initialized() else 0)

    def _next_seed(self) -> int:
        """The run seed of the next forward (:mod:`autoshard.graph.rng`): the same on every rank, rank 0's
        initial seed plus the number of forwards run so far."""
        if self._base_seed is None:
            with tc.outside_local_tensor_mode():  # LocalTensorMode answers with a per-rank seed
                box = [int(torch.initial_seed())]
            if several_processes():
                dist.broadcast_object_list(box, src=0)
            self._base_seed = int(box[0])
        self._runs += 1
        return self._base_seed + self._runs

    def _callable(self, which: str, rank: int, program: RankProgram):
        """The program as a function of one list of inputs, which it empties: its graph module
        in FX's boxed convention, or that module compiled by torch.compile (on first use)."""
        key = (which, rank)
        if key in self._callables:
            return self._callables[key]
        if not self.compile:
            self._callables[key] = tc.boxed_graph_module(program.gm)
            return self._callables[key]
        backend = "inductor" if self.compile is True else self.compile
        log.info(f"compiling the {which} program of rank {rank} ({backend})")
        compiled = torch.compile(program.gm, backend=backend, fullgraph=True, dynamic=False)

        def boxed(args: list):
            own = list(args)
            args.clear()
            return compiled(*own)

        self._callables[key] = boxed
        return boxed

    def compiled(self) -> list[str]:
        """``"forward@rank"`` / ``"backward@rank"`` for each program this process runs compiled."""
        return sorted(f"{which}@{rank}" for which, rank in self._callables) if self.compile else []

    def run(self, which: str, locals_: list) -> list:
        """Run every local rank's ``forward``, ``forward_held`` (:meth:`forward_held_program`) or
        ``backward`` program on its shards. ``locals_`` is emptied: a backward frees each saved
        activation at its last use, as autograd does."""
        get = {"forward": self.forward_program, "forward_held": self.forward_held_program,
               "backward": self.backward_program}[which]
        if which != "backward":
            rng.next_run(self._next_seed())
        ranks = tc.local_tensor_ranks()
        if ranks is None:
            rank = dist.get_rank()
            args = get(rank).conform(locals_)
            locals_.clear()
            return list(self._callable(which, rank, get(rank))(args))
        if self.compile and not self._warned_eager:
            self._warned_eager = True
            log.warning("compile applies to real processes: under LocalTensorMode every rank's program runs eagerly")
        programs = {r: get(r).gm for r in ranks}
        args = {r: [] for r in ranks}
        for t in locals_:
            for r, part in tc.rank_parts(t, ranks).items():
                args[r].append(part)
        locals_.clear()
        # Outside the mode: a copy that conforms a rank's part made under LocalTensorMode is a
        # LocalTensor of every rank's copy, nested in this rank's part (found as AdamW updating
        # FSDP-sharded weights beside experts several times per step: each op ran per inner rank).
        with tc.outside_local_tensor_mode():
            args = {r: get(r).conform(a) for r, a in args.items()}
            outs = run_ranks(programs, args, self.mesh)
        n = len(outs[ranks[0]])
        return [tc.from_rank_parts({r: outs[r][i] for r in ranks}) for i in range(n)]


class StepFunction(torch.autograd.Function):
    """Forward and backward of the model as the lowered programs: one autograd node."""

    @staticmethod
    def forward(ctx, program: PlannedProgram, *flat):
        ctx.program = program
        ctx.set_materialize_grads(False)
        locals_ = [t.to_local() if isinstance(t, DTensor) else t for t in flat]
        rank = program._any_rank()
        fwd = program.forward_program(rank)
        if program.held_values is not None:
            results = program.run("forward_held", locals_ + list(program.held_values))
        else:
            results = program.run("forward", locals_)
            if program.held:
                program.held_values = [results[program.returned.index(h)] for h in program.held]
        n = len(program.outputs)
        ctx.saved = results[n:n + len(program.split.saved)]
        outs = []
        for local, spec, meta in zip(results[:n], fwd.out_specs[:n], fwd.out_meta[:n]):
            if spec is None:
                outs.append(local)
                continue
            outs.append(DTensor.from_local(local, program.mesh, tc.placements_for(spec, program.mesh),
                                           run_check=False, shape=meta[0], stride=meta[1]))
        ctx.n_flat = len(flat)
        non_diff = [o for o in outs if not o.is_floating_point()]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        program: PlannedProgram = ctx.program
        s = program.split
        tangents = []
        reached = {k for k, _ in s.tangents}
        by_leaf = dict(zip([k for k, _ in program.leaves], grad_outs))
        for k, g in by_leaf.items():
            if g is not None and k not in reached:
                raise PlanError(f"the loss reaches model output {k}, which the plan's loss_fn did not: plan with "
                                "a loss_fn that uses every output the training loss uses")
        bwd = program.backward_program(program._any_rank())
        for (k, d), spec in zip(s.tangents, program.tangent_specs()):
            g = by_leaf.get(k)
            if g is None:  # the caller's loss does not reach this output: a zero gradient
                val = d.meta["val"]
                g = torch.zeros(val.shape, dtype=val.dtype, device=program.mesh.device_type)
            # A plain gradient (of an output the plan left unsharded) is the same on every rank.
            tangents.append(program.lowering._move(g, spec).to_local().contiguous())
        args = list(ctx.saved) + tangents
        del ctx.saved, tangents
        g = None
        grads = program.run("backward", args)
        out = [None] * ctx.n_flat
        index = {f: i for i, f in enumerate(program.tg.param_fqns)}
        first_input = len(program.tg.param_fqns) + len(program.tg.buffer_fqns)
        index.update({k: first_input + k for k in s.input_grads})
        for f, local, spec, meta in zip(program.trainable + sorted(s.input_grads), grads, bwd.out_specs,
                                        bwd.out_meta):
            g = DTensor.from_local(local, program.mesh, tc.placements_for(spec, program.mesh),
                                   run_check=False, shape=meta[0], stride=meta[1])
            if program.accumulate and isinstance(f, str):
                program.pending[f] = g if f not in program.pending else program.pending[f] + g
            else:
                out[index[f]] = g
        return (None, *out)
