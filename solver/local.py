"""What a local search keeps about the current choice: each node's edges, the cost of each
of its strategies given its neighbours, the tie groups that move together, and total memory
usage over time, updated per move.

Shared by the start heuristics (:mod:`solver.heuristic`), the windowed MILPs
(:mod:`solver.lns`) and the weight search (:mod:`solver.weights`).
"""

from __future__ import annotations

import numpy as np

from solver.problem import Problem


class Adjacency:
    """Per node, the edges it touches, as (edge, other node, is_source)."""

    def __init__(self, problem: Problem):
        self.inc: list[list[tuple[int, int, bool]]] = [[] for _ in range(problem.num_nodes)]
        for e, (u, v) in enumerate(problem.edges.tolist()):
            self.inc[u].append((e, v, True))
            self.inc[v].append((e, u, False))


def local_cost(problem: Problem, adj: Adjacency, choice: np.ndarray, v: int) -> np.ndarray:
    """Cost of every strategy of ``v`` given the neighbours' current choices."""
    c = problem.node_costs[v].copy()
    for e, w, is_src in adj.inc[v]:
        m = problem.edge_costs[e]
        c += m[:, choice[w]] if is_src else m[choice[w], :]
    c[~problem.allowed(v)] = np.inf
    return c


def tie_groups(problem: Problem) -> list[list[int]]:
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


class Memory:
    """Total usage per time segment, updated per move: a move is checked in O(its interval)."""

    def __init__(self, problem: Problem, choice: np.ndarray):
        self.problem = problem
        iv = problem.intervals
        self.times = np.unique(iv.ravel())
        self.a = np.searchsorted(self.times, iv[:, 0])
        self.b = np.searchsorted(self.times, iv[:, 1])
        self.total = np.zeros(max(1, self.times.size))
        chosen = np.array([problem.node_usages[v][choice[v]] for v in range(problem.num_nodes)], dtype=np.float64)
        self.total = self.profile(chosen)
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


def onto_allowed(problem: Problem, choice: np.ndarray, adj: Adjacency | None = None) -> tuple[np.ndarray, int]:
    """``choice`` with every tie group that takes a strategy the problem does not allow (a pin,
    a strategy ruled out), or whose members disagree, moved to its cheapest allowed strategy
    given its neighbours' choices, in group order: (that choice, how many groups moved). A
    plan made for another problem of the same graph (without these pins) becomes one of this
    problem's, as close to it as a greedy pass gets. ``adj``: the problem's, where the caller
    has it (else built where a group moves)."""
    choice = np.asarray(choice, dtype=np.int64).copy()
    moved = 0
    for g in tie_groups(problem):
        if len({int(choice[v]) for v in g}) == 1 and all(problem.allowed(v)[choice[v]] for v in g):
            continue
        adj = adj if adj is not None else Adjacency(problem)
        cost = sum(local_cost(problem, adj, choice, v) for v in g)
        choice[g] = int(np.argmin(cost))
        moved += 1
    return choice, moved
