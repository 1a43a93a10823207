"""Memory by penalties: a Cost Function Network solver (toulbar2) inside a multiplier loop.

The exact MILP cannot even be built on industrial instances (its memory rows run
to 1e8 nonzeros), while the problem WITHOUT memory is a pairwise Cost Function
Network that toulbar2 solves in seconds. So, as the IOPDDL contest winners do,
memory is moved into the objective:

    min  sum_v c_v(s_v) + sum_(u,v) C_uv(s_u, s_v) + sum_v m_v(s_v) * sum_(t in [lo_v, hi_v)) mu_t

with one multiplier mu_t >= 0 per time segment, raised where the last solution
overflowed (a damped subgradient step, relative to the overflow) and decayed
elsewhere. Every round's solution is made feasible by a greedy repair (cheapest
cost per byte saved at the worst segment) and polished by local search; the best
feasible one is kept. Optional: without ``pytoulbar2`` this stage is skipped.
"""

from __future__ import annotations

import time

import numpy as np

from solver import heuristic
from solver.evaluate import evaluate
from solver.problem import FORBIDDEN, Problem

try:
    import pytoulbar2
except ImportError:  # pragma: no cover - exercised only where the wheel is missing
    pytoulbar2 = None

TOP = 1e13


def available() -> bool:
    return pytoulbar2 is not None


def _solve_cfn(problem: Problem, unary: list[np.ndarray], pairs, seconds: float) -> np.ndarray | None:
    cfn = pytoulbar2.CFN(TOP, resolution=0, verbose=-1, seed=1)
    for v in range(problem.num_nodes):
        cfn.AddVariable(f"x{v}", list(range(problem.num_strategies(v))))
    for v, c in enumerate(unary):
        cfn.AddFunction([v], np.minimum(np.round(c), TOP).tolist())
    for u, v, m in pairs:
        cfn.AddFunction([u, v], m)
    res = cfn.Solve(timeLimit=max(1, int(seconds)))
    if not res:
        return None
    return np.asarray(res[0], dtype=np.int64)


