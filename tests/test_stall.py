"""The stall rule (solver.stall) and the watched exact search that it ends (solver.exact_child)."""

import math

import numpy as np
import pytest
from test_memrows import layered_problem

from solver import cfn, evaluate
from solver.exact import build_exact, finish
from solver.exact_child import ExactChild
from solver.stall import Progress, RunsWithoutGain, StallRule


def test_small_gains_do_not_count_and_patience_follows_the_run():
    rule = StallRule(gain=0.01, gap_share=0.1, patience=1.0, min_seconds=2.0)
    p = Progress(rule)
    assert not p.stalled(100.0)  # nothing reported, not begun: a deadline bounds it
    p.begin(0.0)
    assert not p.stalled(100.0) and p.stalls_at() == math.inf
    assert p.incumbent(100.0, 1.0)  # the first always counts
    assert p.stalled(3.0) and not p.stalled(2.9)  # min_seconds after it (1 s of run: patience 1 s)
    assert not p.incumbent(99.5, 2.0)  # 0.5% < gain: seen, not counted
    assert p.best == 99.5 and p.stalled(3.0)
    assert p.incumbent(98.0, 6.0)  # 1.5% below the last counted (100)
    assert p.stalls_at() == 12.0  # 6 s of run to it: 6 s more
    assert not p.stalled(11.9) and p.stalled(12.0)
    # Bounds count when they close a tenth of the gap left to the best answer (98).
    assert p.bound(50.0, 7.0)
    assert not p.bound(54.0, 8.0)  # 4 < 0.1 * (98 - 50)
    assert p.bound(55.0, 9.0)
    assert p.stalls_at() == 18.0


def test_a_begun_search_that_counts_its_start_stalls_when_silent():
    p = Progress(StallRule(min_seconds=3.0))
    p.begin(10.0, counts=True)
    assert not p.stalled(12.9) and p.stalled(13.0)


def test_a_search_after_another_progresses_only_past_what_is_known():
    """Branch and bound under DGVNS's answer finds that answer again, and a MILP beside the
    exact search reports bounds weaker than its: neither is progress."""
    p = Progress(StallRule(gain=0.01, gap_share=0.1, min_seconds=2.0))
    p.begin(0.0)
    p.known(100.0, 80.0)
    assert p.best == 100.0 and p.stalls_at() == math.inf  # nothing counted yet
    assert not p.incumbent(100.0, 5.0)  # the known answer again
    assert not p.incumbent(99.5, 6.0)  # below it, but by less than the gain
    assert not p.bound(70.0, 7.0) and not p.bound(81.0, 7.5)  # weaker, or closing < 10% of 20
    assert p.stalls_at() == math.inf
    assert p.bound(82.5, 8.0)  # closes 2.5 of the 19.5 left: counts
    assert p.stalls_at() == 16.0
    assert p.incumbent(98.0, 9.0) and p.stalls_at() == 18.0
    # Begun counting its start (the MILP beside the exact search): silent means stalled.
    q = Progress(StallRule(min_seconds=3.0))
    q.begin(0.0, counts=True)
    q.known(100.0, 80.0)
    assert not q.incumbent(100.0, 1.0) and q.stalled(3.0)


@pytest.mark.parametrize("field,value", [("gain", 1.0), ("gap_share", -0.1), ("patience", -1.0),
                                         ("min_seconds", -1.0)])
