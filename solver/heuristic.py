"""Cheap incumbents and repairs: a memory-first start, single-node local search, joint
moves out of forbidden pairs, and a greedy repair of memory overflow.

The MILP is handed the best of these as a warm start, and ``solve`` never
returns anything worse, so a stalled MILP still yields a usable plan.
"""

from __future__ import annotations

import time

import numpy as np

from solver.problem import FORBIDDEN, Problem


class _Adjacency:
    """Per node, the edges it touches, as (edge, other node, is_source)."""

    def __init__(self, problem: Problem):
        self.inc: list[list[tuple[int, int, bool]]] = [[] for _ in range(problem.num_nodes)]
        for e, (u, v) in enumerate(problem.edges.tolist()):
            self.inc[u].append((e, v, True))
            self.inc[v].append((e, u, False))


def _local_cost(problem: Problem, adj: _Adjacency, choice: np.ndarray, v: int) -> np.ndarray:
    """Cost of every strategy of ``v`` given the neighbours' current choices."""
    c = problem.node_costs[v].copy()
    for e, w, is_src in adj.inc[v]:
        m = problem.edge_costs[e]
        c += m[:, choice[w]] if is_src else m[choice[w], :]
    c[~problem.allowed(v)] = np.inf
    return c


def _tie_groups(problem: Problem) -> list[list[int]]:
    """Every node in exactly one group: its tie group, or itself alone."""
    seen: set[int] = set()
    groups = []
    for g in problem.ties:
        g = [v for v in g if v not in seen]
        seen.update(g)
        if g:
            groups.append(g)
    groups += [[v] for v in range(problem.num_nodes) if v not in seen]
    return groups


class _Memory:
    """Total usage per time segment, updated per move: a move is checked in O(its interval)."""

    def __init__(self, problem: Problem, choice: np.ndarray):
        self.problem = problem
        iv = problem.intervals
        self.times = np.unique(iv.ravel())
        self.a = np.searchsorted(self.times, iv[:, 0])
        self.b = np.searchsorted(self.times, iv[:, 1])
        self.total = np.zeros(max(1, self.times.size))
        for v in range(problem.num_nodes):
            self.total[self.a[v]:self.b[v]] += problem.node_usages[v][choice[v]]
        self.limit = problem.usage_limit if problem.usage_limit is not None else np.inf

    def profile(self, per_node: np.ndarray, nodes: np.ndarray | None = None) -> np.ndarray:
        """Total of ``per_node`` (one value per node, or per node of ``nodes``) at each time segment."""
        a, b = (self.a, self.b) if nodes is None else (self.a[nodes], self.b[nodes])
        delta = np.zeros(self.total.size + 1)
        np.add.at(delta, a, per_node)
        np.add.at(delta, b, -per_node)
        return np.cumsum(delta)[:-1]

    def fits(self, group, old: int, new: int) -> bool:
        if not np.isfinite(self.limit):
            return True
        delta = {}
        for v in group:
            d = self.problem.node_usages[v][new] - self.problem.node_usages[v][old]
            if d > 0:
                delta[v] = d
        if not delta:
            return True
        lo = min(self.a[v] for v in delta)
        hi = max(self.b[v] for v in delta)
        seg = self.total[lo:hi].copy()
        for v, d in delta.items():
            seg[self.a[v] - lo:self.b[v] - lo] += d
        return seg.size == 0 or seg.max() <= self.limit

    def move(self, group, old: int, new: int) -> None:
        for v in group:
            self.total[self.a[v]:self.b[v]] += self.problem.node_usages[v][new] - self.problem.node_usages[v][old]


def initial_choice(problem: Problem) -> np.ndarray:
    """Per tie group, the allowed strategy of least usage (ties broken by cost)."""
    choice = np.zeros(problem.num_nodes, dtype=np.int64)
    for g in _tie_groups(problem):
        ok = np.logical_and.reduce([problem.allowed(v) for v in g])
        usage = sum(problem.node_usages[v] for v in g)
        cost = sum(problem.node_costs[v] for v in g)
        key = np.where(ok, 0, 1)
        order = np.lexsort((cost, usage, key))
        choice[g] = order[0]
    return choice


