"""Run a training step exactly as planned: the traced joint graph, op by op, on DTensors.

``parallelize`` leaves the choice of each op's input specs to DTensor's dispatcher,
which may redistribute differently from the plan. ``PlannedStep`` instead executes
the same forward+backward graph the planner costed: before every op, each tensor
argument is moved to the spec the plan chose for it, by the planner's own steps
(:func:`costmodel.execute_plan`: its collectives, merged steps on flattened
sub-meshes included); the op then runs on DTensors whose specs already match a
strategy of its rule, so DTensor adds no redistribute of its own. Gradients come
out of the graph in their parameter's planned spec and are set as ``.grad``, so any
optimizer steps the parameters as usual.

Gradient reductions are bucketed and overlapped, as DDP does: a gradient that only
the output reads and whose planned move is one all-reduce (a partial sum over some
mesh axes) joins a bucket of gradients reduced over the same axes; a full bucket
(``bucket_mb``) is reduced as one flat buffer by one asynchronous collective
while the backward pass goes on, and the results are waited for at the end. The
bytes and the reduction are the plan's; only the number of calls differs (the
planner costs each gradient's all-reduce alone: latency is overestimated).

Shard orders are kept: a parameter planned as, say, ``S(0)[1,0]S(0)`` (FSDP over TP)
is a DTensor with ``_StridedShard`` placements, and every move into or out of it runs
the planner's order-aware steps.
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor

from autoshard._torch_compat import from_placements, placements_for, quiet_tracing
from autoshard.errors import ConfigError, PlanError
from autoshard.graph.strategies import is_tensor
from autoshard.graph.tracing import trace
from autoshard.planfile import Plan
from autoshard.runtime.shards import distribute, unsharded_meta_copy
from costmodel import MeshTopology, RedistributePlanner, Spec, load_profile, start_step
from costmodel.profile import Profile


def spec_of(t: DTensor) -> Spec:
    spec = from_placements(t.placements, t.device_mesh)
    if spec is None:
        raise PlanError(f"a tensor with placements {t.placements} has no spec the planner knows")
    return spec


class PlannedStep:
    """``loss = step(*inputs)``: forward and backward of a parallelized model, as planned.

    ``model`` must be the output of :func:`autoshard.parallelize` with the same plan;
    ``example_inputs`` (shapes only) and ``loss_fn`` as given to :func:`autoshard.plan`.
    ``bucket_mb``: gradient all-reduces are grouped into buckets of about this many MiB, as
    ``parallelize``'s are (0: one collective per gradient, exactly the plan's steps).
    ``bucket_bytes`` is its deprecated form, in bytes.
    """

    def __init__(self, model: torch.nn.Module, plan: Plan, mesh, example_inputs, loss_fn=None,
                 profile: Profile | str | None = None, bucket_mb: float = 25.0, bucket_bytes: int | None = None):
        if bucket_bytes is not None:  # the name before bucket sizes were MiB everywhere
            warnings.warn("PlannedStep(bucket_bytes=) is deprecated: give bucket_mb (MiB), as parallelize takes",
                          DeprecationWarning, stacklevel=2)
            bucket_mb = bucket_bytes / 2**20
        if not bucket_mb >= 0:
            raise ConfigError(f"bucket_mb: expected >= 0 (MiB), found {bucket_mb}")
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.model, self.plan, self.mesh = model, plan, mesh
        with quiet_tracing():
            with torch.device("meta"):
                shapes = [torch.empty(x.shape, dtype=x.dtype) for x in example_inputs]
            local = unsharded_meta_copy(model)
            self.tg = trace(local, shapes, loss_fn)  # the same graph, node names included, as planned
        # The nodes a plan gives specs to: every op but getitem, and the tensor constants make_fx lifts.
        ops = [n for n in self.tg.gm.graph.nodes if (n.op == "call_function" and n.target is not operator.getitem)
               or (n.op == "get_attr" and is_tensor(n))]
        missing = [n.name for n in ops if plan.nodes.get(n.name, {}).get("op") != str(n.target)]
        if not missing and len(ops) != len(plan.nodes):
            missing = sorted(set(plan.nodes) - {n.name for n in ops})
        if missing:
            raise PlanError(f"the plan has no specs for graph nodes {missing[:5]} ({len(missing)} in all): it was "
                            "made for another model, input shape or loss")
        prof = profile if isinstance(profile, Profile) else load_profile(profile or plan.profile.get("name")
                                                                         or "h100-sxm")
        self.planner = RedistributePlanner(MeshTopology(tuple(mesh.shape), prof.devices_per_node), prof)
        self.params = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())
        self.moves = 0
        """Redistributes executed by the last call (each as the planner's steps)."""
        self.buckets = 0
        """Bucketed gradient all-reduces issued by the last call."""
        out = list(self.tg.gm.graph.nodes)[-1]
        flat = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
        trainable = [f for f, p in self.params.items() if p.requires_grad]
        # Gradient nodes that nothing but the output reads: their reduction may wait in a bucket.
        self._grad_of = {n: fqn for n, fqn in zip(flat[1:], trainable)
                         if isinstance(n, fx.Node) and set(n.users) == {out}}
        self._sunk = self._sinkable_views() if self.bucket_bytes else set()

    def _move(self, t, want: Spec):
        from autoshard.runtime.lower import move

        out = move(t, want, self.planner, self.mesh)
        self.moves += out is not t and isinstance(t, DTensor)
        return out

    def _sinkable_views(self) -> set[fx.Node]:
        """View ops between a partial weight gradient and the output whose planned input is that
        gradient all-reduced: they run on the partial tensor instead (views commute with a sum),
        so the reduction reaches the output and can join a bucket. Same bytes, same result."""
        sunk = set()
        for g in self._grad_of:
            chain, cur = [], g
            while isinstance(cur, fx.Node) and cur.op == "call_function" and cur.target in _VIEW_OPS \
                    and len(cur.users) == 1:
                chain.append(cur)
                cur = cur.args[0]
            if not chain or not isinstance(cur, fx.Node) or cur.name not in self.plan.nodes:
                continue
            have = Spec.parse(self.plan.nodes[cur.name]["out"])
            want = Spec.parse(self.plan.nodes[chain[-1].name]["in"][0])
            partial = set(have.partial_axes())
            summed = tuple("R" if a in partial else p for a, p in enumerate(have.placements))
            if partial and want.placements == summed:
                sunk.update(chain)
        return sunk

    def _bucketable(self, g, fqn):
        """The planned move of a gradient when it is a single all-reduce, else None."""
        if not isinstance(g, DTensor) or self.bucket_bytes == 0:
            return None
        have, want = spec_of(g), spec_of(self.params[fqn])
        if have == want:
            return None
        steps = self.planner.plan(have, want, tuple(g.shape), g.element_size())
        if len(steps.steps) != 1 or steps.steps[0].kind != "all_reduce":
            return None
        return steps.steps[0]

    def __call__(self, *inputs):
        tg, plan = self.tg, self.plan
        env: dict[fx.Node, object] = {}
        buckets = _Buckets(self)
        in_specs = [Spec.parse(s) for s in plan.inputs]
        k = 0
        self.moves = 0
        for n in tg.placeholders:
            kind = tg.kinds[n.name]
            if kind == "param":
                env[n] = self.params[tg.fqn_of[n.name]].detach()
            elif kind == "buffer":
                env[n] = self.buffers[tg.fqn_of[n.name]]
            else:
                x = inputs[k]
                # Every rank holds the whole batch (as the plan's input cost assumes): no broadcast.
                env[n] = x if isinstance(x, DTensor) else distribute(x, self.mesh, in_specs[k], src_data_rank=None)
                k += 1
        out_node = None
        order = list(tg.gm.graph.nodes)
        outputs = set(order[-1].all_input_nodes)
        last = {}
        for i, n in enumerate(order):
            for a in n.all_input_nodes:
                last[a] = i
        with torch.no_grad():
            for i, n in enumerate(order):
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    out_node = n
                    break
                if n.op == "get_attr":
                    env[n] = getattr(tg.gm, n.target)
                    continue
                if n.target is operator.getitem:
                    env[n] = env[n.args[0]][n.args[1]]
                    continue
                if not any(isinstance(v, DTensor) for v in map(env.get, n.all_input_nodes)):
                    # Only constants in (tensors built inside forward): every rank computes the same
                    # full value; a consumer takes its planned shard of it locally (as lowered).
                    args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                    env[n] = n.target(*args, **kwargs)
                    continue
                wants = [Spec.parse(s) for s in plan.nodes[n.name]["in"]]
                it = iter(wants)

                def arg(a):
                    v = env[a]
                    if isinstance(v, torch.Tensor):
                        want = next(it)
                        return v if n in self._sunk else self._move(v, want)
                    return v

                args, kwargs = fx.node.map_arg((n.args, n.kwargs), arg)
                try:
                    env[n] = n.target(*args, **kwargs)
                except (RuntimeError, ValueError) as exc:  # as lowering: the view views a contiguous copy
                    from autoshard.runtime.lower import contiguous, view_refused

                    if not view_refused(n, args, exc):
                        raise
                    env[n] = n.target(contiguous(args[0]), *args[1:], **kwargs)
                if n in self._grad_of:
                    step = self._bucketable(env[n], self._grad_of[n])
                    if step is not None:
                        buckets.add(self._grad_of[n], env[n], step)
                        env[n] = None
                for a in n.all_input_nodes:  # free activations no later node reads
                    if last.get(a) == i and a.op != "placeholder" and a in env and a not in outputs:
                        del env[a]
        outs = fx.node.map_arg(out_node.args[0], lambda a: env[a])
        flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        loss, grads = flat[0], flat[1:]
        reduced = buckets.finish()
        self.buckets = buckets.issued
        for fqn, g in zip([f for f, p in self.params.items() if p.requires_grad], grads):
            g = reduced.get(fqn, g)
            if g is None:
                continue
            p = self.params[fqn]
            g = self._move(g, spec_of(p))
            p.grad = g if p.grad is None else p.grad + g
        return loss


_VIEW_OPS = {
    torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
}


class _Buckets:
    """Gradients waiting for one all-reduce per (mesh axes, reduce op, dtype), flushed at
    ``bucket_mb``; each flush starts its collective at once and is waited for in ``finish``."""

    def __init__(self, owner: PlannedStep):
        self.owner = owner
        self.open: dict[tuple, list] = {}
        self.bytes: dict[tuple, int] = {}
        self.flying: list = []
        self.issued = 0

    def add(self, fqn: str, g: DTensor, step) -> None:
        key = (step.axes, step.src.placements[step.axes[0]], g.dtype)
        entries = self.open.setdefault(key, [])
        entries.append((fqn, g, step))
        self.bytes[key] = self.bytes.get(key, 0) + g.to_local().numel() * g.element_size()
        if self.bytes[key] >= self.owner.bucket_bytes:
            self._flush(key)

    def _flush(self, key) -> None:
        entries = self.open.pop(key)
        self.bytes.pop(key, None)
        flat = torch.cat([g.to_local().reshape(-1) for _, g, _ in entries])
        step = entries[0][2]
        # An all-reduce is elementwise: the flat buffer reduces exactly like each piece would.
        self.flying.append((start_step(flat, step, self.owner.mesh, tuple(flat.shape)), entries))
        self.issued += 1

    def finish(self) -> dict[str, DTensor]:
        for key in list(self.open):
            self._flush(key)
        out = {}
        mesh = self.owner.mesh
        for result, entries in self.flying:
            if hasattr(result, "wait"):
                result = result.wait()
            offset = 0
            for fqn, g, step in entries:
                local = g.to_local()
                piece = result[offset:offset + local.numel()].view(local.shape)
                offset += local.numel()
                out[fqn] = DTensor.from_local(piece, mesh, placements_for(step.dst, mesh), run_check=False,
                                              shape=g.shape, stride=g.stride())
        return out
