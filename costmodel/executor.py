"""Run a redistribute plan: each step with the placement methods DTensor's own
``redistribute_local_tensor`` calls (through :mod:`costmodel._torch_compat`), on the mesh
axis or flattened sub-mesh the plan chose, so the plan that was costed is the plan that runs.
Under LocalTensorMode ``local`` holds every rank's shard."""

from __future__ import annotations

import itertools

import torch

from costmodel import _torch_compat as tc
from costmodel.states import RedistributePlan, Step, encode


def _logical_shape(mesh, orders, shape, skip_axes):
    """Shape of the tensor as sharded by every axis but ``skip_axes`` (this rank's sizes)."""
    out = list(shape)
    for d, order in enumerate(orders):
        for a in order:
            if a not in skip_axes:
                out[d] = tc.local_shard_size(d, out[d], mesh.size(mesh_dim=a), tc.coordinate(mesh, a))
    return out


def _group_mesh(mesh, axes):
    """(mesh, axis index) of a step's group: the axis itself, or the flattened sub-mesh of several."""
    if len(axes) == 1:
        return mesh, axes[0]
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"a merged step over axes {axes} needs a mesh with axis names to flatten")
    return tc.flatten(mesh, tuple(names[a] for a in axes)), 0


#: (mesh, axis index) of a group of mesh axes: the axis, or the flattened sub-mesh of several.
group_mesh = _group_mesh


def make_groups(mesh) -> None:
    """Create the flattened sub-mesh of every set of two or more axes now: a merged step
    creates its group on first use, which must not happen while a program is traced."""
    if not mesh.mesh_dim_names:
        return
    for k in range(2, mesh.ndim + 1):
        for axes in itertools.combinations(range(mesh.ndim), k):
            _group_mesh(mesh, axes)


def start_step(local: torch.Tensor, step: Step, mesh, shape) -> torch.Tensor:
    """Start one step of a plan without waiting: a collective returns a tensor that waits on
    first use (or on ``.wait()``), so the caller can overlap it with work."""
    shape = tuple(shape)
    axis = step.axes[0]
    use_mesh, i = _group_mesh(mesh, step.axes)
    if step.kind in ("all_gather", "all_to_all"):
        _, orders = encode(step.src, len(shape), mesh.ndim)
        logical = _logical_shape(mesh, orders, shape, set(step.axes))
        if step.kind == "all_gather":
            return tc.all_gather(local, step.src, axis, use_mesh, i, logical)
        return tc.all_to_all(local, step.src, step.dst, axis, use_mesh, i, logical)
    if step.kind == "all_reduce":
        return tc.all_reduce(local, step.src, axis, use_mesh, i)
    if step.kind == "reduce_scatter":
        return tc.reduce_scatter(local, step.src, step.dst, axis, use_mesh, i)
    if step.kind == "chunk":
        return tc.chunk(local, step.dst, axis, use_mesh, i)
    if step.kind == "partition":
        return tc.partition(local, step.dst, axis, use_mesh, i)
    raise ValueError(f"unknown step kind {step.kind!r}")


def execute_plan(local: torch.Tensor, plan: RedistributePlan, mesh, shape) -> torch.Tensor:
    """Run ``plan`` on this rank's local shard of a tensor of global ``shape``."""
    for step in plan.steps:
        local = start_step(local, step, mesh, shape)
        if hasattr(local, "wait"):
            local = local.wait()
    return local
