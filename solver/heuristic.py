"""Cheap incumbents and repairs: a memory-first start, single-node local search, joint
moves out of forbidden pairs, and a greedy repair of memory overflow.

The MILP is handed the best of these as a warm start, and ``solve`` never
returns anything worse, so a stalled MILP still yields a usable plan.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from solver.local import Adjacency, Memory, local_cost, tie_groups
from solver.problem import FORBIDDEN, Problem


def initial_choice(problem: Problem) -> np.ndarray:
    """Per tie group, the allowed strategy of least usage (ties broken by cost)."""
    choice = np.zeros(problem.num_nodes, dtype=np.int64)
    for g in tie_groups(problem):
        ok = np.logical_and.reduce([problem.allowed(v) for v in g])
        usage = sum(problem.node_usages[v] for v in g)
        cost = sum(problem.node_costs[v] for v in g)
        key = np.where(ok, 0, 1)
        order = np.lexsort((cost, usage, key))
        choice[g] = order[0]
    return choice


def local_search(problem: Problem, choice: np.ndarray, max_rounds: int = 20,
                 deadline: float | None = None, now: Callable[[], float] = time.perf_counter) -> np.ndarray:
    """Move one tie group at a time to its cheapest strategy that keeps memory within the limit.

    Stops after a sweep without improvement, ``max_rounds`` sweeps, or at ``deadline``
    (a value of ``now``: the wall clock, or a :class:`solver.clock.WorkClock`).
    """
    adj = Adjacency(problem)
    groups = tie_groups(problem)
    choice = choice.copy()
    mem = Memory(problem, choice)
    for _ in range(max_rounds):
        improved = False
        for g in groups:
            if deadline is not None and now() > deadline:
                return choice
            gain = sum(local_cost(problem, adj, choice, v) for v in g)
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
                 max_rounds: int = 5, now: Callable[[], float] = time.perf_counter) -> np.ndarray:
    """Move both ends of each edge whose chosen pair is forbidden (or costly) at once.

    Single-node moves cannot leave a forbidden pair when every other strategy of
    either end is forbidden with some third neighbour; a joint move of the two ends
    to their best compatible pair often can. Memory is checked for the joint move.
    """
    adj = Adjacency(problem)
    groups = {v: g for g in tie_groups(problem) for v in g}
    choice = choice.copy()
    mem = Memory(problem, choice)
    for _ in range(max_rounds):
        changed = False
        for e, (u, v) in enumerate(problem.edges.tolist()):
            if deadline is not None and now() > deadline:
                return choice
            m = problem.edge_costs[e]
            if m[choice[u], choice[v]] < FORBIDDEN or u == v or len(groups[u]) > 1 or len(groups[v]) > 1:
                continue
            cu = local_cost(problem, adj, choice, u) - m[:, choice[v]]
            cv = local_cost(problem, adj, choice, v) - m[choice[u], :]
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


def repair_memory(problem: Problem, choice: np.ndarray, deadline: float,
                  now: Callable[[], float] = time.perf_counter) -> np.ndarray | None:
    """From a choice that breaks the memory limit (the memory-free optimum), move one tie group
    at a time to a strategy of less usage at the fullest segment, the one that costs least per
    byte it frees there, until every segment fits; None when no move frees anything or at
    ``deadline``. Tied groups move whole, so the answer keeps the ties; untied nodes are groups
    of one."""
    if problem.usage_limit is None:
        return choice
    choice = choice.copy()
    mem = Memory(problem, choice)
    adj = Adjacency(problem)
    groups = tie_groups(problem)
    group_of = np.zeros(problem.num_nodes, dtype=np.int64)
    for k, g in enumerate(groups):
        group_of[g] = k
    allowed = [np.logical_and.reduce([problem.allowed(v) for v in g]) for g in groups]
    limit = problem.usage_limit
    while now() < deadline:
        k = int(np.argmax(mem.total))
        if mem.total[k] <= limit:
            return choice
        live = np.nonzero((mem.a <= k) & (k < mem.b))[0]
        best, best_rate = None, np.inf
        for gk in np.unique(group_of[live]).tolist():
            g = groups[gk]
            here = [v for v in g if mem.a[v] <= k < mem.b[v]]
            cur = int(choice[g[0]])
            freed = sum(problem.node_usages[v][cur] - problem.node_usages[v] for v in here)
            ok = allowed[gk] & (freed > 0)
            if not ok.any():
                continue
            lc = sum(local_cost(problem, adj, choice, v) for v in g)
            rate = np.where(ok & (lc < FORBIDDEN), (lc - lc[cur]) / np.where(ok, freed, 1.0), np.inf)
            i = int(np.argmin(rate))
            if rate[i] < best_rate:
                best, best_rate = (gk, i), rate[i]
        if best is None:
            return None
        gk, i = best
        g = groups[gk]
        mem.move(g, int(choice[g[0]]), i)
        choice[g] = i
    return None


def repair_and_polish(problem: Problem, choice: np.ndarray, deadline: float) -> np.ndarray | None:
    """:func:`repair_memory`, then :func:`local_search` from its answer (None where nothing fits)."""
    fixed = repair_memory(problem, choice, deadline)
    return None if fixed is None else local_search(problem, fixed, max_rounds=1000, deadline=deadline)
