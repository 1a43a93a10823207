"""Specs as plain data: one placement per mesh axis plus the shard order.

Text form, one token per mesh axis: ``S(0)`` shard tensor dim 0, ``R`` replicate,
``P(sum)`` / ``P(avg)`` partial. A tensor dim sharded on several axes carries its
order after the token of its first axis in that order: ``S(0)[1,0]S(0)`` means
tensor dim 0 is split first by axis 1, then by axis 0. Default order (ascending
axes) is not written.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from costmodel.errors import CostModelError

_TOKEN = re.compile(r"S\((\d+)\)(\[[\d,\s]+\])?|R|P\((sum|avg|max|min)\)")


def shard_dim(placement: str) -> int | None:
    """``"S(1)"`` -> 1; None for ``"R"`` and ``"P(op)"``. The one place placement text is read."""
    return int(placement[2:-1]) if placement.startswith("S(") else None


def partial_op(placement: str) -> str | None:
    """``"P(sum)"`` -> ``"sum"``; None for ``"R"`` and ``"S(d)"``."""
    return placement[2:-1] if placement.startswith("P(") else None


@dataclass(frozen=True)
class Spec:
    """Placements per mesh axis and, per multiply-sharded tensor dim, its axis order."""

    placements: tuple[str, ...]
    """Per mesh axis: ``"R"``, ``"S(d)"`` or ``"P(op)"``."""
    shard_order: tuple[tuple[int, tuple[int, ...]], ...] = ()
    """``(tensor dim, axes in split order)`` for dims sharded on >= 2 axes in non-ascending order."""

    def __post_init__(self):
        for p in self.placements:
            if not (p == "R" or re.fullmatch(r"S\(\d+\)|P\((sum|avg|max|min)\)", p)):
                raise CostModelError(f"placement {p!r}: expected 'R', 'S(d)' or 'P(sum|avg|max|min)'")
        for dim, axes in self.shard_order:
            on = sorted(a for a, p in enumerate(self.placements) if p == f"S({dim})")
            if sorted(axes) != on:
                raise CostModelError(
                    f"shard order {list(axes)} for tensor dim {dim} must list exactly the axes that shard it {on}"
                )
        # Canonical form: ascending (default) orders are implied, so equal specs compare equal.
        canon = tuple(sorted((int(d), tuple(a)) for d, a in self.shard_order if list(a) != sorted(a)))
        if canon != self.shard_order:
            object.__setattr__(self, "shard_order", canon)

    @staticmethod
    def parse(text: str) -> "Spec":
        pos, placements, order = 0, [], []
        text = text.replace(" ", "")
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m:
                raise CostModelError(f"spec {text!r}: cannot parse at {text[pos:]!r}; expected R, S(d)[axes] or P(op)")
            tok = m.group(0)
            if m.group(1) is not None:
                placements.append(f"S({m.group(1)})")
                if m.group(2):
                    order.append((int(m.group(1)), tuple(int(a) for a in m.group(2)[1:-1].split(","))))
            else:
                placements.append(tok)
            pos = m.end()
        return Spec(tuple(placements), tuple(order))

    def __str__(self) -> str:
        order = dict(self.shard_order)
        out, seen = [], set()
        for p in self.placements:
            out.append(p)
            d = shard_dim(p)
            if d is not None and p not in seen:
                seen.add(p)
                if d in order:
                    out.append("[" + ",".join(map(str, order[d])) + "]")
        return "".join(out)

    def shard_dims(self) -> list[int | None]:
        """Per mesh axis, the tensor dim it shards (None when not sharding)."""
        return [shard_dim(p) for p in self.placements]

    def partial_axes(self) -> list[int]:
        """Mesh axes on which the tensor is a partial (sum, avg, ...)."""
        return [a for a, p in enumerate(self.placements) if partial_op(p) is not None]

    def is_replicated(self) -> bool:
        return all(p == "R" for p in self.placements)

    def local_shape(self, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Largest local shard shape (uneven shards round up, as DTensor's first ranks hold)."""
        out = list(shape)
        for axis, d in enumerate(self.shard_dims()):
            if d is not None:
                out[d] = -(-out[d] // mesh_shape[axis])
        return tuple(out)


def on_mesh(spec: Spec, mesh_shape) -> Spec:
    """``spec`` as it lays a tensor out on a mesh of ``mesh_shape``: an axis of one rank splits
    nothing, so its placement reads as replicated (two specs that differ only there hold the
    same local tensor, and moving between them moves nothing)."""
    if all(n > 1 for n in mesh_shape):
        return spec
    keep = [a for a, n in enumerate(mesh_shape) if n > 1]
    return Spec(tuple(p if mesh_shape[a] > 1 else "R" for a, p in enumerate(spec.placements)),
                tuple((d, tuple(a for a in axes if a in keep)) for d, axes in spec.shard_order
                      if sum(a in keep for a in axes) > 1))


def local_bytes(spec: Spec, t, mesh_shape) -> int:
    """Bytes of the local shard ``spec`` gives tensor ``t`` on a mesh of ``mesh_shape`` (DTensor's
    split: the first ranks' pieces, the same figure on every rank)."""
    return math.prod(spec.local_shape(tuple(t.shape), tuple(mesh_shape))) * t.element_size()