def solve_pairwise(problem: Problem, seconds: float, scale: float = 1000.0) -> tuple[np.ndarray | None, bool, float]:
    """toulbar2 on the problem's costs alone (memory ignored): (choice, proved optimal, slack).

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

    slack = 0.0

    def table(x):
        nonlocal slack
        ok = x < FORBIDDEN
        if ok.any():
            slack += float(np.abs(np.round(x[ok] * scale) - x[ok] * scale).max()) / scale
        return np.where(ok, np.minimum(np.round(x * scale), TOP), TOP)

    cfn = pytoulbar2.CFN(TOP, resolution=0, verbose=-1, seed=1)
    for v in range(n):
        cfn.AddVariable(f"x{v}", list(range(allowed[v].size)))
    for v in range(n):
        cfn.AddFunction([v], table(linear[v][allowed[v]]).tolist())
    for (u, v), m in pairs.items():
        cfn.AddFunction([u, v], table(m[np.ix_(allowed[u], allowed[v])]).ravel().tolist())
    res = cfn.Solve(timeLimit=max(1, int(seconds)))
    if res:
        picked, optimal = res[0], True
    else:
        found = cfn.GetSolutions()
        if not found:
            return None, False, slack
        picked, optimal = found[-1][1], False
    return np.array([allowed[v][i] for v, i in enumerate(picked)], dtype=np.int64), optimal, slack


def repair_memory(problem: Problem, choice: np.ndarray, deadline: float) -> np.ndarray | None:
    """Lower usage at the worst segment by the cheapest move per byte, until within the limit."""
    if problem.usage_limit is None:
        return choice
    choice = choice.copy()
    mem = heuristic._Memory(problem, choice)
    adj = heuristic._Adjacency(problem)
    limit = problem.usage_limit
    while time.perf_counter() < deadline:
        k = int(np.argmax(mem.total))
        if mem.total[k] <= limit:
            return choice
        live = np.nonzero((mem.a <= k) & (k < mem.b))[0]
        best, best_rate = None, np.inf
        for v in live.tolist():
            u = problem.node_usages[v]
            cur = choice[v]
            lower = np.nonzero((u < u[cur]) & problem.allowed(v))[0]
            if lower.size == 0:
                continue
            lc = heuristic._local_cost(problem, adj, choice, v)
            for i in lower.tolist():
                if lc[i] >= FORBIDDEN:
                    continue
                rate = (lc[i] - lc[cur]) / (u[cur] - u[i])
                if rate < best_rate:
                    best, best_rate = (v, i), rate
        if best is None:
            return None
        v, i = best
        mem.move([v], int(choice[v]), i)
        choice[v] = i
    return None


def penalty_search(problem: Problem, start: np.ndarray | None, deadline: float, say=lambda m: None,
                   max_rounds: int = 40):
    """Best feasible choice found by the multiplier loop before ``deadline`` (None if none)."""
    if not available():
        return None
    t_begin = time.perf_counter()
    mem = heuristic._Memory(problem, np.zeros(problem.num_nodes, dtype=np.int64))
    nseg = mem.total.size
    pairs = []
    for e, (u, v) in enumerate(problem.edges.tolist()):
        m = problem.edge_costs[e]
        if np.any(m != 0):
            pairs.append((u, v, np.minimum(m, TOP).ravel().tolist()))
    # A cost-per-byte scale: how much cost the nodes trade for memory.
    rates = []
    for v in range(problem.num_nodes):
        u, c = problem.node_usages[v], problem.node_costs[v]
        ok = c < FORBIDDEN
        if ok.sum() > 1 and np.ptp(u[ok]) > 0:
            rates.append(np.ptp(c[ok]) / np.ptp(u[ok]))
    rates = [r for r in rates if r > 0]
    scale = float(np.median(rates)) if rates else 1.0
    mu = np.zeros(nseg)
    mu_prev = mu
    span_typ = max(1.0, float(np.median(mem.b - mem.a)))
    best, best_cost = None, np.inf
    if start is not None:
        ev = evaluate(problem, start)
        if ev.feasible:
            best, best_cost = start.copy(), ev.cost
    rounds = 0
    last_round = 0.0
    say(f"cfn: {len(pairs)} cost functions, {nseg} time segments, penalty scale {scale:.3g} per byte")
    while True:
        now = time.perf_counter()
        remaining = deadline - now
        if remaining < max(1.0, 1.2 * last_round) or rounds >= max_rounds:
            break
        t_round = now
        prefix = np.concatenate([[0.0], np.cumsum(mu)])
        span = prefix[mem.b] - prefix[mem.a]
        unary = [problem.node_costs[v] + problem.node_usages[v] * span[v] for v in range(problem.num_nodes)]
        choice = _solve_cfn(problem, unary, pairs, min(remaining * 0.6, 60.0))
        rounds += 1
        if choice is None:
            # No solution in time: the last step made the network too hard; step back halfway.
            say(f"cfn round {rounds}: no solution in time; halving the last multiplier step")
            mu = (mu + mu_prev) / 2
            last_round = time.perf_counter() - t_round
            continue
        raw = evaluate(problem, choice)
        usage = np.array([problem.node_usages[v][choice[v]] for v in range(problem.num_nodes)])
        total = np.zeros(nseg)
        np.add.at(total, mem.a, usage)
        np.add.at(total, mem.b[mem.b < nseg], -usage[mem.b < nseg])
        total = np.cumsum(total)
        excess = np.maximum(0.0, total - problem.usage_limit) / problem.usage_limit
        fixed = repair_memory(problem, choice, deadline)
        if fixed is not None:
            fixed = heuristic.local_search(problem, fixed, deadline=deadline)
            ev = evaluate(problem, fixed)
            if ev.feasible and ev.cost < best_cost:
                best, best_cost = fixed, ev.cost
        say(f"cfn round {rounds}: raw cost {raw.cost:.6g}, peak {raw.peak_usage / problem.usage_limit:.2f}x limit, "
            f"best feasible {best_cost:.6g} ({time.perf_counter() - t_begin:.1f}s)")
        # Raise multipliers where memory overflowed, relative to the overflow; let the rest decay.
        mu_prev = mu
        mu = np.where(excess > 0, mu + scale * excess * 2.0 ** min(rounds, 20) / span_typ, mu * 0.8)
        last_round = time.perf_counter() - t_round
    return best
