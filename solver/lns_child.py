"""Windowed MILPs (:mod:`solver.lns`) in a child process, beside the weight search (two cores).

On IOPDDL T the windows improve nearly every answer they are given (10 windows took a
weight-search answer from 9.56e11 to 8.60e11 in 39 s) but, run after the weight search,
they got only its last 15% of the time. Here they run on the second core, as jobs: the caller
:meth:`LnsChild.post` s an answer and a number of windows; the child takes the jobs in the
order they were posted, moves to a job's answer where it is cheaper than its own, runs exactly
that many windows and writes its answer after each job; the caller reads job k's answer
(:meth:`LnsChild.result`, which waits for it) only at fixed points of its own work. What the
child searches and when the caller sees it therefore hang on work, not on which process ran
faster: taking offers between windows as they came and reading the child's best whenever the
caller looked made IOPDDL T's answers 3% apart from run to run (issue "reproducible solves").
Both directions go through files (:mod:`solver.child`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from solver.child import Child, read, write
from solver.evaluate import evaluate
from solver.lns import WindowSearch
from solver.problem import Problem

#: How often (seconds) the child looks for its next job, and the caller for an answer.
POLL = 0.005


class LnsChild:
    """Window search in a child process, job by job, for at most ``seconds`` (the wall-clock guard)."""

    def __init__(self, problem: Problem, seconds: float, seed: int = 1):
        self.child = Child("lns_child", (problem, seconds, seed), prefix="autoshard-lns-")
        self.posted = 0
        """Jobs posted so far; they are numbered from 1."""

    def post(self, choice: np.ndarray, cost: float, windows: int) -> int:
        """Give the child a job: move to ``choice`` (feasible, of ``cost``) where it is cheaper than
        its own answer, then run ``windows`` windows. Returns the job's number."""
        self.posted += 1
        write(self.child.folder / f"job-{self.posted}.pkl", (np.asarray(choice, dtype=np.int64), float(cost),
                                                             int(windows)))
        return self.posted

    def result(self, job: int, until: float) -> tuple[np.ndarray, float, dict] | None:
        """(choice, cost, counters) of the child's answer after ``job``, waiting for it until the
        wall clock reaches ``until``; None where it did not come by then (the guard) or the child
        has ended without it."""
        path = self.child.folder / f"done-{job}.pkl"
        while True:
            got = read(path)
            if got is not None:
                return got
            if self.child.wait(0) or time.perf_counter() >= until:  # raises if the child failed
                return read(path)
            time.sleep(POLL)

    def close(self) -> None:
        self.child.close()


def _main(folder: str) -> None:
    folder = Path(folder)
    problem, seconds, seed = read(folder / "in.pkl")
    deadline = time.perf_counter() + seconds
    search, done, restarts = None, 0, 0
    while time.perf_counter() < deadline:
        job = read(folder / f"job-{done + 1}.pkl")
        if job is None:
            time.sleep(POLL)
            continue
        choice, cost, windows = job
        if search is None:
            search = WindowSearch(problem, choice, seed=seed)
        elif cost < search.cost and evaluate(problem, choice).feasible:
            search.restart(choice)
            restarts += 1
        for _ in range(windows):
            search.step(deadline)
        done += 1
        write(folder / f"done-{done}.pkl", (search.current, search.cost,
                                            {"windows": search.windows, "improved": search.improved,
                                             "restarts": restarts, "jobs": done}))


if __name__ == "__main__":
    _main(sys.argv[1])
