r"""When a search has stopped paying: the stall rule that ends a search before its deadline.

A search reports events over time: incumbents (costs that only fall) and, where it proves
things, lower bounds (that only rise). An event *counts* when it moves enough:

    incumbent c counts   when  c <= c_counted - gain * |c_counted|
    bound b counts       when  b >= b_counted + gap_share * (c_best - b_counted)

(the first incumbent and the first bound always count). With ``t_first`` the time the
search began (:meth:`Progress.begin`; else its first counted event) and ``t_last`` that of
its last counted event, the search is stalled at time t when

    t - t_last >= max(min_seconds, patience * (t_last - t_first))

i.e. it has gone without progress for as long as (``patience`` = 1) it took to make the
progress it made. Before its first counted event a search that was not begun is never
stalled (a deadline bounds it); with ``from_ready``, a search started from an answer it was
given counts its readiness (:meth:`Progress.ready`, the network posted) as an event, so one that
finds nothing better is stalled after as long again as it took to get ready. The rule adapts to
what a run shows, not to a problem's size: a search that keeps finding better answers runs
on, one that found its answer early stops early. Improvements come in bursts (DGVNS on
LLaMA-405B's problem: a 7 s gap between two runs of improvements that took the cost from 68.9
to 58.4 s of step), so patience is measured against the whole run, not only the time since
the first improvement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StallRule:
    """What counts as progress and how long a search may go without it."""

    gain: float = 1e-3
    """An incumbent counts when it is at least this share below the last one that counted."""
    gap_share: float = 0.1
    """A lower bound counts when it closes at least this share of the gap left to the best incumbent."""
    patience: float = 1.0
    """Stalled after this multiple of the time from the search's start to its last counted event, without one."""
    min_seconds: float = 3.0
    """...and never sooner than this after the last counted event."""
    from_ready: bool = False
    """A search started from a given answer is judged from when it is ready to search, not only
    at its deadline: for a search whose time is better spent elsewhere when it finds nothing (an
    overlap round's solve: the next weights), not for one whose late finds pay (the additive
    solve of LLaMA-70B's full recomputation found the plan 12% faster than its repaired start
    only after 5 s)."""

    def __post_init__(self):
        for name in ("gain", "gap_share"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"StallRule.{name}: expected a share in [0, 1), found {getattr(self, name)}")
        if self.patience < 0 or self.min_seconds < 0:
            raise ValueError(f"StallRule: patience and min_seconds must be >= 0, found {self.patience} and "
                             f"{self.min_seconds}")


#: The rule :func:`solver.solve` uses unless given another.
DEFAULT_STALL = StallRule()


