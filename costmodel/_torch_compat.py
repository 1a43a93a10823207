"""The private DTensor APIs the cost model's executor uses, in one place.

``execute`` runs a :class:`RedistributePlan` step by step with the same
placement methods DTensor's ``redistribute_local_tensor`` calls, on the mesh
axis (or flattened sub-mesh) the plan chose, so the plan that was costed is
the plan that runs.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta

from costmodel.redistribute import RedistributePlan, Step, encode
from costmodel.spec import Spec


def placements_of(spec: Spec) -> tuple:
    out = []
    for p in spec.placements:
        if p == "R":
            out.append(Replicate())
        elif p.startswith("S("):
            out.append(Shard(int(p[2:-1])))
        else:
            out.append(Partial(p[2:-1]))
    return tuple(out)


def dtensor_spec(spec: Spec, mesh, shape, dtype=torch.float32) -> DTensorSpec:
    """A DTensorSpec that carries ``spec``'s shard order explicitly."""
    ndim = len(shape)
    _, orders = encode(spec, ndim, mesh.ndim)
    order = tuple(ShardOrderEntry(tensor_dim=d, mesh_dims=tuple(o)) for d, o in enumerate(orders) if o)
    stride = torch.empty(shape, device="meta").stride()
    meta = TensorMeta(torch.Size(shape), stride, dtype)
    return DTensorSpec(mesh, placements_of(spec), tensor_meta=meta, shard_order=order,
                       use_strided_shard_as_shard_order=False)


def _logical_shape(mesh, orders, shape, skip_axes):
    """Shape of the tensor as sharded by every axis but ``skip_axes`` (this rank's sizes)."""
    out = list(shape)
    for d, order in enumerate(orders):
        for a in order:
            if a in skip_axes:
                continue
            size, _ = Shard(d).local_shard_size_and_offset(out[d], mesh.size(mesh_dim=a), mesh._sym_get_coordinate(a))
            out[d] = size
    return out


def _group_mesh(mesh, axes):
    if len(axes) == 1:
        return mesh, axes[0]
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"a merged step over axes {axes} needs a mesh with axis names to flatten")
    return mesh[tuple(names[a] for a in axes)]._flatten(), 0


def make_groups(mesh) -> None:
    """Create the flattened sub-mesh of every set of two or more axes now: a merged step
    creates its group on first use, which must not happen while a program is traced."""
    import itertools

    if not mesh.mesh_dim_names:
        return
    for k in range(2, mesh.ndim + 1):
        for axes in itertools.combinations(range(mesh.ndim), k):
            _group_mesh(mesh, axes)


def run_step(local: torch.Tensor, step: Step, mesh, shape) -> torch.Tensor:
    ndim = len(shape)
    codes, orders = encode(step.src, ndim, mesh.ndim)
    axes = step.axes
    src_p = placements_of(step.src)[axes[0]]
    dst_p = placements_of(step.dst)[axes[0]]
    use_mesh, i = _group_mesh(mesh, axes)
    if step.kind == "all_gather":
        logical = _logical_shape(mesh, orders, shape, set(axes))
        return Shard(src_p.dim)._to_replicate_tensor(local, use_mesh, i, logical)
    if step.kind == "all_to_all":
        logical = _logical_shape(mesh, orders, shape, set(axes))
        return src_p._to_new_shard_dim(local, use_mesh, i, logical, dst_p.dim)
    if step.kind == "all_reduce":
        return src_p._reduce_value(local, use_mesh, i)
    if step.kind == "reduce_scatter":
        return src_p._reduce_shard_value(local, use_mesh, i, dst_p)
    if step.kind == "chunk":
        return dst_p._replicate_to_shard(local, use_mesh, i, use_mesh._sym_get_coordinate(i))
    if step.kind == "partition":
        return dst_p._partition_value(local, use_mesh, i)
    raise ValueError(f"unknown step kind {step.kind!r}")


def execute(local: torch.Tensor, plan: RedistributePlan, mesh, shape) -> torch.Tensor:
    """Run ``plan`` on this rank's local shard of a tensor of global ``shape``."""
    for step in plan.steps:
        local = run_step(local, step, mesh, tuple(shape))
        if hasattr(local, "wait"):
            local = local.wait()
    return local


def flattened_group(mesh, axis_names: tuple[str, ...]):
    """The process group of several mesh axes used as one (DeviceMesh's private ``_flatten``)."""
    if len(axis_names) == 1:
        return mesh.get_group(axis_names[0])
    return mesh[axis_names]._flatten().get_group()


def spec_of_state(state) -> Spec:
    """Our spec for one state of torch's redistribute planner (placements + shard order)."""
    placements = []
    for p in state.placements:
        if isinstance(p, Replicate):
            placements.append("R")
        elif isinstance(p, Shard):
            placements.append(f"S({p.dim})")
        else:
            placements.append(f"P({p.reduce_op})")
    order = tuple((e.tensor_dim, tuple(e.mesh_dims)) for e in state.tensor_dim_to_mesh_dim
                  if len(e.mesh_dims) > 1 and list(e.mesh_dims) != sorted(e.mesh_dims))
    return Spec(tuple(placements), order)


def torch_planner_path(mesh, src: Spec, dst: Spec, shape) -> list[Spec]:
    """The states of torch's own planner (``DTensorRedistributePlanner``) from src to dst, cold."""
    from torch.distributed.tensor._redistribute import DTensorRedistributePlanner

    shape = tuple(shape)
    ss, ds = dtensor_spec(src, mesh, shape), dtensor_spec(dst, mesh, shape)
    planner = DTensorRedistributePlanner(mesh, ss.tensor_meta)
    found = {}
    search = planner.find_min_cost_path

    def capture(s, d):
        found["path"] = search(s, d)
        return found["path"]

    planner.find_min_cost_path = capture
    planner.generate_graph_based_transform_infos(ss, ds, shape)
    return [spec_of_state(s) for s in found.get("path", [])]
