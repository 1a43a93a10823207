"""The mesh search's candidate shapes (:func:`mesh_shapes`) and the order they are bounded in
(:func:`search_order`, :func:`next_to_bound`, :func:`may_start`)."""

from __future__ import annotations

from autoshard.errors import ConfigError
from costmodel import MeshTopology

Shape = tuple[int, ...]


def mesh_shapes(ranks: int, devices_per_node: int, max_axes: int = 3) -> list[Shape]:
    """The candidate shapes, fewest axes first: 1-D, then every factorization into 2..max_axes
    axes of size >= 2 whose innermost axis lies within a node, one per class of shapes that
    differ only in the order of their inter-node axes."""
    if ranks < 1:
        raise ConfigError(f"ranks: expected >= 1, found {ranks}")
    if not 1 <= max_axes <= 4:
        raise ConfigError(f"max_axes: expected 1 to 4, found {max_axes}")

    def factorizations(n: int, k: int):
        if k == 1:
            if n >= 2:
                yield (n,)
            return
        for d in range(2, n + 1):
            if n % d == 0:
                for rest in factorizations(n // d, k - 1):
                    yield (d, *rest)

    out, seen = [(ranks,)], {(ranks,)}
    for k in range(2, max_axes + 1):
        for shape in factorizations(ranks, k):
            topo = MeshTopology(shape, devices_per_node)
            intra = [topo.group_is_intra_node((a,)) for a in range(k)]
            if not intra[-1]:
                continue
            inter = tuple(sorted((s for s, i in zip(shape, intra) if not i), reverse=True))
            key = (inter, tuple(s if i else 0 for s, i in zip(shape, intra)))
            if key in seen:
                continue
            seen.add(key)
            out.append(shape)
    return out


def axis_names(k: int) -> tuple[str, ...]:
    return tuple(f"axis{a}" for a in range(k))


def search_order(shapes: list[Shape], devices_per_node: int) -> list[Shape]:
    """The shapes in the order they are listed, and bounded among equals (:func:`next_to_bound`):
    likeliest first where time runs out: the 1-D mesh
    (cheap to build), then shapes whose innermost axis is a whole node (tensor parallelism on
    the fast links), then the rest; fewer axes first within each."""
    return sorted(shapes, key=lambda s: (len(s) > 1, s[-1] != devices_per_node, len(s), s))


def coarsenings(shape: Shape) -> list[Shape]:
    """The shapes of one axis fewer that ``shape`` refines: two adjacent axes merged into one."""
    return [shape[:a] + (shape[a] * shape[a + 1],) + shape[a + 2:] for a in range(len(shape) - 1)]


def next_to_bound(todo: list[Shape], bounds: dict[Shape, float]) -> Shape:
    """The shape to bound next: fewest axes first; among shapes of as many axes, those refining
    the coarser shape of lowest bound first (a mesh with an axis split in two can lay out every
    plan of the coarser one, a dim split by both halves for one split by the whole, so the best
    coarse shapes' refinements are the likeliest to be best), then in ``todo``'s order."""
    fewest = min(len(s) for s in todo)

    def key(item):
        order, shape = item
        coarse = [bounds[c] for c in coarsenings(shape) if c in bounds]
        return (min(coarse, default=float("inf")), order)

    return min(((i, s) for i, s in enumerate(todo) if len(s) == fewest), key=key)[1]


def may_start(todo: list[Shape], running, bounds: dict[Shape, float]) -> bool:
    """Whether the next shape to bound (of the fewest axes in ``todo``, :func:`next_to_bound`) may
    start while shapes of fewer axes are ``running``: where their bounds could not change which
    one is next (every candidate refines the same coarser shapes: all 2-D shapes refine the one
    1-D shape), or once a shape of one axis fewer is bounded (the order is then informed, and a
    worker does not idle while the last coarse shape finishes)."""
    k = min(map(len, todo))
    if not any(len(r) < k for r in running):
        return True
    candidates = {tuple(sorted(coarsenings(s))) for s in todo if len(s) == k}
    return len(candidates) == 1 or any(len(s) == k - 1 for s in bounds)
