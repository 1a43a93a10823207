r"""Memory by per-node penalty weights, each tuned by its own bisection.

The exact MILP cannot be built on industrial instances (its memory rows run to 1e8
nonzeros), while without memory the problem is a pairwise network that variable
elimination (:mod:`solver.eliminate`) plus toulbar2 on the remaining core
(:class:`solver.core.CoreSolver`) solve in seconds. So memory moves into the node
costs, with one weight w_v >= 0 per node:

    min_s  sum_v [ c_v(s_v) + w_v (m_v(s_v) - min_i m_v(i)) ] + sum_(u,v) C_uv(s_u, s_v)

and each round solves this pairwise problem once (:meth:`Eliminator.solve`). Node v is
*broken* in a round when the total usage overflows the limit somewhere in v's live
interval. Each weight keeps a bracket [lo_v, hi_v] (:class:`Brackets`): a broken node's
weight was too low (lo_v = w_v), a fitting one's high enough (hi_v = w_v); the next
weight is the geometric midpoint, or ``GROWTH`` x lo_v while no high end is known. The
answer moves under a node as its neighbours' weights change, so each round also widens
the other end (hi_v x 1.35 when v breaks, lo_v / 1.5 when it fits): a node that keeps
breaking keeps rising, and nodes that never bind drift down to cheap weights. Nodes
whose interval cannot overflow even with every node at its largest usage keep w_v = 0.
The first weights are the memory-free answer's cost per byte of usage above the least.

Round 0 has w = 0: the memory-free optimum, whose cost (minus toulbar2's unproven gap)
bounds the optimum from below, and which is the answer when it fits. Rounds that fit, or
overflow by at most ``REPAIR_OVERFLOW``, are repaired: the broken nodes' weights alone
are raised and the core re-descended (:func:`_reweigh`, so core nodes move with the trees
and chains eliminated into them), then a greedy per-byte repair
(:func:`solver.heuristic.repair_memory`) and local search. The best feasible answer is
kept, and :mod:`solver.lns` then polishes it. Once the search fits on its own, each round
that breaks the limit is merged with the best answer and the last round merged
(:func:`solver.recombine.merge`: the best answer whose every node takes the strategy one of
the three takes, solved exactly with the memory rows): rounds land either well under the
limit or over it, and the merge finds what lies between.

Per-segment Lagrange multipliers (one per run of time points, summed over a node's
interval) were the previous design. L(mu) bounds the optimum, but on IOPDDL S the
multipliers stayed noisy (toulbar2 does not prove the 3.5k-node core in seconds) and
the repaired answers sat 3% above the best known. With per-node weights the same rounds
go below it. Per-node penalties tuned per node come from ti2-group's IOPDDL 2025 entry
("Soft constraints, strong solutions": many weight levels in parallel processes, toulbar2
on the whole graph); here one chain of rounds runs on exact elimination's core.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from solver import cfn, heuristic, local, recombine
from solver.clock import WALL, WallClock, WorkClock
from solver.core import CoreSolver, cost_scale, descend
from solver.eliminate import Eliminator
from solver.evaluate import evaluate
from solver.problem import Problem

log = logging.getLogger(__name__)

#: Weight growth per round while a node has never fit (no high end to bisect towards).
GROWTH = 8.0

#: Rounds that overflow the limit by at most this factor are repaired; larger overflows
#: only once nothing feasible is known (the greedy repair is slow and costly from far).
REPAIR_OVERFLOW = 1.05

#: Share of the remaining time one round's toulbar2 search may take at most.
ROUND_SHARE = 0.2

#: The same for the memory-free round, which every later round starts from and which gives
#: the bound: capped at a fifth, IOPDDL A's (proved in 6.5-8 s alone) was cut off twice inside
#: its 60 s, so its rounds started from a descent's answer and it reported no bound.
FREE_ROUND_SHARE = 0.5

#: The search stops early once its own answers (repaired rounds) have not improved for this
#: many rounds and for ``STALL_SHARE`` of its time so far: the time is then worth more to the
#: windowed MILPs. (On IOPDDL T its own best improved at 44, 78, 88, 101 and 122 s, then
#: rounds 14-24 only repeated answers 15% above it.)
STALL_ROUNDS = 5
STALL_SHARE = 1 / 2

#: Share of the remaining time one merge (:func:`solver.recombine.merge`) is planned to take.
MERGE_SHARE = 0.25

#: A merge's price, seconds: per row and column of its model (building it) and per LP iteration
#: and row and column (HiGHS): measured 10-19 us and 7-42 ns on IOPDDL A, K, M, S and T's merges.
#: Charged at its CPU seconds, a merge would move every later deadline by as much as the
#: machine's load moves it (K's second merge: 13.2-15.6 s in runs alone, 30 s beside a test run),
#: and the weight search's last rounds with them.
MERGE_BUILD_PER_ENTRY = 12e-6
MERGE_ITERATION_PER_ENTRY = 15e-9

#: What a merge may take, as a multiple of its planned share, before HiGHS is cut: a merge cut by
#: its time hangs on the machine's speed (IOPDDL K: 2.30069e9 and 2.30065e9 from the same three
#: answers in two runs, and the rounds after it parted), one that ends by itself does not. K's
#: merges cut at their share were proved optimal in 14 s against their 3.5-6.3 s share.
MERGE_GUARD = 3.0


class Brackets:
    """Per-node weight brackets; :meth:`update` takes a round's broken nodes, returns the next weights."""

    def __init__(self, active: np.ndarray, start: float):
        self.active = active
        """Nodes that can be broken at all; the others keep weight 0."""
        self.lo = np.zeros(active.size)
        self.hi = np.full(active.size, np.inf)
        self.w = np.where(active, start, 0.0)

    def update(self, broken: np.ndarray) -> np.ndarray:
        w, fits = self.w, ~broken & self.active
        self.lo = np.where(broken, w, self.lo)
        self.hi = np.where(fits, w, self.hi)
        # Widen the other end too: the answer moves under a node as its neighbours' weights
        # change, so a node that keeps breaking keeps rising (x1.35 a round at most) and one
        # that keeps fitting keeps falling (/1.5), rather than settling inside a stale
        # bracket. (Widening only on a repeated state, bisecting nodes that alternate, did
        # worse: S 1.548e9 vs 1.524e9, M 4.9935e10 vs 4.9928e10 before LNS.)
        self.hi = np.where(broken, 1.35 * self.hi, self.hi)
        self.lo = np.where(fits, self.lo / 1.5, self.lo)
        known = np.isfinite(self.hi)
        mid = np.sqrt(self.lo * np.where(known, self.hi, 0.0))
        mid = np.where(self.lo > 0, mid, np.where(known, self.hi / 4, 0.0))
        self.w = np.where(self.active, np.where(known, mid, GROWTH * self.lo), 0.0)
        return self.w


