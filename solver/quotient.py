"""The tie quotient: one node per tie group, for the memory-free search.

Tied nodes take the same strategy, so a group is one variable whose cost is the
sum of its members' costs; edges between groups are summed, and an edge inside
a group contributes only its diagonal (both ends take the same index). Strategies
not allowed for every member (pins, forbidden costs) are forbidden in the group.
Memory is not carried over: the quotient serves the memory-free search, whose
answer is then checked against the full problem's limit.
"""

from __future__ import annotations

import numpy as np

from solver.problem import FORBIDDEN, Problem


def tie_heads(problem: Problem) -> np.ndarray:
    """``head[v]``: the smallest node of v's tie group (v itself when untied)."""
    head = np.arange(problem.num_nodes)
    for g in problem.ties:
        head[list(g)] = min(g)
    return head


def merge_edges(problem: Problem, group: np.ndarray, linear: list[np.ndarray]) -> dict[tuple[int, int], np.ndarray]:
    """Edges between groups, parallel ones summed, keyed (low, high); an edge inside a group
    adds its diagonal to ``linear`` of that group (in place)."""
    pairs: dict[tuple[int, int], np.ndarray] = {}
    for e, (u, v) in enumerate(problem.edges.tolist()):
        m = problem.edge_costs[e]
        gu, gv = int(group[u]), int(group[v])
        if gu == gv:
            linear[gu] = linear[gu] + np.diag(m)
            continue
        key, mat = ((gu, gv), m) if gu < gv else ((gv, gu), m.T)
        pairs[key] = pairs[key] + mat if key in pairs else mat.astype(np.float64, copy=True)
    return pairs


def quotient(problem: Problem) -> tuple[Problem, np.ndarray]:
    """(quotient problem, ``group[v]``: the quotient node of each original node); the one the
    problem carries where it does (:attr:`~solver.problem.Problem.tie_quotient`)."""
    if problem.tie_quotient is not None:
        return problem.tie_quotient
    n = problem.num_nodes
    heads, group = np.unique(tie_heads(problem), return_inverse=True)
    costs = [np.zeros(problem.num_strategies(int(h))) for h in heads]
    allowed = [np.ones(problem.num_strategies(int(h)), dtype=bool) for h in heads]
    for v in range(n):
        costs[group[v]] = costs[group[v]] + problem.node_costs[v]
        allowed[group[v]] &= problem.allowed(v)
    pairs = merge_edges(problem, group, costs)
    costs = [np.where(a, c, 2 * FORBIDDEN) for c, a in zip(costs, allowed)]
    edges = np.array(list(pairs), dtype=np.int64).reshape(-1, 2)
    q = Problem(
        node_costs=costs,
        node_usages=[np.zeros_like(c) for c in costs],
        intervals=np.zeros((len(heads), 2), dtype=np.int64),
        edges=edges,
        edge_costs=list(pairs.values()),
        name=f"{problem.name} (tie quotient)",
    )
    return q, group