def test_rule_checks_its_fields(field, value):
    with pytest.raises(ValueError, match=field if field in ("gain", "gap_share") else "patience and min_seconds"):
        StallRule(**{field: value})


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
def test_watched_exact_search_proves_and_answers_within_the_memory_limit():
    """A small tied problem: DGVNS then branch and bound in the child, proved optimal, the answer
    feasible and no dearer than the brute-force optimum's bound."""
    from test_memrows import tied_brute_force

    p = layered_problem(np.random.default_rng(3), layers=3, tight=0.4)
    model = build_exact(p)
    child = ExactChild(model, None, 20.0)
    import time

    ans = child.run(time.perf_counter() + 20.0, StallRule())
    assert [ph["method"] for ph in ans.phases][:1] == ["vns"]
    res = finish(p, model, ans.picked, ans.proved, ans.gap)
    best = tied_brute_force(p)
    assert res.evaluation.feasible and res.proved
    assert res.evaluation.cost == pytest.approx(best, abs=1e-6)


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
def test_branch_and_bound_under_an_optimal_cost_proves_it():
    """Given an optimal answer's cost as the upper bound, branch and bound finds an answer that
    good again and proves it (toulbar2 alone, searching strictly below, would find nothing and
    keep its root bound: no proof)."""
    from test_memrows import tied_brute_force

    p = layered_problem(np.random.default_rng(5), layers=3, tight=0.4)
    best = tied_brute_force(p)
    model = build_exact(p)
    picked, proved, gap = cfn.solve_tables(model.costs, model.tables, 10, model.scale, best, model.rows)
    assert picked is not None and proved and 0 <= gap < 1e-2
    assert evaluate(p, model.choice(picked)).cost == pytest.approx(best, abs=1e-6)
    # With DGVNS nothing is proved.
    picked, proved, _ = cfn.solve_tables(model.costs, model.tables, 2, model.scale, None, model.rows, method="vns")
    assert picked is not None and not proved and evaluate(p, model.choice(picked)).feasible


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
def test_branch_and_bound_alone_in_a_child_proves_and_reports_its_bound():
    """The phase that runs beside DGVNS: branch and bound alone, in its own child, under a
    feasible upper bound; its answer is optimal and the bound its lines showed holds."""
    import time

    from test_memrows import tied_brute_force

    p = layered_problem(np.random.default_rng(3), layers=3, tight=0.4)
    best = tied_brute_force(p)
    model = build_exact(p)
    child = ExactChild(model, best * 1.5, 20.0, phases=("hbfs",))
    ans = child.run(time.perf_counter() + 20.0, StallRule())
    assert [ph["method"] for ph in ans.phases] == ["hbfs"]
    res = finish(p, model, ans.picked, ans.proved, ans.gap)
    assert res.proved and res.evaluation.cost == pytest.approx(best, abs=1e-6)
    assert ans.lower <= best + 1e-9
    with pytest.raises(ValueError, match="phases"):
        ExactChild(model, None, 1.0, phases=("bfs",))


def test_proof_out_of_reach_projects_the_bound_to_the_best_answer():
    """A branch and bound whose bound, at the rate it has risen, would meet the best answer only
    after longer than its patience allows is out of reach; one about to meet it is not; nothing
    is judged before the bounds span ``min_seconds`` or without an answer."""
    rule = StallRule(min_seconds=2.0, patience=1.0)
    p = Progress(rule)
    p.begin(0.0)
    p.bound(50.0, 1.0)
    p.bound(55.0, 4.0)
    assert not p.proof_out_of_reach(5.0)  # no answer known: nothing to close
    p.known(100.0)
    slow = Progress(rule)
    slow.begin(0.0)
    slow.known(100.0)
    slow.bound(50.0, 1.0)
    assert not slow.proof_out_of_reach(2.5)  # one bound: no rate yet
    slow.bound(51.0, 2.0)
    assert not slow.proof_out_of_reach(2.5)  # bounds span 1 s < min_seconds
    slow.bound(55.0, 4.0)  # 5 in 3 s: 45 left takes 27 s, more than the 5 s earned at t = 5
    assert slow.proof_out_of_reach(5.0)
    assert not slow.proof_out_of_reach(40.0)  # 40 s earned by then
    fast = Progress(rule)
    fast.begin(0.0)
    fast.known(100.0)
    fast.bound(50.0, 1.0)
    fast.bound(95.0, 4.0)  # 15 per s: 5 left takes a third of a second
    assert not fast.proof_out_of_reach(5.0)
    flat = Progress(rule)
    flat.begin(0.0)
    flat.known(100.0)
    flat.bound(50.0, 1.0)
    flat.bound(50.0, 4.0)  # no rise in 3 s
    assert flat.proof_out_of_reach(5.0)


