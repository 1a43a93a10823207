r"""Large-neighbourhood search: exact MILPs on small windows of a feasible answer.

The weight search (:mod:`solver.weights`) ends with repairs that push memory under
the limit a few moves at a time, and they pay for it. Here the memory rows are kept
exact, but on a few hundred nodes at a time: pick a set F of free nodes, fix every
other node at the incumbent's choice, and solve

    min  sum_(v in F) c'_v(s_v) + sum_((u,v) in E, u, v in F) C_uv(s_u, s_v)
    s.t. sum_(v in F live at t) m_v(s_v) <= limit - (usage at t of the fixed nodes)   for all t

with ``c'_v = c_v + sum over edges to fixed neighbours w of C_vw(., s_w)`` (the
fixed neighbour's column folded in). Its optimum is the best the whole problem
can do by changing F alone, so a window never makes the answer worse; the MILP
(:mod:`solver.highs_model`, HiGHS) starts from the incumbent's choice on F. The
right-hand side varies over time, the sub-problem's single limit does not: each
run of time points with the same live free nodes becomes one time point, and a
one-strategy filler node live there takes up ``L' - residual`` (L' the largest
residual), which the MILP's reductions then fold into its rows' constants
(:func:`subproblem`).

Windows (:func:`_window`): seeds among the nodes live where memory binds (the
trades that matter there are between nodes live at the same time), or anywhere at
random, grown breadth-first along edges (a node seldom changes alone: its
neighbours' reshardings move with it), up to a budget of strategy pairs so each
MILP solves in about a second.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np

from solver import highs_model, local
from solver.clock import WALL, WallClock, WorkClock
from solver.evaluate import evaluate
from solver.problem import FORBIDDEN, Problem, ProvedInfeasible

log = logging.getLogger(__name__)


def subproblem(problem: Problem, adj: local.Adjacency, mem: local.Memory, choice: np.ndarray,
               free: np.ndarray) -> Problem:
    """The problem restricted to ``free`` with every other node fixed at ``choice``: nodes
    ``0..len(free)-1`` are ``free`` in order, fillers follow (see the module doc)."""
    index = {int(v): i for i, v in enumerate(free.tolist())}
    costs = [problem.node_costs[v].copy() for v in free.tolist()]
    edges, mats = [], []
    for i, v in enumerate(free.tolist()):
        for e, w, is_src in adj.inc[v]:
            m = problem.edge_costs[e]
            j = index.get(w)
            if j is None:
                costs[i] += m[:, choice[w]] if is_src else m[choice[w], :]
            elif is_src:  # an edge inside the window, added once from its source
                edges.append((i, j))
                mats.append(m)
    usages = [problem.node_usages[v] for v in free.tolist()]
    a, b = mem.a[free], mem.b[free]
    limit = mem.limit
    if not np.isfinite(limit):
        return Problem(costs, usages, np.stack([a, b], axis=1), np.array(edges, dtype=np.int64).reshape(-1, 2),
                       mats, None, ties=_window_ties(problem, index))
    current = np.array([problem.node_usages[v][choice[v]] for v in free.tolist()])
    intervals, fillers, top = fold_fixed(mem, free, current)
    costs += [np.zeros(1) for _ in fillers]
    usages += [np.array([u]) for u in fillers]
    return Problem(costs, usages, intervals, np.array(edges, dtype=np.int64).reshape(-1, 2),
                   mats, top, ties=_window_ties(problem, index))


def fold_fixed(mem: local.Memory, free: np.ndarray, current: np.ndarray) -> tuple[np.ndarray, list[float], float]:
    """The memory of every node outside ``free`` folded into one limit: (intervals of the free
    nodes, then of one filler per run, in run indices; each filler's usage; the limit). Runs
    are the stretches of segments with the same live free nodes; a run's residual is the limit
    less the most the fixed nodes (``current``: the free nodes' usage now) use in it, and its
    filler takes up ``top - residual``, ``top`` the largest residual."""
    a, b = mem.a[free], mem.b[free]
    fixed_total = mem.total - mem.profile(current, free)
    cuts = np.unique(np.concatenate([a, b]))
    cuts = cuts[cuts < fixed_total.size]
    residual = mem.limit - np.maximum.reduceat(fixed_total, cuts) if cuts.size else np.zeros(0)
    intervals = [np.stack([np.searchsorted(cuts, a), np.searchsorted(cuts, b)], axis=1)]
    top = float(residual.max()) if residual.size else 0.0
    fillers = []
    for r, res in enumerate(residual.tolist()):
        if top - res > 0:
            fillers.append(top - res)
            intervals.append(np.array([[r, r + 1]]))
    return np.concatenate(intervals), fillers, max(top, 0.0)


def _window_ties(problem: Problem, index: dict[int, int]) -> list[list[int]]:
    """The tie groups inside the window, renumbered (windows hold whole groups or none)."""
    return [[index[v] for v in g] for g in problem.ties if g and all(v in index for v in g)]


def _close_over_ties(free: np.ndarray, groups: list[np.ndarray], group_of: dict[int, list[int]]) -> np.ndarray:
    """``free`` plus every node tied to one in it, transitively (groups may share nodes)."""
    done: set[int] = set()
    todo = {g for v in free.tolist() for g in group_of.get(v, ())}
    out = set(free.tolist())
    while todo:
        g = todo.pop()
        done.add(g)
        for v in groups[g].tolist():
            if v not in out:
                out.add(v)
                todo.update(h for h in group_of.get(v, ()) if h not in done)
    return np.array(sorted(out), dtype=np.int64)


def _fullest(mem: local.Memory) -> np.ndarray:
    """The 2% of time segments with the most memory in use (binding windows draw from them)."""
    m = max(1, mem.total.size // 50)
    return np.argpartition(mem.total, mem.total.size - m)[-m:]


def _window(problem, adj, mem, choice, rng, budget: int, movable: np.ndarray, fullest: np.ndarray | None
            ) -> np.ndarray:
    """Free nodes: breadth-first from seeds (live at one of the ``fullest`` time points, or
    random when None) until the strategy budget (sum of k_v, plus k_u k_v per edge inside)
    is spent."""
    if fullest is not None:
        k = int(rng.choice(fullest))
        seeds, pool = _trading_seeds(problem, adj, choice, np.nonzero((mem.a <= k) & (k < mem.b) & movable)[0], rng)
    else:
        seeds, pool = [], []
    picked: dict[int, None] = {}
    spent = rejected = 0
    queue = deque(seeds or pool[:1])
    pool = deque(pool if seeds else pool[1:])
    anywhere = None
    while spent < budget:
        if not queue:
            if not pool:
                if anywhere is not None:
                    break
                # Once a component is used up, more seeds: nodes live at the same time trade
                # memory without sharing an edge. Drawn only here: most windows fill first.
                anywhere = pool = deque(rng.permutation(np.nonzero(movable)[0]).tolist())
            queue.append(pool.popleft())
        v = queue.popleft()
        if v in picked or not movable[v]:
            continue
        k_v = problem.num_strategies(v)
        inside = sum(problem.edge_costs[e].size for e, w, _ in adj.inc[v] if w in picked)
        if spent + k_v + inside > budget and picked:
            rejected += 1
            if rejected > 64:
                break  # full: what is left would not fit either
            continue
        picked[v] = None
        spent += k_v + inside
        nbrs = [w for _, w, _ in adj.inc[v] if w not in picked]
        for w in rng.permutation(nbrs).tolist() if nbrs else []:
            queue.append(int(w))
    return np.array(sorted(picked), dtype=np.int64)


def _trading_seeds(problem, adj, choice, live: np.ndarray, rng, count: int = 6) -> list[int]:
    """Nodes live at a binding time point that could trade memory: the ones that would gain
    most with more memory (cost now minus their best cost, neighbours fixed) and the ones
    that give memory up cheapest (least cost per byte saved), alternating."""
    if live.size > 600:
        live = rng.choice(live, 600, replace=False)
    gain, rate = [], []
    for v in live.tolist():
        lc = local.local_cost(problem, adj, choice, v)
        cur = int(choice[v])
        u = problem.node_usages[v]
        gain.append(lc[cur] - lc.min())
        less = (u < u[cur]) & np.isfinite(lc)
        rate.append(((lc[less] - lc[cur]) / (u[cur] - u[less])).min() if less.any() else np.inf)
    gainers = live[np.argsort(-np.asarray(gain), kind="stable")[:count]].tolist()
    donors = live[np.argsort(np.asarray(rate), kind="stable")[:count]].tolist()
    seeds = [v for pair in zip(gainers, donors) for v in pair]
    return seeds, rng.permutation(live).tolist()


def solve_window(sub: Problem, start: np.ndarray, seconds: float,
                 model: highs_model.ArrayModel | None = None, report: dict | None = None) -> np.ndarray | None:
    """HiGHS on ``sub`` (its MILP ``model``, built here when not given) for ``seconds`` from
    ``start``: its answer, or None when it found none. ``report``, a dict, gets ``cut``: whether
    the time limit ended HiGHS (its answer then hangs on the machine's speed), ``iterations``
    (its LP iterations) and ``size`` (the model's rows and columns)."""
    import highspy

    model = model if model is not None else highs_model.build(sub)
    if model.cost.size == 0:
        return highs_model.extract(model, np.zeros(0), sub.num_nodes)
    h = highs_model.to_highs(model, seconds, 1e-9)
    sol = highspy.HighsSolution()
    sol.col_value = highs_model.start_vector(model, start).tolist()
    sol.value_valid = True
    h.setSolution(sol)
    h.run()
    if report is not None:
        report["cut"] = h.getModelStatus() in (highspy.HighsModelStatus.kTimeLimit, highspy.HighsModelStatus.kInterrupt)
        report["iterations"] = int(h.getInfo().simplex_iteration_count)
        report["size"] = int(h.getNumCol() + h.getNumRow())
    if h.getInfo().primal_solution_status < 2:
        return None
    return highs_model.extract(model, np.asarray(h.getSolution().col_value), sub.num_nodes)


class WindowSearch:
    """Window after window on a feasible answer (:meth:`step`); :meth:`restart` moves it to
    another answer (a cheaper one found elsewhere) keeping its random stream."""

    def __init__(self, problem: Problem, choice: np.ndarray, budget: int = 40000, window_seconds: float = 6.0,
                 seed: int = 0):
        self.problem = problem
        self.budget = budget
        self.window_seconds = window_seconds
        self.rng = np.random.default_rng(seed)
        self.adj = local.Adjacency(problem)
        self.movable = np.array([int(problem.allowed(v).sum()) > 1 for v in range(problem.num_nodes)])
        self.groups = [np.array(g, dtype=np.int64) for g in problem.ties if len(g) > 1]
        self.group_of: dict[int, list[int]] = {}
        for i, g in enumerate(self.groups):
            for v in g.tolist():
                self.group_of.setdefault(v, []).append(i)
        self.windows = self.improved = 0
        self.cut = 0
        """Windows whose HiGHS its time limit ended (their answers hang on the machine's speed)."""
        self.restart(choice)

    def restart(self, choice: np.ndarray) -> None:
        ev = evaluate(self.problem, choice)
        if not ev.feasible:
            raise ValueError(f"window search needs a feasible answer, found one that is not ({ev.reason})")
        self.current = np.asarray(choice, dtype=np.int64).copy()
        self.cost = ev.cost
        self.mem = local.Memory(self.problem, self.current)
        self.fullest = _fullest(self.mem)

    def step(self, deadline: float, clock: WorkClock | WallClock = WALL) -> bool:
        """Solve one window (if time allows before ``deadline``, on ``clock``, else the wall
        clock); returns whether the answer improved."""
        problem, current = self.problem, self.current
        if not self.movable.any():
            return False
        fullest = self.fullest if self.windows % 3 != 2 else None
        free = _window(problem, self.adj, self.mem, current, self.rng, self.budget, self.movable, fullest)
        self.windows += 1
        if self.groups:  # a window holds every node of every tie group it touches
            free = _close_over_ties(free, self.groups, self.group_of)
        if free.size < 2:
            return False
        sub = subproblem(problem, self.adj, self.mem, current, free)
        fillers = sub.num_nodes - free.size
        start = np.concatenate([current[free], np.zeros(fillers, dtype=np.int64)])
        before = evaluate(sub, start)
        seconds = min(self.window_seconds, clock.seconds_until(deadline) - 0.2)
        if seconds < 0.2:
            return False
        report: dict = {}
        try:
            found = solve_window(sub, start, seconds, report=report)
        except ProvedInfeasible:  # the window's fixed surroundings leave it no feasible choice
            return False
        self.cut += report.get("cut", False)
        if found is None:
            return False
        after = evaluate(sub, found)
        if not after.feasible or after.cost >= before.cost - 1e-9 * max(1.0, abs(before.cost)):
            return False
        trial = current.copy()
        trial[free] = found[: free.size]
        full = evaluate(problem, trial)
        if not full.feasible or full.cost >= self.cost or full.cost >= FORBIDDEN:
            return False
        for v, new in zip(free.tolist(), found[: free.size].tolist()):
            if new != current[v]:
                self.mem.move([v], int(current[v]), int(new))
        self.current, self.cost = trial, full.cost
        self.fullest = _fullest(self.mem)
        self.improved += 1
        return True


def large_neighbourhood_search(problem: Problem, choice: np.ndarray, deadline: float,
                               budget: int = 40000, window_seconds: float = 6.0, seed: int = 0) -> np.ndarray:
    """Improve a feasible ``choice`` window by window until ``deadline``; never returns a worse one."""
    if not evaluate(problem, choice).feasible:
        return choice
    t0 = time.perf_counter()
    search = WindowSearch(problem, choice, budget, window_seconds, seed)
    while deadline - time.perf_counter() > 0.5:
        if search.step(deadline) and search.improved % 10 == 1:
            log.info(f"lns: {search.windows} windows, {search.improved} improved, cost {search.cost:.6g} "
                f"({time.perf_counter() - t0:.1f}s)")
    log.info(f"lns: {search.windows} windows, {search.improved} improved, cost {search.cost:.6g} "
        f"({time.perf_counter() - t0:.1f}s)")
    return search.current
