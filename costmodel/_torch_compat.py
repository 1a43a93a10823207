"""The private DTensor APIs the cost model uses, in one place: specs as DTensor placements,
the placement methods each redistribute step runs (:mod:`costmodel.executor` drives them),
flattened sub-meshes, and torch's own redistribute planner for comparison."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, ShardOrderEntry, TensorMeta

from costmodel.spec import Spec, partial_op, shard_dim
from costmodel.states import encode


def placements_of(spec: Spec) -> tuple:
    out = []
    for p in spec.placements:
        if p == "R":
            out.append(Replicate())
        elif shard_dim(p) is not None:
            out.append(Shard(shard_dim(p)))
        else:
            out.append(Partial(partial_op(p)))
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


def local_shard_size(dim: int, size: int, num_chunks: int, rank: int) -> int:
    """Rows of tensor dim ``dim`` (``size`` long) that chunk ``rank`` of ``num_chunks`` holds."""
    return Shard(dim).local_shard_size_and_offset(size, num_chunks, rank)[0]


def coordinate(mesh, axis: int):
    """This rank's coordinate on ``axis`` (symbolic-safe: LocalTensorMode patches it)."""
    return mesh._sym_get_coordinate(axis)


def flatten(mesh, axis_names: tuple[str, ...]):
    """The sub-mesh of several axes used as one axis (DeviceMesh's private ``_flatten``)."""
    return mesh[axis_names]._flatten()


# One collective or local op per step kind: the placement methods DTensor's own
# ``redistribute_local_tensor`` calls, on axis ``i`` of ``mesh``.

def all_gather(local, src: Spec, axis_of_src: int, mesh, i: int, logical_shape):
    return Shard(placements_of(src)[axis_of_src].dim)._to_replicate_tensor(local, mesh, i, logical_shape)


def all_to_all(local, src: Spec, dst: Spec, axis: int, mesh, i: int, logical_shape):
    return placements_of(src)[axis]._to_new_shard_dim(local, mesh, i, logical_shape, placements_of(dst)[axis].dim)


def all_reduce(local, src: Spec, axis: int, mesh, i: int):
    return placements_of(src)[axis]._reduce_value(local, mesh, i)


def reduce_scatter(local, src: Spec, dst: Spec, axis: int, mesh, i: int):
    return placements_of(src)[axis]._reduce_shard_value(local, mesh, i, placements_of(dst)[axis])


def chunk(local, dst: Spec, axis: int, mesh, i: int):
    place = placements_of(dst)[axis]
    if local.dim() and local.stride(place.dim) == 0:
        # A broadcast value (a loss's gradient seed, expanded to the logits' global shape): its
        # shard is the same broadcast, smaller. DTensor's chunk clones it, materializing the
        # global tensor's shard.
        return place._select_split_tensor(local, mesh.size(mesh_dim=i), coordinate(mesh, i), with_padding=False,
                                          contiguous=False, clone=False)
    return place._replicate_to_shard(local, mesh, i, coordinate(mesh, i))


def partition(local, dst: Spec, axis: int, mesh, i: int):
    return placements_of(dst)[axis]._partition_value(local, mesh, i)


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