class _ScriptedChild:
    """A child that already printed ``lines`` and wrote ``out`` (what ``ExactChild.run`` reads)."""

    def __init__(self, folder, lines, out):
        import queue
        import subprocess
        import sys
        import time

        from solver.child import write

        self.folder = folder
        write(folder / "out.pkl", out)
        self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        self.lines = queue.Queue()
        for k, line in enumerate([*lines, None]):
            self.lines.put((time.perf_counter(), float(k), line))
        self.total = len(lines) + 1

    def timed_line(self, timeout):  # (arrival, the child's CPU seconds then: one a line, text)
        return None if self.lines.empty() else self.lines.get()

    def cpu(self):  # one CPU second per line handed out
        return float(self.total - self.lines.qsize())

    def pending(self):
        return not self.lines.empty()

    def wait(self, timeout):
        return True

    def close(self):
        self.proc.kill()
        self.proc.wait()


def test_branch_and_bound_gap_is_its_own_answers(tmp_path):
    """Branch and bound stopped before it proves: its gap runs from its own answer (the one it
    writes back) down to its bound lines, never below the bound lines it showed."""
    import time

    child = ExactChild.__new__(ExactChild)
    child.scale, child.phases, child.rounding, child.upper = 1.0, ("hbfs",), 0.0, 7000.0
    child.restarts = None
    child.child = _ScriptedChild(tmp_path, ["@phase hbfs", "Preprocessing time: 5.062 seconds.",
                                            "Initial lower and upper bounds: [5878, 6063]",
                                            "New solution: 6016", "Optimality gap: [5896, 6016] 1.98 %",
                                            "@end hbfs"], ([0, 1], False, math.inf, []))
    ans = child.run(time.perf_counter() + 10.0, StallRule())
    assert ans.lower == 5896.0
    assert ans.gap == pytest.approx(6016.0 - 5896.0)
    assert ans.phases[0]["preprocess_s"] == 5.062


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
def test_solve_with_branch_and_bound_beside_dgvns_is_optimal(monkeypatch):
    """With a core to spare under the stall rule, the exact stage runs DGVNS and branch and bound
    in two children at once (no MILP), branch and bound from DGVNS's first answer on: the answer
    is the brute-force optimum, its bound below it."""
    import importlib

    from test_memrows import tied_brute_force

    from solver import solve

    solve_module = importlib.import_module("solver.solve")

    p = layered_problem(np.random.default_rng(4), layers=4, tight=0.4)
    best = tied_brute_force(p)
    monkeypatch.setattr(solve_module, "second_core_free", lambda: True)
    monkeypatch.setattr(solve_module, "ROUND_MAX_ENTRIES", 0)  # as if the network were LLaMA-70B's
    started = []
    real = solve_module.ExactChild

    def spy(*args, **kwargs):
        started.append(kwargs.get("phases"))
        return real(*args, **kwargs)

    monkeypatch.setattr(solve_module, "ExactChild", spy)
    sol = solve(p, time_limit=30, pairwise=False)  # the pairwise optimum may already fit: go to the exact stage
    assert started == [("vns",), ("hbfs",)]  # branch and bound under DGVNS's first answer
    assert sol.cost == pytest.approx(best, abs=1e-6) and evaluate(p, sol.choice).feasible
    assert sol.lower_bound is not None and sol.lower_bound <= sol.cost + 1e-9


