"""The clock the weight-search path reads: this process's CPU seconds, the wall clock as a guard.

The weight search, its repairs and merges, the windowed MILPs and the last polish end at
shares of the time limit. Read off the wall clock, those shares shrink on a busy machine:
fewer rounds, other answers, another basin (issue "reproducible solves": the same instance at
0.935 of the strongest known cost in one run and 1.024 in the next). Read off
:class:`WorkClock`, a stage ends after the same CPU seconds of this process, which a busy
machine does not stretch, so its rounds follow the same path in every run where the machine
gives it the time; toulbar2's own limits count CPU seconds too. The wall clock stays the outer
guard: past ``guard`` every deadline has passed (:attr:`WorkClock.cut` says so) and the search
returns its best so far.

CPU seconds are work up to the machine's own jitter (a few per cent a stage), so a run whose
stage ends on the edge of one more round may still part from another. Searches that count their
work exactly are charged by it (:meth:`WorkClock.charge`): the weight search's toulbar2 rounds,
bounded by backtracks and priced per backtrack (:class:`solver.core.CoreSolver`), and its merges,
priced per LP iteration (:mod:`solver.weights`).
"""

from __future__ import annotations

import math
import time


class WallClock:
    """The wall clock with :class:`WorkClock`'s interface, no guard: what a search reads when it
    is given no work clock (a caller outside the weight path, a test)."""

    cut = False

    def __call__(self) -> float:
        return time.perf_counter()

    def cpu_until_guard(self) -> float:
        return math.inf

    def seconds_until(self, deadline: float) -> float:
        return deadline - time.perf_counter()

    def charge(self, spent: float, work: float) -> None:
        """Nothing: the wall clock counts what a search took."""

    def mark(self, what: str) -> None:
        """Nothing: on the wall clock every search's answer hangs on the machine."""


#: The clock of searches given none.
WALL = WallClock()


class WorkClock:
    """``clock()``: ``origin`` plus the CPU seconds this process has used since the clock was
    made, on the ``time.perf_counter()`` scale deadlines are written in; ``inf`` once the wall
    clock passes ``guard``."""

    def __init__(self, guard: float, origin: float | None = None):
        self.origin = time.perf_counter() if origin is None else origin
        self.cpu0 = time.process_time()
        self.wall0 = time.perf_counter()
        self.guard = guard
        """The ``time.perf_counter()`` value past which every deadline has passed."""
        self.cut = False
        """Whether a clock, not its work, ended a search (the guard, or a search's own limit)."""
        self.cut_by: list[str] = []
        """What ended searches by a clock (:meth:`mark`): ``guard``, or a search's name."""

    def __call__(self) -> float:
        if time.perf_counter() >= self.guard:
            self.mark("guard")
            return math.inf
        return self.origin + time.process_time() - self.cpu0

    def cpu_until_guard(self) -> float:
        """CPU seconds this process may still use before the guard at the rate it has had them so
        far: the ceiling for a search whose own limit counts CPU seconds (toulbar2), which on a
        busy machine would otherwise run past the guard by the share of the core it lacks."""
        wall = time.perf_counter() - self.wall0
        rate = min(1.0, (time.process_time() - self.cpu0) / wall) if wall > 1.0 else 1.0
        return (self.guard - time.perf_counter()) * rate

    def seconds_until(self, deadline: float) -> float:
        """Seconds a wall-clock-limited search (HiGHS) may take to end by ``deadline``: the work
        left, and no more than the wall clock left to the guard."""
        return min(deadline - self(), self.guard - time.perf_counter())

    def charge(self, spent: float, work: float) -> None:
        """Count a search that just took ``spent`` CPU seconds as ``work`` seconds instead: its
        work priced at fixed rates (toulbar2's backtracks, HiGHS's LP iterations), the same in
        every run, where the CPU seconds it took are not."""
        self.origin += work - spent

    def mark(self, what: str) -> None:
        """Record that a clock, not its work, ended ``what`` (the guard, or a search's own limit):
        its answer may differ between runs."""
        self.cut = True
        if what not in self.cut_by:
            self.cut_by.append(what)
