"""The eliminated core of a pairwise network, solved round after round under changing node costs.

Searches that re-price memory every round (:mod:`solver.weights`) solve the same
core graph many times with costs that move little between rounds. Coordinate
descent from the last round's answer gives a choice at once; toulbar2
(:mod:`solver.cfn`) then only searches for cheaper ones, so a round's answer is
never worse than last round's under the new costs.

toulbar2's time limit adapts to what the last search showed (:meth:`CoreSolver.adapt`):
a search that ended before its limit (proved) sets the next limit to twice its time; one
cut off after cutting the descent's cost by ``PAYING`` or more doubles it (the search pays
and is unfinished); one cut off with a smaller gain goes back halfway to the base; one cut
off without finding anything doubles the limit once, and if the doubled search finds
nothing either, the limit returns to the base until a search completes or pays again. The
caller caps the limit (:attr:`CoreSolver.cap`).

The limit is in seconds of work, not of the clock: toulbar2 gets a backtrack budget,
``(limit - prep) / per_backtrack``, with its preprocessing ``prep`` and each backtrack priced per
entry of the core's tables (:data:`PREP_PER_ENTRY`, :data:`BACKTRACK_PER_ENTRY`), and the search
is charged that price (:meth:`solver.clock.WorkClock.charge`), not the CPU seconds it took. Cut
by a CPU limit, a round's answer hangs on how many backtracks the machine gives it in that time
(IOPDDL K's first round under a 5 s limit: 8.13e8, 8.22e8 and 8.31e8 in three runs, every later
round apart from there); cut by its budget, it is the same in every run, and so are the limits
that follow.
The CPU limit stays as a guard (:data:`GUARD`), which a run that reaches it reports
(:attr:`CoreSolver.cut`).

Measured with a fixed 5 s: on IOPDDL A toulbar2 proves the cores in 6.5-8 s, and cut at
5 s the rounds fell back to a descent's answer, twice the cost. On T, toulbar2 cut the
descent's cost by 24-26% in the first two rounds, and rounds whose search was doubled fitted
at 7.9e11 against 1.1e12 or more. On K it cut 6-8% after the first round, and doubling
there too stretched K's rounds from 9 to 20 s (fewer rounds, K 0.94 -> 0.89).
"""

from __future__ import annotations

import time

import numpy as np

from solver import cfn
from solver.clock import WALL, WallClock, WorkClock
from solver.descent import Network, descend
from solver.problem import FORBIDDEN, Problem

#: A search cut off after lowering the descent's cost by at least this share gets twice the time.
PAYING = 0.1

#: toulbar2's preprocessing (before its first node), CPU seconds per table entry of the core:
#: measured 0.62-0.73 us on IOPDDL K's core (1.6M entries) and 0.56-0.83 us on A's (5.0M), over
#: their rounds' weights.
PREP_PER_ENTRY = 0.75e-6

#: One backtrack of toulbar2's search, CPU seconds per table entry: measured 0.45-1.4 ns over
#: K's rounds, 2.2 ns on A's. Work priced at a fixed rate is the same in every run; how far it is
#: from the seconds it takes on a machine moves only where the stage's time goes.
BACKTRACK_PER_ENTRY = 1.0e-9

#: The CPU limit a search gets as a guard, as a multiple of its priced work (the rates above are
#: a third to two and a half times a search's own).
GUARD = 3.0


