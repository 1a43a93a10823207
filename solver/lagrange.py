r"""Memory by Lagrangian relaxation: exact pairwise solves under multipliers, then repair.

The exact MILP cannot be built on industrial instances (its memory rows run to 1e8
nonzeros), while without memory the problem is a pairwise network that variable
elimination (:mod:`solver.eliminate`) plus toulbar2 on the remaining core solve to
optimality in seconds. So memory moves into the objective, with one multiplier
mu_k >= 0 per time segment k (a run of time points with the same live nodes):

    L(mu) = min_s  sum_v c_v(s_v) + sum_(u,v) C_uv(s_u, s_v)
                   + sum_k mu_k (sum_(v live at k) m_v(s_v) - limit)

Each node's memory term is a node cost, m_v(s_v) * sum_(k in [lo_v, hi_v)) mu_k, so
every round is one pairwise solve (:meth:`Eliminator.solve`); L(mu) is a lower bound
on the optimum whenever the core is solved to optimality. Multipliers follow the
projected subgradient g_k = usage_k - limit with Polyak's step
lambda (T - L(mu)) / |g|^2 with target T the best feasible cost, capped at a fraction above
L(mu) that doubles while the solutions overflow by far; lambda halves after three
rounds without a better L(mu) (Held and Karp). The core is warm-started: coordinate
descent from the last round's answer bounds toulbar2, which then only looks for
cheaper ones (:class:`_CoreSolver`). Every round whose solution overflows by less than
half the limit is repaired (:func:`_penalty_repair`): the multipliers are doubled only
where memory still overflows and the core re-descended, so core nodes move with the
trees and chains eliminated into them; a greedy per-byte repair (:func:`repair_memory`)
removes what is left and local search polishes. The best feasible answer is kept, and
:mod:`solver.lns` then polishes it with exact MILPs on small windows (memory rows kept).

Measured on the IOPDDL instances (2 cores, contest time limits, `benchmarks/iopddl.py`):
score (best known / ours) A 0.997, M 1.000, S 0.975 (mean with G 0.993); before this
module (toulbar2 on the whole graph, greedy repair) 0.993 / 0.857 / 0.768. What limits
S: toulbar2 does not prove its 3.5k-node core in 5 s (gaps ~10%), so the multipliers are
noisy, and the last percent of overflow costs 2-4% in the repair. Results depend on
toulbar2's time limits, so two runs on a busy machine can differ.
"""

from __future__ import annotations

import time

import numpy as np

from solver import cfn, heuristic
from solver.eliminate import Eliminator
from solver.evaluate import evaluate
from solver.problem import FORBIDDEN, Problem

#: Rounds whose raw solution overflows the limit by more than this factor are not
#: repaired: the greedy repair rarely succeeds from there and costs seconds.
REPAIR_MAX_OVERFLOW = 1.5


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


def _penalized(problem: Problem, mem, mu: np.ndarray) -> list[np.ndarray]:
    """Node costs plus memory priced by the multipliers: c_v + m_v * sum of mu over v's live segments."""
    prefix = np.concatenate([[0.0], np.cumsum(mu)])
    span = prefix[mem.b] - prefix[mem.a]
    return [problem.node_costs[v] + problem.node_usages[v] * span[v] for v in range(problem.num_nodes)]


def _excess(problem: Problem, mem, choice) -> np.ndarray:
    """Per time segment, total usage of ``choice`` minus the limit (the subgradient)."""
    usage = np.array([problem.node_usages[v][choice[v]] for v in range(problem.num_nodes)])
    total = np.zeros(mem.total.size + 1)
    np.add.at(total, mem.a, usage)
    np.add.at(total, mem.b, -usage)
    return np.cumsum(total)[:mem.total.size] - float(problem.usage_limit)


