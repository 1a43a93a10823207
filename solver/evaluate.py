"""Exact evaluation of a choice of one strategy per node."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from solver.problem import FORBIDDEN, Problem


@dataclass(frozen=True)
class Evaluation:
    """Cost and feasibility of one assignment."""

    cost: float
    """Sum of chosen node costs and edge costs (exactly rounded sum)."""
    feasible: bool
    """No forbidden choice, pins and ties respected, memory within the limit."""
    peak_usage: float
    """Largest total usage over all time points."""
    peak_time: int | None
    """A time point where ``peak_usage`` is reached (None for an empty problem)."""
    reason: str = ""
    """Why the assignment is infeasible (empty when feasible)."""


def memory_profile(problem: Problem, usage_per_node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Total usage over time as a step function: ``(times, usage)``.

    ``usage[k]`` holds on ``[times[k], times[k+1])``. Built by a sweep over interval
    endpoints, so it costs O(n log n) whatever the length of the time axis.
    """
    return interval_profile(problem.intervals[:, 0], problem.intervals[:, 1], usage_per_node)


def interval_profile(lo: np.ndarray, hi: np.ndarray, usage_per_node: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`memory_profile` of any intervals ``[lo, hi)`` with their usages."""
    live = hi > lo
    times = np.concatenate([lo[live], hi[live]])
    deltas = np.concatenate([usage_per_node[live], -usage_per_node[live]])
    if times.size == 0:
        return np.zeros(0, np.int64), np.zeros(0)
    order = np.argsort(times, kind="stable")
    t_sorted, d_sorted = times[order], deltas[order]
    uniq, start = np.unique(t_sorted, return_index=True)
    summed = np.add.reduceat(d_sorted, start)
    return uniq, np.cumsum(summed)


def evaluate(problem: Problem, choice) -> Evaluation:
    """Cost, feasibility and peak memory of ``choice[v]`` (a strategy index per node)."""
    choice = np.asarray(choice, dtype=np.int64)
    n = problem.num_nodes
    if choice.shape != (n,):
        raise ValueError(f"choice: expected {n} strategy indices, found shape {choice.shape}")
    sizes = np.fromiter((c.size for c in problem.node_costs), np.int64, n)
    out = np.nonzero((choice < 0) | (choice >= sizes))[0]
    if out.size:
        v = int(out[0])
        raise ValueError(f"choice[{v}] = {choice[v]} is out of range: node has {problem.num_strategies(v)} strategies")
    # Python ints index the per-node arrays: numpy integers as indices cost twice as much, on
    # every evaluation of the searches' tens of thousands of nodes.
    picked = choice.tolist()
    terms = [c[i] for c, i in zip(problem.node_costs, picked)]
    terms += [m[picked[u], picked[v]] for m, (u, v) in zip(problem.edge_costs, problem.edges.tolist())]
    cost = math.fsum(terms)
    reason = ""
    if terms and max(terms) >= FORBIDDEN:
        reason = "a forbidden strategy or strategy pair is chosen"
    for v, i in problem.pins.items():
        if choice[v] != i and not reason:
            reason = f"node {v} is pinned to {i} but takes {choice[v]}"
    for group in problem.ties:
        if len({picked[v] for v in group}) > 1 and not reason:
            reason = f"tied nodes {group} take different strategies {[picked[v] for v in group]}"
    usage = np.array([u[i] for u, i in zip(problem.node_usages, picked)], dtype=np.float64)
    times, total = memory_profile(problem, usage)
    if total.size:
        k = int(np.argmax(total))
        peak, peak_t = float(total[k]), int(times[k])
    else:
        peak, peak_t = 0.0, None
    if problem.usage_limit is not None and peak > problem.usage_limit and not reason:
        reason = f"usage {peak:g} at time {peak_t} exceeds the limit {problem.usage_limit:g}"
    return Evaluation(cost=cost, feasible=not reason, peak_usage=peak, peak_time=peak_t, reason=reason)
