import itertools
import re
from pathlib import Path

import numpy as np
import pytest

import solver
from solver import FORBIDDEN, Problem, ProblemError, evaluate, solve
from solver.iopddl import from_dict, to_dict

# The IOPDDL contest's 5-node example (google/iopddl, Apache-2.0), shipped so tests need no shared/.
EXAMPLE = Path(__file__).parent / "data" / "iopddl_example.json"


def random_problem(rng, n=6, kmax=3, density=0.4, limit=True, ties=False, pins=False, forbid=False):
    ks = rng.integers(1, kmax + 1, size=n)
    costs = [rng.integers(0, 50, size=k).astype(float) for k in ks]
    usages = [rng.integers(0, 10, size=k).astype(float) for k in ks]
    lo = rng.integers(0, 10, size=n)
    iv = np.stack([lo, lo + rng.integers(0, 8, size=n)], axis=1)
    edges, mats = [], []
    for u, v in itertools.combinations(range(n), 2):
        if rng.random() < density:
            m = rng.integers(0, 40, size=(ks[u], ks[v])).astype(float)
            if forbid and rng.random() < 0.3:
                m[rng.integers(ks[u]), rng.integers(ks[v])] = 2 * FORBIDDEN
            edges.append((u, v))
            mats.append(m)
    p = Problem(costs, usages, iv, np.array(edges).reshape(-1, 2), mats)
    if limit:
        lows = [u.min() for u in usages]
        highs = [u.max() for u in usages]
        p.usage_limit = float(rng.uniform(sum(lows) * 0.6, sum(highs)))
    if ties:
        for k in set(ks.tolist()):
            same = [v for v in range(n) if ks[v] == k]
            if len(same) >= 2 and k > 1:
                p.ties = [same[:2]]
                break
    if pins:
        v = int(rng.integers(n))
        p.pins = {v: int(rng.integers(ks[v]))}
    return p


def brute_force(p: Problem):
    best = None
    for choice in itertools.product(*[range(p.num_strategies(v)) for v in range(p.num_nodes)]):
        ev = evaluate(p, choice)
        if ev.feasible and (best is None or ev.cost < best - 1e-9):
            best = ev.cost
    return best


@pytest.mark.parametrize("pairwise", [True, False], ids=["toulbar2-first", "milp"])  # exact CFN with toulbar2
@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force(seed, pairwise):
    rng = np.random.default_rng(seed)
    p = random_problem(rng, limit=seed % 4 != 0, ties=seed % 3 == 0, pins=seed % 5 == 0, forbid=seed % 2 == 0)
    exact = brute_force(p)
    if exact is None:
        with pytest.raises(solver.InfeasibleError):
            solve(p, time_limit=10, pairwise=pairwise, exact=pairwise)
        return
    sol = solve(p, time_limit=10, pairwise=pairwise, exact=pairwise)
    ev = evaluate(p, sol.choice)
    assert ev.feasible, ev.reason
    assert sol.cost == pytest.approx(exact, abs=1e-6)
    assert ev.cost == pytest.approx(sol.cost)
    assert sol.status == "optimal"
    assert sol.lower_bound == pytest.approx(exact, abs=1e-4)


@pytest.mark.parametrize("backend", ["highs", "cbc"])
def test_example_instance(backend):
    p = solver.load_iopddl(EXAMPLE)
    # Hand computation for [0, 0, 2, 1, 0]: nodes 15+55+35+75+95, edges 30+40+10+30+60.
    ev = evaluate(p, [0, 0, 2, 1, 0])
    assert ev.cost == 15 + 55 + 35 + 75 + 95 + 30 + 40 + 10 + 30 + 60 == 445
    assert brute_force(p) == 445
    sol = solve(p, time_limit=10, backend=backend)
    assert sol.cost == 445
    assert evaluate(p, sol.choice).feasible


def test_evaluator_reports_memory_violation():
    p = solver.load_iopddl(EXAMPLE)
    p.usage_limit = 40
    ev = evaluate(p, [0, 0, 1, 0, 0])
    assert not ev.feasible
    # Nodes 0, 1, 2 are live on [50, 70): 10 + 25 + 20 = 55.
    assert ev.peak_usage == 55 and 50 <= ev.peak_time < 70
    assert "exceeds the limit 40" in ev.reason


def test_evaluator_names_what_breaks_a_choice():
    """Out-of-range indices raise with the node and its strategy count; a forbidden entry, a pin
    and a tie each make the choice infeasible with the reason, the cost still exact."""
    p = solver.load_iopddl(EXAMPLE)
    with pytest.raises(ValueError, match=r"choice\[2\] = 7 is out of range: node has 3 strategies"):
        evaluate(p, [0, 0, 7, 1, 0])
    with pytest.raises(ValueError, match=r"choice\[0\] = -1 is out of range"):
        evaluate(p, [-1, 0, 0, 0, 0])
    costs = [c.copy() for c in p.node_costs]
    costs[3][1] = solver.FORBIDDEN
    forbidden = p.with_costs(node_costs=costs)
    ev = evaluate(forbidden, [0, 0, 2, 1, 0])
    assert not ev.feasible and "forbidden" in ev.reason and ev.cost == 445 - 75 + solver.FORBIDDEN
    assert "node 3 is pinned to 0 but takes 1" in evaluate(p.replaced(pins={3: 0}), [0, 0, 2, 1, 0]).reason
    tied = evaluate(p.replaced(ties=[[1, 3]]), [0, 0, 2, 1, 0])
    assert not tied.feasible and "tied nodes [1, 3] take different strategies [0, 1]" in tied.reason


