"""Compare with torch: the path torch's own redistribute planner takes between two specs,
and any path of specs priced by our cost model."""

from __future__ import annotations

from costmodel import _torch_compat as tc
from costmodel.redistribute import RedistributePlanner
from costmodel.spec import Spec


def torch_path(mesh, src: Spec, dst: Spec, shape) -> list[Spec]:
    """The specs torch's ``DTensorRedistributePlanner`` visits from ``src`` to ``dst``."""
    return tc.torch_planner_path(mesh, src, dst, tuple(shape))


def price_path(planner: RedistributePlanner, path: list[Spec], shape, itemsize: int) -> list[float]:
    """Each step of a path of specs priced by our cost model (microseconds)."""
    return [planner.transition_cost(a, b, tuple(shape), itemsize) for a, b in zip(path, path[1:])]