class CoreSolver:
    """``__call__(costs, edges)``: a choice per core node (the ``core_solver`` of
    :meth:`solver.eliminate.Eliminator.solve`), warm-started from the previous call."""

    def __init__(self, seconds: float, scale: float, clock: WorkClock | WallClock = WALL):
        self.seconds = seconds
        """toulbar2's limit for the next call in seconds of work (see the module doc), adapted after
        each (:meth:`adapt`)."""
        self.clock = clock
        """What the searches are charged to (their priced work, not their CPU seconds)."""
        self.cut = False
        """Whether a search's CPU guard ended it before its backtrack budget (its answer then hung
        on the machine's speed)."""
        self.base = seconds
        self.doubled = False
        self.cap = np.inf
        """The caller's ceiling on the limit (its remaining time)."""
        self.scale = scale
        """Integer scale for toulbar2's costs (:func:`cost_scale`)."""
        self.previous: list[int] | None = None
        self.gap = np.inf
        """How far the last core answer may be above the core optimum (inf: no bound)."""
        self.found = False
        """Whether toulbar2's last search found an answer (else the answer is a descent's)."""

    def __call__(self, costs: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray]) -> list[int]:
        # Where toulbar2 finds nothing better in time (IOPDDL A's cores) a descent is the answer:
        # from last round's answer, or from each node's cheapest strategy under the new costs,
        # whichever ends cheaper. Under raised weights last round's answer can sit in a basin
        # that single and pair moves do not leave (A: 6.9x the memory limit for four rounds
        # while descents from the cheapest strategies fit). Pair moves, because single moves
        # alone stop at forbidden pairs (4 of them on A's first core).
        net = Network(costs, edges)  # built once for both descents and the three costs
        starts = [descend(costs, edges, None, pairs=True, net=net)]
        if self.previous is not None:
            starts.append(descend(costs, edges, self.previous, pairs=True, net=net))
        start = min(starts, key=lambda c: net.cost(np.asarray(c)))
        upper = net.cost(np.asarray(start))
        limit = max(1.0, min(self.seconds, self.cap))
        entries = sum(c.size for c in costs) + sum(m.size for m in edges.values())
        prep, per_backtrack = PREP_PER_ENTRY * entries, BACKTRACK_PER_ENTRY * max(entries, 1)
        budget = max(1, int((limit - prep) / per_backtrack))
        guard = max(2.0, GUARD * limit, limit + GUARD * prep)
        t0, work = time.process_time(), {}
        picked, _, self.gap = cfn.solve_tables(costs, edges, min(guard, max(1.0, self.clock.cpu_until_guard())),
                                               self.scale, upper if upper < FORBIDDEN else None,
                                               backtracks=budget, work=work)
        used = min(work["backtracks"], budget)
        # Ended by itself (proved), by its budget, or (``cut``) by the CPU guard short of it.
        ended = not work["limited"]
        self.cut = self.cut or (work["limited"] and work["backtracks"] < budget)
        took = prep + used * per_backtrack
        self.clock.charge(time.process_time() - t0, took)
        gain = 0.0 if picked is None else (upper - net.cost(np.asarray(picked))) / max(abs(upper), 1e-12)
        # toulbar2 may hand the start's cost back (proved optimal): found means found cheaper.
        self.found = picked is not None and (upper >= FORBIDDEN or gain > 0)
        self.adapt(limit, took, ended, self.found, gain)
        self.previous = list(picked if picked is not None else start)
        return self.previous

    def adapt(self, limit: float, took: float, ended: bool, found: bool, gain: float = 0.0) -> None:
        """The next limit from this search's (see the module doc): it took ``took`` seconds of work
        and ``ended`` by itself (else by its limit); ``gain`` is how much of the descent's cost the
        search's answer saved."""
        if ended:
            self.seconds, self.doubled = max(self.base, 2.0 * took), False
        elif found:
            self.seconds = 2.0 * limit if gain >= PAYING else max(self.base, 0.5 * (limit + self.base))
            self.doubled = False
        else:
            self.seconds = self.base if self.doubled else 2.0 * limit
            self.doubled = True


def cost_scale(problem: Problem, reference: float) -> float:
    """Integer scale for toulbar2: the reference cost maps to ~1e12 (costs to ~1e-12 relative
    precision, far below toulbar2's int64 ceiling), at most 1000 units per cost unit."""
    if not np.isfinite(reference) or reference >= FORBIDDEN or reference <= 0:
        low = sum(float(c[problem.allowed(v)].min(initial=0)) for v, c in enumerate(problem.node_costs))
        low += sum(float(m.min()) for m in problem.edge_costs if m.size)
        reference = max(1.0, 1000.0 * low)
    return float(min(1000.0, 1e12 / reference))