def _coarse(seconds: float) -> float:
    """``seconds`` (>= 1) rounded down to a power of two. A cap read off the clock moves with the
    CPU seconds of the rounds before it (descents, repairs, merges: 107.5 s against 111.0 s by
    IOPDDL K's eighth round in two runs), and toulbar2's backtrack budget follows the cap:
    rounded, the budget is the same in both unless the cap lies near a power of two."""
    return 2.0 ** math.floor(math.log2(seconds))


def _interval_max(mem, values: np.ndarray) -> np.ndarray:
    """Per node, the largest of ``values`` (one per time segment) over its live interval
    (-inf for an empty one): one ``reduceat`` over the interleaved ends [a_0, b_0, a_1, ...],
    whose even slots are exactly max(values[a_v:b_v]) where a_v < b_v."""
    padded = np.append(values, -np.inf)  # b_v may equal the segment count
    ends = np.empty(2 * mem.a.size, dtype=np.int64)
    ends[0::2], ends[1::2] = mem.a, mem.b
    out = np.maximum.reduceat(padded, ends)[0::2] if ends.size else np.zeros(0)
    return np.where(mem.b > mem.a, out, -np.inf)


def _weighted(problem: Problem, w: np.ndarray, low: np.ndarray) -> list[np.ndarray]:
    """Node costs plus each node's penalty w_v (m_v - min m_v)."""
    return [problem.node_costs[v] + w[v] * (problem.node_usages[v] - low[v]) for v in range(problem.num_nodes)]


def _chosen_usage(problem: Problem, choice: np.ndarray) -> np.ndarray:
    return np.array([problem.node_usages[v][choice[v]] for v in range(problem.num_nodes)])


def _reweigh(problem, elim, core_start, w, low, broken, choice, broken_of, deadline, now, tries: int = 6):
    """Make a round's answer fit by raising the weights ``w`` (already the next round's, so
    broken nodes start raised) of its broken nodes only (x2 a try, x8 while the peak
    stalls) and re-solving with descent on the core from the round's core answer: a core
    node then moves together with the trees and chains eliminated into it, where the
    greedy single-node repair breaks them apart. Returns the last answer, which may still
    overflow (the greedy repair takes it from there)."""
    limit = float(problem.usage_limit)
    positive = w[w > 0]
    floor = 0.25 * float(positive.mean()) if positive.size else 0.0
    w, start, current, last_peak, stalls = w.copy(), core_start, choice, np.inf, 0
    for _ in range(tries):
        peak = evaluate(problem, current).peak_usage
        stalls = stalls + 1 if peak >= last_peak - 1e-3 * limit else 0
        if peak <= limit or stalls >= 2 or now() > deadline:
            break  # fits, or descent cannot move the peak (on A: forbidden pairs all round)
        factor = 8.0 if stalls else 2.0
        last_peak = peak
        w = np.where(broken, factor * np.maximum(w, floor), w)
        picked = {}

        def core(costs, edges):
            picked["core"] = descend(costs, edges, start, pairs=True)
            return picked["core"]

        current = elim.solve(_weighted(problem, w, low), core)
        start = picked["core"]
        broken = broken_of(current)
    return current


