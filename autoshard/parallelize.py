"""Apply a plan: parameters become DTensors, inputs are distributed on entry.

Every redistribute between ops is executed by DTensor's own dispatcher and
redistribution engine, starting from the planned parameter and input specs.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from autoshard._torch_compat import to_placements
from autoshard.errors import MeshError, PlanError
from autoshard.mesh import axis_names_of, check_mesh
from autoshard.plan import Plan
from costmodel.spec import Spec


def check_plan_matches(model: nn.Module, plan: Plan, mesh) -> None:
    """Raise naming the first difference between the plan and (model, mesh)."""
    if list(mesh.shape) != list(plan.mesh_shape):
        raise MeshError(f"plan was made for mesh shape {plan.mesh_shape}, the mesh given has {list(mesh.shape)}")
    names = axis_names_of(mesh)
    if names != plan.axis_names:
        raise MeshError(f"plan was made for mesh axes {plan.axis_names}, the mesh given has {names}")
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    for fqn, t in state.items():
        if fqn not in plan.params:
            raise PlanError(
                f"model has {fqn} {tuple(t.shape)} which the plan does not place "
                f"(plan is for {plan.model.get('class', '?')}, model is {type(model).__name__})"
            )
        want = plan.params[fqn].shape
        if want and list(t.shape) != list(want):
            raise PlanError(f"{fqn}: plan was made for shape {tuple(want)}, the model has {tuple(t.shape)}")
    extra = [fqn for fqn in plan.params if fqn not in state]
    if extra:
        raise PlanError(f"plan places {extra[0]} which the model ({type(model).__name__}) does not have")


def _to_placements_hook(mesh, placements):
    def hook(grad):
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(placements):
            return grad.redistribute(mesh, placements)
        return grad

    return hook


def parallelize(model: nn.Module, plan: Plan, mesh) -> nn.Module:
    """Shard ``model`` in place as ``plan`` says and return it.

    Parameters and buffers become DTensors with the planned placements; each
    tensor argument of ``forward`` is distributed with its planned spec (from the
    full tensor given on every rank). Outputs are DTensors.
    """
    check_mesh(mesh)
    check_plan_matches(model, plan, mesh)
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.is_meta:
                raise PlanError(
                    f"{prefix}{name} is on the meta device: materialize the model (to_empty + init) "
                    "before parallelize"
                )
            placements = to_placements(plan.param_spec(prefix + name))
            dt = distribute_tensor(p.detach(), mesh, placements)
            param = nn.Parameter(dt, requires_grad=p.requires_grad)
            if param.requires_grad:
                # The plan costs the gradient's move to the parameter's spec (DDP's all-reduce,
                # FSDP's reduce-scatter); without this DTensor would leave it Partial.
                param.register_hook(_to_placements_hook(mesh, placements))
            mod.register_parameter(name, param)
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is None:
                continue
            placements = to_placements(plan.param_spec(prefix + name))
            mod.register_buffer(name, distribute_tensor(b, mesh, placements))

    input_specs = [to_placements(Spec.parse(s)) for s in plan.inputs]

    def distribute_inputs(_mod, args):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if len(tensors) != len(input_specs):
            raise PlanError(
                f"forward got {len(tensors)} tensor inputs, the plan was made for {len(input_specs)}"
            )
        it = iter(input_specs)
        out = []
        for a in args:
            if isinstance(a, torch.Tensor):
                placements = next(it)
                if not isinstance(a, DTensor):
                    a = distribute_tensor(a, mesh, placements)
            out.append(a)
        return tuple(out)

    model.register_forward_pre_hook(distribute_inputs)
    model._autoshard_plan = plan
    return model
