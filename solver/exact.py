r"""The whole problem as one cost function network: toulbar2 with memory as knapsack rows.

Over the tie quotient (one variable per tie group, :func:`solver.highs_model.reduce`):

    min   sum_g c_g(x_g) + sum_(g,h) C_gh(x_g, x_h)
    s.t.  sum_g a_kg(x_g) <= L - b_k      for every memory row k (:mod:`solver.memrows`)

The pairwise part is toulbar2's own ground (no edge variables: a table per pair of
groups); each memory row is a knapsack constraint that toulbar2 propagates during the
search, so the answer is exact, and proved optimal when the search completes. Past
``exact_child.LAZY_ROWS`` rows the searches post them as their answers break them
(:func:`solver.cfn.solve_lazy`): the rows posted are a relaxation, so what holds every row
is an answer and what is proved over them holds for all. This is
the model where memory binds and the graph is small once ties are quotiented: planner
problems (LLaMA-70B on (8, 8, 8): 20,930 nodes -> 311 groups, 6,979 memory segments
-> 121 rows, proved optimal in seconds) and the small tight contest instances (IOPDDL V,
where the MILP with 790k edge variables returns 57 times the best known cost). It is not
always the stronger search: where the knapsacks propagate weakly the MILP's LP bound
wins (a 2-layer LLaMA-8B on (2, 4, 8): the MILP proves the optimum in 48 s, toulbar2
sits 68% above it), so :func:`solver.solve` runs the two side by side on two cores
(toulbar2 in the calling process, the MILP in :mod:`solver.milp_child`).

Usages are integers (bytes) in every problem seen; fractional ones are rounded up,
which keeps every answer feasible but proves nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from solver import cfn
from solver.core import cost_scale
from solver.evaluate import Evaluation, evaluate
from solver.highs_model import Reduced, reduce
from solver.memrows import RowsTooLarge, memory_rows
from solver.problem import Problem

#: Knapsack entries (strategy coefficients summed over rows) the exact model may hold.
MAX_ENTRIES = 5e6


@dataclass(frozen=True)
class ExactResult:
    choice: np.ndarray | None
    """One strategy per node of the original problem, or None when nothing was found."""
    proved: bool
    """The choice is optimal for the whole problem (memory included)."""
    lower_bound: float | None
    """A proven lower bound on the optimum (None when the rows were rounded)."""
    stats: dict
    evaluation: Evaluation | None = None
    """``choice`` evaluated on the whole problem."""


@dataclass
class ExactModel:
    """The network toulbar2 reads (:func:`solver.cfn.solve_tables`'s arguments) and the map back."""

    costs: list[np.ndarray]
    tables: dict[tuple[int, int], np.ndarray]
    rows: list[cfn.KnapsackRow]
    scale: float
    exact: bool
    """Every row's weights were integers (else rounded up: feasible answers, no proof)."""
    allowed: list[np.ndarray]
    rep: np.ndarray
    index: np.ndarray
    """``index[head]``: the network variable of a tie group's head (-1 for other nodes)."""
    stats: dict
    reduced: Reduced
    """The reductions it was built from (the MILP beside it reuses them)."""

    def choice(self, picked) -> np.ndarray:
        return np.array([self.allowed[h][picked[self.index[h]]] for h in self.rep.tolist()], dtype=np.int64)

    def values(self, choice: np.ndarray) -> np.ndarray:
        """A choice of the problem as a value per network variable (its tie group's head's
        strategy); a strategy the network dropped (dominated) becomes the variable's cheapest value."""
        heads = np.nonzero(self.index >= 0)[0]
        picked = np.empty(heads.size, dtype=np.int64)
        for h in heads.tolist():
            var, where = int(self.index[h]), np.nonzero(self.allowed[h] == choice[h])[0]
            picked[var] = int(where[0]) if where.size else int(np.argmin(self.costs[var]))
        return picked

    @property
    def entries(self) -> int:
        """Cost-table entries, unary and pairwise: the network's size, what a search step costs."""
        return sum(int(c.size) for c in self.costs) + sum(int(m.size) for m in self.tables.values())


def build_exact(problem: Problem, reference: float | None = None) -> ExactModel:
    """The exact network of ``problem``; :class:`solver.memrows.RowsTooLarge` when the rows pass
    :data:`MAX_ENTRIES`. ``reference`` (a cost of the right magnitude) sets the integer scale."""
    t0 = time.perf_counter()
    red = reduce(problem, memory=True)
    mr = memory_rows(problem, red.rep, red.allowed, MAX_ENTRIES)
    heads = np.unique(red.rep)
    index = np.full(problem.num_nodes, -1, dtype=np.int64)
    index[heads] = np.arange(heads.size)
    costs = [red.linear[h][red.allowed[h]] for h in heads.tolist()]
    tables = {(int(index[a]), int(index[b])): m[np.ix_(red.allowed[a], red.allowed[b])]
              for (a, b), m in red.pairs.items()}
    exact = True
    rows = []
    for row in mr.rows:
        weights = [np.ceil(c).astype(np.int64) for c in row.coefs]
        # Integer weights: sum <= rhs <=> sum <= floor(rhs), so only rounded weights lose exactness.
        exact &= all(np.array_equal(c, w) for c, w in zip(row.coefs, weights))
        rows.append(([(int(index[h]), w) for h, w in zip(row.groups.tolist(), weights)], int(np.floor(row.rhs))))
    scale = cost_scale(problem, reference if reference is not None else np.inf)
    stats = {"groups": int(heads.size), "memory_rows": len(mr.rows), "memory_segments": mr.segments,
             "knapsack_entries": mr.entries, "build_s": round(time.perf_counter() - t0, 3)}
    return ExactModel(costs, tables, rows, scale, exact, red.allowed, red.rep, index, stats, red)


def finish(problem: Problem, model: ExactModel, picked, proved: bool, gap: float) -> ExactResult:
    """toulbar2's answer as a choice for ``problem``, with its bound when the rows were exact."""
    if picked is None:
        return ExactResult(None, False, None, model.stats)
    choice = model.choice(picked)
    ev = evaluate(problem, choice)
    lower = ev.cost - gap if model.exact and np.isfinite(gap) else None
    return ExactResult(choice, proved and model.exact, lower, model.stats, ev)


def solve_exact(problem: Problem, seconds: float, upper: float | None = None,
                reference: float | None = None) -> ExactResult:
    """toulbar2 on the tie quotient with the memory rows, in this process. With ``upper`` (a
    feasible cost) only cheaper answers are searched."""
    t0 = time.perf_counter()
    model = build_exact(problem, reference if reference is not None else upper)
    left = max(1.0, seconds - (time.perf_counter() - t0))
    picked, proved, gap = cfn.solve_tables(model.costs, model.tables, left, model.scale, upper, model.rows)
    return finish(problem, model, picked, proved, gap)


__all__ = ["ExactModel", "ExactResult", "RowsTooLarge", "build_exact", "finish", "solve_exact",
           "MAX_ENTRIES"]
