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
from solver.descent import descend
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


def cost_scale(problem: Problem, reference: float) -> float:
    """Integer scale for toulbar2: the reference cost maps to ~1e12 (costs to ~1e-12 relative
    precision, far below toulbar2's int64 ceiling), at most 1000 units per cost unit."""
    if not np.isfinite(reference) or reference >= FORBIDDEN or reference <= 0:
        low = sum(float(c[problem.allowed(v)].min(initial=0)) for v, c in enumerate(problem.node_costs))
        low += sum(float(m.min()) for m in problem.edge_costs if m.size)
        reference = max(1.0, 1000.0 * low)
    return float(min(1000.0, 1e12 / reference))