def weight_search(problem: Problem, start: np.ndarray | None, deadline: float,
                  core_seconds: float = 5.0, on_best=None, clock: WorkClock | WallClock = WALL
                  ) -> tuple[np.ndarray | None, float | None]:
    """(best feasible choice or None, proven lower bound or None) found before ``deadline``,
    or sooner when the search stalls (``STALL_ROUNDS``, ``STALL_SHARE``). Deadlines and the
    stall rule read ``clock`` (:class:`solver.clock.WorkClock`: the rounds a run makes do not
    depend on how busy the machine is; by default the wall clock).

    ``on_best(choice, cost)`` is called with each answer cheaper than ``start`` and every
    earlier one. Ties are not eliminated (their nodes stay in the core, where toulbar2
    does not tie them); the caller hands problems with ties to the MILP instead.
    """
    if not cfn.available() or problem.usage_limit is None:
        return None, None
    return _WeightSearch(problem, start, deadline, core_seconds, on_best, clock).run()


class _WeightSearch:
    """The rounds of :func:`weight_search`, its state as attributes."""

    def __init__(self, problem: Problem, start, deadline: float, core_seconds: float, on_best, now):
        self.problem, self.deadline, self.on_best, self.now = problem, deadline, on_best, now
        self.t_begin = now()
        n = problem.num_nodes
        self.elim = Eliminator(problem)
        self.mem = local.Memory(problem, np.zeros(n, dtype=np.int64))
        self.limit = float(problem.usage_limit)
        self.low = np.array([u[problem.allowed(v)].min(initial=0.0) for v, u in enumerate(problem.node_usages)])
        high = np.array([u[problem.allowed(v)].max(initial=0.0) for v, u in enumerate(problem.node_usages)])
        self.active = (_interval_max(self.mem, self.mem.profile(high)) > self.limit) & (high > self.low)
        self.best, self.upper = None, np.inf
        if start is not None:
            ev = evaluate(problem, start)
            if ev.feasible:
                self.best, self.upper = start.copy(), ev.cost
        self.core = CoreSolver(core_seconds, cost_scale(problem, np.inf), clock=now)
        log.info(f"weights: {n} nodes -> core of {self.elim.core.size} nodes, {len(self.elim.core_edges)} edges "
                 f"after elimination; {int(self.active.sum())} nodes can overflow the limit")
        self.brackets, self.lower = None, None
        self.w = np.zeros(n)
        self.seen: set[bytes] = set()
        self.merged_with: set[bytes] = set()
        self.no_gain_at = np.inf
        """The least overflow of a round whose merge gained nothing."""
        self.partner: list[np.ndarray] = []
        """The last round merged."""
        self.adj = local.Adjacency(problem)
        self.rounds = 0
        self.cut = False
        """Whether a merge's HiGHS ran to its time limit."""
        self.own, self.last_gain, self.gain_round = np.inf, 0.0, 0
        """The search's own answers (the start aside): the best, when and in which round it came."""

    def broken_of(self, choice):
        problem = self.problem
        return (_interval_max(self.mem, self.mem.profile(_chosen_usage(problem, choice))) > self.limit) & self.active

    def _stalled(self, now: float) -> bool:
        if self.own < np.inf and self.rounds - self.gain_round >= STALL_ROUNDS \
                and now - self.last_gain > STALL_SHARE * (now - self.t_begin):
            log.info(f"weights: stalled, no better answer of its own for {self.rounds - self.gain_round} rounds "
                     f"({now - self.last_gain:.1f}s)")
            return True
        return False

    def run(self) -> tuple[np.ndarray | None, float | None]:
        problem, core, deadline = self.problem, self.core, self.deadline
        last, retried = 0.0, False
        while True:
            now = self.now()
            if deadline - now < max(0.5, 1.2 * last) or self._stalled(now):
                break
            # toulbar2's limit adapts round to round (CoreSolver.adapt), up to a fifth of what is left.
            share = ROUND_SHARE if self.brackets is not None else FREE_ROUND_SHARE
            core.cap = _coarse(max(1.0, min(deadline - now - 1.0, share * (deadline - now))))
            choice = self.elim.solve(_weighted(problem, self.w, self.low), core)
            self.rounds += 1
            if self.brackets is None and not core.found and not retried:
                # The memory-free answer seeds every later round and gives the bound: a descent's
                # answer in its place led IOPDDL A's rounds into a basin far above the best known.
                retried = True
                log.info(f"weights: toulbar2 found nothing on the memory-free core in its limit; "
                         f"again with {core.seconds:.0f}s")
                last = self.now() - now
                continue
            raw = evaluate(problem, choice)
            broken = self.broken_of(choice)
            if self.brackets is None:  # round 0: memory ignored
                if np.isfinite(core.gap):
                    self.lower = raw.cost - core.gap
                if raw.feasible:
                    log.info(f"weights: the memory-free optimum fits ({raw.cost:.6g})")
                    return choice, self.lower
                # First weights: the cost per byte of usage above each node's least, averaged.
                excess = float((_chosen_usage(problem, choice) - self.low)[self.active].sum())
                self.brackets = Brackets(self.active, raw.cost / max(excess, 1.0))
                self.w = self.brackets.w
            else:
                self.w = self.brackets.update(broken)
            repaired = self._repair(choice, raw, broken)
            merged = self._merge(choice, raw)
            log.info(f"weights round {self.rounds}: pairwise cost {raw.cost:.6g}, peak "
                     f"{raw.peak_usage / self.limit:.4f}x limit, {int(broken.sum())} nodes broken, repaired "
                     f"{'-' if repaired is None else f'{repaired:.6g}'}, merged "
                     f"{'-' if merged is None else f'{merged:.6g}'}, best {self.upper:.6g} "
                     f"({self.now() - self.t_begin:.1f}s)")
            last = self.now() - now
        if core.cut:
            self.now.mark("toulbar2")
        if self.cut:
            self.now.mark("merge")
        return self.best, self.lower

    def _repair(self, choice, raw, broken) -> float | None:
        """The round's answer repaired to fit (reweighed, repaired, descended): its cost, or None."""
        problem, deadline, key = self.problem, self.deadline, choice.tobytes()
        if key in self.seen or not (raw.peak_usage <= REPAIR_OVERFLOW * self.limit or self.best is None and
                                    raw.peak_usage <= 1.5 * self.limit):
            return None
        self.seen.add(key)
        now = self.now()
        until = min(deadline, now + max(2.0, 0.1 * (deadline - now)))
        fixed = _reweigh(problem, self.elim, self.core.previous, self.w, self.low, broken, choice, self.broken_of,
                         until, now=self.now)
        fixed = heuristic.repair_memory(problem, fixed, until, now=self.now)
        if fixed is None:
            return None
        fixed = heuristic.local_search(problem, fixed, deadline=until, now=self.now)
        ev = evaluate(problem, fixed)
        if not ev.feasible:
            return None
        if ev.cost < self.own:
            self.own, self.last_gain, self.gain_round = ev.cost, self.now(), self.rounds
        if ev.cost < self.upper:
            self.best, self.upper = fixed, ev.cost
            if self.on_best is not None:
                self.on_best(self.best, self.upper)
        return ev.cost

    def _merge(self, choice, raw) -> float | None:
        """An overflowing round merged with the best answer (and the last round merged): its cost, or None."""
        problem, deadline, key = self.problem, self.deadline, choice.tobytes()
        if not (self.own < np.inf and not raw.feasible and key not in self.merged_with
                and (raw.peak_usage < self.no_gain_at or raw.cost < self.upper)):
            return None
        # Rounds land well under the limit or over it, never near it; an overflowing round is
        # cheaper than the best answer somewhere, and the merge keeps that where memory allows.
        # It is merged together with the last round merged, whether or not it costs less in all;
        # only once the search fits on its own (merges of rounds far over the limit gain nothing
        # for their time), and below the overflow of a merge that gained nothing unless the round
        # costs less than the best.
        self.merged_with.add(key)
        now = self.now()
        # Past the stage's deadline if need be: the merge's work, not the clock, should end it.
        until = now + MERGE_GUARD * max(5.0, MERGE_SHARE * (deadline - now))
        report: dict = {}
        t0 = time.process_time()
        found = recombine.merge(problem, self.best, [choice] + self.partner, until, self.adj, clock=self.now,
                                report=report)
        if "size" in report:  # built (a merge skipped before is charged its CPU seconds)
            self.now.charge(time.process_time() - t0, report["size"] * (
                MERGE_BUILD_PER_ENTRY + MERGE_ITERATION_PER_ENTRY * report.get("iterations", 0)))
        self.cut = self.cut or report.get("cut", False)
        self.partner = [choice]
        if found is None:
            self.no_gain_at = raw.peak_usage
            return None
        merged = evaluate(problem, found).cost
        if merged < self.own:
            self.own, self.last_gain, self.gain_round = merged, self.now(), self.rounds
        self.best, self.upper = found, merged
        if self.on_best is not None:
            self.on_best(self.best, self.upper)
        return merged