def _penalty_repair(problem, elim, mem, mu, g, step, core_start, choice, deadline, tries: int = 10):
    """Make a round's solution fit by raising the multipliers only where it overflows
    (doubling the raise each try) and re-solving with descent on the core from the
    round's core answer. A core node then moves together with the trees and chains
    eliminated into it, where the greedy single-node repair breaks them apart (on S it
    lost 12% of the cost). What is left of the overflow goes to the greedy repair."""
    limit = float(problem.usage_limit)
    mu_r, start, current = mu.copy(), core_start, choice
    floor = 0.25 * float(mu[mu > 0].mean()) if (mu > 0).any() else step * float(np.abs(g).max())
    factor, last_peak = 2.0, np.inf
    for _ in range(tries):
        peak = evaluate(problem, current).peak_usage
        if peak <= limit or time.perf_counter() > deadline:
            break
        factor = 2.0 if peak < last_peak - 1e-3 * limit else 8.0  # stalled: a far larger raise
        last_peak = peak
        # Double the price where memory still overflows (from a floor where it was free).
        mu_r = np.where(g > 0, factor * mu_r + floor, mu_r)
        unary = _penalized(problem, mem, mu_r)
        picked = {}

        def descend(costs, edges):
            picked["core"] = _descend(costs, edges, start, pairs=True)
            return picked["core"]

        current = elim.solve(unary, descend)
        start = picked["core"]
        g = _excess(problem, mem, current)
    return repair_memory(problem, current, deadline)


class _CoreSolver:
    """The core, solved from the previous round's answer: coordinate descent from it under the
    new costs gives a choice at once, and toulbar2 searches only for cheaper ones (multipliers
    move little between rounds, so this keeps its answers from getting worse than last round's)."""

    def __init__(self, seconds: float, scale: float):
        self.seconds, self.scale = seconds, scale
        self.previous: list[int] | None = None
        self.gap = np.inf
        """How far the last core answer may be above the core optimum (inf: no bound)."""

    def __call__(self, costs: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray]) -> list[int]:
        start = _descend(costs, edges, self.previous) if self.previous is not None else None
        upper = _table_cost(costs, edges, start) if start is not None else None
        if upper is not None and not upper < FORBIDDEN:
            upper = None
        picked, _, self.gap = cfn.solve_tables(costs, edges, self.seconds, self.scale, upper)
        if picked is None:
            picked = start if start is not None else _descend(costs, edges, None)
        self.previous = list(picked)
        return self.previous


def _table_cost(costs, edges, choice) -> float:
    return float(sum(c[i] for c, i in zip(costs, choice))
                 + sum(m[choice[a], choice[b]] for (a, b), m in edges.items()))


def _descend(costs, edges, start, sweeps: int = 50, pairs: bool = False) -> list[int]:
    """Coordinate descent on a pairwise network from ``start``: single-node moves to a local
    minimum, then (with ``pairs``) joint moves of the two ends of each edge, which leave
    minima where any single move would cross a forbidden or costly pair; repeated while
    either improves."""
    n = len(costs)
    choice = list(start) if start is not None and len(start) == n else [int(np.argmin(c)) for c in costs]
    nbrs: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
    for (a, b), m in edges.items():
        nbrs[a].append((b, m))
        nbrs[b].append((a, m.T))

    def local(v):
        x = costs[v].copy()
        for w, m in nbrs[v]:
            x += m[:, choice[w]]
        return x

    for _ in range(sweeps):
        changed = False
        for v in range(n):
            x = local(v)
            i = int(np.argmin(x))
            if x[i] < x[choice[v]]:
                choice[v], changed = i, True
        if changed or not pairs:
            if not changed:
                break
            continue
        for (a, b), m in edges.items():
            la = local(a) - m[:, choice[b]]
            lb = local(b) - m[choice[a], :]
            joint = la[:, None] + lb[None, :] + m
            flat = int(np.argmin(joint))
            i, j = divmod(flat, joint.shape[1])
            if joint[i, j] < joint[choice[a], choice[b]] - 1e-9 * max(1.0, abs(joint[i, j])):
                choice[a], choice[b], changed = i, j, True
        if not changed:
            break
    return choice


def _cost_scale(problem: Problem, reference: float) -> float:
    """Integer scale for toulbar2: the reference cost maps to ~1e12 (costs to ~1e-12 relative
    precision, far below toulbar2's int64 ceiling), at most 1000 units per cost unit."""
    if not np.isfinite(reference) or reference >= FORBIDDEN or reference <= 0:
        low = sum(float(c[problem.allowed(v)].min(initial=0)) for v, c in enumerate(problem.node_costs))
        low += sum(float(m.min()) for m in problem.edge_costs if m.size)
        reference = max(1.0, 1000.0 * low)
    return float(min(1000.0, 1e12 / reference))


