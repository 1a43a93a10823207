"""Vectorized coordinate descent: its answers are local minima, never worse than the start."""

import itertools

import numpy as np
import pytest

from solver.descent import Network, colour, descend


def _network(seed, n=40, p_edge=0.12, kmax=5):
    rng = np.random.default_rng(seed)
    k = rng.integers(1, kmax + 1, n)
    costs = [rng.uniform(0, 10, size) for size in k]
    costs[int(np.argmax(k))][0] = np.inf  # an unavailable strategy, as eliminated cores carry
    edges = {}
    for a, b in itertools.combinations(range(n), 2):
        if rng.random() < p_edge:
            m = rng.uniform(0, 10, (k[a], k[b]))
            m[rng.random(m.shape) < 0.1] = 1e15  # forbidden pairs
            if rng.random() < 0.5:  # both orientations occur
                edges[(a, b)] = m
            else:
                edges[(b, a)] = m.T
    return costs, edges


def _local(costs, edges, choice, v):
    x = costs[v].copy()
    for (a, b), m in edges.items():
        if a == v:
            x = x + m[:, choice[b]]
        elif b == v:
            x = x + m[choice[a], :]
    return x


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("pairs", [False, True])
def test_descent_ends_in_a_local_minimum(seed, pairs):
    costs, edges = _network(seed)
    net = Network(costs, edges)
    rng = np.random.default_rng(100 + seed)
    start = [int(rng.integers(c.size)) for c in costs]
    choice = descend(costs, edges, start, sweeps=1000, pairs=pairs)
    assert net.cost(np.array(choice)) <= net.cost(np.array(start))
    for v in range(len(costs)):  # no single move improves
        x = _local(costs, edges, choice, v)
        assert not x.min() < x[choice[v]] - 1e-9 * max(1.0, abs(x.min()))
    if pairs:  # no joint move of an edge's two ends improves
        for (a, b), m in edges.items():
            la = _local(costs, edges, choice, a) - m[:, choice[b]]
            lb = _local(costs, edges, choice, b) - m[choice[a], :]
            joint = la[:, None] + lb[None, :] + m
            assert not joint.min() < joint[choice[a], choice[b]] - 1e-9 * max(1.0, abs(joint.min()))


def test_local_costs_match_a_direct_sum():
    costs, edges = _network(7)
    net = Network(costs, edges)
    choice = np.array([int(np.argmin(c)) for c in costs])
    loc = net.local(choice)
    for v in range(len(costs)):
        np.testing.assert_allclose(loc[net.offs[v]:net.offs[v + 1]], _local(costs, edges, choice, v))


def test_colour_classes_are_independent_and_cover_every_node():
    costs, edges = _network(3, n=60, p_edge=0.2)
    net = Network(costs, edges)
    classes = colour(net.nbrs)
    assert sorted(np.concatenate(classes).tolist()) == list(range(60))
    class_of = {int(v): c for c, members in enumerate(classes) for v in members}
    assert all(class_of[a] != class_of[b] for a, b in edges)


def test_no_edges_and_no_nodes():
    assert descend([np.array([3.0, 1.0, 2.0])], {}, None, pairs=True) == [1]
    assert descend([], {}, None, pairs=True) == []


def test_core_time_limit_adapts_to_the_last_search():
    from solver.core import CoreSolver

    core = CoreSolver(5.0, 1.0)
    core.adapt(limit=5.0, took=5.0, ended=False, found=False)  # cut off with nothing: doubled once
    assert core.seconds == 10.0
    core.adapt(limit=10.0, took=7.5, ended=True, found=True)  # ended early: twice its time
    assert core.seconds == 15.0
    core.adapt(limit=15.0, took=1.0, ended=True, found=False)  # ended early, nothing better exists: the base
    assert core.seconds == 5.0
    core.adapt(limit=5.0, took=5.0, ended=False, found=True, gain=0.25)  # cut off, paying well: doubled
    assert core.seconds == 10.0
    core.adapt(limit=10.0, took=10.0, ended=False, found=True, gain=0.05)  # cut off, paying little: halfway back
    assert core.seconds == 7.5
    core.adapt(limit=7.5, took=2.0, ended=True, found=True)
    assert core.seconds == 5.0
    core.adapt(limit=5.0, took=5.0, ended=False, found=False)  # cut off with nothing: doubled ...
    core.adapt(limit=10.0, took=10.0, ended=False, found=False)  # ... and cut off again: back to the base
    assert core.seconds == 5.0
    core.adapt(limit=5.0, took=5.0, ended=False, found=False)  # no more doubling until a search completes
    assert core.seconds == 5.0
    core.adapt(limit=5.0, took=2.0, ended=True, found=True)
    core.adapt(limit=5.0, took=5.0, ended=False, found=False)
    assert core.seconds == 10.0


