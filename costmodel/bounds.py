"""The redistribute search's lower bounds and the cost model's memoized answers per mesh.

:class:`MeshCosts` holds, per mesh and profile, collective times by (kind, bytes, group),
local sizes and the bound tables; :class:`CoverBound` prices a set of axes that must still
take part in a collective by the cheapest collectives whose groups cover them (dynamic
programming over axis subsets); :class:`Bound` is the A* heuristic for one target state.
See :mod:`costmodel.redistribute` for the search that uses them.
"""

from __future__ import annotations

import math
from functools import lru_cache

from costmodel.collectives import MeshTopology
from costmodel.profile import Profile
from costmodel.states import PARTIAL, R

COLLECTIVE_KINDS = ("all_gather", "all_to_all", "all_reduce", "reduce_scatter")


def agreed(order: tuple, goal_order: tuple) -> int:
    """How many leading axes of a dim's order already sit where the target's order has them."""
    k = 0
    while k < len(order) and k < len(goal_order) and order[k] == goal_order[k]:
        k += 1
    return k


@lru_cache(maxsize=4096)
def code_row(a: int, t: int, ndim: int, n: int) -> tuple[int, ...]:
    """Axis a's key bits per code it may hold, when the target holds t there (see Bound)."""
    row = [0] * (ndim + len(PARTIAL) + 1)
    for c in range(-len(PARTIAL) - 1, ndim):
        if c != R and c != t:
            row[c] = 1 << (a + n) | ((1 << a) if (c < R or t < 0) else 0)
    return tuple(row)


class Bound:
    """The search's heuristic for one goal (see :meth:`RedistributePlanner._heuristic`):
    ``by_code[a][c]`` holds axis a's bits of the key ``U << n | H`` when it holds code c
    (codes run from -len(PARTIAL) - 1 to ndim - 1; a negative one indexes from the
    row's end), ``order_bits(d, o)`` dim d's bits for order o; ``cover`` prices keys."""

    def __init__(self, goal, cover: "CoverBound", n: int, enabled: bool = True):
        gcodes, self.gorders = goal
        self.cover, self.n, self.enabled = cover, n, enabled
        ndim = len(self.gorders)
        zero = (0,) * (ndim + len(PARTIAL) + 1)
        self.by_code = [code_row(a, t, ndim, n) if enabled else zero for a, t in enumerate(gcodes)]
        # Order bits depend only on the target's order of the dim: tables shared by every
        # search on the mesh (a new target meets the same few orders again).
        shared = cover.costs.order_bits
        self.by_order = [shared.setdefault(go, {}) if enabled else {} for go in self.gorders]

    def order_bits(self, d: int, o: tuple) -> int:
        bits = self.by_order[d].get(o)
        if bits is None:
            k = agreed(o, self.gorders[d])
            bits = 0
            if self.enabled:
                for a in o[k:]:
                    bits |= 1 << (a + self.n)
            self.by_order[d][o] = bits
        return bits

    def parts(self, codes, orders) -> tuple[int, list[int]]:
        """The codes' half of the key, and each dim's order bits (the search swaps them per step)."""
        key_codes = 0
        for a, c in enumerate(codes):
            key_codes |= self.by_code[a][c]
        return key_codes, [self.order_bits(d, o) for d, o in enumerate(orders)]

    def price(self, key: int) -> float:
        v = self.cover.get(key)
        return v if v is not None else self.cover.compute(key >> self.n, key & ((1 << self.n) - 1))

    def __call__(self, codes, orders) -> float:
        key_codes, obits = self.parts(codes, orders)
        for bits in obits:
            key_codes |= bits
        return self.price(key_codes)


class CoverBound(dict):
    """The table behind :meth:`RedistributePlanner._cover_bounds` for one buffer size, filled on
    demand: a search meets a few dozen (U, H) pairs, far fewer than the 3^n there are."""

    def __init__(self, costs: "MeshCosts", m: int):
        super().__init__()
        self.costs, self.m, self.n = costs, m, len(costs.shape)
        self.light: dict[int, float] = {}
        self.heavy: dict[int, float] = {}
        self[0] = 0.0

    def _sup(self, table, part, heavy) -> float:
        """min over groups G containing ``part`` of the (heavy) collective bound on G."""
        hit = table.get(part)
        if hit is not None:
            return hit
        time = self.costs.time
        axes = tuple(a for a in range(self.n) if part >> a & 1)
        size = math.prod(self.costs.shape[a] for a in axes)
        best = min(time(k, self.m * size, axes) for k in COLLECTIVE_KINDS if k != "all_to_all")
        if not heavy and len(axes) == 1:
            # all_to_all is the one light collective, and it runs on one axis only.
            best = min(best, time("all_to_all", self.m, axes))
        for a in range(self.n):
            if not part >> a & 1:
                best = min(best, self._sup(table, part | 1 << a, heavy))
        table[part] = best
        return best

    def compute(self, u: int, hv: int) -> float:
        key = u << self.n | hv
        hit = self.get(key)
        if hit is not None:
            return hit
        low = u & -u
        rest = u ^ low
        best = math.inf
        s = rest
        while True:  # every part that holds U's lowest axis
            part = s | low
            price = self._sup(self.heavy, part, True) if part & hv else self._sup(self.light, part, False)
            if price < best:
                best = min(best, price + self.compute(u ^ part, hv & ~part))
            if s == 0:
                break
            s = (s - 1) & rest
        self[key] = best
        return best


class MeshCosts:
    """The cost model's answers on one mesh and profile, memoized as planners ask: collective
    times by (kind, bytes, group), local sizes, and the heuristic's bound tables by buffer size. Pure
    functions of (mesh, profile, bytes), so every planner on the mesh shares them; what a
    new planner starts without is its path cache."""

    def __init__(self, topo: MeshTopology, profile: Profile):
        self.topo, self.profile, self.shape = topo, profile, topo.shape
        self._pred: dict = {}
        self._times: dict = {}
        self.elems: dict = {}
        """Local elements per (orders, tensor shape)."""
        self._cover: dict = {}
        self.order_bits: dict = {}
        """Per target order of a dim: that dim's heuristic key bits per order (see Bound)."""

    def time(self, kind, nbytes, axes) -> float:
        # Hot path: a search asks for the same few (kind, bytes, group) thousands of times.
        key = (kind, nbytes, axes)
        us = self._times.get(key)
        if us is None:
            fn = self._pred.get((kind, axes))
            if fn is None:
                group = math.prod(self.shape[a] for a in axes)
                fn = self._pred[(kind, axes)] = self.profile.collective_predictor(
                    kind, group, self.topo.group_is_intra_node(axes))
            us = self._times[key] = fn(nbytes)
        return us

    def cover(self, m: int) -> "CoverBound":
        hit = self._cover.get(m)
        if hit is None:
            hit = self._cover[m] = CoverBound(self, m)
        return hit




@lru_cache(maxsize=64)
def mesh_costs(topo: MeshTopology, profile: Profile) -> MeshCosts:
    """The shared :class:`MeshCosts` of a mesh and profile."""
    return MeshCosts(topo, profile)
