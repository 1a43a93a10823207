"""When each stage of :func:`solver.solve` must end, as shares of its time limit.

``solve`` runs its stages one after another (some beside each other on spare cores), each
against a deadline ``t0 + share * time_limit``; the shares live here, in one place, instead
of inline in the stages.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Schedule:
    """Stage deadlines as shares of ``time_limit`` from the start of the solve."""

    start_descent: float = 0.05
    """The heuristic start's first local search (from the least-usage choice)."""
    start_repair: float = 0.08
    """Its joint repair of forbidden pairs."""
    start_polish: float = 0.1
    """Its second local search: the heuristic start takes a tenth of the time at most."""
    pairwise: float = 0.5
    """toulbar2 on the tie quotient without memory (proved optimum = answer when it fits)."""
    repair: float = 0.6
    """The memory-free optimum, when it breaks the limit, repaired into it and locally searched."""
    lagrange: float = 0.65
    """Pairwise solves with memory priced (:mod:`solver.lagrange`; rounds end it, this guards)."""
    relaxation: float = 0.5
    """HiGHS without memory rows (lazy memory); its bound holds for the full MILP after it."""
    exact: float = 0.7
    """toulbar2 with the memory rows as knapsacks, alone; the MILP gets the rest."""
    exact_beside_milp: float = 0.95
    """The same, while the MILP runs in a child process on a spare core."""
    weights: float = 0.8
    """The per-node weight search on models too large for the MILP: ``weights - start_polish`` of
    the time limit counted from its own start, in work (:mod:`solver.clock`), so that how long the
    stages before it took on the machine does not move it."""
    windows: float = 0.95
    """Windowed MILPs after (and, on spare cores, beside) the weight search."""
    polish: float = 0.97
    """The last local search and pair repair of the weight path's answer."""

    def __post_init__(self):
        for f in fields(self):
            share = getattr(self, f.name)
            if not 0 < share <= 1:
                raise ValueError(f"schedule.{f.name}: expected a share of the time limit in (0, 1], found {share}")
        for a, b in (("start_descent", "start_repair"), ("start_repair", "start_polish"), ("start_polish", "weights"),
                     ("weights", "windows"), ("windows", "polish")):
            if getattr(self, a) > getattr(self, b):
                raise ValueError(f"schedule: {a} ({getattr(self, a)}) must end no later than {b} "
                                 f"({getattr(self, b)})")

    def deadline(self, stage: str, t0: float, time_limit: float) -> float:
        """``t0 + share * time_limit`` for ``stage`` (a field name)."""
        return t0 + getattr(self, stage) * time_limit


#: The schedule ``solve`` uses unless given another.
DEFAULT = Schedule()
