"""Collective time on a mesh: which link class a group uses (:class:`MeshTopology`) and
the alpha-beta time on it (:mod:`costmodel.links`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from costmodel.errors import CostModelError
from costmodel.links import LinkModel


@dataclass(frozen=True)
class MeshTopology:
    """Where each mesh axis's groups live: within a node or across nodes."""

    shape: tuple[int, ...]
    """Mesh shape (ranks per axis)."""
    devices_per_node: int
    """Consecutive ranks that share a node."""

    def __post_init__(self):
        if not self.shape or any(s < 1 for s in self.shape):
            raise CostModelError(f"mesh shape must be non-empty with sizes >= 1, found {self.shape}")

    def axis_stride(self, axis: int) -> int:
        return math.prod(self.shape[axis + 1:])

    def group_is_intra_node(self, axes: tuple[int, ...]) -> bool:
        """A group over ``axes`` (row-major ranks) stays in one node when its rank span does."""
        span = 1 + sum((self.shape[a] - 1) * self.axis_stride(a) for a in axes)
        return span <= self.devices_per_node and self.devices_per_node % max(1, self.axis_stride(min(axes))) == 0


def collective_time_us(kind: str, nbytes, group_size, link: LinkModel) -> np.ndarray:
    """Vectorized time of ``kind`` moving ``nbytes`` (full buffer) over ``group_size`` ranks."""
    return link.time_us(kind, nbytes, group_size)