class Progress:
    """The counted events of one search, against :class:`StallRule` ``rule`` (times in seconds
    on any one clock)."""

    def __init__(self, rule: StallRule):
        self.rule = rule
        self.best = math.inf
        """The best incumbent seen (counted or not)."""
        self.counted_cost = math.inf
        self.counted_bound = -math.inf
        self.first: float | None = None
        self.last: float | None = None
        self.first_bound: tuple[float, float] | None = None
        """(time, value) of the first lower bound reported (counted or not)."""
        self.last_bound: tuple[float, float] | None = None
        """(time, value) of the highest lower bound reported."""

    def begin(self, t: float, counts: bool = False) -> None:
        """The search began at ``t``, from which its patience is measured. With ``counts`` the
        start is an event too, so a search that never reports is stalled ``min_seconds`` after
        it began (without, it is never stalled before its first event)."""
        self.first = t
        if counts:
            self.last = t

    def ready(self, t: float) -> None:
        """The search is ready to search at ``t`` (its network posted and preprocessed): where
        nothing counted yet, an event, so a search that then finds nothing better than the answer
        it was given is stalled after as long again as it took to get ready (at least
        ``min_seconds``), not only at its deadline."""
        if self.first is None:
            self.first = t
        if self.last is None:
            self.last = t

    def known(self, cost: float = math.inf, lower: float = -math.inf) -> None:
        """An answer ``cost`` and a bound ``lower`` found before this search (by another one):
        its own incumbents and bounds count only when they move past these, as if these were
        its first counted events (no event is recorded: the patience still runs from
        :meth:`begin`). A search that only finds the known answer again has not progressed."""
        self.best = min(self.best, cost)
        if cost < math.inf:
            self.counted_cost = min(self.counted_cost, cost)
        if lower > -math.inf:
            self.counted_bound = max(self.counted_bound, lower)

    def _count(self, t: float) -> None:
        if self.first is None:
            self.first = t
        self.last = t

    def incumbent(self, cost: float, t: float) -> bool:
        """Record an incumbent found at ``t``; whether it counted."""
        self.best = min(self.best, cost)
        if math.isinf(self.counted_cost) or cost <= self.counted_cost - self.rule.gain * abs(self.counted_cost):
            self.counted_cost = cost
            self._count(t)
            return True
        return False

    def bound(self, lower: float, t: float) -> bool:
        """Record a lower bound proved at ``t``; whether it counted."""
        if self.first_bound is None:
            self.first_bound = (t, lower)
        if self.last_bound is None or lower >= self.last_bound[1]:
            self.last_bound = (t, lower)
        if math.isinf(self.counted_bound):
            self.counted_bound = lower
            self._count(t)
            return True
        gap = self.best - self.counted_bound
        if lower > self.counted_bound and (math.isinf(gap) or lower - self.counted_bound >= self.rule.gap_share * gap):
            self.counted_bound = lower
            self._count(t)
            return True
        return False

    def proof_out_of_reach(self, t: float) -> bool:
        """Whether closing the gap to the best answer, at the rate the bound has risen so far (a
        line through the first bound reported and the highest), would take longer than the
        patience the search has earned at ``t``: ``max(min_seconds, patience * (t - t_first))``.
        Judged once the bounds span ``min_seconds``; never where no answer is known. A branch
        and bound that no longer races a search for answers is worth its core only for a proof:
        on LLaMA-70B's problem its bound rose 0.018e6 in 5 s with 0.078e6 left (a proof 20 s
        away at best, bounds slow down) and the stall rule, which counts any tenth of the gap,
        kept it 7.6 s past DGVNS's end for a bound and no answer."""
        if self.first_bound is None or self.last_bound is None or math.isinf(self.best):
            return False
        (t0, l0), (t1, l1) = self.first_bound, self.last_bound
        if t1 - t0 < self.rule.min_seconds or self.first is None:
            return False
        gap = self.best - l1
        if gap <= 0:
            return False
        rate = (l1 - l0) / (t1 - t0)
        earned = max(self.rule.min_seconds, self.rule.patience * (t - self.first))
        return rate <= 0 or gap / rate > earned

    def stalled(self, t: float) -> bool:
        """Whether the search has gone too long without a counted event at time ``t``."""
        return t >= self.stalls_at()

    def stalls_at(self) -> float:
        """The time at which the search will be stalled if nothing counts before (inf before its first event)."""
        if self.last is None:
            return math.inf
        return self.last + max(self.rule.min_seconds, self.rule.patience * (self.last - self.first))


class RunsWithoutGain:
    """A search of searches stalled after ``patience`` results in a row none of which counted
    (:meth:`Progress.incumbent` under ``rule``'s ``gain``): the mesh search's solves, which end
    together, are counted by result, not by time."""

    def __init__(self, rule: StallRule, patience: int, known: float = math.inf):
        if patience < 1:
            raise ValueError(f"RunsWithoutGain.patience: expected >= 1, found {patience}")
        self.progress = Progress(rule)
        self.progress.known(known)
        self.patience = patience
        self.dry = 0
        """Results in a row that did not count."""

    def result(self, cost: float) -> None:
        self.dry = 0 if self.progress.incumbent(cost, 0.0) else self.dry + 1

    @property
    def stalled(self) -> bool:
        return self.dry >= self.patience


__all__ = ["DEFAULT_STALL", "Progress", "RunsWithoutGain", "StallRule"]