def test_branch_and_bound_searches_again_only_under_a_counted_gain_and_a_cheap_network():
    """Branch and bound ended unproved under DGVNS's first answer searches again under DGVNS's
    last where that is a gain the stall rule counts and its network was preprocessed within
    ``min_seconds``; the two answers combine as the second's where it found or proved
    anything, else the first's, with the higher bound."""
    from solver.exact_child import ExactAnswer, combine, search_again

    rule = StallRule(gain=1e-3, min_seconds=3.0)

    def hbfs(preprocess_s, proved=False, picked=None, gap=math.inf, lower=-math.inf):
        return ExactAnswer(picked, proved, gap, [{"method": "hbfs", "preprocess_s": preprocess_s}], lower)

    assert search_again(hbfs(0.5), upper=100.0, best=99.0, rule=rule)
    assert not search_again(hbfs(5.0), upper=100.0, best=99.0, rule=rule)  # posting costs too much
    assert not search_again(hbfs(0.5), upper=100.0, best=99.95, rule=rule)  # 0.05% < gain
    assert not search_again(hbfs(0.5, proved=True), upper=100.0, best=99.0, rule=rule)
    assert not search_again(hbfs(None), upper=100.0, best=99.0, rule=rule)  # never preprocessed
    assert not search_again(hbfs(0.5), upper=100.0, best=math.inf, rule=rule)

    first = hbfs(0.5, picked=[1, 2], gap=5.0, lower=95.0)
    nothing = hbfs(0.4, lower=96.0)  # the second found nothing below 99 and proved nothing
    both = combine(first, nothing)
    assert both.picked == [1, 2] and both.gap == 5.0 and both.lower == 96.0 and len(both.phases) == 2
    proved = combine(first, hbfs(0.4, proved=True, gap=0.01, lower=99.0))  # 99 itself proved optimal
    assert proved.proved and proved.picked is None and proved.lower == 99.0
    found = combine(first, hbfs(0.4, picked=[3, 4], gap=1.0, lower=97.5))
    assert found.picked == [3, 4] and found.gap == 1.0


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
@pytest.mark.parametrize("seed", range(4))
def test_lazy_dgvns_posts_the_rows_its_answers_break_and_answers_only_what_holds_them_all(seed):
    """DGVNS with the memory rows posted one at a time, as its answers break them: the optimum
    without rows breaks some (the test has rows to post), each answer reported holds every row
    and costs less than the one before, and the last is the brute-force optimum with fewer rows
    posted than there are."""
    from test_memrows import tied_brute_force

    p = layered_problem(np.random.default_rng(seed), layers=6, tight=0.4, grads=True)
    model = build_exact(p)
    free, _, _ = cfn.solve_tables(model.costs, model.tables, 5, model.scale, None, [])
    assert (cfn.row_excess(model.rows, free) > 0).any()
    said = []
    picked, proved, gap = cfn.solve_lazy(model.costs, model.tables, 10, model.scale, None, model.rows, add=1,
                                         on_answer=lambda cost, posted, _: said.append((cost, posted)))
    assert not proved and gap == np.inf
    assert (cfn.row_excess(model.rows, picked) <= 0).all()
    costs = [c for c, _ in said]
    assert costs == sorted(costs, reverse=True) and len(set(costs)) == len(costs)
    assert costs[-1] == pytest.approx(cfn.table_cost(model.costs, model.tables, picked))
    assert all(1 <= posted <= len(model.rows) for _, posted in said)
    res = finish(p, model, picked, False, np.inf)
    assert res.evaluation.feasible and res.evaluation.cost == pytest.approx(tied_brute_force(p), abs=1e-6)
    # Stopped before its first round, it answers nothing.
    assert cfn.solve_lazy(model.costs, model.tables, 10, model.scale, None, model.rows, stop=lambda: True)[0] is None


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
def test_a_watched_lazy_dgvns_reports_answers_that_hold_every_row():
    """In the child, DGVNS past ``lazy_rows`` rows posts them lazily; what its lines report (the
    stall rule's incumbents) and what it writes back hold every row: the brute-force optimum here."""
    import time

    from test_memrows import tied_brute_force

    p = layered_problem(np.random.default_rng(3), layers=6, tight=0.4, grads=True)
    model = build_exact(p)
    child = ExactChild(model, None, 20.0, phases=("vns",), lazy_rows=0)
    ans = child.run(time.perf_counter() + 20.0, StallRule())
    assert [ph["method"] for ph in ans.phases] == ["vns"] and "preprocess_s" not in ans.phases[0]
    best = tied_brute_force(p)
    seen = [cfn.table_cost(model.costs, model.tables, a) for a in ans.others + [ans.picked]]
    assert ans.phases[0]["best"] == pytest.approx(best, abs=1e-2)
    res = finish(p, model, ans.picked, ans.proved, ans.gap)
    assert res.evaluation.feasible and res.evaluation.cost == pytest.approx(best, abs=1e-6)
    # Its earlier answers come back too (the solve's pool): each holds every row, none is cheaper.
    assert len(ans.others) == len(seen) - 1
    for other in ans.others:
        assert (cfn.row_excess(model.rows, other) <= 0).all()
        assert cfn.table_cost(model.costs, model.tables, other) > cfn.table_cost(model.costs, model.tables, ans.picked)


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
def test_a_solve_keeps_its_other_feasible_answers_in_a_pool():
    """Beside its answer, a solve returns the other feasible answers its stages found (a start,
    the lazy DGVNS's earlier answers ...), distinct, cheapest first, never the answer itself: the
    planner ranks them by their simulated step."""
    from solver import solve
    from solver.solve import POOL_SIZE

    p = layered_problem(np.random.default_rng(3), layers=6, tight=0.4, grads=True)
    dear = np.array([int(np.argmin(u)) for u in p.node_usages])  # least usage: feasible, not cheapest
    assert evaluate(p, dear).feasible
    sol = solve(p, time_limit=20, starts=[("least usage", dear)])
    assert sol.cost < evaluate(p, dear).cost
    keys = [c.tobytes() for _, c in sol.pool]
    assert len(set(keys)) == len(keys) <= POOL_SIZE and sol.choice.tobytes() not in keys
    costs = [evaluate(p, c).cost for _, c in sol.pool]
    assert all(evaluate(p, c).feasible for _, c in sol.pool) and costs == sorted(costs)
    assert all(c >= sol.cost - 1e-9 for c in costs)
    assert ("start:least usage", dear.tobytes()) in [(s, c.tobytes()) for s, c in sol.pool]


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
@pytest.mark.parametrize("seed", range(4))
def test_lazy_branch_and_bound_proves_the_optimum_with_rows_posted_as_they_break(seed):
    """Branch and bound over the rows its answers broke: the relaxation's optimum that holds
    every row is the whole network's, proved; under that cost it proves nothing is cheaper (no
    answer, proved), and under a cost below the optimum it finds nothing and proves it."""
    from test_memrows import tied_brute_force

    p = layered_problem(np.random.default_rng(seed), layers=6, tight=0.4, grads=True)
    model = build_exact(p)
    best = tied_brute_force(p)
    said = []
    picked, proved, gap = cfn.solve_lazy(model.costs, model.tables, 20, model.scale, None, model.rows, add=1,
                                         method="hbfs", on_answer=lambda cost, posted, _: said.append(posted))
    assert proved and picked is not None and 0 <= gap < 1e-2
    assert (cfn.row_excess(model.rows, picked) <= 0).all() and said and said[-1] <= len(model.rows)
    assert evaluate(p, model.choice(picked)).cost == pytest.approx(best, abs=1e-6)
    again, proved, _ = cfn.solve_lazy(model.costs, model.tables, 20, model.scale, best, model.rows, method="hbfs")
    assert proved and (again is None or cfn.table_cost(model.costs, model.tables, again) == pytest.approx(best))
    below, proved, _ = cfn.solve_lazy(model.costs, model.tables, 20, model.scale, best - 1.0, model.rows,
                                      method="hbfs")
    assert below is None and proved


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
def test_a_watched_lazy_branch_and_bound_proves_and_reports_only_what_holds_every_row():
    """In the child, branch and bound past ``lazy_rows`` rows: proved optimal, its bound lines
    below the optimum, the answer it writes back holding every row."""
    import time

    from test_memrows import tied_brute_force

    p = layered_problem(np.random.default_rng(3), layers=6, tight=0.4, grads=True)
    best = tied_brute_force(p)
    model = build_exact(p)
    child = ExactChild(model, best * 1.5, 20.0, phases=("hbfs",), lazy_rows=0)
    ans = child.run(time.perf_counter() + 20.0, StallRule())
    res = finish(p, model, ans.picked, ans.proved, ans.gap)
    assert res.proved and res.evaluation.cost == pytest.approx(best, abs=1e-6)
    assert ans.lower <= best + 1e-9 and (cfn.row_excess(model.rows, ans.picked) <= 0).all()


