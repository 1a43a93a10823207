"""Windowed MILPs (:mod:`solver.lns`) in a child process, beside the weight search (two cores).

On IOPDDL T the windows improve nearly every answer they are given (10 windows took a
weight-search answer from 9.56e11 to 8.60e11 in 39 s) but, run after the weight search,
they got only its last 15% of the time. Here they run on the second core from the weight
search's first answer on.

The child works by tasks, in the order they are given (:meth:`LnsChild.task`): move to the
task's answer where it is cheaper than the child's own, then run the task's number of
windows, then publish the result under the task's number (:meth:`LnsChild.result` waits for
it). Counted in windows, not seconds, what the child hands back is the same in every run,
where an answer taken up "when it came" and a best read "so far" would hang on how fast each
process had got.
Between tasks the child waits. Both directions go through files (:mod:`solver.child`).
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

#: How often the child looks for its next task, and the caller for a result (seconds).
POLL = 0.01


class LnsChild:
    """Window search in a child process from ``start``, for at most ``seconds`` (its guard)."""

    def __init__(self, problem: Problem, start: np.ndarray, seconds: float, seed: int = 1):
        self.child = Child("lns_child", (problem, np.asarray(start, dtype=np.int64), seconds, seed),
                           prefix="autoshard-lns-")
        self.tasks = 0

    def task(self, choice: np.ndarray | None, cost: float, windows: int) -> int:
        """Queue a task: move to ``choice`` (a feasible answer; None: stay) where it is cheaper than
        the child's own, then run ``windows`` windows. Returns the task's number."""
        if windows < 0:
            raise ValueError(f"windows: expected >= 0, found {windows}")
        self.tasks += 1
        choice = None if choice is None else np.asarray(choice, dtype=np.int64)
        write(self.child.folder / f"task-{self.tasks}.pkl", (choice, float(cost), int(windows)))
        return self.tasks

    def result(self, task: int, timeout: float) -> tuple[np.ndarray, float, dict] | None:
        """(choice, cost, counters) once task ``task`` is done, or None where it was not done within
        ``timeout`` seconds (or the child ran out of its own). Raises where the child failed."""
        if not 1 <= task <= self.tasks:
            raise ValueError(f"task: expected one of 1..{self.tasks}, found {task}")
        until = time.perf_counter() + timeout
        path = self.child.folder / f"result-{task}.pkl"
        while True:
            got = read(path)
            if got is not None:
                return got
            if self.child.wait(0) or time.perf_counter() >= until:
                return read(path)
            time.sleep(POLL)

    def best(self) -> tuple[np.ndarray, float, dict] | None:
        """(choice, cost, counters) of the child's last finished task, or None before its first."""
        self.child.wait(0)  # raises if the child failed
        return read(self.child.folder / "best.pkl")

    def close(self) -> None:
        self.child.close()


def _main(folder: str) -> None:
    folder = Path(folder)
    problem, start, seconds, seed = read(folder / "in.pkl")
    guard = time.perf_counter() + seconds
    search = WindowSearch(problem, start, seed=seed)
    restarts, task = 0, 0
    while time.perf_counter() < guard:
        got = read(folder / f"task-{task + 1}.pkl")
        if got is None:
            time.sleep(POLL)
            continue
        task += 1
        choice, cost, windows = got
        if choice is not None and cost < search.cost and evaluate(problem, choice).feasible:
            search.restart(choice)
            restarts += 1
        for _ in range(windows):
            # Each window gets its full time (the guard aside): a window cut by a deadline would
            # hang on the machine's speed.
            search.step(guard)
        result = (search.current, search.cost, {"windows": search.windows, "improved": search.improved,
                                                "restarts": restarts, "task": task, "cut": search.cut})
        write(folder / "best.pkl", result)
        write(folder / f"result-{task}.pkl", result)


if __name__ == "__main__":
    _main(sys.argv[1])
