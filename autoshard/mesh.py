"""Meshes for planning (fake process group) and checks that a mesh fits its world."""

from __future__ import annotations

import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.errors import MeshError


def several_processes() -> bool:
    """Whether the ranks are real, separate processes (not one process under LocalTensorMode, not
    a fake process group): what one rank decides must then be broadcast to the others."""
    from autoshard._torch_compat import local_tensor_ranks

    return dist.is_initialized() and dist.get_world_size() > 1 and local_tensor_ranks() is None \
        and dist.get_backend() != "fake"


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``"dp=8,tp=8"`` -> ((8, 8), ("dp", "tp")); ``"8x8"`` -> ((8, 8), ("axis0", "axis1"))."""
    text = text.strip()
    try:
        if "=" in text:
            pairs = [p.split("=") for p in text.split(",") if p]
            names = tuple(k.strip() for k, _ in pairs)
            shape = tuple(int(v) for _, v in pairs)
        else:
            shape = tuple(int(v) for v in text.lower().replace(",", "x").split("x") if v)
            names = tuple(f"axis{k}" for k in range(len(shape)))
    except ValueError:
        raise MeshError(f"mesh {text!r}: expected 'name=size,...' (e.g. dp=8,tp=8) or '8x8'") from None
    if not shape or any(s < 1 for s in shape):
        raise MeshError(f"mesh {text!r}: expected one or more axis sizes >= 1, found {shape}")
    if len(set(names)) != len(names):
        raise MeshError(f"mesh {text!r}: axis names must be distinct, found {names}")
    return shape, names


def check_mesh(mesh: DeviceMesh) -> None:
    """The mesh must cover the whole world of the default process group, or be a slice of a
    mesh that does (a pipeline stage's sub-mesh: ``mesh["dp", "tp"]``)."""
    if dist.is_initialized():
        world = dist.get_world_size()
        from autoshard._torch_compat import root_mesh

        if root_mesh(mesh).size() != world:
            raise MeshError(
                f"mesh {tuple(mesh.shape)} has {mesh.size()} ranks but the world size is {world}: "
                "expected their product to equal the number of processes"
            )


def fake_mesh(shape, axis_names=None, device_type: str = "cpu") -> DeviceMesh:
    """A mesh on a fake process group: plan for 64 or 1024 ranks from one process, no GPU.

    Initializes the ``fake`` backend with world size = prod(shape) unless a process
    group exists; an existing group of another size is an error.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    shape = tuple(int(s) for s in shape)
    axis_names = tuple(axis_names) if axis_names else tuple(f"axis{k}" for k in range(len(shape)))
    if len(axis_names) != len(shape):
        raise MeshError(f"mesh shape {shape} has {len(shape)} axes but {len(axis_names)} names {axis_names}")
    world = math.prod(shape)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    elif dist.get_world_size() != world:
        raise MeshError(
            f"mesh {shape} needs {world} ranks but the process group has world size "
            f"{dist.get_world_size()}: destroy it or use a mesh of that size"
        )
    return init_device_mesh(device_type, shape, mesh_dim_names=axis_names)


def axis_names_of(mesh: DeviceMesh) -> list[str]:
    return list(mesh.mesh_dim_names) if mesh.mesh_dim_names else [f"axis{k}" for k in range(mesh.ndim)]
