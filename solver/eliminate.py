r"""Exact variable elimination of low-degree nodes in the pairwise (memory-free) problem.

For fixed node costs ``c_v`` (the costs plus, under per-node weights, each
node's memory penalty) the problem is a min-sum pairwise network

    min_s  sum_v c_v(s_v) + sum_(u,v) C_uv(s_u, s_v)

and a node of degree <= 2 can be removed exactly by dynamic programming:

* degree 0: s_v = argmin c_v;
* degree 1 (neighbour a):   c_a(i) += min_k C_av(i, k) + c_v(k)        (argmin kept per i);
* degree 2 (neighbours a, b): C_ab(i, j) += min_k C_av(i, k) + c_v(k) + C_vb(k, j)
  (argmin kept per (i, j)): a chain becomes one edge.

Repeating until every node has degree >= 3 leaves a *core* (IOPDDL: 33k nodes -> 1.9k on
M, 28k -> 3.5k on S, 35k -> 6.6k on A); the core is solved by any pairwise solver and
the removed nodes are read back from the argmin tables in reverse order. The order of
removal depends only on the graph, so :class:`Eliminator` computes it once and
:meth:`Eliminator.solve` replays it for every new set of node costs.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from solver.problem import Problem

#: A degree-2 removal whose new edge table (k_a * k_v * k_b work) would exceed this many
#: entries is skipped: the node stays in the core.
MAX_WORK = 8_000_000


class Eliminator:
    """The elimination order of a problem's graph; ``keep`` nodes are never removed."""

    def __init__(self, problem: Problem, keep: set[int] | frozenset = frozenset()):
        self.problem = problem
        n = problem.num_nodes
        # A node with nothing allowed keeps all its strategies: every choice is forbidden anyway.
        self.allowed = [np.nonzero(problem.allowed(v))[0] for v in range(n)]
        self.allowed = [a if a.size else np.arange(problem.num_strategies(v)) for v, a in enumerate(self.allowed)]
        k = np.array([a.size for a in self.allowed])
        self.fixed = np.nonzero(k == 1)[0]
        adj: list[set[int]] = [set() for _ in range(n)]
        for u, v in problem.edges.tolist():
            if u != v and k[u] > 1 and k[v] > 1:
                adj[u].add(v)
                adj[v].add(u)
        alive = k > 1
        self.ops: list[tuple[int, tuple[int, ...]]] = []
        queue = deque(v for v in range(n) if alive[v] and v not in keep and len(adj[v]) <= 2)
        while queue:
            v = queue.popleft()
            if not alive[v] or len(adj[v]) > 2:
                continue
            nb = tuple(sorted(adj[v]))
            if len(nb) == 2 and k[nb[0]] * k[v] * k[nb[1]] > MAX_WORK:
                continue
            alive[v] = False
            self.ops.append((v, nb))
            for w in nb:
                adj[w].discard(v)
            if len(nb) == 2:
                adj[nb[0]].add(nb[1])
                adj[nb[1]].add(nb[0])
            for w in nb:
                if alive[w] and w not in keep and len(adj[w]) <= 2:
                    queue.append(w)
            adj[v] = set()
        self.core = np.nonzero(alive)[0]
        # Each edge's table on the allowed strategies is the same in every call of solve: cut once
        # (slicing 41k tables was a fifth of a weight round on IOPDDL T).
        self.tables = [problem.edge_costs[e][np.ix_(self.allowed[u], self.allowed[v])]
                       for e, (u, v) in enumerate(problem.edges.tolist())]
        self.core_edges = sorted({(min(u, w), max(u, w)) for u in self.core.tolist() for w in adj[u]})

    def solve(self, unary: list[np.ndarray],
              core_solver: Callable[[list[np.ndarray], dict[tuple[int, int], np.ndarray]], dict[int, int]]
              ) -> np.ndarray:
        """Minimize the pairwise problem with ``unary[v]`` as node costs.

        ``core_solver(costs, edges)`` gets, in the allowed-strategy index space of
        each core node, ``costs`` (a list indexed like ``self.core``) and ``edges``
        ({(position of u, position of v): matrix u x v}, one entry per pair of nodes),
        and returns the chosen position per core position.
        """
        p = self.problem
        n = p.num_nodes
        lin = [np.where(np.isfinite(unary[v][a]), unary[v][a], np.inf) for v, a in enumerate(self.allowed)]
        # (low, high) -> (u, v, matrix u x v): each edge keeps the orientation it first came in,
        # which toulbar2 is sensitive to (on IOPDDL A, edges turned to (low, high) took it 3x longer).
        edges: dict[tuple[int, int], tuple[int, int, np.ndarray]] = {}

        def add(u, v, m):
            key = (u, v) if u < v else (v, u)
            if key in edges:
                x, y, mat = edges[key]
                edges[key] = (x, y, mat + (m if (x, y) == (u, v) else m.T))
            else:
                edges[key] = (u, v, m)

        def take(a, b):
            x, y, m = edges.pop((a, b) if a < b else (b, a))
            return m if (x, y) == (a, b) else m.T

        for (u, v), m in zip(p.edges.tolist(), self.tables):
            if u == v:
                lin[u] = lin[u] + np.diag(m)
            elif self.allowed[u].size == 1:
                lin[v] = lin[v] + m[0]
            elif self.allowed[v].size == 1:
                lin[u] = lin[u] + m[:, 0]
            else:
                add(u, v, m)

        back = []
        for v, nb in self.ops:
            if not nb:
                back.append(None)
            elif len(nb) == 1:
                (a,) = nb
                t = take(a, v) + lin[v][None, :]
                arg = t.argmin(1)
                lin[a] = lin[a] + t[np.arange(t.shape[0]), arg]
                back.append(arg)
            else:
                a, b = nb
                av, vb = take(a, v), take(v, b)
                t = av[:, :, None] + lin[v][None, :, None] + vb[None, :, :]
                arg = t.argmin(1)
                ab = np.take_along_axis(t, arg[:, None, :], 1)[:, 0, :]
                add(a, b, ab)
                back.append(arg)
        index = {int(v): i for i, v in enumerate(self.core)}
        core_edges = {(index[u], index[w]): m for u, w, m in edges.values()}
        picked = core_solver([lin[v] for v in self.core], core_edges)
        local = np.zeros(n, dtype=np.int64)  # positions in the allowed lists
        for i, v in enumerate(self.core.tolist()):
            local[v] = picked[i]
        for (v, nb), arg in zip(reversed(self.ops), reversed(back)):
            if not nb:
                local[v] = int(np.argmin(lin[v]))
            elif len(nb) == 1:
                local[v] = arg[local[nb[0]]]
            else:
                local[v] = arg[local[nb[0]], local[nb[1]]]
        return np.array([self.allowed[v][local[v]] for v in range(n)], dtype=np.int64)

