"""The redistribute state graph of one tensor, built once and searched at C speed.

An ILP's edge matrices ask for the cost from each producer spec to every consumer spec
of the same tensor. Searching each source afresh (:meth:`RedistributePlanner._settle`)
regenerates the same states and steps per source: LLaMA-70B on (8, 8, 8) made 3,407
searches over 59 tensors, 478k neighbour expansions, 10 of its 16 s of problem build.

For one tensor (shape, itemsize) and the partial kinds a partition may create, every state
a search from any source can reach is reachable from the replicated state (chunks build any
shard order, partitions any allowed partial), and there are few of them: at most 316 on
(8, 8, 8) for LLaMA's tensors. :class:`StateGraph` expands each once, keeps the cheapest
step between each pair of states, and answers "every cost from this source" with one
Dijkstra in scipy (``scipy.sparse.csgraph``) plus the step costs summed back along the
predecessor tree. Steps are weighted as the planner's own search weighs them (a local
step costs 1e-6 us, so no plan takes a pointless detour); the returned costs are the
collectives' times alone, as :meth:`RedistributePlanner.plan` reports them.
"""

from __future__ import annotations

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import dijkstra

#: Graphs with more states than this are searched per source instead (dense step tables
#: of this size stay under 100 MB).
MAX_STATES = 3000

#: The weight of a step that moves no bytes, as the planner's search counts it.
LOCAL_STEP = 1e-6


class StateGraph:
    """The states reachable from the replicated state and the cheapest step between each pair."""

    def __init__(self, index: dict, weights: csr_matrix, step_us: np.ndarray):
        self.index = index
        """State (codes, orders) -> row."""
        self.weights = weights
        self.step_us = step_us
        """``step_us[u, v]``: the collective time of the cheapest step u -> v (0 for a local one)."""
        self._rows: dict[int, np.ndarray] = {}

    @classmethod
    def build(cls, neighbors, start, max_states: int = MAX_STATES) -> StateGraph | None:
        """Expand every state reachable from ``start`` by ``neighbors(state) -> [(us, next)]``;
        ``None`` when there are more than ``max_states``."""
        index = {start: 0}
        order = [start]
        best: dict[tuple[int, int], tuple[float, float]] = {}
        k = 0
        while k < len(order):
            state = order[k]
            for us, nxt in neighbors(state):
                j = index.get(nxt)
                if j is None:
                    if len(order) >= max_states:
                        return None
                    j = index[nxt] = len(order)
                    order.append(nxt)
                w = us or LOCAL_STEP
                old = best.get((k, j))
                if old is None or w < old[0]:
                    best[(k, j)] = (w, us)
            k += 1
        n = len(order)
        pairs = np.array(list(best), dtype=np.int64).reshape(-1, 2)
        vals = np.array(list(best.values()), dtype=np.float64).reshape(-1, 2)
        weights = csr_matrix((vals[:, 0], (pairs[:, 0], pairs[:, 1])), shape=(n, n))
        step_us = np.zeros((n, n))
        step_us[pairs[:, 0], pairs[:, 1]] = vals[:, 1]
        return cls(index, weights, step_us)

    def costs_from(self, state) -> np.ndarray | None:
        """Collective time of the cheapest path from ``state`` to every state (inf where none
        leads); ``None`` when ``state`` is not in the graph."""
        i = self.index.get(state)
        if i is None:
            return None
        row = self._rows.get(i)
        if row is None:
            row = self._rows[i] = self._search(i)
        return row

    def _search(self, i: int) -> np.ndarray:
        dist, pred = dijkstra(self.weights, indices=i, return_predecessors=True)
        n = dist.size
        # Sum the steps' own times back to the source by pointer jumping: after round r each
        # state holds the sum over its last 2^r steps and the ancestor 2^r steps up.
        up = np.where(pred >= 0, pred, -1)
        total = np.zeros(n)
        has = up >= 0
        total[has] = self.step_us[up[has], np.nonzero(has)[0]]
        while has.any():
            prev_total, prev_up = total.copy(), up.copy()
            total[has] += prev_total[prev_up[has]]
            up[has] = prev_up[prev_up[has]]
            has = up >= 0
        total[~np.isfinite(dist)] = np.inf
        return total


__all__ = ["LOCAL_STEP", "MAX_STATES", "StateGraph"]