def test_runs_without_gain_stall_after_patience_results_that_do_not_count():
    runs = RunsWithoutGain(StallRule(gain=0.01), patience=2, known=100.0)
    runs.result(99.5)  # within 1% of the known answer: does not count
    assert runs.dry == 1 and not runs.stalled
    runs.result(98.0)  # 2% better: counts, the count starts over
    assert runs.dry == 0
    runs.result(97.5)
    runs.result(97.4)
    assert runs.stalled
    first = RunsWithoutGain(StallRule(), patience=1)  # nothing known: the first result always counts
    first.result(1e9)
    assert not first.stalled


def test_a_watched_child_s_work_clock_counts_its_cpu_not_the_wall():
    """The clock the stall rules read is the child's CPU seconds: a child that sleeps gains
    none while the wall clock runs; one that computes gains about the wall's time (issue
    "reproducible solves": a busy machine stretches the wall clock, not the work done). Each
    line carries the child's CPU seconds when it came."""
    import os
    import sys
    import time

    from solver.child import Child, process_seconds

    mine = process_seconds(os.getpid())
    if mine is None:
        pytest.skip("/proc cannot be read here: the work clock is the wall clock")
    assert mine >= 0
    code = ("import time\nprint('up', flush=True)\ntime.sleep(1.0)\nprint('slept', flush=True)\n"
            "t = time.process_time()\nwhile time.process_time() - t < 1.0: pass\nprint('spun', flush=True)\n")
    child = Child.command([sys.executable, "-c", code])
    got = {}
    t0 = time.perf_counter()
    while len(got) < 3 and time.perf_counter() - t0 < 30:
        line = child.timed_line(timeout=1.0)
        if line and line[2]:
            got[line[2].strip()] = line
    child.close()
    (w_up, c_up, _), (w_slept, c_slept, _), (_, c_spun, _) = got["up"], got["slept"], got["spun"]
    assert w_slept - w_up >= 0.9 and c_slept - c_up < 0.3  # asleep: the wall ran, the work did not
    assert c_spun - c_slept >= 0.8  # computing: the work ran


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
@pytest.mark.parametrize("seed", range(3))
def test_dgvns_in_rounds_of_bounded_restarts_proves_the_optimum_the_same_way_twice(seed):
    """DGVNS whose restarts are bounded ends each round in toulbar2's own branch and bound: the
    lazy search proves the brute-force optimum, with the rows posted as they break or all from
    the start, and a second run answers the same choice (its rounds end by their work)."""
    from test_memrows import tied_brute_force

    from solver.exact_child import ROUND_RESTARTS

    p = layered_problem(np.random.default_rng(seed), layers=6, tight=0.4, grads=True)
    model = build_exact(p)
    best = tied_brute_force(p)
    for posted in ((), range(len(model.rows))):
        said = []
        runs = [cfn.solve_lazy(model.costs, model.tables, 30, model.scale, None, model.rows, method="vns",
                               restarts=ROUND_RESTARTS, posted=posted, on_answer=lambda c, n, _: said.append(c))
                for _ in range(2)]
        (picked, proved, gap), again = runs
        assert proved and again[1] and list(again[0]) == list(picked)
        res = finish(p, model, picked, proved, gap)
        assert res.proved and res.evaluation.feasible and res.evaluation.cost == pytest.approx(best, abs=1e-6)
        assert said[:len(said) // 2] == said[len(said) // 2:]  # the same answers, in the same order
    # Unbounded, DGVNS proves nothing.
    assert not cfn.solve_lazy(model.costs, model.tables, 2, model.scale, None, model.rows, method="vns")[1]


@pytest.mark.skipif(not cfn.available(), reason="needs pytoulbar2")
def test_solve_under_the_stall_rule_runs_one_exact_search_in_rounds_and_answers_the_same_twice(monkeypatch):
    """Under the stall rule (the planner's solves) the exact stage runs DGVNS in rounds of
    ``ROUND_RESTARTS`` in one child, nothing beside it even with a core to spare (no MILP, no
    second search): it proves the brute-force optimum, and a second solve answers the same plan."""
    import importlib

    from test_memrows import tied_brute_force

    from solver import solve
    from solver.exact_child import ROUND_RESTARTS

    solve_module = importlib.import_module("solver.solve")
    p = layered_problem(np.random.default_rng(4), layers=4, tight=0.4)
    best = tied_brute_force(p)
    monkeypatch.setattr(solve_module, "second_core_free", lambda: True)
    started = []
    real = solve_module.ExactChild

    def spy(*args, **kwargs):
        started.append((kwargs.get("phases"), kwargs.get("restarts")))
        return real(*args, **kwargs)

    monkeypatch.setattr(solve_module, "ExactChild", spy)
    monkeypatch.setattr(solve_module, "MilpChild", lambda *a, **k: pytest.fail("no MILP beside under the stall rule"))
    sols = [solve(p, time_limit=30, pairwise=False) for _ in range(2)]  # pairwise off: to the exact stage
    assert started == [(None, ROUND_RESTARTS)] * 2
    for sol in sols:
        assert sol.status.value == "optimal"  # proved by the exact stage (its answer, or the start it could not beat)
        assert sol.cost == pytest.approx(best, abs=1e-6) and evaluate(p, sol.choice).feasible
    assert np.array_equal(sols[0].choice, sols[1].choice)


def test_dgvns_answers_are_dropped_where_branch_and_bound_beside_it_proved(monkeypatch):
    """DGVNS is stopped when branch and bound beside it proves, so its answer then depends on how
    far it had got: it is offered only where the proof was under it and found nothing cheaper
    (then it is DGVNS's first answer of that cost), or where nothing was proved."""
    import importlib
    from types import SimpleNamespace

    solve_module = importlib.import_module("solver.solve")
    offered = []
    monkeypatch.setattr(solve_module, "_offer_others", lambda run, model, first: None)
    run = SimpleNamespace(inc=SimpleNamespace(offer=lambda choice, source, ev=None: offered.append(choice)))
    found = SimpleNamespace(choice=np.array([1, 2]), evaluation=None)
    cases = [  # (proved, branch and bound's answer, its bound was DGVNS's), offered?
        (True, [0, 0], True, False),
        (True, None, False, False),
        (True, None, True, True),
        (False, [0, 0], True, True),
        (False, None, False, True),
    ]
    for proved, picked, under_dgvns, expect in cases:
        offered.clear()
        solve_module._offer_dgvns(run, None, None, found, SimpleNamespace(proved=proved, picked=picked), under_dgvns)
        assert bool(offered) == expect, (proved, picked, under_dgvns)


def test_a_search_from_a_given_answer_stalls_after_as_long_again_as_it_took_to_get_ready():
    p = Progress(StallRule(min_seconds=2.0, patience=1.0, from_ready=True))
    p.begin(0.0)
    p.known(100.0)
    assert p.stalls_at() == math.inf  # not ready yet: only the deadline bounds it
    p.ready(5.0)  # 5 s to post the network
    assert p.stalls_at() == 10.0 and not p.stalled(9.9) and p.stalled(10.0)
    p.ready(7.0)  # a later round's end is not a second event
    assert p.stalls_at() == 10.0
    assert p.incumbent(90.0, 8.0)  # a better answer counts: patience runs from it
    assert p.stalls_at() == 16.0
    q = Progress(StallRule(min_seconds=2.0))
    q.begin(0.0)
    q.ready(0.5)  # ready at once: min_seconds still holds
    assert q.stalls_at() == 2.5


def test_the_watcher_marks_readiness_only_where_the_rule_asks_and_an_answer_was_given():
    from solver.exact_child import mark_ready

    for from_ready, best, phase, expect in ((True, 100.0, "vns", 1.0), (False, 100.0, "vns", None),
                                            (True, math.inf, "vns", None), (True, 100.0, "hbfs", None)):
        p = Progress(StallRule(from_ready=from_ready))
        p.begin(0.0)
        mark_ready(phase, p, best, 1.0)
        assert p.last == expect, (from_ready, best, phase)
