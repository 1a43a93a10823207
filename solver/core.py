"""The eliminated core of a pairwise network, solved round after round under changing node costs.

Searches that re-price memory every round (:mod:`solver.weights`) solve the same
core graph many times with costs that move little between rounds. Coordinate
descent from the last round's answer gives a choice at once; toulbar2
(:mod:`solver.cfn`) then only searches for cheaper ones, so a round's answer is
never worse than last round's under the new costs.
"""

from __future__ import annotations

import numpy as np

from solver import cfn
from solver.problem import FORBIDDEN, Problem


class CoreSolver:
    """``__call__(costs, edges)``: a choice per core node (the ``core_solver`` of
    :meth:`solver.eliminate.Eliminator.solve`), warm-started from the previous call."""

    def __init__(self, seconds: float, scale: float):
        self.seconds = seconds
        """toulbar2's time limit per call."""
        self.scale = scale
        """Integer scale for toulbar2's costs (:func:`cost_scale`)."""
        self.previous: list[int] | None = None
        self.gap = np.inf
        """How far the last core answer may be above the core optimum (inf: no bound)."""

    def __call__(self, costs: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray]) -> list[int]:
        start = descend(costs, edges, self.previous) if self.previous is not None else None
        upper = table_cost(costs, edges, start) if start is not None else None
        if upper is not None and not upper < FORBIDDEN:
            upper = None
        picked, _, self.gap = cfn.solve_tables(costs, edges, self.seconds, self.scale, upper)
        if picked is None:
            picked = start if start is not None else descend(costs, edges, None)
        self.previous = list(picked)
        return self.previous


def table_cost(costs, edges, choice) -> float:
    return float(sum(c[i] for c, i in zip(costs, choice))
                 + sum(m[choice[a], choice[b]] for (a, b), m in edges.items()))


def descend(costs, edges, start, sweeps: int = 50, pairs: bool = False) -> list[int]:
    """Coordinate descent on a pairwise network from ``start`` (per-node argmin when None):
    single-node moves to a local minimum, then (with ``pairs``) joint moves of the two ends
    of each edge, which leave minima where any single move would cross a forbidden or
    costly pair; repeated while either improves, at most ``sweeps`` times."""
    n = len(costs)
    choice = list(start) if start is not None and len(start) == n else [int(np.argmin(c)) for c in costs]
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for (a, b), m in edges.items():
        nbrs[a].append((b, m))
        nbrs[b].append((a, m.T))

    def local(v):
        x = costs[v].copy()
        for w, m in nbrs[v]:
            x += m[:, choice[w]]
        return x

    for _ in range(sweeps):
        changed = False
        for v in range(n):
            x = local(v)
            i = int(np.argmin(x))
            if x[i] < x[choice[v]]:
                choice[v], changed = i, True
        if changed or not pairs:
            if not changed:
                break
            continue
        for (a, b), m in edges.items():
            la = local(a) - m[:, choice[b]]
            lb = local(b) - m[choice[a], :]
            joint = la[:, None] + lb[None, :] + m
            i, j = divmod(int(np.argmin(joint)), joint.shape[1])
            if joint[i, j] < joint[choice[a], choice[b]] - 1e-9 * max(1.0, abs(joint[i, j])):
                choice[a], choice[b], changed = i, j, True
        if not changed:
            break
    return choice


def cost_scale(problem: Problem, reference: float) -> float:
    """Integer scale for toulbar2: the reference cost maps to ~1e12 (costs to ~1e-12 relative
    precision, far below toulbar2's int64 ceiling), at most 1000 units per cost unit."""
    if not np.isfinite(reference) or reference >= FORBIDDEN or reference <= 0:
        low = sum(float(c[problem.allowed(v)].min(initial=0)) for v, c in enumerate(problem.node_costs))
        low += sum(float(m.min()) for m in problem.edge_costs if m.size)
        reference = max(1.0, 1000.0 * low)
    return float(min(1000.0, 1e12 / reference))
