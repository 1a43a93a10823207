"""Collective time from an alpha-beta model per link class.

nccl-tests conventions: algbw = bytes / time and busbw = algbw * f(n) with
f = 2(n-1)/n for all_reduce and (n-1)/n for all_gather, reduce_scatter and
all_to_all, so time = alpha + bytes * f(n) / busbw. ``bytes`` is the size of the
full (gathered / reduced) buffer, as nccl-tests reports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from costmodel.profile import LinkModel

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
_BUS_FACTOR = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: np.ones_like(n, dtype=np.float64) if isinstance(n, np.ndarray) else 1.0,
}


@dataclass(frozen=True)
class MeshTopology:
    """Where each mesh axis's groups live: within a node or across nodes."""

    shape: tuple[int, ...]
    """Mesh shape (ranks per axis)."""
    devices_per_node: int
    """Consecutive ranks that share a node."""

    def __post_init__(self):
        if not self.shape or any(s < 1 for s in self.shape):
            raise ValueError(f"mesh shape must be non-empty with sizes >= 1, found {self.shape}")

    def axis_stride(self, axis: int) -> int:
        return math.prod(self.shape[axis + 1:])

    def group_is_intra_node(self, axes: tuple[int, ...]) -> bool:
        """A group over ``axes`` (row-major ranks) stays in one node when its rank span does."""
        span = 1 + sum((self.shape[a] - 1) * self.axis_stride(a) for a in axes)
        return span <= self.devices_per_node and self.devices_per_node % max(1, self.axis_stride(min(axes))) == 0


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw / algbw for ``kind`` on ``n`` ranks."""
    if kind not in _BUS_FACTOR:
        raise ValueError(f"collective kind must be one of {KINDS}, found {kind!r}")
    return float(_BUS_FACTOR[kind](float(n)))


def collective_time_us(kind: str, nbytes, group_size, link: LinkModel) -> np.ndarray:
    """Vectorized time of ``kind`` moving ``nbytes`` (full buffer) over ``group_size`` ranks."""
    if kind not in _BUS_FACTOR:
        raise ValueError(f"collective kind must be one of {KINDS}, found {kind!r}")
    n = np.asarray(group_size, dtype=np.float64)
    b = np.asarray(nbytes, dtype=np.float64)
    t = link.latency_us + b * _BUS_FACTOR[kind](n) / (link.busbw_gbps * 1e3)
    return np.where(n <= 1, 0.0, t)