def test_infeasible_reports_smallest_limit():
    p = solver.load_iopddl(EXAMPLE)
    p.usage_limit = 20
    with pytest.raises(solver.InfeasibleError) as err:
        solve(p, time_limit=5)
    # Least usages live together on [50, 70): 10 + 25 + 15 = 50.
    assert err.value.min_feasible_limit_bound == 50
    assert "must be >= 50" in str(err.value)


def test_iopddl_roundtrip(tmp_path):
    p = solver.load_iopddl(EXAMPLE)
    for name in ("x.json", "x.json.gz"):
        solver.save_iopddl(p, tmp_path / name)
        q = solver.load_iopddl(tmp_path / name)
        assert to_dict(q) == to_dict(p)
    # The planner's ties and pins travel as extra keys and come back as they were.
    p = Problem(p.node_costs, p.node_usages, p.intervals, p.edges, p.edge_costs, p.usage_limit,
                pins={2: 2}, ties=[[1, 3]])
    solver.save_iopddl(p, tmp_path / "t.json")
    q = solver.load_iopddl(tmp_path / "t.json")
    assert q.ties == p.ties and q.pins == p.pins
    assert solve(q, time_limit=5).cost == pytest.approx(solve(p, time_limit=5).cost)
    with pytest.raises(ProblemError, match="problem.ties: expected a list of node lists"):
        from_dict({"problem": {**to_dict(p)["problem"], "ties": 3}})


def test_deterministic():
    rng = np.random.default_rng(7)
    p = random_problem(rng, n=12, kmax=4, density=0.3)
    a, b = solve(p, time_limit=10), solve(p, time_limit=10)
    assert a.to_list() == b.to_list() and a.cost == b.cost


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["problem"]["edges"]["costs"].__setitem__(0, [1, 2, 3]), "expected 1 x 2 = 2"),
        (lambda d: d["problem"]["nodes"]["intervals"].__setitem__(0, [70, 30]), "lo > hi"),
        (lambda d: d["problem"]["nodes"]["usages"].__setitem__(1, [-1, 25]), "usages must be >= 0"),
        (lambda d: d["problem"]["nodes"]["usages"].__setitem__(2, [15, float("nan"), 15]), "node 2: usages must be"),
        (lambda d: d["problem"]["nodes"]["costs"].__setitem__(3, [float("nan"), 1]), "node 3: cost is NaN"),
        (lambda d: d["problem"]["nodes"].pop("costs"), "missing"),
        (lambda d: d["problem"]["edges"]["nodes"].__setitem__(0, [0, 9]), "outside [0, 5)"),
    ],
)
def test_bad_problems_are_named(mutate, message):
    import json

    d = json.loads(EXAMPLE.read_text())
    mutate(d)
    with pytest.raises(ProblemError, match=re.escape(message)):
        from_dict(d)


def test_replaced_changes_constraints_and_shares_the_arrays():
    import json

    p = from_dict(json.loads(EXAMPLE.read_text()))
    q = p.replaced(usage_limit=1e9, pins={2: 1}, name="tighter")
    assert q.node_costs is p.node_costs and q.edge_costs is p.edge_costs
    assert (q.usage_limit, q.pins, q.name) == (1e9, {2: 1}, "tighter") and p.pins == {} and p.name != "tighter"
    assert solve(q, time_limit=10).choice[2] == 1
    with pytest.raises(ProblemError, match=re.escape("pin 0 -> 9: node must be in [0, 5)")):
        p.replaced(pins={0: 9})
    with pytest.raises(ProblemError, match=re.escape("usage_limit must be >= 0")):
        p.replaced(usage_limit=-1.0)
    with pytest.raises(ProblemError, match=re.escape("only ['usage_limit', 'pins', 'ties', 'name', 'node_names'] "
                                                     "may change, found ['node_costs']")):
        p.replaced(node_costs=p.node_costs)


def test_malformed_file(tmp_path):
    f = tmp_path / "bad.json"
    f.write_text("{not json")
    with pytest.raises(ProblemError, match="cannot read"):
        solver.load_iopddl(f)


