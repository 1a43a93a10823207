"""``solve``: incumbent heuristics, then the MILP, returning the best feasible answer."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pulp

from solver import heuristic, ilp
from solver.evaluate import evaluate, memory_profile
from solver.problem import Problem

BACKENDS = ("highs", "cbc")


class InfeasibleError(ValueError):
    """No choice of strategies fits the memory limit."""

    def __init__(self, message: str, min_feasible_limit_bound: float, binding_times: list[int]):
        super().__init__(message)
        self.min_feasible_limit_bound = min_feasible_limit_bound
        """A lower bound on the smallest usage limit for which a solution exists."""
        self.binding_times = binding_times
        """Time points where even the least-usage choices exceed the limit."""


@dataclass
class Solution:
    """One strategy per node, with how good it is known to be."""

    choice: np.ndarray
    """``choice[v]``: the strategy index of node v."""
    cost: float
    """Exact objective of ``choice``."""
    status: str
    """``optimal``, ``feasible`` (time limit or gap reached) or ``heuristic`` (MILP found nothing better)."""
    lower_bound: float | None = None
    """Best proven lower bound on the optimum, when the backend reports one."""
    seconds: float = 0.0
    peak_usage: float = 0.0
    backend: str = ""
    stats: dict = field(default_factory=dict)

    @property
    def gap(self) -> float | None:
        """Relative gap (cost - bound) / |cost|, when a bound is known."""
        if self.lower_bound is None:
            return None
        return max(0.0, (self.cost - self.lower_bound) / max(abs(self.cost), 1e-12))

    def to_list(self) -> list[int]:
        return [int(i) for i in self.choice]


class _HighsWithStart(pulp.HiGHS):
    """PuLP's HiGHS API, plus a MIP start and the dual bound read back."""

    def callSolver(self, lp):  # noqa: N802 (PuLP's name)
        import highspy

        if self.optionsDict.get("warmStart"):
            sol = highspy.HighsSolution()
            sol.col_value = [float(v.varValue) if v.varValue is not None else 0.0 for v in lp.variables()]
            sol.value_valid = True
            lp.solverModel.setSolution(sol)
        lp.solverModel.setOptionValue("random_seed", 0)
        super().callSolver(lp)
        info = lp.solverModel.getInfo()
        self.dual_bound = float(info.mip_dual_bound) if math.isfinite(info.mip_dual_bound) else None
        self.primal_ok = info.primal_solution_status >= 2


def memory_lower_bound(problem: Problem) -> tuple[float, list[int]]:
    """Peak usage when every node takes its least-usage allowed strategy, and where it peaks."""
    usage = np.array(
        [problem.node_usages[v][problem.allowed(v)].min(initial=np.inf) for v in range(problem.num_nodes)]
    )
    times, total = memory_profile(problem, usage)
    if total.size == 0:
        return 0.0, []
    peak = float(total.max())
    limit = problem.usage_limit if problem.usage_limit is not None else np.inf
    binding = times[total > limit].tolist()
    return peak, [int(t) for t in binding]


def solve(
    problem: Problem,
    time_limit: float = 60.0,
    backend: str = "highs",
    mip_gap: float = 1e-6,
    log: Callable[[str], None] | None = None,
) -> Solution:
    """Pick one strategy per node minimizing cost under the memory limit.

    Raises :class:`InfeasibleError` when even the least-usage strategies exceed the
    limit. Always returns the best feasible choice it found within ``time_limit``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, found {backend!r}")
    if time_limit <= 0:
        raise ValueError(f"time_limit must be > 0 seconds, found {time_limit}")
    say = log or (lambda _msg: None)
    t0 = time.perf_counter()
    if problem.usage_limit is not None:
        floor, binding = memory_lower_bound(problem)
        if floor > problem.usage_limit:
            raise InfeasibleError(
                f"memory limit {problem.usage_limit:g} is infeasible: even the least-usage strategies "
                f"need {floor:g} at time(s) {binding[:5]}; the limit must be >= {floor:g}",
                floor,
                binding,
            )
    start = heuristic.initial_choice(problem)
    # The incumbent gets a tenth of the time; the MILP the rest.
    start = heuristic.local_search(problem, start, deadline=t0 + 0.1 * time_limit)
    best = evaluate(problem, start)
    best_choice, status = start, "heuristic"
    say(f"incumbent: cost {best.cost:.6g} (feasible={best.feasible}) after {time.perf_counter() - t0:.2f}s")

    model = ilp.build(problem)
    say(f"ilp: {model.stats['variables']} variables, {model.stats['constraints']} constraints "
        f"after {time.perf_counter() - t0:.2f}s")
    if best.feasible:
        ilp.set_start(model, problem, best_choice)
    remaining = max(0.1, time_limit - (time.perf_counter() - t0))
    if backend == "highs":
        solver = _HighsWithStart(msg=False, timeLimit=remaining, gapRel=mip_gap, threads=1,
                                 warmStart=best.feasible)
    else:
        solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=remaining, gapRel=mip_gap, warmStart=best.feasible,
                                   options=["randomSeed 0", "randomCbcSeed 0"])
    lp_status = model.lp.solve(solver)
    lower = getattr(solver, "dual_bound", None)
    if lower is not None:
        # PuLP does not hand the objective's constant to HiGHS.
        lower += float(model.lp.objective.constant)
    choice = ilp.extract(model, problem)
    if choice is not None:
        ev = evaluate(problem, choice)
        if ev.feasible and (not best.feasible or ev.cost <= best.cost):
            best, best_choice = ev, choice
            status = "optimal" if pulp.LpStatus[lp_status] == "Optimal" else "feasible"
    if not best.feasible:
        floor, binding = memory_lower_bound(problem)
        raise InfeasibleError(
            f"no feasible assignment found ({pulp.LpStatus[lp_status]}): {best.reason}; "
            f"the least-usage strategies peak at {floor:g}",
            floor,
            binding,
        )
    if status == "optimal" and lower is None:
        lower = best.cost
    seconds = time.perf_counter() - t0
    say(f"solved: {status}, cost {best.cost:.6g}, bound {lower}, {seconds:.2f}s")
    return Solution(
        choice=best_choice,
        cost=best.cost,
        status=status,
        lower_bound=lower,
        seconds=seconds,
        peak_usage=best.peak_usage,
        backend=backend,
        stats={**problem.stats(), **{k: v for k, v in model.stats.items()}},
    )
