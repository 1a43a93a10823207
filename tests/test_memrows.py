"""Memory rows over tie groups (solver.memrows) and the exact CFN that reads them (solver.exact)."""

import itertools

import numpy as np
import pytest
from test_solver import random_problem

from solver import Problem, evaluate, solve
from solver.exact import solve_exact
from solver.highs_model import reduce
from solver.memrows import memory_rows
from solver.solve import memory_lower_bound


def layered_problem(rng, layers=6, per_layer=3, k=3, tight=0.5, grads=False):
    """``layers`` identical tied blocks over one time line: each block's nodes are live from
    their forward step until the matching backward step (saved activations), as in a training
    graph, with a temporary in each layer's forward and backward step, plus one untied node. Memory
    binds: the limit sits ``tight`` of the way from the least-usage peak to the largest-usage peak.
    With ``grads``, each layer's backward step also makes a gradient that lives to the end, so
    along the backward the saved activations shrink while the gradients grow: no backward
    segment dominates another."""
    costs = [rng.integers(0, 30, size=k).astype(float) for _ in range(per_layer)]
    usages = [rng.integers(1, 10, size=k).astype(float) for _ in range(per_layer)]
    node_costs, node_usages, iv, ties = [], [], [], [[] for _ in range(per_layer)]
    horizon = 2 * layers * per_layer + 2
    node_costs.append(rng.integers(0, 30, size=k).astype(float))
    node_usages.append(rng.integers(1, 10, size=k).astype(float))
    iv.append((0, horizon))
    temp_costs = [rng.integers(0, 30, size=k).astype(float) for _ in range(2)]
    temp_usages = [rng.integers(1, 10, size=k).astype(float) for _ in range(2)]
    ties += [[], []]
    for layer in range(layers):
        for j in range(per_layer):
            t = 1 + layer * per_layer + j
            node_costs.append(costs[j])
            node_usages.append(usages[j])
            iv.append((t, horizon - t))
            ties[j].append(len(node_costs) - 1)
        # A forward and a backward temporary per layer: every layer boundary is its own segment.
        t = 1 + layer * per_layer
        for side, span in enumerate(((t, t + 1), (horizon - t - 1, horizon - t))):
            node_costs.append(temp_costs[side])
            node_usages.append(temp_usages[side])
            iv.append(span)
            ties[per_layer + side].append(len(node_costs) - 1)
        if grads:
            if layer == 0:
                ties.append([])
                grad_cost = rng.integers(0, 30, size=k).astype(float)
                grad_usage = rng.integers(1, 10, size=k).astype(float)
            node_costs.append(grad_cost)
            node_usages.append(grad_usage)
            iv.append((horizon - t - 1, horizon))
            ties[-1].append(len(node_costs) - 1)
    n = len(node_costs)
    edges, mats = [], []
    for v in range(n - 1):
        edges.append((v, v + 1))
        mats.append(rng.integers(0, 20, size=(k, k)).astype(float))
    p = Problem(node_costs, node_usages, np.array(iv), np.array(edges), mats, ties=ties)
    low = memory_lower_bound(p)[0]
    high = evaluate(p, [int(np.argmax(u)) for u in node_usages]).peak_usage
    p.usage_limit = float(np.floor(low + tight * (high - low)))
    return p


def rows_hold(rows, choice) -> bool:
    return all(sum(c[choice[h]] for h, c in zip(groups, coefs)) <= rhs + 1e-9 for groups, coefs, rhs in rows)


def _by_strategy(problem, red, mr):
    """Each row as (groups, coefficients indexed by strategy rather than allowed position, rhs)."""
    out = []
    for r in mr.rows:
        full = []
        for h, c in zip(r.groups.tolist(), r.coefs):
            x = np.full(problem.num_strategies(h), np.inf)
            x[red.allowed[h]] = c
            full.append(x)
        out.append((r.groups.tolist(), full, r.rhs))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_aggregated_rows_hold_exactly_when_memory_fits(seed):
    """Every tie-respecting choice over the allowed strategies: all rows hold <=> the peak fits."""
    rng = np.random.default_rng(seed)
    p = layered_problem(rng, layers=3 + seed % 3, tight=0.3 + 0.05 * (seed % 5), grads=seed % 2 == 1)
    red = reduce(p)
    mr = memory_rows(p, red.rep, red.allowed)
    rows = _by_strategy(p, red, mr)
    heads = np.unique(red.rep)
    for picks in itertools.islice(itertools.product(*[red.allowed[h].tolist() for h in heads]), 3000):
        of_head = dict(zip(heads.tolist(), picks))
        choice = np.array([of_head[int(red.rep[v])] for v in range(p.num_nodes)])
        fits = evaluate(p, choice).peak_usage <= p.usage_limit
        assert rows_hold(rows, choice) == fits


