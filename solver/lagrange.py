r"""Memory by Lagrangian relaxation: pairwise solves with a price on every time segment's bytes.

Where the memory-free optimum breaks the limit, :func:`solver.solve`'s next search (toulbar2 with
the memory rows, :mod:`solver.exact`) posts knapsacks in a child process: seconds before a first
answer even where the optimum is a few small moves from the memory-free one (LLaMA-8B on (8, 8),
an overlap round's problem: 3.5 s, 2.4 of them to DGVNS's first answer). Here the rows move into
the objective instead. With ``U_k(x) = sum_(v live at k) u_v(x_v)`` the usage at time segment
``k`` (:class:`solver.local.Memory`) and ``M`` the limit, for every ``mu >= 0``

    L(mu) = min_x  c(x) + sum_k mu_k (U_k(x) - M)
          = min_x  c(x) + sum_v u_v(x_v) * (sum_(k in [a_v, b_v)) mu_k)  -  M sum_k mu_k

bounds the optimum from below (weak duality: a feasible ``x`` has every ``U_k(x) - M <= 0``), and
the inner minimum is a pairwise problem of the same graph whose node costs carry the price of
their bytes over their lifetime: toulbar2 on the tie quotient, as the memory-free stage
(:func:`solver.cfn.solve_pairwise`; its rounding ``slack`` taken off keeps the bound valid).
Each round's minimizer ``x_mu`` is a candidate where it fits, and is otherwise repaired into the
limit (the caller's repair: :mod:`solver.rowrepair` in :func:`solver.solve`). The prices follow the
projected subgradient ``g_k = U_k(x_mu) - M`` (0 where ``mu_k = 0`` and ``g_k < 0``: such a
segment stays unpriced, so it takes no share of the step) with Polyak's step toward the best
feasible cost ``UB``:

    mu <- max(0, mu + theta (UB - L(mu)) g / |g|^2)

``theta`` (:data:`THETA` at first) halves after every :data:`PATIENCE` rounds in a row that raise
neither ``L`` (above its best since the first priced round, whose prices overshoot) nor the
incumbent. The stage ends when ``UB - max L <= gap |UB|`` (proved within the gap: no search
follows), after :data:`MAX_ROUNDS` rounds, after ``2 * PATIENCE`` rounds in a row that improve
nothing, or after its first round where that round found no plan that fits and beats the
incumbent (prices on tied layers swing whole layers at once, LLaMA-70B on (8, 8, 8): its rounds
alternate between a plan 98 GiB over and one 0.2 GiB over that no single move repairs, so the
stage gives way to the exact search at once). Rounds, not seconds, end it, so the same problem
gets the same answer on a busy machine; the deadline only guards. :func:`solver.solve` runs it
where the gap asked is one it can prove (``LAGRANGE_MIN_GAP``: the overlap objective's rounds).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from solver import cfn, heuristic
from solver.evaluate import evaluate
from solver.local import Memory
from solver.problem import FORBIDDEN, Problem
from solver.quotient import quotient

log = logging.getLogger(__name__)

#: The most rounds (pairwise solves) the stage makes.
MAX_ROUNDS = 12
#: Rounds in a row without a better bound or plan after which ``theta`` halves, and after
#: which, twice over, the stage ends.
PATIENCE = 2
#: Polyak's first step share ``theta``.
THETA = 1.0
#: Seconds the repair of one round's plan may take at most (it takes hundredths on the
#: planner's problems).
REPAIR_SECONDS = 1.0


@dataclass
class LagrangeAnswer:
    """What :func:`lagrange_memory` found."""

    choice: np.ndarray | None
    """The cheapest plan found that fits (None: none beat the given upper bound)."""
    cost: float
    """Its cost (inf without one)."""
    lower: float
    """The largest ``L(mu)`` proved: no plan that fits costs less (-inf where no round proved one)."""
    plans: list[np.ndarray] = field(default_factory=list)
    """Every distinct plan found that fits, in the order found."""
    rounds: int = 0
    stopped: str = ""


class LagrangeRounds:
    """The stage of the module doc, one round per :meth:`step`, from the memory-free optimum
    ``free`` (round 0: proved, with bound ``free_bound``) and the cost ``upper`` of the best plan
    known to fit (inf: none); :attr:`answer` is what the rounds found."""

    def __init__(self, problem: Problem, free: np.ndarray, free_bound: float, upper: float = math.inf,
                 gap: float = 1e-6, max_rounds: int = MAX_ROUNDS, repair=None):
        if problem.usage_limit is None:
            raise ValueError("LagrangeRounds needs a memory limit (problem.usage_limit is None)")
        self.problem, self.gap, self.max_rounds = problem, gap, max_rounds
        self.repair = repair or functools.partial(heuristic.repair_and_polish, problem)
        self.q, self.group = quotient(problem)
        self.mem = Memory(problem, free)
        self.members: list[list[int]] = [[] for _ in range(self.q.num_nodes)]
        for v in range(problem.num_nodes):
            self.members[self.group[v]].append(v)
        self.answer = LagrangeAnswer(None, math.inf, free_bound)
        self.best = upper
        self._seen: set[bytes] = set()
        self._choice, self._usage = free, self.mem.total
        self._mu = np.zeros(self._usage.size)
        self._theta, self._dry, self._top, self._ascent = THETA, 0, free_bound, -math.inf

    @property
    def done(self) -> bool:
        return bool(self.answer.stopped)

    def proved(self) -> bool:
        """Whether the best plan known is within the gap of the bound proved."""
        return math.isfinite(self.best) and self.best - self.answer.lower <= self.gap * abs(self.best)

    def _offer(self, choice: np.ndarray) -> bool:
        ev = evaluate(self.problem, choice)
        if not ev.feasible:
            return False
        if (key := choice.tobytes()) not in self._seen:
            self._seen.add(key)
            self.answer.plans.append(choice)
        if ev.cost < self.best:
            self.best, self.answer.choice, self.answer.cost = ev.cost, choice, ev.cost
            return True
        return False

    def step(self, deadline: float) -> bool:
        """One round (none once :attr:`done`); whether the stage has ended."""
        ans, problem, limit = self.answer, self.problem, self.problem.usage_limit
        if self.done:
            return True
        if self.proved():
            ans.stopped = "proved within the gap"
            return True
        if ans.rounds >= self.max_rounds:
            ans.stopped = f"{self.max_rounds} rounds"
            return True
        if time.perf_counter() >= deadline:
            ans.stopped = "deadline"
            return True
        usage, mu = self._usage, self._mu
        # Projected: a segment priced at 0 with room to spare stays at 0, so it takes no share of the step.
        g = np.where((mu > 0) | (usage > limit), usage - limit, 0.0)
        norm = float(g @ g)
        if norm == 0.0:
            ans.stopped = "no subgradient"
            return True
        # Before a plan fits, aim a little above this round's plan (Polyak's target unknown).
        target = self.best if math.isfinite(self.best) else evaluate(problem, self._choice).cost * 1.05
        self._mu = mu = np.maximum(0.0, mu + self._theta * max(target - self._top, 1e-9 * abs(target)) * g / norm)
        prefix = np.concatenate([[0.0], np.cumsum(mu)])
        price = prefix[self.mem.b] - prefix[self.mem.a]  # per node: its live segments' prices, summed
        usages, costs = problem.node_usages, []
        for k, vs in enumerate(self.members):
            c = self.q.node_costs[k]
            priced = c + sum(price[v] * usages[v] for v in vs if price[v])
            costs.append(np.where(c >= FORBIDDEN, c, priced))
        q = self.q.with_costs(node_costs=costs)
        try:
            picked, proved, slack = cfn.solve_pairwise(q, max(1.0, deadline - time.perf_counter()))
        except Exception as exc:  # pytoulbar2's SolverOut (its timer), or any failure of one round: the rounds end
            ans.stopped = f"toulbar2 stopped: {type(exc).__name__}: {exc}"
            return True
        ans.rounds += 1
        if picked is None:
            ans.stopped = "toulbar2 found nothing"
            return True
        self._choice = choice = picked[self.group]
        self._usage = usage = self.mem.profile(np.array([usages[v][choice[v]] for v in range(problem.num_nodes)]))
        self._top = evaluate(q, picked).cost - limit * float(mu.sum())
        # Progress is the dual's ascent since round 1 (its first prices overshoot, below round 0's bound).
        gained = proved and self._top > self._ascent + 1e-9 * abs(self._top)
        if proved:
            self._ascent = max(self._ascent, self._top)
            ans.lower = max(ans.lower, self._top - slack)
        fits = usage.max() <= limit
        if fits:
            found = self._offer(choice)
        else:
            fixed = self.repair(choice, min(deadline, time.perf_counter() + REPAIR_SECONDS))
            found = fixed is not None and self._offer(fixed)
        if log.isEnabledFor(logging.DEBUG):  # the plan's cost is one more evaluation: only when shown
            log.debug(f"lagrange round {ans.rounds}: bound {ans.lower:.6g}, plan {evaluate(problem, choice).cost:.6g} "
                      f"({'fits' if fits else f'{usage.max() - limit:.4g} over'}), best {self.best:.6g}")
        if ans.rounds == 1 and not found:
            ans.stopped = "its first round found no better plan that fits"
            return True
        self._dry = 0 if (found or gained) else self._dry + 1
        if self._dry >= 2 * PATIENCE:
            ans.stopped = f"{self._dry} rounds without a better bound or plan"
            return True
        if self._dry and self._dry % PATIENCE == 0:
            self._theta /= 2
        if self.proved():
            ans.stopped = "proved within the gap"
        return self.done


def lagrange_memory(problem: Problem, free: np.ndarray, free_bound: float, deadline: float,
                    upper: float = math.inf, gap: float = 1e-6, max_rounds: int = MAX_ROUNDS,
                    repair=None) -> LagrangeAnswer:
    """:class:`LagrangeRounds` run to their end, alone. ``repair(choice, until)``: a round's plan
    that breaks the limit moved into it (None: nothing found); node by node
    (:func:`solver.heuristic.repair_and_polish`) unless given."""
    rounds = LagrangeRounds(problem, free, free_bound, upper, gap, max_rounds, repair)
    while not rounds.step(deadline):
        pass
    return rounds.answer
