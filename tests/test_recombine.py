"""Merge search (solver.recombine) and the memory rows that cannot bind (solver.memrows)."""

import itertools
import time

import numpy as np
import pytest
from test_solver import random_problem

from solver import Problem, evaluate
from solver.highs_model import build
from solver.memrows import kept_segments, least_usage
from solver.recombine import merge


def restricted_optimum(p, base, others):
    """Brute force over every mix: each node takes the strategy of one of the answers."""
    opts = np.stack([base, *others])
    best = None
    for choice in itertools.product(*[sorted(set(opts[:, v].tolist())) for v in range(p.num_nodes)]):
        ev = evaluate(p, choice)
        if ev.feasible and (best is None or ev.cost < best):
            best = ev.cost
    return best


def feasible_start(rng, p):
    base = np.array([int(np.argmin(u)) for u in p.node_usages])
    p.usage_limit = float(max(p.usage_limit, evaluate(p, base).peak_usage))
    for _ in range(20):  # a random feasible answer, so the merge has something to gain
        trial = np.array([int(rng.integers(p.num_strategies(v))) for v in range(p.num_nodes)])
        if evaluate(p, trial).feasible:
            return trial
    return base


@pytest.mark.parametrize("seed", range(16))
def test_merge_is_the_best_mix_of_its_answers(seed):
    rng = np.random.default_rng(700 + seed)
    p = random_problem(rng, n=9, kmax=4, density=0.35, limit=True, forbid=seed % 2 == 0)
    base = feasible_start(rng, p)
    others = [np.array([int(rng.integers(p.num_strategies(v))) for v in range(p.num_nodes)])
              for _ in range(1 + seed % 3)]
    got = merge(p, base, others, time.perf_counter() + 10)
    if not evaluate(p, base).feasible:  # a forbidden pair in every start tried: nothing to merge from
        assert got is None
        return
    best = restricted_optimum(p, base, others)
    if got is None:
        assert best == pytest.approx(evaluate(p, base).cost)
        return
    ev = evaluate(p, got)
    assert ev.feasible, ev.reason
    assert ev.cost == pytest.approx(best)
    assert ev.cost < evaluate(p, base).cost
    opts = np.stack([base, *others])
    assert all(got[v] in opts[:, v] for v in range(p.num_nodes))


def test_merge_keeps_what_an_overflowing_answer_gains_where_memory_allows():
    """A chain of four nodes, two strategies each (cheap and big, or dear and small), and room
    for two big ones: the cheap answer breaks the limit, the small one fits, the merge takes
    the two cheapest gains."""
    costs = [np.array([1.0, 10.0]), np.array([1.0, 20.0]), np.array([1.0, 5.0]), np.array([1.0, 30.0])]
    usages = [np.array([10.0, 1.0])] * 4
    p = Problem(costs, usages, np.array([[0, 4]] * 4), np.array([[0, 1], [1, 2], [2, 3]]),
                [np.zeros((2, 2))] * 3, usage_limit=22.0)
    small, cheap = np.ones(4, dtype=int), np.zeros(4, dtype=int)
    assert not evaluate(p, cheap).feasible
    got = merge(p, small, [cheap], time.perf_counter() + 10)
    assert got.tolist() == [1, 0, 1, 0]
    assert evaluate(p, got).cost == 10 + 1 + 5 + 1


def test_merge_keeps_ties():
    costs = [np.array([1.0, 10.0])] * 4
    usages = [np.array([10.0, 1.0])] * 4
    p = Problem(costs, usages, np.array([[0, 4]] * 4), np.zeros((0, 2), int), [], usage_limit=22.0,
                ties=[[0, 3]])
    got = merge(p, np.ones(4, dtype=int), [np.zeros(4, dtype=int)], time.perf_counter() + 10)
    ev = evaluate(p, got)
    assert ev.feasible and got[0] == got[3] and ev.cost == 1 + 1 + 10 + 10


def test_merge_declines_an_infeasible_base_and_equal_answers():
    p = Problem([np.array([1.0, 2.0])], [np.array([5.0, 1.0])], np.array([[0, 1]]), np.zeros((0, 2), int), [],
                usage_limit=2.0)
    assert merge(p, np.array([0]), [np.array([1])], time.perf_counter() + 5) is None  # base breaks the limit
    assert merge(p, np.array([1]), [np.array([1])], time.perf_counter() + 5) is None


def test_rows_that_cannot_bind_are_dropped():
    """Two runs of segments: on the first even the largest usages fit, on the second they do
    not. Only the second gives a row, and the MILP's memory rows say the same."""
    costs = [np.array([2.0, 1.0])] * 3  # the larger usage is cheaper: nothing dominated
    usages = [np.array([1.0, 4.0]), np.array([1.0, 4.0]), np.array([1.0, 9.0])]
    p = Problem(costs, usages, np.array([[0, 2], [0, 4], [2, 4]]), np.zeros((0, 2), int), [], usage_limit=10.0)
    allowed = [np.arange(2)] * 3
    low, varying = least_usage(p, allowed)
    spread = np.array([3.0, 3.0, 8.0])
    assert kept_segments(p, varying, low).keep.sum() == 2
    seg = kept_segments(p, varying, low, spread)
    assert seg.keep.tolist() == [False, True]
    assert build(p).stats["memory_rows"] == 1
    for choice in itertools.product(range(2), repeat=3):  # the kept row decides feasibility alone
        assert evaluate(p, choice).feasible == (usages[1][choice[1]] + usages[2][choice[2]] <= 10.0)


@pytest.mark.parametrize("seed", range(20))
def test_sparse_memory_rows_solve_the_same_milp(seed, monkeypatch):
    """Untied problems' rows built as arrays (no deduplication or dominance) give the MILP the
    same optimum as the rows of memrows.memory_rows."""
    from test_solver import brute_force

    from solver import highs_model

    rng = np.random.default_rng(900 + seed)
    p = random_problem(rng, n=7, kmax=3, density=0.4, limit=True, forbid=seed % 2 == 0)
    exact = brute_force(p)
    if exact is None:  # infeasible instances are the reductions' business, not the rows'
        return
    models = []
    for threshold in (-1.0, np.inf):
        monkeypatch.setattr(highs_model, "SPARSE_ENTRIES", threshold)
        models.append(highs_model.build(p))
        choice, _, optimal = highs_model.solve_model(models[-1], p.num_nodes, 10, 1e-9)
        assert optimal and evaluate(p, choice).cost == pytest.approx(exact)
    assert models[0].stats["memory_rows"] >= models[1].stats["memory_rows"]
