"""The MILP of :mod:`solver.highs_model` as a PuLP model, solved with CBC (``backend="cbc"``).

Both backends solve the one model :func:`solver.highs_model.build` makes: the same
columns, rows, reductions and memory rows. PuLP is the model builder for CBC, for any
other solver PuLP drives, and for users who want the model (``to_pulp(...).lp.writeLP``).
It creates one Python object per variable and coefficient, so it is for models of
modest size: the IOPDDL instances go to HiGHS.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pulp

from solver.highs_model import ArrayModel, extract, row_matrix, start_vector


@dataclass
class PulpModel:
    """The PuLP problem and its columns, in the array model's order."""

    lp: pulp.LpProblem
    cols: list[pulp.LpVariable]


def to_pulp(model: ArrayModel, name: str = "autoshard") -> PulpModel:
    """Columns as variables (integer where the array model says so), rows as constraints."""
    lp = pulp.LpProblem(name, pulp.LpMinimize)
    cols = [pulp.LpVariable(f"{'x' if model.integer[k] else 'y'}_{k}", 0, float(model.upper[k]),
                            cat="Binary" if model.integer[k] and model.upper[k] > 0 else "Continuous")
            for k in range(model.cost.size)]
    lp += pulp.LpAffineExpression([(cols[k], float(c)) for k, c in enumerate(model.cost) if c != 0],
                                  constant=model.const)
    starts, c, v, lower, upper = row_matrix(model)
    for r in range(model.n_rows):
        lo, hi = starts[r], starts[r + 1] if r + 1 < model.n_rows else c.size
        expr = pulp.LpAffineExpression([(cols[int(c[k])], float(v[k])) for k in range(lo, hi)])
        if lower[r] == upper[r]:
            lp += expr == float(upper[r]), f"r{r}"
        else:
            if np.isfinite(upper[r]):
                lp += expr <= float(upper[r]), f"r{r}_le"
            if np.isfinite(lower[r]):
                lp += expr >= float(lower[r]), f"r{r}_ge"
    return PulpModel(lp, cols)


def solve_model(model: ArrayModel, n: int, seconds: float, mip_gap: float, start: np.ndarray | None = None
                ) -> tuple[np.ndarray | None, float | None, bool]:
    """CBC on ``model`` (of a problem with ``n`` nodes), as :func:`solver.highs_model.solve_model`:
    (choice or None, lower bound or None (CBC through PuLP reports none), proved optimal)."""
    if model.cost.size == 0:  # the reductions fixed every node
        return extract(model, np.zeros(0), n), model.const, True
    pm = to_pulp(model)
    if start is not None:
        for col, value in zip(pm.cols, start_vector(model, start)):
            col.setInitialValue(value)
    cbc = pulp.PULP_CBC_CMD(msg=False, timeLimit=max(0.1, seconds), gapRel=mip_gap, warmStart=start is not None,
                            options=["randomSeed 0", "randomCbcSeed 0"])
    pm.lp.solve(cbc)
    # sol_status tells a proved optimum from an integer answer cut off by the time limit
    # (LpStatus reads "Optimal" for both).
    found = pm.lp.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
    values = np.array([col.varValue if col.varValue is not None else 0.0 for col in pm.cols])
    choice = extract(model, values, n) if found else None
    optimal = pm.lp.sol_status == pulp.LpSolutionOptimal
    return choice, (float(pulp.value(pm.lp.objective)) if optimal else None), optimal
