"""The memory-free optimum repaired on the exact network's rows (solver.rowrepair)."""

import time

import numpy as np
import pytest
from test_memrows import layered_problem, tied_brute_force

from solver import cfn, heuristic, rowrepair
from solver.evaluate import evaluate
from solver.exact import build_exact
from solver.problem import FORBIDDEN, Problem
from solver.rowrepair import RowNetwork
from solver.solve import memory_free


def _layout_and_view(layers: int = 4) -> Problem:
    """Per layer a matmul whose output is large and cheap (strategy 0) or small and dear (1),
    and a view of it that must keep its layout (the pair of different layouts is forbidden),
    both saved to the end of the step; tied across layers. Only the small layout fits."""
    costs, usages, iv, edges, mats = [], [], [], [], []
    ties: list[list[int]] = [[], []]
    horizon = 2 * layers + 1
    for layer in range(layers):
        for j, (c, u) in enumerate((([0.0, 5.0], [10.0, 2.0]), ([0.0, 1.0], [10.0, 2.0]))):
            costs.append(np.array(c))
            usages.append(np.array(u))
            iv.append((1 + 2 * layer + j, horizon))
            ties[j].append(len(costs) - 1)
        v = len(costs) - 2
        edges.append((v, v + 1))
        mats.append(np.array([[0.0, FORBIDDEN], [FORBIDDEN, 0.0]]))
        if layer:
            edges.append((v - 1, v))  # the previous layer's view feeds this matmul: any layout
            mats.append(np.array([[0.0, 3.0], [3.0, 0.0]]))
    return Problem(costs, usages, np.array(iv), np.array(edges), mats, usage_limit=4.0 * layers + 1, ties=ties)


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
def test_a_move_forbidden_alone_carries_the_view_that_must_follow_it(monkeypatch):
    p = _layout_and_view()
    free = memory_free(p, 5.0)
    assert not free.fits and set(free.choice.tolist()) == {0}
    # Node by node, every move that frees memory leaves a forbidden pair: nothing fits.
    assert heuristic.repair_memory(p, free.choice, time.perf_counter() + 5.0) is None
    model = build_exact(p)
    net = RowNetwork(model.costs, model.tables, model.rows)
    picked, moves = rowrepair.repair(net, model.values(free.choice), time.perf_counter() + 5.0)
    assert picked is not None and moves >= 1
    ev = evaluate(p, model.choice(picked))
    assert ev.feasible and set(model.choice(picked).tolist()) == {1}
    assert ev.cost == pytest.approx(tied_brute_force(p))
    monkeypatch.setattr(rowrepair, "CHAINS_PER_VARIABLE", 0)
    assert rowrepair.repair(net, model.values(free.choice), time.perf_counter() + 5.0)[0] is None


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
@pytest.mark.parametrize("seed", range(6))
def test_the_repair_fits_costs_no_less_than_the_optimum_and_is_the_same_every_time(seed):
    p = layered_problem(np.random.default_rng(seed), layers=5, tight=0.3, grads=seed % 2 == 1)
    free = memory_free(p, 5.0)
    model = build_exact(p)
    net = RowNetwork(model.costs, model.tables, model.rows)
    answers = []
    for _ in range(2):
        picked, _ = rowrepair.repair(net, model.values(free.choice), time.perf_counter() + 5.0)
        if picked is None:
            answers.append(None)
            continue
        picked = rowrepair.descend(net, picked, time.perf_counter() + 5.0)
        assert (cfn.row_excess(model.rows, picked) <= 0).all()
        answers.append(model.choice(picked))
    if answers[0] is None:
        assert answers[1] is None
        return
    assert np.array_equal(answers[0], answers[1])
    ev = evaluate(p, answers[0])
    assert ev.feasible and ev.cost >= tied_brute_force(p) - 1e-6
    assert ev.cost >= free.cost - 1e-6


def test_descend_takes_only_moves_that_keep_every_row():
    # Two variables, no tables; one row of limit 5 over both: value 1 is cheaper and heavier.
    costs = [np.array([3.0, 1.0]), np.array([3.0, 1.0])]
    rows = [([(0, np.array([1, 4])), (1, np.array([1, 4]))], 5)]
    net = RowNetwork(costs, {}, rows)
    x = rowrepair.descend(net, np.array([0, 0]), time.perf_counter() + 5.0)
    assert x.tolist() == [1, 0]  # the second move would make the row 8 > 5
