"""toulbar2's search of the exact network (:mod:`solver.exact`) in a child process, watched.

toulbar2 holds the GIL for its whole search and reports nothing to Python until it ends,
so a search in the caller can only run to its time limit. In a child interpreter
(:mod:`solver.child`) its progress lines (``cfn.solve_tables(progress=True)``) come through
a pipe, and SIGVTALRM, the signal of toulbar2's own CPU timer, ends a search early with its
incumbent. The child runs two phases over the same network:

1. ``vns``: DGVNS, which finds good answers fast (the planner's 70B problem: 0.06% under
   60 s of branch and bound in 7 s; IOPDDL V: the proven optimum in 15 s), ended by the
   stall rule (:mod:`solver.stall`) on its incumbents, or at half of the time left;
2. ``hbfs``: branch and bound under the first phase's cost, which proves optimality where it
   can (a tight upper bound prunes), ended when proved, when stalled on incumbents and lower
   bounds (unless the caller wants the whole time), or at the deadline.

With more than ``lazy_rows`` memory rows, both post them as their answers break them
(:func:`solver.cfn.solve_lazy`: ``@phase NAME lazy``), and only the answers that hold every row
are reported (``Held solution: C``); bounds and proofs over the rows posted hold for all of them.

With ``restarts`` (the planner's solves) the first phase is DGVNS in rounds of that many restarts,
each ended by toulbar2's own branch and bound (:func:`solver.cfn.solve_lazy`): rounds end by
their work, not at a stall judged on a clock, so the answer is the same in every run unless the
time runs out; where a round proves its answer, branch and bound does not follow. A round that
runs out of ``ROUND_SHARE`` of DGVNS's time (``@clock``: LLaMA-70B's networks) turns DGVNS into
the search by the clock it is without rounds.

The caller (:class:`ExactChild`) reads the lines, keeps one :class:`solver.stall.Progress` per
phase and signals the child; the child writes its best answer after each phase (``out.pkl``).
A child may run one phase alone (``phases``).
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from solver import cfn
from solver.cfn import table_cost
from solver.child import Child, read, write
from solver.stall import Progress, StallRule

PHASES = ("vns", "hbfs")
#: Both phases post every memory row where there are at most this many (two rounds' worth of
#: :data:`solver.cfn.LAZY_ADD`: toulbar2 preprocesses 20 rows of LLaMA-70B's in 0.5 s), and
#: more only as their answers break them (225 of them: 4.2 s).
LAZY_ROWS = 2 * cfn.LAZY_ADD
#: Share of the time left that the first (no proof) phase may take at most.
VNS_SHARE = 0.5
#: DGVNS's restarts per round where its rounds are to end by their work (``ExactChild(restarts=)``):
#: one, then toulbar2's branch and bound under its answer. On the planner's 4-layer LLaMA on
#: (8, 8) the round proved the optimum with 10 of 204 memory rows posted in 1.8 s (two or three
#: restarts: the same answer, 1.7 s); LLaMA-70B's first round with 10 rows proved in 8 s (three: 29 s).
ROUND_RESTARTS = 1
#: Share of DGVNS's time a round ended by its work may take (:func:`solver.cfn.solve_lazy`'s
#: ``round_seconds``): past it, DGVNS runs on by the clock, under the stall rule, as without rounds.
ROUND_SHARE = 0.25
#: The largest network (cost-table entries, :attr:`solver.exact.ExactModel.entries`) whose DGVNS
#: runs in rounds ended by their work: LLaMA shapes with 4 layers on (8, 8) have 245k and their
#: rounds prove in 2 s; LLaMA-70B's (8, 8, 8) 1.3M, whose rounds run out and, unseeded, found
#: no plan where DGVNS by the clock with branch and bound beside it did. A rough proxy: 2-layer
#: LLaMA-8B corpus networks of 1.6-1.8M entries (``benchmarks/corpus``) proved in rounds in 9-25 s.
ROUND_MAX_ENTRIES = 600_000
_NUMBER = r"(-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)"
_SOLUTION = re.compile(rf"New solution: {_NUMBER}")
#: What a lazy phase (``@phase NAME lazy``) says of an answer that holds every memory row; its
#: toulbar2 lines' own answers may break rows that were not posted, and are not answers.
_HELD = re.compile(rf"Held solution: {_NUMBER}")
_BOUNDS = re.compile(rf"(?:Optimality gap|Initial lower and upper bounds): \[{_NUMBER}, {_NUMBER}\]")
_PREPROCESSED = re.compile(rf"Preprocessing time: {_NUMBER} seconds")


@dataclass
class ExactAnswer:
    picked: list[int] | None
    """One value index per network variable, or None when the searches found nothing."""
    proved: bool
    """``picked`` (or, when None, the given upper bound's choice) is optimal."""
    gap: float
    """How far the answer can be above the optimum (cost units), inf when unknown."""
    phases: list[dict] = field(default_factory=list)
    """Per phase: method, seconds, how it ended, best cost seen."""
    lower: float = -math.inf
    """A bound on every answer's network cost that branch and bound's lines showed (rounding
    slack taken off), -inf when none: it holds even where the search found no answer."""
    others: list = field(default_factory=list)
    """Answers found before ``picked`` (a lazy search's, each holding every row), dearest first."""


def search_again(ans: ExactAnswer, upper: float, best: float, rule: StallRule) -> bool:
    """Whether branch and bound, ended unproved under ``upper``, is worth starting again under
    the ``best`` answer found since: that answer must count as progress by the stall rule's
    measure (``gain`` below ``upper``) and the network must post and preprocess within
    ``min_seconds``, the shortest wait the stall rule grants (LLaMA-70B's takes 5 s: not again)."""
    posted = [ph.get("preprocess_s") for ph in ans.phases if ph.get("method") == "hbfs"]
    return (not ans.proved and math.isfinite(best) and best <= upper - rule.gain * abs(upper)
            and bool(posted) and posted[-1] is not None and posted[-1] < rule.min_seconds)


def combine(first: ExactAnswer, second: ExactAnswer) -> ExactAnswer:
    """Two branch-and-bound answers as one: the second's where it proved or found an answer
    (it searched under a lower cost), else the first's answer with the higher bound; phases of both."""
    phases = first.phases + second.phases
    if not (second.proved or second.picked is not None):
        second = replace(second, picked=first.picked, gap=first.gap)
    return replace(second, phases=phases, lower=max(first.lower, second.lower))


class ExactChild:
    """The two phases in a child process; :meth:`run` watches it until it ends."""

    def __init__(self, model, upper: float | None, seconds: float, phases: tuple[str, ...] = PHASES,
                 lazy_rows: int = LAZY_ROWS, restarts: int | None = None):
        """``lazy_rows``: with more memory rows than this, the phases post them as their answers
        break them (:func:`solver.cfn.solve_lazy`). ``restarts``: DGVNS runs in rounds of that
        many restarts, each ended by its own branch-and-bound tail (:func:`solver.cfn.solve_lazy`),
        and is not stopped by the stall rule, only by the time: where it ends by its work, its
        answer is the same in every run (issue "reproducible solves")."""
        if not phases or any(p not in PHASES for p in phases):
            raise ValueError(f"phases: expected some of {PHASES} in order, found {phases!r}")
        self.scale = model.scale
        self.phases = tuple(phases)
        self.rounding = cfn.rounding_slack(len(model.costs) + len(model.tables), model.scale)
        self.upper = math.inf if upper is None else upper
        self.restarts = restarts
        self.child = Child("exact_child", (model.costs, model.tables, model.rows, model.scale, upper, seconds,
                                           self.phases, lazy_rows, restarts),
                           prefix="autoshard-exact-", watch=True)

    def run(self, deadline: float, rule: StallRule, stop_when_stalled: bool = True, log=None,
            known: float = math.inf, beside=None, on_answer=None) -> ExactAnswer:
        """Watch the child until it ends (signalled at each phase's stall, judged on the child's
        CPU seconds, or at its wall-clock deadline, killed a few seconds past ``deadline``); its
        answer. ``known``: a cost found meanwhile by another
        search (branch and bound beside DGVNS, watched after it): only answers below it, and
        bounds closing the gap to it, are progress. ``beside()``: a child searching at the same
        time (or None), whose end (branch and bound proved, or its deadline) ends this one's
        phase too. ``on_answer(cost)``: called on each answer the child reports. DGVNS in
        rounds (``restarts``) is signalled at a stall only once its rounds ran out of their share
        (``@clock``), else only at its share of the time; branch and bound only with
        ``stop_when_stalled``."""
        phase, progress, phase_end, signalled, stats = None, None, math.inf, 0.0, []
        lazy = False  # the phase posts its memory rows lazily: only "Held solution" lines are answers
        clocked = False  # DGVNS's rounds ran out of their share (``@clock``): it runs on by the clock
        # With no answer known, DGVNS by the clock ends at its first: branch and bound takes it from there.
        first_only = self.restarts is not None and math.isinf(self.upper) and "hbfs" in self.phases
        best = min(self.upper, known)
        lower_seen = -math.inf  # branch and bound's best bound line (the child may be stopped before its gap)
        own = math.inf  # the child's own best answer: what it writes back (``best`` may be the upper bound)
        ended = False
        while not ended:
            # ``t``: the child's CPU seconds when the line came, the clock of its progress (work:
            # the same in every run, :mod:`solver.child`); ``wall``: for the deadlines.
            wall, t, line = self.child.timed_line(timeout=0.1) or (time.perf_counter(), self.child.cpu(), "")
            if line is None:
                ended = True
            elif line.startswith("@phase "):
                phase, lazy, clocked = line.split()[1], "lazy" in line.split()[2:], False
                progress, signalled = Progress(rule), 0.0
                progress.begin(t)
                if phase == "hbfs":
                    # Branch and bound under DGVNS's answer finds that answer again: only a
                    # better one is progress (LLaMA-70B: 7 s were waited out after the re-find).
                    progress.known(best)
                else:
                    # DGVNS's first answer is progress whatever it costs (it may take seconds
                    # to post the network); bounds close the gap to the best answer known.
                    progress.best = best
                left = deadline - wall
                # DGVNS leaves time for the branch and bound that follows it in this child.
                phase_end = wall + _vns_share(self.phases, self.restarts, self.upper) * left if phase == "vns" \
                    else deadline
                stats.append({"method": phase, "start": wall, "ended": "finished", "best": None})
            elif line.startswith("@clock") and stats:
                # DGVNS's rounds ran out of their share: it runs on by the clock, under the stall rule.
                stats[-1]["clock"] = clocked = True
            elif line.startswith("@end ") and stats:
                stats[-1]["seconds"] = round(wall - stats[-1].pop("start"), 3)
                phase = None
            elif phase is not None and (m := (_HELD if lazy else _SOLUTION).search(line)):
                own = min(own, float(m.group(1)) / self.scale)
                progress.incumbent(own, t)
                stats[-1]["best"] = best = progress.best
                if on_answer is not None:
                    on_answer(best)
            elif phase is not None and (m := _PREPROCESSED.search(line)):
                stats[-1]["preprocess_s"] = float(m.group(1))
                mark_ready(phase, progress, best, t)
            elif line.startswith("@round"):  # a lazy search's round ended (its first: the network posted)
                mark_ready(phase, progress, best, t)
            elif phase == "hbfs" and (m := _BOUNDS.search(line)):
                lower_seen = max(lower_seen, float(m.group(1)) / self.scale)
                progress.bound(lower_seen, t)
            now = time.perf_counter()
            # Lines queued while this child was not watched (while the caller ran the
            # hand-written plans) are read first: judged mid-backlog, a search looked
            # stalled at ``now`` by events it had already reported.
            if self.child.pending() and now <= deadline + 5.0:
                continue
            if phase is not None and now - signalled > 1.0:
                why, work = None, self.child.cpu()
                if now >= phase_end:
                    why = "time"
                elif phase == "vns" and clocked and first_only and math.isfinite(own):
                    # Its first answer is what branch and bound needs to prune (LLaMA-70B unseeded:
                    # DGVNS's first, 1.94e7, came after 16 s; branch and bound under it found 5.58e6).
                    why = "first answer, for branch and bound"
                elif progress.stalled(work) and (phase == "vns" and (self.restarts is None or clocked)
                                                 or phase == "hbfs" and stop_when_stalled):
                    why = "stalled"
                elif phase == "hbfs" and stop_when_stalled and progress.proof_out_of_reach(work):
                    why = "proof out of reach"
                elif beside is not None and (other := beside()) is not None and other.ended():
                    why = "the search beside ended"
                if why:
                    if not signalled:
                        stats[-1]["ended"] = why
                        if log:
                            log(f"exact ({phase}): {why}, best {progress.best:.6g}")
                    # Again each second: a signal that came while the phase was still posting
                    # its network is ignored there. The file ends a lazy search between rounds.
                    (self.child.folder / f"stop-{phase}").touch()
                    os.kill(self.child.proc.pid, signal.SIGVTALRM)
                    signalled = now
            if now > deadline + 5.0:  # a search deaf to its signal: its last phase's answer stands
                break
        for s in stats:
            s.pop("start", None)
        if ended:
            self.child.wait(timeout=5.0)  # raises when the child failed
        out = read(self.child.folder / "out.pkl")
        self.child.close()
        lower = lower_seen - 2 * self.rounding
        if out is None:
            return ExactAnswer(None, False, math.inf, stats, lower)
        picked, proved, gap, others = out
        if picked is not None and math.isfinite(lower_seen) and math.isfinite(own):
            # Branch and bound stopped before its gap line still bounds the optimum by its bound
            # lines. The gap is the child's own answer's (the one written back), never that of a
            # cheaper answer found beside it: measured from DGVNS's 5.974e6 it once made
            # 70B's 6.016e6 answer claim a 5.938e6 bound where the search had shown 5.896e6.
            # Both figures are rounded costs: each may be off by the rounding slack.
            gap = min(gap, max(0.0, own - lower_seen) + 2 * self.rounding)
        return ExactAnswer(picked, proved, gap, stats, lower, others)

    def ended(self) -> bool:
        """Whether the child process has exited."""
        return self.child.proc.poll() is not None

    def close(self) -> None:
        self.child.close()


def mark_ready(phase: str | None, progress: Progress | None, best: float, t: float) -> None:
    """DGVNS from a given answer reports only better ones: where the rule says so
    (:attr:`StallRule.from_ready`) and none comes, its patience runs from when it was ready, not
    to its share of the time (LLaMA-8B on (2, 4, 8), the overlap rounds' solves: 6.7 and 7.7 s
    each, nothing found)."""
    if phase == "vns" and progress is not None and math.isfinite(best) and progress.rule.from_ready:
        progress.ready(t)


def _vns_share(phases: tuple[str, ...], restarts: int | None, upper: float) -> float:
    """DGVNS's share of the time left when it begins: all of it where no branch and bound follows,
    and in rounds (``restarts``) where no answer is known yet (``upper`` inf), since branch and
    bound without an upper bound finds nothing on the planner's networks (LLaMA-70B unseeded: its
    first answer holding every row came after 16 s, and with half the time the plan was
    "infeasible"); else :data:`VNS_SHARE`."""
    if "hbfs" not in phases or restarts is not None and math.isinf(upper):
        return 1.0
    return VNS_SHARE


def _main(folder: str) -> None:
    # Outside a search, a late stop signal must not end the process (its default action).
    signal.signal(signal.SIGVTALRM, signal.SIG_IGN)
    costs, tables, rows, scale, upper, seconds, phases, lazy_rows, restarts = read(Path(folder) / "in.pkl")
    t0 = time.perf_counter()
    best, proved, gap = None, False, math.inf
    others: list = []  # answers before the best (a lazy search's): the caller ranks them too
    for method in phases:
        left = seconds - (time.perf_counter() - t0)
        if left < 1:
            break
        lazy = len(rows) > lazy_rows
        # DGVNS in rounds of bounded restarts (the rows all posted where they are few) reports,
        # as a lazy search does, only the answers that hold every row.
        rounds = method == "vns" and restarts is not None
        print(f"@phase {method}{' lazy' if lazy or rounds else ''}", flush=True)
        # DGVNS's share of the time (the caller's deadline for it).
        phase_s = _vns_share(phases, restarts, math.inf if upper is None else upper) * left if method == "vns" else left
        if lazy or rounds:
            def said(cost: float, posted: int, picked: list[int]) -> None:
                # Scaled, as toulbar2 says its answers: these hold every row.
                print(f"Held solution: {cost * scale:.0f} ({posted} of {len(rows)} memory rows posted)", flush=True)
                others.append(picked)

            def stop(path=Path(folder) / f"stop-{method}") -> bool:
                # Between rounds toulbar2's handler is still installed: a late signal must not
                # reach it outside a search.
                signal.signal(signal.SIGVTALRM, signal.SIG_IGN)
                return path.exists()

            # Branch and bound shows its bound lines (they hold with any rows posted); DGVNS's
            # restarts would show one first answer each.
            picked, proved, gap = cfn.solve_lazy(costs, tables, left, scale, upper, rows, on_answer=said, stop=stop,
                                                 method=method, progress=method == "hbfs",
                                                 restarts=restarts if rounds else None,
                                                 posted=() if lazy else range(len(rows)),
                                                 round_seconds=ROUND_SHARE * phase_s,
                                                 on_clock=lambda: print("@clock", flush=True),
                                                 on_round=lambda: print("@round", flush=True))
        else:
            picked, proved, gap = cfn.solve_tables(costs, tables, left, scale, upper, rows, method=method,
                                                   progress=True)
        signal.signal(signal.SIGVTALRM, signal.SIG_IGN)  # toulbar2's handler stays installed after a search
        sys.stdout.flush()
        if picked is not None:
            best, upper = picked, table_cost(costs, tables, picked)
        write(Path(folder) / "out.pkl", (best, proved, gap, [p for p in others if p is not best]))
        print(f"@end {method}", flush=True)
        if proved:
            break
    if not (Path(folder) / "out.pkl").exists():
        write(Path(folder) / "out.pkl", (None, False, math.inf, []))


if __name__ == "__main__":
    _main(sys.argv[1])
