"""Full tensors and modules in a plan's layout: a tensor distributed to a spec (its shard
order included), and a module's unsharded meta copy for re-tracing."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from autoshard._torch_compat import placements_for
from autoshard.errors import PlanError
from costmodel import execute_plan, local_plan
from costmodel.spec import Spec


def distribute(tensor: torch.Tensor, mesh, spec: Spec, src_data_rank: int | None = 0) -> DTensor:
    """``tensor`` (the full tensor) as a DTensor of ``spec``, its shard order included.

    A default-order spec is DTensor's ``distribute_tensor``. A spec with a shard order is
    replicated and then chunked locally, axis by axis in the planned order (the planner's
    own local steps), and carries ``_StridedShard`` placements: every rank keeps exactly the
    slice the plan's redistributes expect. (``distribute_tensor`` with those placements also
    slices correctly on real processes, but not under LocalTensorMode.)
    """
    if not spec.shard_order:
        return distribute_tensor(tensor, mesh, placements_for(spec, mesh), src_data_rank=src_data_rank)
    if spec.partial_axes():
        raise PlanError(f"cannot distribute a full tensor as {spec}: a partial spec has no full-tensor layout")
    replicated = Spec(("R",) * len(spec.placements))
    local = distribute_tensor(tensor, mesh, placements_for(replicated, mesh), src_data_rank=src_data_rank).to_local()
    local = execute_plan(local, local_plan(replicated, spec, tensor.ndim), mesh, tuple(tensor.shape))
    return DTensor.from_local(local, mesh, placements_for(spec, mesh), run_check=False, shape=tensor.shape,
                              stride=tensor.stride())


def unsharded_meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The model's structure with meta tensors of the global shapes (for re-tracing)."""
    import copy

    template = getattr(model.__dict__.get("forward"), "template", None)
    if template is not None:  # parallelized: the unsharded structure was kept
        return template
    clone = copy.deepcopy(model)
    made: dict[int, torch.Tensor] = {}  # tied tensors stay tied (one placeholder, as planned)
    for mod in clone.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                 requires_grad=p.requires_grad)
            mod.register_parameter(name, made[id(p)])
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None:
                if id(b) not in made:
                    made[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
                mod._buffers[name] = made[id(b)]
    for h in list(clone._forward_pre_hooks):
        clone._forward_pre_hooks.pop(h)
    return clone
