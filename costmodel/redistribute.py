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
rounded up) on the group it uses, plus the local copy DTensor makes around it
(:meth:`RedistributePlanner.copied_bytes`: a gather along a dim other than the
first concatenates its output, a reduce_scatter onto one chunks and concatenates
its input, an all_to_all both), priced at the profile's copy bandwidth. A partition may put a partial of a kind the
source or target holds on any replicated axis (one merged all_reduce through it
can beat reducing another axis alone), but not once no partial is left or wanted.

Search is A* over canonical integer states. The heuristic is a set cover: the axes
that must still take part in a collective, priced by the cheapest collectives whose
groups cover them (:meth:`_cover_bounds`, dynamic programming over axis subsets).
Every collective but all_to_all is heavy: an all_gather, all_reduce or
reduce_scatter on group G has a buffer whole along G, and all_to_all has no merged
form, so one cheap collective over many axes never stands in for several. The plan
that gathers and reduces everything the target lacks, then chunks, bounds the search
from above: states whose f reaches it are never queued. Answers are cached by (src,
dst, shape, itemsize); the cost model's answers (times by bytes and group, local
sizes, bound tables) are memoized per mesh and profile and shared by every planner.

Measured (``benchmarks/redistribute.py``, 48 pairs, cold = a new planner per pair):
torch's planner / ours = 10.9x with the previous bound (the dearest single axis) ->
26x with the cover bound -> 42x with the heavy/light split and the per-mesh memo ->
47x with the upper bound, incremental keys and pruned partitions (2-D 15x, 3-D 34x,
4-D 80x, 5-D 120x); expansions on (2, 2, 2, 2, 2) fell from 1.5k-5.7k to 0.1k-1.9k ->
59-61x once multi-axis collectives are priced as heavy (2-D 16x, 3-D 36-39x, 4-D
116-128x, 5-D 179x; expansions over the suite's 4-D pairs 931 -> 511).
"""

from __future__ import annotations

import gc
import heapq
import math
from contextlib import contextmanager
from functools import lru_cache
from itertools import combinations

import numpy as np

from costmodel.bounds import Bound, CoverBound, agreed, mesh_costs
from costmodel.collectives import MeshTopology
from costmodel.profile import Profile
from costmodel.spec import Spec, on_mesh
from costmodel.stategraph import MAX_STATES, StateGraph
from costmodel.states import (
    COMPATIBLE_PARTIALS,
    R,
    RedistributeError,
    RedistributePlan,
    Step,
    decode,
    encode,
    partials_of,
)


class RedistributePlanner:
    """Plans redistributes for one mesh and profile; caches every answer."""

    def __init__(self, topo: MeshTopology, profile: Profile, merge: bool = True, use_heuristic: bool = True,
                 max_graph_states: int = MAX_STATES):
        self.topo, self.profile = topo, profile
        self.max_graph_states = max_graph_states
        """Past this many states a tensor's costs are searched per source, without a state graph."""
        self.merge, self.use_heuristic = merge, use_heuristic
        self.shape = topo.shape
        self.n = len(topo.shape)
        self._costs = mesh_costs(topo, profile)
        self._time = self._costs.time
        # read and written once each, at a copy's bandwidth (GB/s = 1e3 bytes per microsecond)
        self._copy_us_per_byte = 2.0 / (profile.bandwidth_gbps() * 1e3)
        self._leading: dict = {}
        self._elems: dict = self._costs.elems
        self.cache: dict = {}
        self.cost_cache: dict = {}
        self._graphs: dict = {}
        self.stats = {"searches": 0, "expanded": 0, "hits": 0}

    # -- sizes ------------------------------------------------------------
    def _local_elems(self, orders, tshape) -> int:
        key = (orders, tshape)
        n = self._elems.get(key)
        if n is None:
            n = 1
            for d, size in enumerate(tshape):
                for a in orders[d]:
                    size = -(-size // self.shape[a])
                n *= size
            self._elems[key] = n
        return n

    def _leading_ones(self, orders, tshape, d) -> bool:
        """Every local dim before ``d`` has one element: a buffer cut or joined along ``d`` is
        a view of one joined along the first dim."""
        key = (orders, tshape, d)
        ones = self._leading.get(key)
        if ones is None:
            ones = True
            for j in range(d):
                size = tshape[j]
                for a in orders[j]:
                    size = -(-size // self.shape[a])
                if size != 1:
                    ones = False
                    break
            self._leading[key] = ones
        return ones

    def copied_bytes(self, kind: str, dims: tuple[int, ...], orders, new_orders, tshape, local_bytes: int,
                     out_bytes: int) -> int:
        """Bytes a step's collective copies on the device besides what it moves, as DTensor's
        functional collectives run it: NCCL gathers and scatters along the first dim, so an
        ``all_gather`` along dim ``d > 0`` concatenates its output (unless the dims before ``d``
        hold one element, where it is a view), a ``reduce_scatter`` onto ``d > 0`` chunks and
        concatenates its input, and an ``all_to_all`` (``dims = (d, e)``: gathered along ``d``,
        split along ``e``) does both, each side a view where its leading dims are ones."""
        if kind == "all_gather":
            d = dims[0]
            return 0 if d == 0 or self._leading_ones(orders, tshape, d) else out_bytes
        if kind == "reduce_scatter":
            return local_bytes if dims[0] else 0
        if kind == "all_to_all":
            d, e = dims
            split = 0 if e == 0 or self._leading_ones(orders, tshape, e) else local_bytes
            joined = 0 if d == 0 or self._leading_ones(new_orders, tshape, d) else local_bytes
            return split + joined
        return 0

    def _price(self, kind: str, nbytes: int, axes, copy: int) -> float:
        """A step's time: its collective's, and its copy's (:meth:`copied_bytes`)."""
        if not nbytes:
            return 0.0
        return self._time(kind, nbytes, axes) + copy * self._copy_us_per_byte

    def _even(self, d, axes_in_order, tshape, orders) -> bool:
        """Dim d splits evenly through its current order and then ``axes_in_order``."""
        size = tshape[d]
        for a in orders[d] + tuple(axes_in_order):
            if size % self.shape[a]:
                return False
            size //= self.shape[a]
        return True

    # -- transitions ------------------------------------------------------
    def _neighbors(self, codes, orders, tshape, item, partials):
        """Every single step from (codes, orders) as ``(kind, axes, bytes, codes', orders',
        dims whose order changed, bytes copied locally)`` (:meth:`copied_bytes`); ``partials`` holds the partial codes a
        partition may create: those of the source and target. A partial of another kind
        could only be undone by a reduction of its own; one of those kinds on another axis
        can pay (R -> P(sum) on x, then one all_reduce over x and an axis already partial
        can be cheaper than reducing that axis alone and moving x by all_to_all)."""
        # Hot path (millions of calls when an ILP is built): tuples sliced and joined, never
        # lists copied; every branch builds exactly the states the table above lists.
        local_elems = self._local_elems
        local = local_elems(orders, tshape) * item
        out = []
        append = out.append
        ndim = len(orders)
        merge = self.merge
        for d in range(ndim):
            od = orders[d]
            if not od:
                continue
            x = od[-1]
            head = od[:-1]
            before, after = codes[:x], codes[x + 1:]
            new_orders = orders[:d] + (head,) + orders[d + 1:]
            # gather the last axis of d's order
            out_bytes = local_elems(new_orders, tshape) * item
            copy = self.copied_bytes("all_gather", (d,), orders, new_orders, tshape, local, out_bytes) if d else 0
            append(("all_gather", (x,), out_bytes, before + (R,) + after, new_orders, (d,), copy))
            # merged gather of the last k axes (ascending, even shards)
            if merge and len(od) > 1 and self._even_tail(d, od, tshape):
                for k in range(2, len(od) + 1):
                    tail = od[-k:]
                    if list(tail) != sorted(tail):
                        continue
                    no = orders[:d] + (od[:-k],) + orders[d + 1:]
                    c3 = list(codes)
                    for a in tail:
                        c3[a] = R
                    out_bytes = local_elems(no, tshape) * item
                    copy = self.copied_bytes("all_gather", (d,), orders, no, tshape, local, out_bytes) if d else 0
                    append(("all_gather", tail, out_bytes, tuple(c3), no, (d,), copy))
            # all_to_all: move the last axis of d to the end of e
            for e in range(ndim):
                if e == d:
                    continue
                if e < d:
                    no = orders[:e] + (orders[e] + (x,),) + orders[e + 1:d] + (head,) + orders[d + 1:]
                else:
                    no = orders[:d] + (head,) + orders[d + 1:e] + (orders[e] + (x,),) + orders[e + 1:]
                append(("all_to_all", (x,), local, before + (e,) + after, no, (d, e),
                        self.copied_bytes("all_to_all", (d, e), orders, no, tshape, local, local)))
        partial_axes = [a for a, c in enumerate(codes) if c < R]
        for x in partial_axes:
            before, after = codes[:x], codes[x + 1:]
            append(("all_reduce", (x,), local, before + (R,) + after, orders, (), 0))
            for d in range(ndim):
                no = orders[:d] + (orders[d] + (x,),) + orders[d + 1:]
                append(("reduce_scatter", (x,), local, before + (d,) + after, no, (d,),
                        self.copied_bytes("reduce_scatter", (d,), orders, no, tshape, local, local) if d else 0))
        if merge and len(partial_axes) > 1:
            for k in range(2, len(partial_axes) + 1):
                for group in combinations(partial_axes, k):
                    if len({codes[a] for a in group}) > 1:
                        continue  # one reduce op per merged collective
                    c2 = list(codes)
                    for a in group:
                        c2[a] = R
                    append(("all_reduce", group, local, tuple(c2), orders, (), 0))
                    for d in range(ndim):
                        if not self._even(d, group, tshape, orders):
                            continue
                        no = orders[:d] + (orders[d] + group,) + orders[d + 1:]
                        c3 = list(codes)
                        for a in group:
                            c3[a] = d
                        append(("reduce_scatter", group, local, tuple(c3), no, (d,),
                                self.copied_bytes("reduce_scatter", (d,), orders, no, tshape, local, local)
                                if d else 0))
        held = None
        for x, c in enumerate(codes):
            if c != R:
                continue
            before, after = codes[:x], codes[x + 1:]
            for d in range(ndim):
                append(("chunk", (x,), 0, before + (d,) + after, orders[:d] + (orders[d] + (x,),) + orders[d + 1:],
                        (d,), 0))
            if partials:
                if held is None:
                    held = {cc for cc in codes if cc < R}
                for p in partials:
                    if frozenset(held | {p}) not in COMPATIBLE_PARTIALS:
                        continue
                    append(("partition", (x,), 0, before + (p,) + after, orders, (), 0))
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
        for c, t in zip(codes, dst_codes):
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
        for kind, axes, nbytes, c2, o2, _, copy in self._neighbors(*s0, tuple(tshape), itemsize,
                                                                   partials_of(s0[0], goal[0])):
            if (c2, o2) == goal and len(axes) == 1:
                return 0.0 if kind in ("chunk", "partition") else self._price(kind, nbytes, axes, copy)
        raise RedistributeError(f"{src} -> {dst} is not a single step")

    # -- search -----------------------------------------------------------
    def plan(self, src: Spec, dst: Spec, tshape: tuple[int, ...], itemsize: int) -> RedistributePlan:
        key = (src, dst, tuple(tshape), itemsize)
        hit = self.cache.get(key)
        if hit is not None:
            self.stats["hits"] += 1
            return hit
        enabled = gc.isenabled()  # see _no_gc; inline, a context manager costs a few microseconds
        gc.disable()
        try:
            result = self._search(src, dst, tuple(tshape), itemsize)
        finally:
            if enabled:
                gc.enable()
        self.cache[key] = result
        self.cost_cache.setdefault(key, result.us)
        return result

    def _search(self, src, dst, tshape, item) -> RedistributePlan:
        ndim = len(tshape)
        s0 = encode(src, ndim, self.n)
        goal = encode(dst, ndim, self.n)
        self.stats["searches"] += 1
        if s0 == goal:
            return RedistributePlan(src, dst, [])
        on_src, on_dst = on_mesh(src, self.shape), on_mesh(dst, self.shape)
        if (on_src, on_dst) != (src, dst):
            # An axis of one rank splits nothing: its placements are read as replicated, so no
            # step runs over it (a chunk or a gather over one rank would copy the tensor).
            return RedistributePlan(src, dst, self.plan(on_src, on_dst, tshape, item).steps)
        partials = partials_of(s0[0], goal[0])
        cover = self._cover_bounds(tshape, item)
        bound = self._heuristic(goal, cover)
        h0 = bound(*s0)
        # The direct plan bounds the search from above: states whose f reaches it are never
        # queued (most generated states are such), and it is the answer when nothing beats it.
        upper, direct = self._direct(s0, goal, tshape, item)
        frontier = [(h0, -0.0, 0, s0)]
        best = {s0: 0.0}
        parent = {s0: None}
        tie = 0
        # Hot loop: names bound once.
        pop, push, best_get, price, neighbors = heapq.heappop, heapq.heappush, best.get, self._price, self._neighbors
        by_code, order_bits, parts, bound_price = bound.by_code, bound.order_bits, bound.parts, bound.price
        cover_get = cover.get
        inf, cap = math.inf, upper - 1e-9
        prune = min(goal[0]) >= R
        expanded = 0
        while frontier:
            f, g, _, state = pop(frontier)
            g = -g
            if f >= cap:
                break
            if g > best_get(state, inf):
                continue
            if state == goal:
                self.stats["expanded"] += expanded
                return RedistributePlan(src, dst, self._unwind(parent, state))
            codes, orders = state
            if self._free_reachable(codes, orders, goal[0], goal[1]):
                # Popped with the least f and only local steps left: nothing can beat finishing here.
                self.stats["expanded"] += expanded
                return RedistributePlan(src, dst, self._unwind(parent, state) + self._complete(state, goal))
            expanded += 1
            key_codes, obits = parts(codes, orders)
            key_orders = 0
            for bits in obits:
                key_orders |= bits
            # No partial left and none wanted: a partition could only be undone by a
            # reduction (all_reduce: back where it was; reduce_scatter: what a free chunk does).
            steps = neighbors(codes, orders, tshape, item, () if prune and min(codes) >= R else partials)
            for kind, axes, nbytes, c2, o2, dims, copy in steps:
                nxt = (c2, o2)
                # Local steps (no bytes) still cost a hair, so a plan never takes pointless detours.
                us = price(kind, nbytes, axes, copy)
                ng = g + (us or 1e-6)
                if ng < cap and ng < best_get(nxt, inf) - 1e-12:
                    # The child's key: the parent's with the changed axes' and dims' bits
                    # swapped (each axis and each dim owns disjoint bits of its half).
                    kc = key_codes
                    for a in axes:
                        kc ^= by_code[a][codes[a]] ^ by_code[a][c2[a]]
                    ko = key_orders
                    for d in dims:
                        ko ^= obits[d] ^ order_bits(d, o2[d])
                    key = kc | ko
                    hv = cover_get(key)
                    nf = ng + (hv if hv is not None else bound_price(key))
                    if nf >= cap:
                        continue
                    best[nxt] = ng
                    parent[nxt] = (state, kind, axes, nbytes, us, copy * self._copy_us_per_byte)
                    tie += 1
                    push(frontier, (nf, -ng, -tie, nxt))
        self.stats["expanded"] += expanded
        return RedistributePlan(src, dst, self._direct_steps(s0, goal, direct))

    def _direct(self, s0, goal, tshape, item) -> tuple[float, list]:
        """The plan that undoes everything the target does not hold, one axis at a time, then
        builds the target by local steps: (its cost as the search counts it, its collectives
        as ``(kind, axis, bytes, us, of it the copy's us)``). It always applies: gathers take the last axis of an
        order, and after the reductions only partials the target holds are left, so the
        target's partitions never mix kinds."""
        orders = list(s0[1])
        gcodes, gorders = goal
        moves = []
        g = 0.0
        local = 0
        for d, (o, go) in enumerate(zip(s0[1], gorders)):
            k = agreed(o, go)
            for x in reversed(o[k:]):
                before = tuple(orders)
                orders[d] = orders[d][:-1]
                after = tuple(orders)
                nbytes = self._local_elems(after, tshape) * item
                copy = self.copied_bytes("all_gather", (d,), before, after, tshape, 0, nbytes) * self._copy_us_per_byte
                us = self._time("all_gather", nbytes, (x,)) + copy
                moves.append(("all_gather", x, nbytes, us, copy))
                g += us
            local += len(go) - k
        nbytes = self._local_elems(tuple(orders), tshape) * item
        for x, c in enumerate(s0[0]):
            t = gcodes[x]
            if c < R and c != t:
                us = self._time("all_reduce", nbytes, (x,))
                moves.append(("all_reduce", x, nbytes, us, 0.0))
                g += us
                local += t < R
            elif c == R and t < R:
                local += 1
        return g + 1e-6 * local, moves

    def _direct_steps(self, s0, goal, moves) -> list[Step]:
        codes, orders = list(s0[0]), list(s0[1])
        steps = []
        for kind, x, nbytes, us, copy_us in moves:
            prev = (tuple(codes), tuple(orders))
            if codes[x] >= 0:
                orders[codes[x]] = orders[codes[x]][:-1]
            codes[x] = R
            steps.append(Step(kind, (x,), int(nbytes), us, decode(*prev), decode(tuple(codes), tuple(orders)),
                              copy_us))
        return steps + self._complete((tuple(codes), tuple(orders)), goal)

    def costs(self, src: Spec, dsts: list[Spec], tshape: tuple[int, ...], itemsize: int) -> list[float]:
        """``plan(src, d).us`` for every d in ``dsts``, from one search.

        Dijkstra from ``src`` over the whole state space (no goal, no heuristic)
        settles every target at once: a producer spec has as many targets as its
        consumers have candidate specs, and one search over the few hundred
        states of a 2-D or 3-D mesh is far cheaper than one A* per target. The state
        graph is built once per tensor (:class:`~costmodel.stategraph.StateGraph`) and
        searched by scipy; past its size limit each source is searched here.
        Answers agree with :meth:`plan` (both are exact) and are cached.
        """
        tshape = tuple(tshape)
        out = [self.cost_cache.get((src, d, tshape, itemsize)) for d in dsts]
        todo = [d for d, c in zip(dsts, out) if c is None]
        if not todo:
            return out
        if len(set(todo)) < 3:
            return [c if c is not None else self.plan(src, d, tshape, itemsize).us for d, c in zip(dsts, out)]
        unique = list(dict.fromkeys(todo))
        for d, c in zip(unique, self.cost_matrix([src], unique, tshape, itemsize)[0].tolist()):
            self.cost_cache[(src, d, tshape, itemsize)] = c
        return [self.cost_cache[(src, d, tshape, itemsize)] for d in dsts]

    def cost_matrix(self, srcs: list[Spec], dsts: list[Spec], tshape: tuple[int, ...], itemsize: int) -> np.ndarray:
        """``[[plan(s, d).us for d in dsts] for s in srcs]``: what :meth:`costs` answers, for a
        whole edge matrix at once. Each source is searched once per partial set, over the
        tensor's state graph (or, past its size limit, by :meth:`_settle`); the answers are
        read off by index, not cached pair by pair."""
        tshape = tuple(tshape)
        ndim = len(tshape)
        out = np.empty((len(srcs), len(dsts)))
        goals = [encode(d, ndim, self.n) for d in dsts]
        # Columns by the partial kinds their targets hold: few groups, merged per source below.
        by_goal_partials: dict[tuple, list[int]] = {}
        for j, g in enumerate(goals):
            by_goal_partials.setdefault(partials_of(g[0]), []).append(j)
        for i, src in enumerate(srcs):
            s0 = encode(src, ndim, self.n)
            # One search per set of partials a partition may create, the set plan() would use.
            by_partials: dict[tuple, list[int]] = {}
            for gp, cols in by_goal_partials.items():
                by_partials.setdefault(partials_of(s0[0], gp), []).extend(cols)
            for partials, cols in by_partials.items():
                self.stats["searches"] += 1
                targets = [goals[j] for j in cols]
                graph = self._graph(tshape, itemsize, partials)
                row = graph.costs_from(s0) if graph is not None else None
                if row is not None:
                    idx = np.array([graph.index.get(g, -1) for g in targets])
                    vals = np.where(idx >= 0, row[idx], np.inf)
                else:
                    with _no_gc():
                        true, done = self._settle(s0, targets, tshape, itemsize, partials)
                    vals = np.array([true[g] if g in done else np.inf for g in targets])
                if not np.isfinite(vals).all():
                    bad = cols[int(np.argmin(np.isfinite(vals)))]
                    raise RedistributeError(f"no sequence of collectives turns {src} into {dsts[bad]}")
                out[i, cols] = vals
        return out

    def _graph(self, tshape, itemsize, partials) -> StateGraph | None:
        """The state graph of a tensor under the partial kinds a partition may create (every
        source with those kinds lies in it), built on first use; ``None`` when too large."""
        key = (tshape, itemsize, partials)
        if key not in self._graphs:
            price, neighbors = self._price, self._neighbors

            def steps(state):
                return [(price(kind, nbytes, axes, copy), (c2, o2))
                        for kind, axes, nbytes, c2, o2, _, copy in neighbors(*state, tshape, itemsize, partials)]

            start = ((R,) * self.n, ((),) * len(tshape))
            with _no_gc():
                self._graphs[key] = StateGraph.build(steps, start, self.max_graph_states)
        return self._graphs[key]

    def _settle(self, s0, goals, tshape, itemsize, partials):
        """Dijkstra from ``s0`` until every state in ``goals`` is settled: (cost per state, settled)."""
        true = {s0: 0.0}
        best = {s0: 0.0}
        frontier = [(0.0, 0, s0)]
        goals = set(goals)
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
            for kind, axes, nbytes, c2, o2, _, copy in self._neighbors(codes, orders, tshape, itemsize, partials):
                nxt = (c2, o2)
                us = self._price(kind, nbytes, axes, copy)  # as _search prices steps
                ng = g + (us or 1e-6)
                if ng < best.get(nxt, math.inf) - 1e-12:
                    best[nxt] = ng
                    true[nxt] = true[state] + us
                    tie += 1
                    heapq.heappush(frontier, (ng, tie, nxt))
        return true, done

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

    def _heuristic(self, goal, cover):
        """Admissible: the cheapest set of collectives that touches every axis that must change.

        Axis a must take part in some collective when it holds a shard or partial
        the target does not, or sits in a dim's order after the first place where
        that order leaves the target's (only the last axis of an order ever leaves
        it). Some of those need a *heavy* collective, one whose group holds a full
        (unsharded) copy along a: a partial that must go (all_reduce or
        reduce_scatter) and a shard whose target is R or partial (only an
        all_gather unshards). ``cover`` prices such sets (:meth:`_cover_bounds`).
        Each axis's code and each dim's order contribute their own bits of the
        table key ``U << n | H`` (:class:`Bound`), so a step updates the key of its
        parent by the axes and dims it changed.
        """
        return Bound(goal, cover, self.n, self.use_heuristic)

    def _cover_bounds(self, tshape, item) -> "CoverBound":
        """``cover[U << n | H]``: a lower bound on the cost of collectives whose groups contain
        every axis of U, each axis of H (a subset of U) in a heavy one.

        Every collective moves at least the fully sharded buffer ``m`` (the tensor
        over the whole mesh, rounded down), and all but all_to_all, on group G, at
        least ``m * |G|``: an all_gather's output, an all_reduce's buffer and a
        reduce_scatter's input are whole along G. all_to_all moves one axis (no
        merged form exists). Predictions are monotone in bytes, so a heavy
        collective on G costs at least ``h(G) = min over all_gather, all_reduce,
        reduce_scatter of t(kind, G, m|G|)``, any collective on G at least
        ``c(G) = min(h(G), t(all_to_all, G, m))`` when G is one axis, else ``h(G)``.
        The cheapest (heavy) collective whose group contains P costs ``c'(P)`` (``h'(P)``), the minimum over supersets
        (no monotonicity in the group assumed). Assigning each axis of U to one
        collective that serves it splits U into parts, each priced at least ``h'``
        when it holds an axis of H, else ``c'``: the cheapest such split is the
        bound. Dynamic programming over axis subsets, once per tensor size.
        """
        # Rounded down, not up to one element: a tensor smaller than the mesh has local
        # buffers of one element whatever the group, so m|G| would overstate them.
        return self._costs.cover(math.prod(tshape) // math.prod(self.shape) * item)

    @staticmethod
    def _unwind(parent, state) -> list[Step]:
        steps = []
        while parent[state] is not None:
            prev, kind, axes, nbytes, us, copy_us = parent[state]
            steps.append(Step(kind, tuple(axes), int(nbytes), us, decode(*prev), decode(*state), copy_us))
            state = prev
        return steps[::-1]


def local_plan(src: Spec, dst: Spec, ndim: int) -> RedistributePlan:
    """``src -> dst`` by local steps only (chunks in ``dst``'s shard order, partitions), as the
    planner ends its own plans; raises when a collective is needed."""
    n = len(src.placements)
    s0, goal = encode(src, ndim, n), encode(dst, ndim, n)
    if not RedistributePlanner._free_reachable(*s0, *goal):
        raise RedistributeError(f"{src} -> {dst} needs a collective: it is not local")
    return RedistributePlan(src, dst, RedistributePlanner._complete(s0, goal))


@contextmanager
def _no_gc():
    """A search allocates thousands of small tuples and no cycles; in a process holding a
    large heap (torch imported) the collections they trigger cost more than the search."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@lru_cache(maxsize=64)
def _shared_planner(topo: MeshTopology, profile: Profile) -> RedistributePlanner:
    return RedistributePlanner(topo, profile)


def plan_redistribute(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
                      topo: MeshTopology, profile: Profile) -> RedistributePlan:
    """The cheapest plan from ``src`` to ``dst`` (cached per mesh and profile)."""
    return _shared_planner(topo, profile).plan(src, dst, tuple(shape), itemsize)


def plan_steps(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
               topo: MeshTopology, profile: Profile) -> list[Step]:
    """The collectives of the cheapest plan (local steps left out)."""
    plan = plan_redistribute(src, dst, shape, itemsize, topo, profile)
    return [s for s in plan.steps if s.kind not in ("chunk", "partition")]


def redistribute_cost_us(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
                         topo: MeshTopology, profile: Profile) -> float:
    return plan_redistribute(src, dst, shape, itemsize, topo, profile).us