def test_core_solver_answers_within_its_cap_and_never_worse_than_a_descent():
    import time

    from solver.cfn import table_cost
    from solver.core import CoreSolver

    costs, edges = _network(5, n=30)
    core = CoreSolver(5.0, 1000.0)
    core.cap = 2.0
    t0 = time.perf_counter()
    picked = core(costs, edges)
    assert time.perf_counter() - t0 < 8.0
    assert table_cost(costs, edges, picked) <= table_cost(costs, edges, descend(costs, edges, None, pairs=True))


def _hard_network(seed=0, n=60, d=6):
    """A network toulbar2 proves in about a thousand backtracks."""
    rng = np.random.default_rng(seed)
    costs = [rng.integers(0, 100, d).astype(float) for _ in range(n)]
    edges = {}
    for a in range(n):
        for b in rng.choice(n, 4, replace=False).tolist():
            if a < b:
                edges[(a, b)] = rng.integers(0, 100, (d, d)).astype(float)
    return costs, edges


def test_toulbar2_ends_by_its_backtrack_budget_and_says_what_it_did():
    from solver import cfn

    costs, edges = _hard_network()
    answers = []
    for _ in range(2):
        work = {}
        picked, proved, _ = cfn.solve_tables(costs, edges, 30, 1.0, backtracks=50, work=work)
        assert work["limited"] and not proved and 50 <= work["backtracks"] <= 51
        answers.append(picked)
    assert answers[0] == answers[1]  # ended by its work: the same answer every time
    work = {}
    cfn.solve_tables(costs, edges, 30, 1.0, work=work)
    assert not work["limited"] and work["backtracks"] > 51  # the same search unbounded proves, later
    with pytest.raises(ValueError, match="backtracks: expected >= 1, found 0"):
        cfn.solve_tables(costs, edges, 30, 1.0, backtracks=0)


class _Ledger:
    """A work clock that records what it is charged."""

    cut = False

    def __init__(self):
        self.charges = []

    def cpu_until_guard(self):
        return np.inf

    def charge(self, spent, work):
        self.charges.append(work)


def test_core_searches_are_bounded_and_charged_by_their_work_not_the_clock(monkeypatch):
    from solver import core as core_module
    from solver.core import CoreSolver

    # Priced high enough that the one-second floor of a limit buys 20 backtracks: every search ends by its budget.
    entries_price = 1e-5
    monkeypatch.setattr(core_module, "BACKTRACK_PER_ENTRY", entries_price)
    costs, edges = _hard_network()
    entries = sum(c.size for c in costs) + sum(m.size for m in edges.values())
    per_backtrack = entries_price * entries
    runs = []
    for _ in range(2):
        clock = _Ledger()
        core = CoreSolver(1.0, 1.0, clock=clock)
        picked, limits = [], []
        for k in range(3):  # costs moved between calls, as the weight rounds move them
            shifted = [c + k * (np.arange(c.size) % 2) for c in costs]
            picked.append(core(shifted, edges))
            limits.append(core.seconds)
        assert not core.cut
        runs.append((picked, limits, clock.charges))
    assert runs[0] == runs[1]
    first_limit = 1.0
    # Cut by its budget: charged the budget's price, within one backtrack of the limit.
    assert abs(runs[0][2][0] - first_limit) <= per_backtrack
