"""The Lagrangian stage (:mod:`solver.lagrange`): its bound holds, its plans fit, and a solve
whose gap it proves ends there."""

import importlib
import time

import numpy as np
import pytest
from test_solver import brute_force, random_problem

from solver import evaluate, solve
from solver.lagrange import lagrange_memory

pytest.importorskip("pytoulbar2")
solve_module = importlib.import_module("solver.solve")


def _binding(seed: int, n: int = 8):
    """A random problem whose memory-free optimum breaks its limit while some plan fits, its
    memory-free optimum and its optimum."""
    rng = np.random.default_rng(seed)
    for _ in range(500):
        p = random_problem(rng, n=n, kmax=3, density=0.35, limit=True, ties=seed % 2 == 0)
        free = solve_module.memory_free(p.replaced(usage_limit=None), 5)
        if free is None or not free.proved or evaluate(p, free.choice).feasible:
            continue
        best = brute_force(p)
        if best is not None:
            return p, free, best
    raise AssertionError("no problem whose memory binds")


@pytest.mark.parametrize("seed", range(12))
def test_the_bound_holds_and_every_plan_fits(seed):
    """Every round's bound is weak duality's: no plan that fits costs less than it (checked by
    enumeration); every plan it returns fits and costs what it says."""
    p, free, best = _binding(seed)
    ans = lagrange_memory(p, free.choice, free.lower_bound, deadline=time.perf_counter() + 60, gap=0.0, max_rounds=8)
    assert ans.rounds >= 1
    assert ans.lower <= best + 1e-6
    for plan in ans.plans:
        assert evaluate(p, plan).feasible
    if ans.choice is not None:
        assert evaluate(p, ans.choice).cost == pytest.approx(ans.cost) and ans.cost >= best - 1e-9


def test_a_solve_ends_at_the_stage_where_it_proves_the_gap():
    """With a gap the stage's bound reaches, the solve's answer is the stage's, proved within that
    gap of the enumerated optimum; with the default gap (below ``LAGRANGE_MIN_GAP``) the stage
    does not run and the exact search proves the optimum."""
    ended = 0
    for seed in range(40):
        p, free, best = _binding(1000 + seed)
        gap = 0.05
        sol = solve(p, time_limit=10, mip_gap=gap)
        assert evaluate(p, sol.choice).feasible and sol.lower_bound <= best + 1e-6
        assert sol.cost <= best * (1 + gap) + 1e-6
        if sol.source == "lagrange":
            ended += 1
            assert sol.status.value == "optimal" and sol.stats["lagrange"]["rounds"] >= 1
        if "lagrange" in sol.stats:  # whether the stage ended the solve, or the searches after it ran
            assert sol.stats["lagrange"]["answered"] == ("exact" not in sol.stats and "milp_skipped" not in sol.stats)
        tight = solve(p, time_limit=10)
        assert "lagrange" not in tight.stats and tight.cost == pytest.approx(best)
        # Turned off, the stage does not run and the searches after it answer within the gap.
        off = solve(p, time_limit=10, mip_gap=gap, lagrange=False)
        assert "lagrange" not in off.stats and evaluate(p, off.choice).feasible
        assert off.cost <= best * (1 + gap) + 1e-6
    assert ended >= 1
