"""toulbar2 (a Cost Function Network solver) on pairwise cost tables.

Without memory the problem is a pairwise CFN: toulbar2 proves optima on planner
graphs (a few hundred tie groups) and on eliminated IOPDDL cores (2-4k nodes) in
seconds, where the MILP needs an edge variable per table entry. Memory is either
posted as knapsack constraints over the tie quotient where its rows are few
(:mod:`solver.exact`), or handled around the search: checked after (``solve``) or
priced by per-node weights (:mod:`solver.weights`).
Optional: without ``pytoulbar2`` these stages are skipped.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import numpy as np

from solver.problem import FORBIDDEN, Problem

try:
    import pytoulbar2
except ImportError:  # pragma: no cover - exercised only where the wheel is missing
    pytoulbar2 = None

#: ``([(variable, integer weight per value)], rhs)``: sum of the chosen values' weights <= rhs.
KnapsackRow = tuple[list[tuple[int, np.ndarray]], int]

#: toulbar2's forbidden cost: far above any real total once scaled (costs are int64 there).
TOP = 1e15


def available() -> bool:
    return pytoulbar2 is not None


def solve_tables(costs: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray], seconds: float,
                 scale: float, upper: float | None = None, rows: Sequence[KnapsackRow] = (),
                 method: str = "hbfs", progress: bool = False,
                 restarts: int | None = None, backtracks: int | None = None,
                 work: dict | None = None) -> tuple[list[int] | None, bool, float]:
    """Minimize sum_i costs[i][x_i] + sum_(a,b) edges[a,b][x_a, x_b]: (choice, proved, gap).

    Costs are multiplied by ``scale`` and rounded (toulbar2's costs are integers);
    entries at or above ``FORBIDDEN`` (or inf) are hard. ``gap`` (in cost units,
    rounding included) bounds how far the choice can be above the optimum. With
    ``upper`` (the cost of a known choice) only choices at most as costly (within rounding)
    are searched, so the known choice's own may come back, proved optimal.
    ``rows`` are hard linear constraints sum_(i, w) w[x_i] <= rhs with integer w >= 0
    (toulbar2's knapsack constraint, propagated during the search: memory rows).
    Choice None when nothing was found in time; then ``proved`` says whether the bounds
    alone proved that nothing beats ``upper`` (its choice is optimal, within ``gap``).

    ``method``: ``"hbfs"`` (toulbar2's default hybrid best-first branch and bound: exact,
    proves) or ``"vns"`` (its decomposition-guided variable neighbourhood search, DGVNS,
    from the first depth-first solution: no proof, but on the planner's 70B problem it found
    in 7 s a cheaper plan than branch and bound in 60 s, and on IOPDDL V the strongest
    known cost, a proven optimum, in 15 s where branch and bound stayed 6% above).
    ``progress``: toulbar2 prints its search to stdout (``New solution: C`` per incumbent,
    ``Optimality gap: [L, U]``, costs scaled): what :mod:`solver.exact_child` reads. It
    stops early, returning its incumbent, on SIGVTALRM (its own CPU timer's signal).

    ``restarts`` (DGVNS only): its restarts are bounded by this count, after which toulbar2
    searches on by branch and bound under DGVNS's answer until it proves (its own tail): a
    search that ends by its work, not by a clock, so the same in every run (issue
    "reproducible solves"; toulbar2's backtrack limit does not bound DGVNS). Without, DGVNS
    restarts 10000 times: in effect until its time limit or a signal.

    ``backtracks`` bounds the search by its work (toulbar2's backtrack limit; ``seconds``, CPU
    seconds, stays the guard): a search it ends is the same in every run, where one a CPU limit
    ends is not. ``work``, a dict, is filled with what the search did: ``backtracks``, ``nodes``
    and ``limited`` (whether a limit, of either kind, ended it).
    """
    if method not in ("hbfs", "vns"):
        raise ValueError(f"method: expected 'hbfs' or 'vns', found {method!r}")
    # Up to ``upper`` itself, plus what rounding may add to its choice's integer cost: a search
    # that finds only the given answer again, and proves it, has proved that answer optimal
    # (toulbar2 searches below its bound and, finding nothing, leaves its root bound).
    rounding = rounding_slack(len(costs) + len(edges), scale)
    slack = rounding * scale
    ub = TOP if upper is None else min(TOP, float(np.floor(upper * scale + slack)) + 1)
    # A solve that finds no solution leaves toulbar2's global state (options and more) such
    # that every later solve in the process ran ~15x slower; CFN()'s own reinit does not undo
    # it, a full init does (found through the test suite: the planner slowed after it).
    pytoulbar2.pytb2.init()
    net = pytoulbar2.CFN(ub, resolution=0, verbose=0 if progress else -1, seed=1,
                         vns=-4 if method == "vns" else None)
    if backtracks is not None:
        if backtracks < 1:
            raise ValueError(f"backtracks: expected >= 1, found {backtracks}")
        pytoulbar2.pytb2.option.backtrackLimit = int(backtracks)
    if restarts is not None and method == "vns":
        if restarts < 1:
            raise ValueError(f"restarts: expected >= 1, found {restarts}")
        pytoulbar2.pytb2.option.restart = int(restarts)
    # DGVNS with its restarts bounded ends in branch and bound, whose bound proves as hbfs's does.
    proves = method == "hbfs" or restarts is not None
    try:
        return _search(net, costs, edges, scale, rows, seconds, upper, rounding, proves)
    finally:
        if work is not None:
            work.update(backtracks=int(net.GetNbBacktracks()), nodes=int(net.GetNbNodes()),
                        limited=bool(pytoulbar2.pytb2.option.limited))


def _search(net, costs, edges, scale, rows, seconds, upper, rounding, proves) -> tuple[list[int] | None, bool, float]:
    """:func:`solve_tables`'s search, once its network's options are set."""
    try:
        for i, c in enumerate(costs):
            net.AddVariable(f"x{i}", list(range(c.size)))
        _post_tables(net, costs, edges, scale)
        for terms, rhs in rows:
            _post_knapsack(net, terms, rhs)
        res = net.Solve(timeLimit=max(1, int(seconds)))
    except net.Contradiction:  # the bounds alone prove nothing beats ``upper``
        return None, upper is not None, rounding if upper is not None else np.inf
    except net.SolverOut:  # its timer fired before the search began (preprocessing a short round)
        found = net.GetSolutions()
        return (list(found[-1][1]) if found else None), False, np.inf
    if not res:
        found = net.GetSolutions()
        if found:
            return list(found[-1][1]), False, np.inf
        # Nothing below the bound: proved where branch and bound ended by itself (toulbar2 marks a
        # search its time limit or a signal stopped as limited; its dual bound need not reach the
        # bound when the search closes early).
        proved = proves and upper is not None and not pytoulbar2.pytb2.option.limited
        return None, proved, rounding if proved else np.inf
    # Solve returns its incumbent on a time limit too: optimal where the dual bound meets it, or
    # where the search ended by itself: toulbar2 then prints "Optimum", but its dual bound may be
    # its last gap line's, below the optimum (a 4-layer LLaMA's quotient: 21724058542 against
    # 21724065283, the search closed after 128 backtracks).
    primal, dual = float(res[1]), float(net.GetDDualBound())
    if not proves:  # DGVNS's bound is not relied on: no proof, no gap
        return list(res[0]), False, np.inf
    if dual >= primal or not pytoulbar2.pytb2.option.limited:
        return list(res[0]), True, rounding
    return list(res[0]), False, (primal - dual) / scale + rounding


#: Memory rows a lazy search (:func:`solve_lazy`) posts per round: the most broken by the
#: round's answer. On LLaMA-70B's 3-D problems (225 rows) 5, 10 or 20 gave the same answers:
#: one progression of rows binds, and any few of its rows hold the rest.
LAZY_ADD = 10


def table_cost(costs, edges, choice) -> float:
    """The cost of ``choice`` (a value index per variable) over the tables, unscaled."""
    return float(sum(c[i] for c, i in zip(costs, choice))
                 + sum(m[choice[a], choice[b]] for (a, b), m in edges.items()))


def row_excess(rows: Sequence[KnapsackRow], choice) -> np.ndarray:
    """Per row, ``sum_(i, w) w[x_i] - rhs``: how far ``choice`` breaks it (<= 0 where it holds)."""
    return np.array([sum(int(w[choice[var]]) for var, w in terms) - rhs for terms, rhs in rows], dtype=np.int64)


def solve_lazy(costs: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray], seconds: float, scale: float,
               upper: float | None, rows: Sequence[KnapsackRow], add: int = LAZY_ADD, on_answer=None,
               stop=None, method: str = "vns", progress: bool = False, restarts: int | None = None,
               posted: Sequence[int] = (), round_seconds: float | None = None,
               on_clock=None, on_round=None) -> tuple[list[int] | None, bool, float]:
    """:func:`solve_tables` with the memory rows posted as its answers break them: (the best
    answer that holds every row or None, proved, gap), as :func:`solve_tables` answers.

    Each round searches the tables with the rows posted so far (none in the first), below the
    best answer known (``upper``, then each one found). An answer that breaks rows adds the
    ``add`` it breaks most and the round is searched again; one that holds them all is an
    answer (``on_answer(cost, rows posted, answer)``). Rows only cut answers off, so the posted
    rows are a relaxation: an answer that holds every row is one of the whole network, a bound
    of the relaxation bounds the whole network, and nothing below ``upper`` with some rows means
    nothing with all.

    ``method="vns"`` (DGVNS, no proof): a round that ran to its time limit without a better
    answer is searched again with twice the time (DGVNS restarts from scratch); one that ended
    by itself with none ends the search (the first answer may cost ``upper`` itself: the known
    answer found again, as toulbar2 searches up to it). ``method="hbfs"`` (branch and bound, all
    the time left each round): an answer proved optimal with the rows posted that holds them all
    is proved optimal, and one cut off by the time limit has the relaxation's gap.
    With ``restarts`` (DGVNS), each round is DGVNS with that many restarts and its branch-and-
    bound tail (:func:`solve_tables`), given all the time left, so rounds end by their work: a
    round that proves its answer (or nothing below the best) with the rows posted ends the
    search, proved; one that ends otherwise ends it unproved. The same in every run unless the
    time runs out (issue "reproducible solves"). A round gets at most ``round_seconds``: one that
    runs out of them (the tail's proof is far: LLaMA-70B's networks) turns the search into the
    rounds without ``restarts`` for the rest, whose answers DGVNS finds by the time it has
    (``on_clock()`` is called then: the answer now hangs on the clock). ``posted``: rows posted
    from the first round on (all of them: a network whose rows are few). ``on_round()`` is
    called after each round (the first one's end is when the search is ready: its network posted).
    ``stop()`` (checked between rounds) or ``seconds`` end either. Posting the rows is what
    toulbar2's preprocessing pays for: LLaMA-70B on (4, 16, 8) has 225 rows, 4.2 s of
    preprocessing before DGVNS's first answer with all of them (5.9756e6 after 15 s); with 10
    posted, the first answer holding all 225 came in 2.8 s and 5.9724e6 in 5.0, and branch and
    bound proved nothing cheaper in 1.3 s more. On (2, 4, 8), branch and bound under DGVNS's
    answer proved it optimal in 1.3 s with the rows posted lazily, 9.2 s with all of them."""
    if method not in ("hbfs", "vns"):
        raise ValueError(f"method: expected 'hbfs' or 'vns', found {method!r}")
    t0 = time.perf_counter()
    best, best_cost = None, math.inf if upper is None else upper
    posted = list(posted)
    round_s = 1.0
    proved, gap = False, np.inf
    work = restarts is not None and method == "vns"
    while True:
        left = seconds - (time.perf_counter() - t0)
        if left < 1.0 or (stop is not None and stop()):
            break
        limit = min(left, round_s) if method == "vns" and not work else left
        if work and round_seconds is not None:
            limit = min(limit, max(1.0, round_seconds))
        # toulbar2's time limit counts this process's CPU time (its timer's signal is SIGVTALRM):
        # whether a round ran out is judged on the same clock, so a busy machine, which
        # stretches the wall clock, does not turn a round that ended by itself into one that ran
        # out (and the search into another path: issue "reproducible solves").
        started = time.process_time()
        picked, proved, gap = solve_tables(costs, edges, limit, scale, None if math.isinf(best_cost) else best_cost,
                                           [rows[k] for k in posted], method=method, progress=progress,
                                           restarts=restarts if work else None)
        ran_out = time.process_time() - started >= 0.9 * max(1, int(limit))
        if on_round is not None:
            on_round()
        if work and ran_out:
            # Too far from a proof to end by its work: DGVNS's anytime answers serve better (on
            # LLaMA-70B's unseeded solve, rounds ended by proofs gave a plan 2.4x FSDP+TP+AC's).
            work = False
            if on_clock is not None:
                on_clock()
        proved = proved and not ran_out
        if picked is not None:
            excess = row_excess(rows, picked)
            broken = np.nonzero(excess > 0)[0]
            if broken.size:
                posted.extend(broken[np.argsort(-excess[broken], kind="stable")][:add].tolist())
                proved, gap = False, np.inf
                continue
            cost = table_cost(costs, edges, picked)
            # The first answer may be ``upper``'s own found again (toulbar2 searches up to it), as
            # DGVNS with every row posted reports it.
            if cost < best_cost or best is None:
                best, best_cost = picked, cost
                if on_answer is not None:
                    on_answer(cost, len(posted), picked)
                if method == "vns" and not (work and proved):
                    continue
        if method == "hbfs" or work:
            break  # proved (an answer, or nothing below the best), ended by its work unproved, or out of time
        if not ran_out:
            break  # DGVNS ended by itself with nothing better: as it would with every row posted
        round_s *= 2
    if method == "vns" and not (work and proved):
        return best, False, np.inf
    return best, proved, gap


def rounding_slack(n_tables: int, scale: float) -> float:
    """How far rounding to toulbar2's integer costs can move any choice's cost (cost units):
    one rounded entry per table, half a unit each."""
    return 0.5 * n_tables / scale


def _post_tables(net, costs, edges, scale: float) -> None:
    """Every cost table, rounded in one array operation and posted straight to toulbar2's wcsp:
    pytoulbar2's ``AddFunction`` checks and converts each table in Python, which was a third of
    a weight round on IOPDDL T (322k tables in 7 rounds, 10 s). Constant tables become a
    nullary cost, as ``AddFunction`` does."""
    wcsp = net.CFN.wcsp
    tables = [*costs, *edges.values()]
    if not tables:
        return
    sizes = np.array([t.size for t in tables])
    flat = _table(np.concatenate([np.ravel(t) for t in tables]), scale)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    nonempty = sizes > 0
    low = np.full(sizes.size, np.inf)
    high = np.full(sizes.size, -np.inf)
    low[nonempty] = np.minimum.reduceat(flat, starts[nonempty])
    high[nonempty] = np.maximum.reduceat(flat, starts[nonempty])
    scopes = [(i,) for i in range(len(costs))] + list(edges)
    values = flat.astype(np.int64).tolist()
    for scope, lo, hi, a, b in zip(scopes, low.tolist(), high.tolist(), starts.tolist(), ends.tolist()):
        if a == b:
            continue
        if lo == hi:
            wcsp.postNullaryConstraint(int(lo))
        elif len(scope) == 1:
            wcsp.postUnaryConstraint(scope[0], values[a:b], False)
        else:
            wcsp.postBinaryConstraint(scope[0], scope[1], values[a:b], False)


def _post_knapsack(net, terms: list[tuple[int, np.ndarray]], rhs: int) -> None:
    """sum_(i, w) w[x_i] <= rhs as toulbar2's knapsack  sum -w[x_i] >= -rhs. Posted directly:
    pytoulbar2's AddGeneralizedLinearConstraint scans every tuple once per variable, which is
    quadratic in a row's size (seconds per row on IOPDDL V)."""
    scope, parts = [], [str(-int(rhs))]
    for var, w in terms:
        nz = np.nonzero(w)[0]
        if nz.size == 0:
            continue
        scope.append(int(var))
        parts.append(str(nz.size))
        parts.extend(f"{i} {-int(w[i])}" for i in nz.tolist())
    if scope:
        net.CFN.wcsp.postKnapsackConstraint(scope, " ".join(parts), kp=True)


def _rounding_error(x: np.ndarray, scale: float) -> float:
    ok = x < FORBIDDEN
    return float(np.abs(np.round(x[ok] * scale) - x[ok] * scale).max()) / scale if ok.any() else 0.0


def _table(x: np.ndarray, scale: float) -> np.ndarray:
    return np.where(x < FORBIDDEN, np.minimum(np.round(x * scale), TOP), TOP)


def solve_pairwise(problem: Problem, seconds: float, scale: float = 1000.0,
                   upper: float | None = None) -> tuple[np.ndarray | None, bool, float]:
    """toulbar2 on the problem's costs alone (memory ignored): (choice, proved optimal, slack).
    With ``upper``, the cost of a known choice, only choices at most as costly are searched:
    choice None then, with proved True, says that none is cheaper (the known one is optimal
    within ``slack``).

    ``slack`` bounds how far rounding can have moved the optimum (the sum over cost
    tables of their largest rounding error): the true optimum is at least the
    returned choice's cost minus ``slack``.

    Costs are scaled by ``scale`` and rounded to integers (toulbar2's costs are
    integral): microseconds become nanoseconds, so rounding moves the optimum by
    at most half a nanosecond per cost term. No MILP edge variables exist here:
    toulbar2 works on the pairwise tables directly, which is what makes 3-D
    meshes (hundreds of strategies per node) tractable.
    """
    from solver.highs_model import drop_dominated
    from solver.quotient import merge_edges

    n = problem.num_nodes
    allowed = [np.nonzero(problem.allowed(v))[0] for v in range(n)]
    linear = [c.copy() for c in problem.node_costs]
    pairs = merge_edges(problem, np.arange(n), linear)
    # Exact domain reduction first: the tables toulbar2 reads shrink with the domains.
    drop_dominated(problem, np.arange(n), allowed, linear, pairs, use_usage=False)

    costs = [linear[v][allowed[v]] for v in range(n)]
    tables = {key: m[np.ix_(allowed[key[0]], allowed[key[1]])] for key, m in pairs.items()}
    slack = sum(_rounding_error(x, scale) for x in [*costs, *tables.values()])
    picked, optimal, gap = solve_tables(costs, tables, seconds, scale, upper=upper)
    if picked is None:
        return None, optimal, max(slack, gap) if optimal else slack
    slack = max(slack, gap) if not optimal else slack
    return np.array([allowed[v][i] for v, i in enumerate(picked)], dtype=np.int64), optimal, slack
