"""Cheap incumbents: a memory-first start and single-node local search.

The MILP is handed the best of these as a warm start, and ``solve`` never
returns anything worse, so a stalled MILP still yields a usable plan.
"""

from __future__ import annotations

import time

import numpy as np

from solver.evaluate import memory_profile
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


def _peak_excess(problem: Problem, choice: np.ndarray) -> float:
    if problem.usage_limit is None:
        return 0.0
    usage = np.array([problem.node_usages[v][choice[v]] for v in range(problem.num_nodes)])
    _, total = memory_profile(problem, usage)
    return max(0.0, float(total.max(initial=0.0)) - problem.usage_limit)


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
    """Move one tie group at a time to its best strategy while memory stays within the limit.

    Stops after ``max_rounds`` sweeps without improvement or at ``deadline``
    (a ``time.perf_counter()`` value): a memory check costs O(n log n) per move.
    """
    adj = _Adjacency(problem)
    groups = _tie_groups(problem)
    choice = choice.copy()
    has_limit = problem.usage_limit is not None
    for _ in range(max_rounds):
        improved = False
        for g in groups:
            if deadline is not None and time.perf_counter() > deadline:
                return choice
            gain = sum(_local_cost(problem, adj, choice, v) for v in g)
            cur = gain[choice[g[0]]]
            best = int(np.argmin(gain))
            if not gain[best] < cur - 1e-9 * max(1.0, abs(cur)):
                continue
            old = choice[g[0]]
            choice[g] = best
            if has_limit and _peak_excess(problem, choice) > 0:
                # Try the candidates in order of gain; keep the first that fits.
                choice[g] = old
                for i in np.argsort(gain, kind="stable"):
                    if gain[i] >= cur or gain[i] >= FORBIDDEN:
                        break
                    choice[g] = i
                    if _peak_excess(problem, choice) == 0:
                        improved = True
                        break
                    choice[g] = old
            else:
                improved = True
        if not improved:
            break
    return choice