def test_cli_prints_choice_last(capsys):
    from solver.__main__ import main

    assert main([str(EXAMPLE), "5"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "[0, 0, 2, 1, 0]"


def test_solver_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, solver; solver.solve; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pair_repair_leaves_forbidden_pairs_single_moves_cannot():
    from solver import heuristic

    big = 2 * FORBIDDEN
    p = Problem([np.zeros(2), np.zeros(2)], [np.zeros(2), np.zeros(2)], np.array([[0, 1], [0, 1]]),
                np.array([[0, 1]]), [np.array([[big, big], [big, 5.0]])])
    start = np.array([0, 0])
    assert heuristic.local_search(p, start).tolist() == [0, 0]  # every single move stays forbidden
    fixed = heuristic.repair_pairs(p, start)
    assert fixed.tolist() == [1, 1] and evaluate(p, fixed).feasible


def test_large_models_fall_back_to_heuristics_within_the_limit():
    rng = np.random.default_rng(11)
    p = random_problem(rng, n=30, kmax=4, density=0.3)
    sol = solve(p, time_limit=5, max_nonzeros=10, pairwise=False, exact=False)  # any MILP is "too large"
    assert evaluate(p, sol.choice).feasible and sol.status == "heuristic"
    assert "milp_skipped" in sol.stats and sol.seconds < 5


def test_the_weight_path_cut_by_the_wall_clock_returns_its_best_and_says_so(monkeypatch):
    """Its stages end by this process's CPU seconds; where the wall clock's guard ends them first
    (a machine too busy to give them their time) the answer is the best so far, marked."""
    import importlib

    from solver.clock import WorkClock

    solve_module = importlib.import_module("solver.solve")
    monkeypatch.setattr(solve_module, "WorkClock", lambda guard, origin=None: WorkClock(0.0, origin))
    p = random_problem(np.random.default_rng(11), n=30, kmax=4, density=0.3)
    sol = solve(p, time_limit=5, max_nonzeros=10, pairwise=False, exact=False)
    assert evaluate(p, sol.choice).feasible and sol.source == "heuristic"  # the start: nothing ran after it
    assert sol.stats["cut_by_clock"] == ["weights (guard)"]


def test_the_work_clock_counts_this_process_cpu_seconds_and_stops_at_its_guard():
    import time

    from solver.clock import WorkClock

    clock = WorkClock(guard=time.perf_counter() + 60)
    a = clock()
    time.sleep(0.3)  # waiting is not work
    b = clock()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:  # work is
        pass
    c = clock()
    assert b - a < 0.1 and c - b > 0.1 and not clock.cut
    assert clock.seconds_until(c + 100) <= 60
    late = WorkClock(guard=time.perf_counter() - 1)
    assert late() == float("inf") and late.cut and late.cut_by == ["guard"] and late.seconds_until(1e9) < 0


def test_the_work_clock_counts_a_priced_search_at_its_price():
    """A search bounded by its work is charged its price, not the CPU seconds it took, so the clock
    reads the same after it in every run; what a search's own clock ended is named."""
    import time

    from solver.clock import WorkClock

    clock = WorkClock(guard=time.perf_counter() + 60)
    a = clock()
    t0 = time.process_time()
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    clock.charge(time.process_time() - t0, 2.0)
    assert clock() - a == pytest.approx(2.0, abs=0.05)
    assert not clock.cut
    clock.mark("merge")
    clock.mark("merge")
    assert clock.cut and clock.cut_by == ["merge"]


def test_a_search_ended_by_the_wall_clock_is_said_and_one_ended_by_its_work_is_not():
    """An unproved answer whose exact search a deadline ended says so (``cut_by_clock``: a rerun
    on a less busy machine may differ); one whose searches ended by their stall rule, or any
    proved answer, does not."""
    import importlib
    import time

    solve_module = importlib.import_module("solver.solve")
    p = random_problem(np.random.default_rng(3), n=6, limit=False)
    choice = np.zeros(p.num_nodes, dtype=np.int64)

    def finished(ended: str, status: str):
        run = solve_module._Run(p, time.perf_counter(), 10.0, "highs", 1e-6, 30e6, solve_module.DEFAULT_SCHEDULE)
        run.inc.offer(choice, "start")
        run.stats["exact"] = {"phases": [{"method": "vns", "ended": "stalled"}, {"method": "hbfs", "ended": ended}]}
        return run.finish(status, None).stats

    assert finished("time", "heuristic")["cut_by_clock"] == ["exact (hbfs)"]
    assert "cut_by_clock" not in finished("stalled", "heuristic")
    assert "cut_by_clock" not in finished("time", "optimal")


@pytest.mark.skipif(not __import__("solver.cfn").cfn.available(), reason="pytoulbar2 not installed")
@pytest.mark.parametrize("seed", range(3))
def test_weight_search_finds_feasible_answers_above_its_bound(seed, caplog):
    import time

    from solver import weights

    rng = np.random.default_rng(100 + seed)
    p = random_problem(rng, n=40, kmax=4, density=0.15, limit=False)
    free = solve(p, time_limit=10)
    floor = evaluate(p, np.array([int(np.argmin(u)) for u in p.node_usages])).peak_usage
    assert free.peak_usage > floor
    p.usage_limit = float((floor + free.peak_usage) / 2)  # binds: the memory-free optimum breaks it
    exact = solve(p, time_limit=30)
    with caplog.at_level("INFO", logger="solver"):
        found, bound = weights.weight_search(p, None, deadline=time.perf_counter() + 4)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("weights round" in m for m in lines) >= 2, lines
    assert found is not None
    ev = evaluate(p, found)
    assert ev.feasible and ev.cost >= exact.cost - 1e-6
    # the memory-free optimum bounds the optimum from below (up to toulbar2's rounding)
    assert bound is not None and bound <= exact.cost + 1e-6 * max(1.0, exact.cost)


def test_weight_brackets_raise_broken_nodes_and_lower_fitting_ones():
    from solver.weights import GROWTH, Brackets

    b = Brackets(np.array([True, True, False]), start=1.0)
    w = b.update(np.array([True, False, False]))  # node 0 broke at 1, node 1 fit at 1
    assert w[0] == pytest.approx(GROWTH) and w[1] == pytest.approx(0.25) and w[2] == 0
    w = b.update(np.array([False, True, False]))  # they swap: bisected, the other end widened
    assert w[0] == pytest.approx(np.sqrt(1.0 / 1.5 * 8.0)) and w[1] == pytest.approx(np.sqrt(0.25 * 1.35))
    for _ in range(20):  # a node that keeps breaking keeps rising, one that keeps fitting falls
        w = b.update(np.array([True, False, False]))
    assert w[0] > 100 and w[1] < 1e-3 and w[2] == 0


def test_weight_search_returns_the_memory_free_optimum_when_it_fits():
    import time

    from solver import weights

    if not __import__("solver.cfn").cfn.available():
        pytest.skip("pytoulbar2 not installed")
    rng = np.random.default_rng(7)
    p = random_problem(rng, n=30, kmax=3, density=0.2, limit=False)
    p.node_costs = [c + rng.random(c.size) for c in p.node_costs]  # one optimum, not several
    free = solve(p, time_limit=10)
    p.usage_limit = float(free.peak_usage)  # the memory-free optimum just fits
    found, bound = weights.weight_search(p, None, deadline=time.perf_counter() + 5)
    assert evaluate(p, found).cost == pytest.approx(free.cost) and bound <= free.cost + 1e-6


def test_memory_repair_reaches_the_limit():
    import time

    from solver import heuristic

    rng = np.random.default_rng(5)
    p = random_problem(rng, n=25, kmax=3, density=0.1, limit=False)
    greedy = np.array([int(np.argmax(u)) for u in p.node_usages])  # the most memory everywhere
    peak = evaluate(p, greedy).peak_usage
    floor = evaluate(p, np.array([int(np.argmin(u)) for u in p.node_usages])).peak_usage
    p.usage_limit = (peak + floor) / 2
    fixed = heuristic.repair_memory(p, greedy, time.perf_counter() + 5)
    assert fixed is not None and evaluate(p, fixed).peak_usage <= p.usage_limit


def test_group_memory_repair_keeps_ties_and_frees_cheapest_bytes_first():
    """Three tied layers of two nodes (one live through the whole step) and a free node: each
    group can go from big and cheap to small and dear. The limit leaves room for exactly one
    group to stay big; the repair keeps the one whose shrinking costs most per byte."""
    import time

    from solver import heuristic

    # Groups: A = nodes 0,1,2 (saves 3 x 4 bytes for +3 each: 0.75/byte),
    #         B = nodes 3,4,5 (saves 3 x 4 bytes for +30 each: 7.5/byte), node 6 free.
    costs = [np.array([0.0, 1.0])] * 3 + [np.array([0.0, 10.0])] * 3 + [np.array([0.0])]
    usages = [np.array([5.0, 1.0])] * 6 + [np.array([2.0])]
    iv = np.array([[0, 10]] * 7)
    p = Problem(costs, usages, iv, np.zeros((0, 2), dtype=np.int64), [], usage_limit=2 + 3 * 5 + 3 * 1,
                ties=[[0, 1, 2], [3, 4, 5]])
    start = np.zeros(7, dtype=np.int64)  # everything big: 32 bytes, over the 20-byte limit
    assert not evaluate(p, start).feasible
    fixed = heuristic.repair_memory(p, start, time.perf_counter() + 5)
    assert fixed is not None and evaluate(p, fixed).feasible
    assert fixed.tolist() == [1, 1, 1, 0, 0, 0, 0]
    p.usage_limit = 1.0  # below the free node alone: nothing frees enough
    assert heuristic.repair_memory(p, start, time.perf_counter() + 5) is None


@pytest.mark.parametrize("exact", [False, True], ids=["milp", "exact-cfn"])
@pytest.mark.parametrize("seed", range(30))
def test_tie_groups_of_three_match_brute_force(seed, exact):
    """Tied nodes share MILP columns (their edges merged, edges inside a group diagonal,
    memory rows weighing a group once per live member) and dominated strategies are dropped:
    the optimum must still be the brute-force one."""
    rng = np.random.default_rng(1000 + seed)
    p = random_problem(rng, n=7, kmax=3, density=0.6, limit=seed % 3 != 0)
    for k in (3, 2):
        same = [v for v in range(p.num_nodes) if p.num_strategies(v) == k]
        if len(same) >= 3:
            p.ties = [same[:3]]
            break
    exact = brute_force(p)
    if exact is None:
        with pytest.raises(solver.InfeasibleError):
            solve(p, time_limit=10, pairwise=False, exact=exact)
        return
    sol = solve(p, time_limit=10, pairwise=False, exact=exact)
    assert evaluate(p, sol.choice).feasible
    assert sol.cost == pytest.approx(exact, abs=1e-6)
    assert sol.status == "optimal"


def _pairwise_brute_force(p: Problem, unary):
    best, arg = np.inf, None
    for choice in itertools.product(*[range(p.num_strategies(v)) for v in range(p.num_nodes)]):
        c = sum(unary[v][i] for v, i in enumerate(choice))
        c += sum(p.edge_costs[e][choice[u], choice[v]] for e, (u, v) in enumerate(p.edges.tolist()))
        if c < best - 1e-9:
            best, arg = c, choice
    return best, arg


@pytest.mark.parametrize("seed", range(40))
def test_elimination_keeps_the_pairwise_optimum(seed):
    """Chains, trees, parallel edges, self-loops, pinned and forbidden entries: removing every
    node of degree <= 2 by dynamic programming and brute-forcing the core gives the optimum."""
    from solver.eliminate import Eliminator

    rng = np.random.default_rng(500 + seed)
    p = random_problem(rng, n=7, kmax=3, density=[0.2, 0.35, 0.6][seed % 3], limit=False, pins=seed % 4 == 0,
                       forbid=seed % 2 == 0)
    if seed % 5 == 0 and p.num_edges:  # a parallel edge and a self-loop
        u, v = p.edges[0].tolist()
        p = Problem(p.node_costs, p.node_usages, p.intervals, np.vstack([p.edges, [[v, u], [u, u]]]),
                    [*p.edge_costs, p.edge_costs[0].T * 0.5, rng.integers(0, 9, (p.num_strategies(u),) * 2) * 1.0],
                    pins=p.pins)
    unary = [c + rng.integers(0, 5, c.size) for c in p.node_costs]  # a penalty-like shift
    want, _ = _pairwise_brute_force(p, [np.where(p.allowed(v), unary[v], np.inf) for v in range(p.num_nodes)])
    el = Eliminator(p)

    def core_brute(costs, edges):
        best, arg = np.inf, None
        for ch in itertools.product(*[range(c.size) for c in costs]):
            c = sum(costs[i][x] for i, x in enumerate(ch)) + sum(m[ch[a], ch[b]] for (a, b), m in edges.items())
            if c < best:
                best, arg = c, ch
        return list(arg)

    got = el.solve(unary, core_brute)
    cost = sum(unary[v][i] for v, i in enumerate(got))
    cost += sum(p.edge_costs[e][got[u], got[v]] for e, (u, v) in enumerate(p.edges.tolist()))
    assert all(p.allowed(v)[got[v]] for v in range(p.num_nodes)) or want >= FORBIDDEN
    assert cost == pytest.approx(want, rel=1e-9)


def test_elimination_reduces_a_chain_and_a_tree_to_nothing():
    from solver.eliminate import Eliminator

    rng = np.random.default_rng(0)
    n = 10
    edges = [(i, i + 1) for i in range(4)] + [(4, 5), (4, 6), (6, 7), (6, 8), (8, 9)]
    p = Problem([rng.random(3) for _ in range(n)], [np.zeros(3)] * n, np.zeros((n, 2)), np.array(edges),
                [rng.random((3, 3)) for _ in edges])
    el = Eliminator(p)
    assert el.core.size == 0 and len(el.ops) == n
    got = el.solve(p.node_costs, lambda costs, edges: [])
    brute = min(itertools.product(range(3), repeat=n), key=lambda ch: evaluate(p, ch).cost)
    assert evaluate(p, got).cost == pytest.approx(evaluate(p, brute).cost)


@pytest.mark.parametrize("seed", range(12))
def test_lns_window_prices_every_assignment_like_the_whole_problem(seed):
    """For every assignment of the free nodes, the window's cost difference equals the whole
    problem's, and it fits the window's memory exactly when the whole problem's."""
    from solver import lns, local

    rng = np.random.default_rng(300 + seed)
    p = random_problem(rng, n=9, kmax=3, density=0.4, limit=True)
    choice = np.array([int(np.argmin(u)) for u in p.node_usages])
    p.usage_limit = float(max(p.usage_limit, evaluate(p, choice).peak_usage))
    free = np.sort(rng.choice(p.num_nodes, size=4, replace=False))
    adj, mem = local.Adjacency(p), local.Memory(p, choice)
    sub = lns.subproblem(p, adj, mem, choice, free)
    fillers = sub.num_nodes - free.size
    assert all(sub.num_strategies(v) == 1 for v in range(free.size, sub.num_nodes))
    base_full = evaluate(p, choice).cost
    base_sub = evaluate(sub, np.concatenate([choice[free], np.zeros(fillers, int)])).cost
    for x in itertools.product(*[range(p.num_strategies(v)) for v in free.tolist()]):
        full = choice.copy()
        full[free] = x
        ef, es = evaluate(p, full), evaluate(sub, np.concatenate([x, np.zeros(fillers, int)]))
        assert es.cost - base_sub == pytest.approx(ef.cost - base_full)
        assert es.feasible == ef.feasible, (x, ef.peak_usage, es.peak_usage, p.usage_limit, sub.usage_limit)


@pytest.mark.parametrize("seed", range(6))
def test_lns_never_worse_and_reaches_the_optimum_on_small_problems(seed):
    import time

    from solver import lns

    rng = np.random.default_rng(400 + seed)
    p = random_problem(rng, n=8, kmax=3, density=0.3, limit=True)
    start = np.array([int(np.argmin(u)) for u in p.node_usages])
    p.usage_limit = float(max(p.usage_limit, evaluate(p, start).peak_usage))
    best = brute_force(p)
    found = lns.large_neighbourhood_search(p, start, time.perf_counter() + 3, budget=10_000)
    ev = evaluate(p, found)
    assert ev.feasible and ev.cost <= evaluate(p, start).cost
    assert ev.cost == pytest.approx(best)  # the window (budget) covers the whole problem


def test_lns_child_works_by_tasks_counted_in_windows():
    """The child moves to a task's answer only where it is cheaper than its own, runs the task's
    windows, and hands back the same results when the same tasks are given again."""
    from solver.lns_child import LnsChild

    rng = np.random.default_rng(402)
    p = random_problem(rng, n=8, kmax=3, density=0.3, limit=True)
    start = np.array([int(np.argmin(u)) for u in p.node_usages])
    p.usage_limit = float(max(p.usage_limit, evaluate(p, start).peak_usage))
    optimum = solve(p, time_limit=10, pairwise=False, exact=False)
    assert optimum.status == "optimal"
    if evaluate(p, start).cost <= optimum.cost:
        pytest.skip("the start is already optimal")
    runs = []
    for _ in range(2):
        child = LnsChild(p, start, seconds=60)
        try:
            first = child.task(start, evaluate(p, start).cost, 0)  # no cheaper, no windows: the start back
            second = child.task(optimum.choice, optimum.cost, 3)
            with pytest.raises(ValueError, match="task: expected one of 1..2, found 3"):
                child.result(3, timeout=1)
            got = [child.result(k, timeout=30) for k in (first, second)]
        finally:
            child.close()
        assert got[0][2]["windows"] == 0 and got[0][2]["restarts"] == 0
        assert got[0][1] == pytest.approx(evaluate(p, start).cost)
        choice, cost, counters = got[1]
        assert counters == {"windows": 3, "improved": 0, "restarts": 1, "task": 2, "cut": 0}
        assert cost == pytest.approx(optimum.cost) and evaluate(p, choice).feasible
        runs.append([(r[0].tolist(), r[1]) for r in got])
    assert runs[0] == runs[1]


def test_weight_path_with_windows_in_a_child(monkeypatch, caplog):
    """Models too large for the MILP on three cores: the weight search here, windows in two
    children; the answer is feasible and optimal on a small problem."""
    import importlib

    # The module, not the function of the same name that ``solver`` exports.
    monkeypatch.setattr(importlib.import_module("solver.solve"), "cores", lambda: 3)
    rng = np.random.default_rng(403)
    p = random_problem(rng, n=9, kmax=3, density=0.3, limit=True)
    with caplog.at_level("INFO", logger="solver"):
        sol = solve(p, time_limit=14, max_nonzeros=10, pairwise=False, exact=False)
    lines = [r.getMessage() for r in caplog.records]
    assert any("in 2 child process(es)" in m for m in lines), lines
    assert sum("lns (child" in m for m in lines) == 2, lines
    assert sol.cost == pytest.approx(brute_force(p))


class _ScriptedChild:
    """A window child that answers every task with one given answer (None: never in time)."""

    def __init__(self, answer):
        self.answer, self.tasks = answer, []

    def task(self, choice, cost, windows):
        self.tasks.append((np.asarray(choice).tolist(), cost, windows))
        return len(self.tasks)

    def result(self, task, timeout):
        return self.answer

    def best(self):
        return self.answer


def test_the_windows_stage_takes_its_childrens_answers_at_the_end_of_each_epoch():
    """Each epoch gives every child a task of EPOCH_WINDOWS windows from the best answer known and
    takes the cheapest answer back when they are done; a child the guard ends is said."""
    import importlib
    import time

    from solver.clock import WorkClock

    solve_module = importlib.import_module("solver.solve")
    rng = np.random.default_rng(402)
    p = random_problem(rng, n=8, kmax=3, density=0.3, limit=True)
    start = np.array([int(np.argmin(u)) for u in p.node_usages])
    p.usage_limit = float(max(p.usage_limit, evaluate(p, start).peak_usage))
    optimum = solve(p, time_limit=10, pairwise=False, exact=False)
    if evaluate(p, start).cost <= optimum.cost:
        pytest.skip("the start is already optimal")
    inc = solve_module._Incumbent(p)
    inc.offer(start, "start")
    counters = {"windows": 1, "improved": 0, "restarts": 0}
    dearer = _ScriptedChild((start, evaluate(p, start).cost, counters))
    cheapest = _ScriptedChild((optimum.choice, optimum.cost, counters))
    clock = WorkClock(guard=time.perf_counter() + 30)
    solve_module._windows(p, inc, [dearer, cheapest], time.perf_counter() + 0.8, clock)
    assert inc.cost == pytest.approx(optimum.cost)
    assert len(dearer.tasks) == len(cheapest.tasks) >= 1
    assert all(windows == solve_module.EPOCH_WINDOWS for _, _, windows in dearer.tasks)
    assert dearer.tasks[0][0] == start.tolist()  # the first epoch starts from the incumbent
    assert not clock.cut
    late = _ScriptedChild(None)
    clock = WorkClock(guard=time.perf_counter() + 30)
    solve_module._windows(p, inc, [late], time.perf_counter() + 0.8, clock)
    assert len(late.tasks) == 1 and clock.cut_by == ["guard"]


@pytest.mark.parametrize("seed", range(4))
def test_lns_keeps_ties(seed):
    """Windows take whole tie groups, so repeated layers move together and answers stay tied."""
    import time

    from solver import lns

    rng = np.random.default_rng(500 + seed)
    p = random_problem(rng, n=8, kmax=3, density=0.3, limit=True, ties=True)
    if not p.ties:
        pytest.skip("draw without a tie")
    g = p.ties[0]
    start = np.array([int(np.argmin(u)) for u in p.node_usages])
    start[g] = start[g[0]]
    p.usage_limit = float(max(p.usage_limit, evaluate(p, start).peak_usage))
    found = lns.large_neighbourhood_search(p, start, time.perf_counter() + 2, budget=10_000)
    ev = evaluate(p, found)
    assert ev.feasible and len({int(found[v]) for v in g}) == 1
    assert ev.cost == pytest.approx(brute_force(p))


@pytest.mark.parametrize("error", [ValueError, KeyError, RuntimeError])
def test_a_bug_in_the_milp_path_surfaces_as_itself(monkeypatch, error):
    """Only a proof of infeasibility (ProvedInfeasible) turns the MILP path into a heuristic answer;
    any other error from the builder is a bug and reaches the caller unchanged."""
    from solver import highs_model

    rng = np.random.default_rng(3)
    p = random_problem(rng, limit=False)

    def broken(*args, **kwargs):
        raise error("injected")

    monkeypatch.setattr(highs_model, "build", broken)
    with pytest.raises(error, match="injected"):
        solve(p, time_limit=5, pairwise=False, exact=False)


def test_a_proof_of_infeasibility_in_the_milp_path_is_not_an_error(monkeypatch):
    from solver import highs_model
    from solver.problem import ProvedInfeasible

    rng = np.random.default_rng(3)
    p = random_problem(rng, limit=False)

    def proves(*args, **kwargs):
        raise ProvedInfeasible("injected proof")

    monkeypatch.setattr(highs_model, "build", proves)
    sol = solve(p, time_limit=5, pairwise=False, exact=False)  # the heuristic's answer stands
    assert evaluate(p, sol.choice).feasible and sol.status != "optimal"


def test_schedule_is_checked_and_used():
    """Stage deadlines live in one documented dataclass; a bad one names the broken relation."""
    from solver import Schedule

    with pytest.raises(ValueError, match=r"schedule.pairwise: expected a share of the time limit in \(0, 1\]"):
        Schedule(pairwise=1.5)
    with pytest.raises(ValueError, match=r"weights \(0.9\) must end no later than windows \(0.5\)"):
        Schedule(weights=0.9, windows=0.5)
    assert Schedule().deadline("exact", 10.0, 100.0) == pytest.approx(80.0)
    rng = np.random.default_rng(7)
    p = random_problem(rng, n=8, kmax=3, density=0.3, limit=True)
    sol = solve(p, time_limit=5, schedule=Schedule(pairwise=0.2, exact=0.3))
    assert sol.cost == pytest.approx(brute_force(p))


@pytest.mark.parametrize("seed", [901, 902, 906, 909])
def test_both_backends_solve_one_model(seed):
    """CBC (through PuLP) and HiGHS get the same array model: same columns and rows, same
    optimum, on problems with memory, ties, pins and forbidden pairs."""
    from solver import highs_model, ilp

    rng = np.random.default_rng(seed)
    p = random_problem(rng, n=8, kmax=3, density=0.35, limit=True, ties=True, pins=True, forbid=True)
    best = brute_force(p)
    assert best is not None  # these seeds give feasible problems
    model = highs_model.build(p)
    pm = ilp.to_pulp(model)
    assert len(pm.cols) == model.cost.size
    lower, upper = np.concatenate(model.row_lower), np.concatenate(model.row_upper)
    assert len(pm.lp.constraints) == int(np.sum(lower == upper) + np.sum((lower != upper) & np.isfinite(upper))
                                         + np.sum((lower != upper) & np.isfinite(lower)))
    runs = {b: solve(p, time_limit=20, backend=b, pairwise=False, exact=False) for b in ("highs", "cbc")}
    for b, sol in runs.items():
        assert sol.cost == pytest.approx(best), b
        assert sol.status == "optimal", b
    assert runs["highs"].stats["variables"] == runs["cbc"].stats["variables"]
    assert runs["highs"].stats["constraints"] == runs["cbc"].stats["constraints"]


def test_pairwise_stage_runs_when_its_share_is_under_a_second():
    """toulbar2 counts whole seconds: a solve of 1.5 s gives the pairwise stage a share of 0.75 s,
    which once skipped it (a hand-written plan solved in a share of a share of the planner's time
    came out of the heuristic start 280x dearer). The stage gets its one second."""
    pytest.importorskip("pytoulbar2")
    rng = np.random.default_rng(3)
    p = random_problem(rng, n=8, kmax=3, density=0.3, limit=False)
    sol = solve(p, time_limit=1.5)
    assert sol.source == "pairwise" and sol.status.value == "optimal"
    assert sol.cost == pytest.approx(brute_force(p))


def test_a_repair_within_the_gap_of_the_memory_free_optimum_is_the_answer():
    """Where the memory-free optimum breaks the limit and its repair lies within mip_gap of it (a
    bound of every answer), the solve ends there, proved within the gap; with the default gap
    the exact stage runs and proves the true optimum."""
    pytest.importorskip("pytoulbar2")
    import importlib

    solve_module = importlib.import_module("solver.solve")
    rng = np.random.default_rng(11)
    for _ in range(200):
        p = random_problem(rng, n=8, kmax=3, density=0.3, limit=True)
        free = solve_module.memory_free(p.replaced(usage_limit=None), 5)
        if free is not None and not evaluate(p, free.choice).feasible and brute_force(p) is not None:
            break
    best = brute_force(p)
    loose = solve(p, time_limit=10, mip_gap=10.0)  # any repair is within 1000% of the bound here
    assert loose.source == "repair" and loose.status.value == "optimal"
    assert loose.lower_bound == pytest.approx(free.cost) and loose.cost >= best - 1e-9
    tight = solve(p, time_limit=10)
    assert tight.cost == pytest.approx(best) and tight.lower_bound <= best + 1e-6


@pytest.mark.parametrize("seed", range(30))
def test_starts_made_without_the_pins_bound_the_memory_free_search(seed):
    """A start that breaks the problem's pins or ties (a plan made without them) is moved onto
    the allowed strategies and bounds toulbar2's search from above: the answer is the same
    proved optimum as without it, whether the start lies above it or is it (nothing is found
    below, and the start comes back proved)."""
    from solver.local import onto_allowed

    rng = np.random.default_rng(100 + seed)
    p = random_problem(rng, n=7, limit=False, ties=seed % 2 == 0, pins=True, forbid=seed % 3 == 0)
    exact = brute_force(p)
    if exact is None:
        return
    v, i = next(iter(p.pins.items()))
    start = np.array([int(rng.integers(p.num_strategies(w))) for w in range(p.num_nodes)])
    if p.num_strategies(v) > 1:
        start[v] = (i + 1) % p.num_strategies(v)  # breaks the pin
    moved, count = onto_allowed(p, start)
    assert moved[v] == i and count >= (1 if p.num_strategies(v) > 1 else 0)
    assert all(len({int(moved[w]) for w in g}) == 1 for g in p.ties)
    optimum = solve(p, time_limit=10).choice
    for given in (start, optimum):
        sol = solve(p, time_limit=10, starts=[("elsewhere", given)])
        assert sol.status == "optimal" and sol.cost == pytest.approx(exact, abs=1e-6)
        assert sol.lower_bound == pytest.approx(exact, abs=1e-4)
        assert evaluate(p, sol.choice).feasible


def test_the_starts_bound_reaches_toulbar2_and_a_start_nothing_beats_is_the_answer(monkeypatch):
    """The least start's cost is toulbar2's upper bound (on the tie quotient); where toulbar2
    finds nothing below it, the start is the memory-free stage's answer: proved optimal when the
    bounds proved that nothing is cheaper, else unproved and bounding nothing."""
    import importlib

    solve_module = importlib.import_module("solver.solve")
    rng = np.random.default_rng(7)
    p = random_problem(rng, n=7, limit=False)
    exact = brute_force(p)
    optimum = solve(p, time_limit=10).choice
    uppers = []
    real = solver.cfn.solve_pairwise

    def spy(q, seconds, scale=1000.0, upper=None):
        uppers.append(upper)
        return real(q, seconds, scale, upper=upper)

    monkeypatch.setattr(solver.cfn, "solve_pairwise", spy)
    choice, ev, bound, proved = solve_module._pairwise_first(p, 0.0, at_least=10.0, upper=(exact, optimum))
    assert uppers == [pytest.approx(exact)] and proved
    assert ev.cost == pytest.approx(exact) and bound == pytest.approx(exact, abs=1e-2)
    for said, want in ((True, pytest.approx(exact - 0.25)), (False, -np.inf)):
        monkeypatch.setattr(solver.cfn, "solve_pairwise", lambda q, seconds, upper=None: (None, said, 0.25))
        choice, ev, bound, proved = solve_module._pairwise_first(p, 0.0, at_least=10.0, upper=(exact, optimum))
        assert np.array_equal(choice, optimum) and proved == said and bound == want


def _dominance_by_rows(problem, allowed, pairs):
    """drop_dominated's rule, one kept row against all rows at a time (its first form)."""
    adj = {}
    for (u, v), m in pairs.items():
        adj.setdefault(u, []).append((v, m, False))
        adj.setdefault(v, []).append((u, m, True))
    for _ in range(3):
        removed = 0
        for v in range(problem.num_nodes):
            a = allowed[v]
            if a.size < 2:
                continue
            cols = [problem.node_costs[v][a][:, None], problem.node_usages[v][a][:, None]]
            for w, m, transposed in adj.get(v, []):
                cols.append(m[np.ix_(allowed[w], a)].T if transposed else m[np.ix_(a, allowed[w])])
            rows = np.hstack(cols)
            slack = rows + 1e-9 * np.abs(rows)
            keep = np.ones(a.size, dtype=bool)
            for j in np.argsort(rows.sum(axis=1), kind="stable").tolist():
                if keep[j]:
                    beaten = (rows[j] <= slack).all(axis=1)
                    beaten[j] = False
                    keep &= ~beaten
            removed += int((~keep).sum())
            allowed[v] = a[keep]
        if not removed:
            break


@pytest.mark.parametrize("seed", range(12))
def test_dominated_strategies_are_the_ones_a_row_by_row_test_drops(seed):
    """Dominance is tested on a few columns for every pair at once, then on all columns for the
    pairs that pass: the strategies kept are exactly those of testing each kept strategy's row
    against every other row in full (wide rows, equal rows, few distinct values)."""
    from solver.highs_model import drop_dominated

    rng = np.random.default_rng(seed)
    n, k = 6, int(rng.integers(20, 60))
    # Strategies past the first k // 2 copy an earlier one, some a little dearer (dominated),
    # others exactly (equal rows: the first is kept).
    copy = [np.concatenate([np.arange(k // 2), rng.integers(0, k // 2, size=k - k // 2)]) for _ in range(n)]
    worse = [(np.arange(k) >= k // 2) & (rng.random(k) < 0.5) for _ in range(n)]
    costs = [rng.integers(0, 4, size=k).astype(float)[c] + w for c, w in zip(copy, worse)]
    usages = [rng.integers(0, 3, size=k).astype(float)[c] for c in copy]
    edges, mats = [], []
    for u, v in itertools.combinations(range(n), 2):
        if rng.random() < 0.5:
            m = rng.integers(0, 3, size=(k, k)).astype(float)[np.ix_(copy[u], copy[v])]
            edges.append((u, v))
            mats.append(m)
    p = Problem(costs, usages, np.zeros((n, 2), dtype=int), np.array(edges).reshape(-1, 2), mats)
    p.usage_limit = 1e9
    pairs = {(u, v): m for (u, v), m in zip(edges, mats)}
    mine = [np.arange(k) for _ in range(n)]
    drop_dominated(p, np.arange(n), mine, [c.copy() for c in costs], pairs)
    theirs = [np.arange(k) for _ in range(n)]
    _dominance_by_rows(p, theirs, pairs)
    assert [a.tolist() for a in mine] == [a.tolist() for a in theirs]
    assert sum(a.size for a in mine) < n * k  # some were dropped: the test tests something


def test_a_toulbar2_search_that_closes_by_itself_is_a_proof():
    """toulbar2 ends its branch and bound ("Optimum: 21724065283") with its dual bound left at
    its last gap line's (21724058542): a search that ended by itself, not by its limit, proved
    its answer. The tables: a 4-layer LLaMA's tie quotient (strategies pruned by dominance)."""
    from pathlib import Path

    from solver import cfn

    data = np.load(Path(__file__).parent / "data" / "toulbar2_stale_bound.npz")
    costs = [data[f"c{i}"] for i in range(int(data["n"]))]
    tables = {(int(u), int(v)): data[f"t{j}"] for j, (u, v) in enumerate(data["keys"].tolist())}
    choice, proved, gap = cfn.solve_tables(costs, tables, 30, 1000.0)
    assert proved and gap <= cfn.rounding_slack(len(costs) + len(tables), 1000.0) + 1e-12
    assert cfn.table_cost(costs, tables, choice) == pytest.approx(21724065.283, abs=1e-3)