def lagrangian_search(problem: Problem, start: np.ndarray | None, deadline: float, say=lambda m: None,
                      core_seconds: float = 5.0) -> tuple[np.ndarray | None, float | None]:
    """(best feasible choice or None, best proven lower bound or None) found before ``deadline``.

    Ties are not eliminated (their nodes stay in the core, where toulbar2 does not tie
    them); the caller hands problems with ties to the MILP instead.
    """
    if not cfn.available() or problem.usage_limit is None:
        return None, None
    t_begin = time.perf_counter()
    elim = Eliminator(problem)
    mem = heuristic._Memory(problem, np.zeros(problem.num_nodes, dtype=np.int64))
    nseg = mem.total.size
    limit = float(problem.usage_limit)
    best, upper = None, np.inf
    if start is not None:
        ev = evaluate(problem, start)
        if ev.feasible:
            best, upper = start.copy(), ev.cost
    core = _CoreSolver(core_seconds, _cost_scale(problem, upper))
    say(f"lagrange: {problem.num_nodes} nodes -> core of {elim.core.size} nodes, {len(elim.core_edges)} edges "
        f"after elimination; {nseg} time segments")
    mu = np.zeros(nseg)
    lower = None
    push = 0.25  # how far above L(mu) a step may aim; doubles while the overflow stays large
    rounds, last = 0, 0.0
    scale, best_value, stale = 1.0, -np.inf, 0
    while True:
        now = time.perf_counter()
        if deadline - now < max(0.5, 1.2 * last):
            break
        unary = _penalized(problem, mem, mu)
        core.seconds = max(1.0, min(core_seconds, deadline - now - 1.0))
        choice = elim.solve(unary, core)
        rounds += 1
        raw = evaluate(problem, choice)
        g = _excess(problem, mem, choice)
        value = raw.cost + float(mu @ g)
        if np.isfinite(core.gap) and raw.cost < FORBIDDEN and (lower is None or value - core.gap > lower):
            lower = value - core.gap
        active = np.where(mu > 0, g, np.maximum(g, 0))  # the projected subgradient
        norm = float(active @ active)
        # Polyak's step toward the best feasible cost, but never aiming more than `push` above
        # L(mu): a poor incumbent (38x the optimum on M) would otherwise flood every multiplier.
        target = min(upper, value + push * max(abs(value), 1.0))
        step = scale * max(target - value, 1e-3 * abs(target)) / max(norm, 1e-300)
        fixed_cost = None
        if raw.feasible or raw.peak_usage <= REPAIR_MAX_OVERFLOW * limit:
            # A repair may take a quarter of the time left: a failing one must not eat the rounds.
            until = min(deadline, time.perf_counter() + max(3.0, 0.25 * (deadline - time.perf_counter())))
            fixed = _penalty_repair(problem, elim, mem, mu, g, step, core.previous, choice, until)
            if fixed is not None:
                fixed = heuristic.local_search(problem, fixed, deadline=deadline)
                ev = evaluate(problem, fixed)
                if ev.feasible:
                    fixed_cost = ev.cost
                    if ev.cost < upper:
                        best, upper = fixed, ev.cost
        say(f"lagrange round {rounds}: pairwise cost {raw.cost:.6g}, peak {raw.peak_usage / limit:.3f}x limit, "
            f"L(mu) {value:.6g} (core gap {core.gap:.3g}), repaired "
            f"{'-' if fixed_cost is None else f'{fixed_cost:.6g}'}, best {upper:.6g} "
            f"({time.perf_counter() - t_begin:.1f}s)")
        if norm == 0:
            break  # feasible and complementary: L(mu) is the optimum
        # Held and Karp's rule: halve the step after three rounds that did not raise L(mu).
        if value > best_value:
            best_value, stale = value, 0
        else:
            stale += 1
            if stale >= 3:
                scale, stale = max(scale / 2, 1e-3), 0
        if raw.peak_usage > REPAIR_MAX_OVERFLOW * limit:
            push *= 2
        mu = np.maximum(0.0, mu + step * g)
        last = time.perf_counter() - now
    return best, lower
