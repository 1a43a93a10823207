r"""Redistribute states and plans as data.

A state is ``(codes, orders)``: ``codes[axis]`` is ``R`` (-1), a partial code (``PARTIAL``)
or the tensor dim the axis shards; ``orders[d]`` the axes splitting dim ``d``, in split
order. :func:`encode` / :func:`decode` turn specs into states and back (memoized: plans,
keys and steps meet the same few thousand states again and again). A plan is a list of
:class:`Step`\ s between two specs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from costmodel.errors import CostModelError
from costmodel.spec import Spec, shard_dim

R = -1
PARTIAL = {"P(sum)": -2, "P(avg)": -3, "P(max)": -4, "P(min)": -5}
PARTIAL_NAME = {v: k for k, v in PARTIAL.items()}
COMPATIBLE_PARTIALS = {frozenset(), frozenset({-2}), frozenset({-3}), frozenset({-4}), frozenset({-5}),
                        frozenset({-2, -3})}





class RedistributeError(CostModelError):
    """A spec that does not fit the mesh or tensor, or a target no path reaches."""


@dataclass(frozen=True)
class Step:
    """One collective (or local op) of a redistribute plan."""

    kind: str
    """``all_gather``, ``all_to_all``, ``all_reduce``, ``reduce_scatter``, ``chunk`` or ``partition``."""
    axes: tuple[int, ...]
    """Mesh axes of the group, ascending; several for a merged (flattened-group) step."""
    nbytes: int
    """Bytes of the collective's full buffer, nccl-tests convention."""
    us: float
    """Predicted time, microseconds: the collective's and :attr:`copy_us`."""
    src: Spec
    """Spec before the step."""
    dst: Spec
    """Spec after the step."""
    copy_us: float = 0.0
    """Of :attr:`us`, the local copy DTensor makes around the collective on the compute stream
    (:meth:`costmodel.redistribute.RedistributePlanner.copied_bytes`)."""

    @property
    def axis(self) -> int:
        return self.axes[0]


@dataclass
class RedistributePlan:
    src: Spec
    dst: Spec
    steps: list[Step] = field(default_factory=list)

    @property
    def us(self) -> float:
        return float(sum(s.us for s in self.steps))

    def describe(self, axis_names=None) -> str:
        name = (lambda a: axis_names[a]) if axis_names else str
        parts = [f"{s.kind}({','.join(name(a) for a in s.axes)}) {s.us:.1f}us" for s in self.steps]
        return f"{self.src} -> {self.dst}: " + (" ; ".join(parts) if parts else "no-op") + f" = {self.us:.1f}us"


@lru_cache(maxsize=1 << 16)
def encode(spec: Spec, ndim: int, mesh_ndim: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    if len(spec.placements) != mesh_ndim:
        raise RedistributeError(
            f"spec {spec} has {len(spec.placements)} placements, the mesh has {mesh_ndim} axes"
        )
    codes = []
    for p in spec.placements:
        if p == "R":
            codes.append(R)
        elif p in PARTIAL:
            codes.append(PARTIAL[p])
        else:
            d = shard_dim(p)
            if not 0 <= d < ndim:
                raise RedistributeError(f"spec {spec} shards tensor dim {d}, the tensor has {ndim} dims")
            codes.append(d)
    kinds = frozenset(c for c in codes if c < R)
    if kinds not in COMPATIBLE_PARTIALS:
        raise RedistributeError(f"spec {spec} mixes partial kinds {sorted(PARTIAL_NAME[k] for k in kinds)}")
    given = dict(spec.shard_order)
    orders = []
    for d in range(ndim):
        on = tuple(a for a, c in enumerate(codes) if c == d)
        orders.append(tuple(given[d]) if d in given else on)
    return tuple(codes), tuple(orders)


@lru_cache(maxsize=1 << 16)
def decode(codes, orders) -> Spec:
    placements = tuple("R" if c == R else PARTIAL_NAME[c] if c < R else f"S({c})" for c in codes)
    order = tuple((d, o) for d, o in enumerate(orders) if len(o) > 1 and list(o) != sorted(o))
    return Spec(placements, order)



def partials_of(*codes_lists) -> tuple[int, ...]:
    """The partial codes held anywhere in these states, sorted (deterministic neighbour order)."""
    return tuple(sorted({c for codes in codes_lists for c in codes if c < R}))