def local_search(problem: Problem, choice: np.ndarray, max_rounds: int = 20,
                 deadline: float | None = None) -> np.ndarray:
    """Move one tie group at a time to its cheapest strategy that keeps memory within the limit.

    Stops after a sweep without improvement, ``max_rounds`` sweeps, or at ``deadline``
    (a ``time.perf_counter()`` value).
    """
    adj = _Adjacency(problem)
    groups = _tie_groups(problem)
    choice = choice.copy()
    mem = _Memory(problem, choice)
    for _ in range(max_rounds):
        improved = False
        for g in groups:
            if deadline is not None and time.perf_counter() > deadline:
                return choice
            gain = sum(_local_cost(problem, adj, choice, v) for v in g)
            old = int(choice[g[0]])
            cur = gain[old]
            if not np.min(gain) < cur - 1e-9 * max(1.0, abs(cur)):
                continue
            for i in np.argsort(gain, kind="stable"):
                if not gain[i] < cur - 1e-9 * max(1.0, abs(cur)) or gain[i] >= FORBIDDEN:
                    break
                if mem.fits(g, old, int(i)):
                    mem.move(g, old, int(i))
                    choice[g] = i
                    improved = True
                    break
        if not improved:
            break
    return choice


def repair_pairs(problem: Problem, choice: np.ndarray, deadline: float | None = None,
                 max_rounds: int = 5) -> np.ndarray:
    """Move both ends of each edge whose chosen pair is forbidden (or costly) at once.

    Single-node moves cannot leave a forbidden pair when every other strategy of
    either end is forbidden with some third neighbour; a joint move of the two ends
    to their best compatible pair often can. Memory is checked for the joint move.
    """
    adj = _Adjacency(problem)
    groups = {v: g for g in _tie_groups(problem) for v in g}
    choice = choice.copy()
    mem = _Memory(problem, choice)
    for _ in range(max_rounds):
        changed = False
        for e, (u, v) in enumerate(problem.edges.tolist()):
            if deadline is not None and time.perf_counter() > deadline:
                return choice
            m = problem.edge_costs[e]
            if m[choice[u], choice[v]] < FORBIDDEN or u == v or len(groups[u]) > 1 or len(groups[v]) > 1:
                continue
            cu = _local_cost(problem, adj, choice, u) - m[:, choice[v]]
            cv = _local_cost(problem, adj, choice, v) - m[choice[u], :]
            total = cu[:, None] + cv[None, :] + m
            cur = total[choice[u], choice[v]]
            order = np.argsort(total, axis=None, kind="stable")
            for flat in order[:64]:
                i, j = divmod(int(flat), total.shape[1])
                if not total[i, j] < cur:
                    break
                oi, oj = int(choice[u]), int(choice[v])
                if mem.fits([u], oi, i):
                    mem.move([u], oi, i)
                    if mem.fits([v], oj, j):
                        mem.move([v], oj, j)
                        choice[u], choice[v] = i, j
                        changed = True
                        break
                    mem.move([u], i, oi)
        if not changed:
            break
    return choice


def repair_memory(problem: Problem, choice: np.ndarray, deadline: float) -> np.ndarray | None:
    """Lower usage at the worst segment by the cheapest move per byte, until within the limit."""
    if problem.usage_limit is None:
        return choice
    choice = choice.copy()
    mem = _Memory(problem, choice)
    adj = _Adjacency(problem)
    limit = problem.usage_limit
    while time.perf_counter() < deadline:
        k = int(np.argmax(mem.total))
        if mem.total[k] <= limit:
            return choice
        live = np.nonzero((mem.a <= k) & (k < mem.b))[0]
        best, best_rate = None, np.inf
        for v in live.tolist():
            u = problem.node_usages[v]
            cur = choice[v]
            lower = np.nonzero((u < u[cur]) & problem.allowed(v))[0]
            if lower.size == 0:
                continue
            lc = _local_cost(problem, adj, choice, v)
            for i in lower.tolist():
                if lc[i] >= FORBIDDEN:
                    continue
                rate = (lc[i] - lc[cur]) / (u[cur] - u[i])
                if rate < best_rate:
                    best, best_rate = (v, i), rate
        if best is None:
            return None
        v, i = best
        mem.move([v], int(choice[v]), i)
        choice[v] = i
    return None