@pytest.mark.parametrize("seed", range(8))
def test_class_counts_equal_the_live_sets_they_replace(seed):
    """Counting live members per class down the segment groups gives the rows that building
    every live set gives, in the same (time) order, tied layers or not."""
    from solver.memrows import class_counts, distinct_rows, kept_segments, least_usage, memory_segments, tie_classes

    rng = np.random.default_rng(seed)
    p = layered_problem(rng, layers=2 + seed, tight=0.4, grads=seed % 2 == 0) if seed < 5 else \
        random_problem(rng, n=30, kmax=3, ties=seed == 7)
    red = reduce(p)
    low, varying = least_usage(p, red.allowed)
    cls, first = tie_classes(p, red.rep)
    via_sets = distinct_rows(memory_segments(p, varying, low), cls, float(p.usage_limit))
    via_counts = class_counts(p, kept_segments(p, varying, low), cls, len(first), float(p.usage_limit))
    assert len(via_sets) == len(via_counts) > 0
    for (c1, n1, r1), (c2, n2, r2) in zip(via_sets, via_counts):
        assert c1.tolist() == c2.tolist() and n1.tolist() == n2.tolist() and r1 == r2


def test_tied_layers_keep_few_rows_however_deep():
    """A segment per layer boundary, but one kept row whatever the depth: the deepest point
    (every layer's activations live) implies the others."""
    kept = []
    for layers in (4, 16, 64):
        p = layered_problem(np.random.default_rng(7), layers=layers)
        red = reduce(p)
        mr = memory_rows(p, red.rep, red.allowed, binding=False)  # every segment, bound or not
        assert mr.segments >= 2 * layers
        kept.append(len(mr.rows))
    assert max(kept) <= 4, kept


def test_rows_along_the_layers_keep_their_ends():
    """With gradients growing as activations shrink, each backward segment binds for some
    strategies, but the rows lie on arithmetic progressions across the layers: only their ends
    are kept, so the count stays flat with depth, and the kept rows are exact (a choice fits
    iff they hold, checked on every tie-respecting choice)."""
    kept = []
    for layers in (4, 16, 64):
        p = layered_problem(np.random.default_rng(3), layers=layers, grads=True)
        red = reduce(p)
        mr = memory_rows(p, red.rep, red.allowed)
        kept.append(len(mr.rows))
        if layers == 16:
            rows = _by_strategy(p, red, mr)
            heads = np.unique(red.rep)
            for picks in itertools.product(*[red.allowed[h].tolist() for h in heads]):
                of_head = dict(zip(heads.tolist(), picks))
                choice = np.array([of_head[int(red.rep[v])] for v in range(p.num_nodes)])
                assert rows_hold(rows, choice) == (evaluate(p, choice).peak_usage <= p.usage_limit)
    assert kept[0] == kept[1] == kept[2] <= 8, kept
    # Without the progressions, dominance alone keeps a row per layer.
    p = layered_problem(np.random.default_rng(3), layers=64, grads=True)
    red = reduce(p)
    assert len(memory_rows(p, red.rep, red.allowed, progressions=False, binding=False).rows) >= 64


def tied_brute_force(p: Problem):
    """The optimum by enumerating one strategy per tie group (None when nothing is feasible)."""
    heads = {}
    for g in p.ties:
        for v in g:
            heads[v] = min(g)
    free = sorted({heads.get(v, v) for v in range(p.num_nodes)})
    best = None
    for picks in itertools.product(*[range(p.num_strategies(h)) for h in free]):
        of = dict(zip(free, picks))
        ev = evaluate(p, [of[heads.get(v, v)] for v in range(p.num_nodes)])
        if ev.feasible and (best is None or ev.cost < best):
            best = ev.cost
    return best


@pytest.mark.parametrize("seed", range(20))
def test_exact_cfn_matches_brute_force(seed):
    rng = np.random.default_rng(500 + seed)
    if seed % 2:
        p = layered_problem(rng, layers=3, per_layer=2, tight=0.2 + 0.1 * (seed % 4))
    else:
        p = random_problem(rng, n=7, kmax=3, density=0.5, ties=seed % 4 == 0, forbid=True)
    best = tied_brute_force(p)
    res = solve_exact(p, seconds=10)
    if best is None:
        assert res.choice is None
        return
    assert res.proved
    ev = evaluate(p, res.choice)
    assert ev.feasible, ev.reason
    assert ev.cost == pytest.approx(best, abs=1e-6)
    assert best - 0.01 <= res.lower_bound <= best  # less toulbar2's integer rounding


def test_solve_reports_the_exact_stage_and_never_loses_a_start():
    p = layered_problem(np.random.default_rng(3), layers=8, tight=0.25)
    sol = solve(p, time_limit=20)
    assert sol.status == "optimal" and sol.cost == pytest.approx(tied_brute_force(p))
    assert sol.stats["exact"]["memory_rows"] <= 4 < sol.stats["exact"]["memory_segments"]
    assert sol.source in ("heuristic", "pairwise", "repair", "exact")
    # A start that is already optimal is kept (named as its source) when no stage beats it.
    again = solve(p, time_limit=5, pairwise=False, exact=False, max_nonzeros=1, starts=[("given", sol.choice)])
    assert again.cost == pytest.approx(sol.cost)
    assert again.source == "start:given"
    with pytest.raises(ValueError, match="start 'bad': expected"):
        solve(p, time_limit=5, starts=[("bad", np.zeros(3, dtype=np.int64))])
