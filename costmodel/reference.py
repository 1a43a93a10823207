"""Run and compare redistribute plans: execute one with DTensor's machinery, and
find the path torch's own planner takes between the same specs."""

from __future__ import annotations

import torch

from costmodel import _torch_compat as tc
from costmodel.redistribute import RedistributePlan, RedistributePlanner
from costmodel.spec import Spec


def execute_plan(local: torch.Tensor, plan: RedistributePlan, mesh, shape) -> torch.Tensor:
    """Run ``plan`` on this rank's local shard of a tensor of global ``shape`` (DTensor's
    own placement methods; flattened sub-meshes for merged steps). Under LocalTensorMode
    ``local`` holds every rank's shard."""
    return tc.execute(local, plan, mesh, tuple(shape))


def make_groups(mesh) -> None:
    """Create every flattened axis group a merged step may use (before tracing programs)."""
    tc.make_groups(mesh)


def start_step(local: torch.Tensor, step, mesh, shape) -> torch.Tensor:
    """Start one step of a plan without waiting: a collective returns a tensor that
    waits on first use (or on ``.wait()``), so the caller can overlap it with work."""
    return tc.run_step(local, step, mesh, tuple(shape))


def torch_path(mesh, src: Spec, dst: Spec, shape) -> list[Spec]:
    """The specs torch's ``DTensorRedistributePlanner`` visits from ``src`` to ``dst``."""
    return tc.torch_planner_path(mesh, src, dst, tuple(shape))


def price_path(planner: RedistributePlanner, path: list[Spec], shape, itemsize: int) -> list[float]:
    """Each step of a path of specs priced by our cost model (microseconds)."""
    return [planner.transition_cost(a, b, tuple(shape), itemsize) for a, b in zip(path, path[1:])]
