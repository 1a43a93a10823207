"""The redistribute planner: the cheapest sequence of collectives between two specs.

A state is a spec: per mesh axis ``R``, ``P(op)`` or sharding, plus for every
tensor dim the mesh axes that split it, in split order (the shard order).
Transitions, as in DTensor's own planner, each a single collective on one axis:

==================  =======================================================  ==============
step                what changes                                             collective
==================  =======================================================  ==============
gather              drop the last axis x of dim d's order; x becomes R       all_gather
all_to_all          move the last axis x of d's order to the end of e's      all_to_all
reduce              P(op) on x becomes R                                     all_reduce
reduce_scatter      P(op) on x becomes S(d), x appended to d's order         reduce_scatter
chunk               R on x becomes S(d), x appended to d's order             none (local)
partition           R on x becomes P(op), for an op the target holds         none (local)
==================  =======================================================  ==============

plus merged transitions, one collective over a flattened group of axes
(ascending axis order, as DeviceMesh flattens): the last k axes of a dim's order
gathered at once, several partial axes reduced at once, or reduce-scattered onto
one dim at once. Shard merges need even shards (nested uneven shards are not a
flat uneven shard).

Each step is costed by the collective model with the bytes it moves (the local
buffer, the shard sizes of the other axes taken into account, uneven shards
rounded up) on the group it uses. Search is A* over canonical integer states
with an admissible heuristic (zero when the target is reachable by local steps
alone, else the cheapest latency of any collective), and results are cached
by (src, dst, shape, itemsize).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import combinations


from costmodel.collectives import MeshTopology
from costmodel.profile import Profile
from costmodel.spec import Spec

R = -1
_PARTIAL = {"P(sum)": -2, "P(avg)": -3, "P(max)": -4, "P(min)": -5}
_PARTIAL_NAME = {v: k for k, v in _PARTIAL.items()}
_COMPATIBLE_PARTIALS = {frozenset(), frozenset({-2}), frozenset({-3}), frozenset({-4}), frozenset({-5}),
                        frozenset({-2, -3})}


class RedistributeError(ValueError):
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
    """Predicted time, microseconds."""
    src: Spec
    """Spec before the step."""
    dst: Spec
    """Spec after the step."""

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


# ---- canonical states ------------------------------------------------------
# A state is (codes, orders): codes[axis] is R, a partial code, or the tensor
# dim it shards; orders[d] is the tuple of axes splitting dim d, in order.


def encode(spec: Spec, ndim: int, mesh_ndim: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]:
    if len(spec.placements) != mesh_ndim:
        raise RedistributeError(
            f"spec {spec} has {len(spec.placements)} placements, the mesh has {mesh_ndim} axes"
        )
    codes = []
    for p in spec.placements:
        if p == "R":
            codes.append(R)
        elif p in _PARTIAL:
            codes.append(_PARTIAL[p])
        else:
            d = int(p[2:-1])
            if not 0 <= d < ndim:
                raise RedistributeError(f"spec {spec} shards tensor dim {d}, the tensor has {ndim} dims")
            codes.append(d)
    given = dict(spec.shard_order)
    orders = []
    for d in range(ndim):
        on = tuple(a for a, c in enumerate(codes) if c == d)
        orders.append(tuple(given[d]) if d in given else on)
    return tuple(codes), tuple(orders)


def decode(codes, orders) -> Spec:
    placements = tuple("R" if c == R else _PARTIAL_NAME[c] if c < R else f"S({c})" for c in codes)
    order = tuple((d, o) for d, o in enumerate(orders) if len(o) > 1 and list(o) != sorted(o))
    return Spec(placements, order)


class RedistributePlanner:
    """Plans redistributes for one mesh and profile; caches every answer."""

    def __init__(self, topo: MeshTopology, profile: Profile, merge: bool = True, use_heuristic: bool = True):
        self.topo, self.profile = topo, profile
        self.merge, self.use_heuristic = merge, use_heuristic
        self.shape = topo.shape
        self.n = len(topo.shape)
        self._pred: dict = {}
        fits = profile.collectives
        self._min_latency = min([profile.intra_node.latency_us, profile.inter_node.latency_us]
                                + [f.alpha_us for f in fits])
        self._max_busbw = max([profile.intra_node.busbw_gbps, profile.inter_node.busbw_gbps]
                              + [f.busbw_gbps for f in fits if math.isfinite(f.busbw_gbps)])
        self.cache: dict = {}
        self.cost_cache: dict = {}
        self.stats = {"searches": 0, "expanded": 0, "hits": 0}

    def _time(self, kind, nbytes, axes) -> float:
        # Hot path: one memoized bytes -> us predictor per (kind, group).
        fn = self._pred.get((kind, axes))
        if fn is None:
            group = math.prod(self.shape[a] for a in axes)
            fn = self._pred[(kind, axes)] = self.profile.collective_predictor(
                kind, group, self.topo.group_is_intra_node(axes))
        return fn(nbytes)

    # -- sizes ------------------------------------------------------------
    def _local_elems(self, orders, tshape) -> int:
        n = 1
        for d, size in enumerate(tshape):
            for a in orders[d]:
                size = -(-size // self.shape[a])
            n *= size
        return n

    def _even(self, d, axes_in_order, tshape, orders) -> bool:
        """Dim d splits evenly through its current order and then ``axes_in_order``."""
        size = tshape[d]
        for a in orders[d] + tuple(axes_in_order):
            if size % self.shape[a]:
                return False
            size //= self.shape[a]
        return True

    # -- transitions ------------------------------------------------------
    def _neighbors(self, codes, orders, tshape, item, partition_ok):
        """Every single step from (codes, orders); ``partition_ok`` holds the (axis, partial code)
        pairs a target holds: a partial anywhere else would only cost a reduction later."""
        local = self._local_elems(orders, tshape) * item
        out = []
        ndim = len(orders)
        dims_on = [range(ndim)] * self.n
        for d in range(ndim):
            od = orders[d]
            if not od:
                continue
            x = od[-1]
            # gather the last axis of d's order
            new_orders = orders[:d] + (od[:-1],) + orders[d + 1:]
            c2 = list(codes)
            c2[x] = R
            gathered = self._local_elems(new_orders, tshape) * item
            out.append(("all_gather", (x,), gathered, tuple(c2), new_orders))
            # merged gather of the last k axes (ascending, even shards)
            if self.merge:
                for k in range(2, len(od) + 1):
                    tail = od[-k:]
                    if list(tail) != sorted(tail) or not self._even_tail(d, od, tshape):
                        continue
                    no = orders[:d] + (od[:-k],) + orders[d + 1:]
                    c3 = list(codes)
                    for a in tail:
                        c3[a] = R
                    out.append(("all_gather", tuple(sorted(tail)), self._local_elems(no, tshape) * item,
                                tuple(c3), no))
            # all_to_all: move the last axis of d to the end of e
            for e in dims_on[x]:
                if e == d:
                    continue
                no = list(orders)
                no[d] = od[:-1]
                no[e] = orders[e] + (x,)
                c4 = list(codes)
                c4[x] = e
                out.append(("all_to_all", (x,), local, tuple(c4), tuple(no)))
        partial_axes = [a for a, c in enumerate(codes) if c < R]
        for x in partial_axes:
            c2 = list(codes)
            c2[x] = R
            out.append(("all_reduce", (x,), local, tuple(c2), orders))
            for d in dims_on[x]:
                no = list(orders)
                no[d] = orders[d] + (x,)
                c3 = list(codes)
                c3[x] = d
                out.append(("reduce_scatter", (x,), local, tuple(c3), tuple(no)))
        if self.merge and len(partial_axes) > 1:
            for k in range(2, len(partial_axes) + 1):
                for group in combinations(partial_axes, k):
                    if len({codes[a] for a in group}) > 1:
                        continue  # one reduce op per merged collective
                    c2 = list(codes)
                    for a in group:
                        c2[a] = R
                    out.append(("all_reduce", group, local, tuple(c2), orders))
                    for d in sorted({e for a in group for e in dims_on[a]}):
                        if not self._even(d, group, tshape, orders):
                            continue
                        no = list(orders)
                        no[d] = orders[d] + group
                        c3 = list(codes)
                        for a in group:
                            c3[a] = d
                        out.append(("reduce_scatter", group, local, tuple(c3), tuple(no)))
        for x, c in enumerate(codes):
            if c != R:
                continue
            for d in dims_on[x]:
                no = list(orders)
                no[d] = orders[d] + (x,)
                c2 = list(codes)
                c2[x] = d
                out.append(("chunk", (x,), 0, tuple(c2), tuple(no)))
            for xx, p in partition_ok:
                if xx != x:
                    continue
                kinds = {cc for cc in codes if cc < R} | {p}
                if frozenset(kinds) not in _COMPATIBLE_PARTIALS:
                    continue
                c2 = list(codes)
                c2[x] = p
                out.append(("partition", (x,), 0, tuple(c2), orders))
        return out

    def _even_tail(self, d, od, tshape) -> bool:
        """Dim d splits evenly through all of its order ``od``."""
        size = tshape[d]
        for a in od:
            if size % self.shape[a]:
                return False
            size //= self.shape[a]
        return True

    @staticmethod
    def _free_reachable(codes, orders, dst_codes, dst_orders) -> bool:
        for a, (c, t) in enumerate(zip(codes, dst_codes)):
            if c != t and c != R:
                return False
        return all(dst_o[: len(o)] == o for o, dst_o in zip(orders, dst_orders))

    def transition_cost(self, src: Spec, dst: Spec, tshape: tuple[int, ...], itemsize: int) -> float:
        """Cost of the single step ``src -> dst`` (one axis changes), as this model prices it.

        Used to price another planner's path step by step.
        """
        ndim = len(tshape)
        s0, goal = encode(src, ndim, self.n), encode(dst, ndim, self.n)
        if s0 == goal:
            return 0.0
        for kind, axes, nbytes, c2, o2 in self._neighbors(*s0, tuple(tshape), itemsize, _partition_ok(goal[0])):
            if (c2, o2) == goal and len(axes) == 1:
                return 0.0 if kind in ("chunk", "partition") else self._time(kind, nbytes, axes)
        raise RedistributeError(f"{src} -> {dst} is not a single step")

    # -- search -----------------------------------------------------------
    def plan(self, src: Spec, dst: Spec, tshape: tuple[int, ...], itemsize: int) -> RedistributePlan:
        key = (src, dst, tuple(tshape), itemsize)
        hit = self.cache.get(key)
        if hit is not None:
            self.stats["hits"] += 1
            return hit
        result = self._search(src, dst, tuple(tshape), itemsize)
        self.cache[key] = result
        self.cost_cache.setdefault(key, result.us)
        return result

    def _search(self, src, dst, tshape, item) -> RedistributePlan:
        ndim = len(tshape)
        s0 = encode(src, ndim, self.n)
        goal = encode(dst, ndim, self.n)
        for spec, (codes, orders) in ((src, s0), (dst, goal)):
            kinds = frozenset(c for c in codes if c < R)
            if kinds not in _COMPATIBLE_PARTIALS:
                raise RedistributeError(f"spec {spec} mixes partial kinds {sorted(_PARTIAL_NAME[k] for k in kinds)}")
        self.stats["searches"] += 1
        if s0 == goal:
            return RedistributePlan(src, dst, [])
        partition_ok = _partition_ok(goal[0])
        axis_lb = self._axis_lower_bounds(tshape, item)
        h0 = self._h(s0, goal, axis_lb)
        frontier = [(h0, 0.0, 0, s0)]
        best = {s0: 0.0}
        parent = {s0: None}
        tie = 0
        while frontier:
            f, g, _, state = heapq.heappop(frontier)
            if g > best.get(state, math.inf):
                continue
            if state == goal:
                return RedistributePlan(src, dst, self._unwind(parent, state))
            if self._free_reachable(state[0], state[1], goal[0], goal[1]):
                # Popped with the least f and only local steps left: nothing can beat finishing here.
                return RedistributePlan(src, dst, self._unwind(parent, state) + self._complete(state, goal))
            self.stats["expanded"] += 1
            codes, orders = state
            for kind, axes, nbytes, c2, o2 in self._neighbors(codes, orders, tshape, item, partition_ok):
                nxt = (c2, o2)
                us = 0.0 if kind in ("chunk", "partition") else self._time(kind, nbytes, axes)
                # Local steps still cost a hair, so a plan never takes pointless detours.
                ng = g + us + (1e-6 if us == 0 else 0)
                if ng < best.get(nxt, math.inf) - 1e-12:
                    best[nxt] = ng
                    parent[nxt] = (state, kind, axes, nbytes, us)
                    tie += 1
                    heapq.heappush(frontier, (ng + self._h(nxt, goal, axis_lb), ng, tie, nxt))
        raise RedistributeError(f"no sequence of collectives turns {src} into {dst}")

    def costs(self, src: Spec, dsts: list[Spec], tshape: tuple[int, ...], itemsize: int) -> list[float]:
        """``plan(src, d).us`` for every d in ``dsts``, from one search.

        Dijkstra from ``src`` over the whole state space (no goal, no heuristic)
        settles every target at once: a producer spec has as many targets as its
        consumers have candidate specs, and one search over the few hundred
        states of a 2-D or 3-D mesh is far cheaper than one A* per target.
        Answers agree with :meth:`plan` (both are exact) and are cached.
        """
        tshape = tuple(tshape)
        out = [self.cost_cache.get((src, d, tshape, itemsize)) for d in dsts]
        todo = [d for d, c in zip(dsts, out) if c is None]
        if not todo:
            return out
        if len(set(todo)) < 3:
            return [c if c is not None else self.plan(src, d, tshape, itemsize).us for d, c in zip(dsts, out)]
        ndim = len(tshape)
        s0 = encode(src, ndim, self.n)
        goals = {}
        for d in dict.fromkeys(todo):
            g = encode(d, ndim, self.n)
            if frozenset(c for c in g[0] if c < R) not in _COMPATIBLE_PARTIALS:
                raise RedistributeError(f"spec {d} mixes partial kinds")
            goals.setdefault(g, []).append(d)
        if frozenset(c for c in s0[0] if c < R) not in _COMPATIBLE_PARTIALS:
            raise RedistributeError(f"spec {src} mixes partial kinds")
        partition_ok = frozenset(pair for g in goals for pair in _partition_ok(g[0]))
        self.stats["searches"] += 1
        true = {s0: 0.0}
        best = {s0: 0.0}
        frontier = [(0.0, 0, s0)]
        tie, left = 0, len(goals)
        done = set()
        while frontier and left:
            g, _, state = heapq.heappop(frontier)
            if state in done:
                continue
            done.add(state)
            if state in goals:
                left -= 1
            codes, orders = state
            for kind, axes, nbytes, c2, o2 in self._neighbors(codes, orders, tshape, itemsize, partition_ok):
                nxt = (c2, o2)
                us = 0.0 if kind in ("chunk", "partition") else self._time(kind, nbytes, axes)
                ng = g + us + (1e-6 if us == 0 else 0)
                if ng < best.get(nxt, math.inf) - 1e-12:
                    best[nxt] = ng
                    true[nxt] = true[state] + us
                    tie += 1
                    heapq.heappush(frontier, (ng, tie, nxt))
        for g, ds in goals.items():
            if g not in done:
                raise RedistributeError(f"no sequence of collectives turns {src} into {ds[0]}")
            for d in ds:
                self.cost_cache[(src, d, tshape, itemsize)] = true[g]
        return [self.cost_cache[(src, d, tshape, itemsize)] for d in dsts]

    @staticmethod
    def _complete(state, goal) -> list[Step]:
        """The local steps (chunks in the target's shard order, partitions) from ``state`` to ``goal``."""
        codes, orders = list(state[0]), list(state[1])
        steps = []
        for d, dst_order in enumerate(goal[1]):
            for x in dst_order[len(orders[d]):]:
                prev = (tuple(codes), tuple(orders))
                codes[x] = d
                orders[d] = orders[d] + (x,)
                steps.append(Step("chunk", (x,), 0, 0.0, decode(*prev), decode(tuple(codes), tuple(orders))))
        for x, t in enumerate(goal[0]):
            if t < R and codes[x] != t:
                prev = (tuple(codes), tuple(orders))
                codes[x] = t
                steps.append(Step("partition", (x,), 0, 0.0, decode(*prev), decode(tuple(codes), tuple(orders))))
        return steps

    def _h(self, state, goal, axis_lb) -> float:
        """Admissible: the dearest axis that some collective must still touch.

        Axis a must take part in a collective when it holds a shard or partial the
        target does not (or a shard out of the target's order). Any collective on a
        group with a moves at least the fully sharded buffer at the best bus
        bandwidth: ``axis_lb[a]``. One merged collective may serve several such
        axes, so the bound is their maximum, not their sum.
        """
        if not self.use_heuristic:
            return 0.0
        codes, orders = state
        gcodes, gorders = goal
        h = 0.0
        for a, c in enumerate(codes):
            if c != R and c != gcodes[a]:
                h = max(h, axis_lb[a])
        for o, go in zip(orders, gorders):
            k = 0
            while k < len(o) and k < len(go) and o[k] == go[k]:
                k += 1
            for a in o[k:]:
                h = max(h, axis_lb[a])
        return h

    def _axis_lower_bounds(self, tshape, item) -> list[float]:
        m_min = max(1, math.prod(tshape) // math.prod(self.shape)) * item
        bw = self._max_busbw * 1e3
        return [self._min_latency + m_min * (n - 1) / n / bw for n in self.shape]

    @staticmethod
    def _unwind(parent, state) -> list[Step]:
        steps = []
        while parent[state] is not None:
            prev, kind, axes, nbytes, us = parent[state]
            steps.append(Step(kind, tuple(axes), int(nbytes), us, decode(*prev), decode(*state)))
            state = prev
        return steps[::-1]


def _partition_ok(goal_codes) -> frozenset:
    return frozenset((x, c) for x, c in enumerate(goal_codes) if c < R)


def local_plan(src: Spec, dst: Spec, ndim: int) -> RedistributePlan:
    """``src -> dst`` by local steps only (chunks in ``dst``'s shard order, partitions), as the
    planner ends its own plans; raises when a collective is needed."""
    n = len(src.placements)
    s0, goal = encode(src, ndim, n), encode(dst, ndim, n)
    if not RedistributePlanner._free_reachable(*s0, *goal):
        raise RedistributeError(f"{src} -> {dst} needs a collective: it is not local")
    return RedistributePlan(src, dst, RedistributePlanner._complete(s0, goal))


@lru_cache(maxsize=64)
def _planner(topo: MeshTopology, profile: Profile) -> RedistributePlanner:
    return RedistributePlanner(topo, profile)


def plan_redistribute(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
                      topo: MeshTopology, profile: Profile) -> RedistributePlan:
    """The cheapest plan from ``src`` to ``dst`` (cached per mesh and profile)."""
    return _planner(topo, profile).plan(src, dst, tuple(shape), itemsize)


def plan_steps(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
               topo: MeshTopology, profile: Profile) -> list[Step]:
    """The collectives of the cheapest plan (local steps left out)."""
    plan = plan_redistribute(src, dst, shape, itemsize, topo, profile)
    return [s for s in plan.steps if s.kind not in ("chunk", "partition")]


def redistribute_cost_us(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
                         topo: MeshTopology, profile: Profile) -> float:
    return plan_redistribute(src, dst, shape, itemsize, topo, profile).us
