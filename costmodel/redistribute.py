"""Redistribute cost between two specs: one collective per mesh axis that changes.

Skeleton model (the device-order-aware planner replaces it): axes are visited in
order; the bytes an axis's collective moves are those of the tensor as sharded
by the other axes at that moment.

==========  ==========  ===================================
from        to          collective on that axis
==========  ==========  ===================================
S(d)        R           all_gather
S(d)        S(e)        all_to_all
S(d)        P           all_gather (then a local zeroing)
P           R           all_reduce
P           S(d)        reduce_scatter
P(x)        P(y)        all_reduce
R           S(d), P     none (local chunk / zeroing)
==========  ==========  ===================================
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from costmodel.collectives import MeshTopology, collective_time_us, link_for
from costmodel.profile import Profile
from costmodel.spec import Spec


@dataclass(frozen=True)
class Step:
    kind: str
    axis: int
    nbytes: int
    us: float


def _transition(src: str, dst: str) -> str | None:
    if src == dst:
        return None
    if src == "R":
        return None
    if src.startswith("S("):
        return "all_to_all" if dst.startswith("S(") else "all_gather"
    # src is partial
    if dst.startswith("S("):
        return "reduce_scatter"
    return "all_reduce"


def plan_steps(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
               topo: MeshTopology, profile: Profile) -> list[Step]:
    """The collectives that turn ``src`` into ``dst``, with bytes and predicted time."""
    if len(src.placements) != len(topo.shape) or len(dst.placements) != len(topo.shape):
        raise ValueError(
            f"specs {src} -> {dst} must have one placement per mesh axis ({len(topo.shape)} axes)"
        )
    cur = list(src.placements)
    steps = []
    for axis in range(len(topo.shape)):
        kind = _transition(cur[axis], dst.placements[axis])
        cur[axis] = dst.placements[axis]
        if kind is None:
            continue
        # The full buffer of this axis's collective: the tensor sharded by the other axes only.
        others = Spec(tuple("R" if a == axis or p.startswith("P") else p for a, p in enumerate(cur)))
        nbytes = int(np.prod(others.local_shape(shape, topo.shape), dtype=np.int64)) * itemsize
        link = link_for(profile, topo, (axis,))
        us = float(collective_time_us(kind, nbytes, topo.shape[axis], link))
        steps.append(Step(kind, axis, nbytes, us))
    return steps


def redistribute_cost_us(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
                         topo: MeshTopology, profile: Profile) -> float:
    return sum(s.us for s in plan_steps(src, dst, shape, itemsize, topo, profile))
