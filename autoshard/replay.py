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

Specs with a non-default shard order run in the default order (DTensor placements
carry no order); each op then still receives its planned placements.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, distribute_tensor

from autoshard._torch_compat import from_placements, outside_local_tensor_mode, to_placements
from autoshard.errors import PlanError
from autoshard.plan import Plan
from autoshard.trace import trace
from costmodel import MeshTopology, RedistributePlanner, Spec, execute_plan, load_profile
from costmodel.profile import Profile


def spec_of(t: DTensor) -> Spec:
    spec = from_placements(t.placements)
    if spec is None:
        raise PlanError(f"a tensor with placements {t.placements} has no spec the planner knows")
    return spec


class PlannedStep:
    """``loss = step(*inputs)``: forward and backward of a parallelized model, as planned.

    ``model`` must be the output of :func:`autoshard.parallelize` with the same plan;
    ``example_inputs`` (shapes only) and ``loss_fn`` as given to :func:`autoshard.plan`.
    """

    def __init__(self, model: torch.nn.Module, plan: Plan, mesh, example_inputs, loss_fn=None,
                 profile: Profile | str | None = None):
        self.model, self.plan, self.mesh = model, plan, mesh
        with outside_local_tensor_mode():
            with torch.device("meta"):
                shapes = [torch.empty(x.shape, dtype=x.dtype) for x in example_inputs]
            local = _unsharded_meta_copy(model)
            self.tg = trace(local, shapes, loss_fn)  # the same graph, node names included, as planned
        ops = [n for n in self.tg.gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
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

    def _move(self, t, want: Spec):
        if not isinstance(t, torch.Tensor):
            return t
        if not isinstance(t, DTensor):
            # A constant or a factory op's result: every rank holds the same full tensor,
            # so taking the planned shard is local.
            return distribute_tensor(t, self.mesh, to_placements(Spec(want.placements)), src_data_rank=None)
        have = spec_of(t)
        want = Spec(want.placements)  # placements only: see the module note on shard orders
        if have == want:
            return t
        shape = tuple(t.shape)
        steps = self.planner.plan(have, want, shape, t.element_size())
        local = execute_plan(t.to_local(), steps, self.mesh, shape)
        self.moves += 1
        return DTensor.from_local(local, self.mesh, to_placements(want), run_check=False, shape=t.shape,
                                  stride=t.stride())

    def __call__(self, *inputs):
        tg, plan = self.tg, self.plan
        env: dict[fx.Node, object] = {}
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
                env[n] = x if isinstance(x, DTensor) else distribute_tensor(
                    x, self.mesh, to_placements(in_specs[k]), src_data_rank=None)
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
                wants = [Spec.parse(s) for s in plan.nodes[n.name]["in"]]
                it = iter(wants)

                def arg(a):
                    v = env[a]
                    if isinstance(v, torch.Tensor):
                        return self._move(v, next(it))
                    return v

                args, kwargs = fx.node.map_arg((n.args, n.kwargs), arg)
                env[n] = n.target(*args, **kwargs)
                for a in n.all_input_nodes:  # free activations no later node reads
                    if last.get(a) == i and a.op != "placeholder" and a in env and a not in outputs:
                        del env[a]
        outs = fx.node.map_arg(out_node.args[0], lambda a: env[a])
        flat = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        loss, grads = flat[0], flat[1:]
        for fqn, g in zip([f for f, p in self.params.items() if p.requires_grad], grads):
            if g is None:
                continue
            p = self.params[fqn]
            g = self._move(g, spec_of(p))
            p.grad = g if p.grad is None else p.grad + g
        return loss


def _unsharded_meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model's structure with meta tensors of the global shapes (for re-tracing)."""
    import copy

    clone = copy.deepcopy(model)
    for mod in clone.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                            requires_grad=p.requires_grad))
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None:
                mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    for h in list(clone._forward_pre_hooks):
        clone._forward_pre_hooks.pop(h)
    return clone
