"""Windowed MILPs (:mod:`solver.lns`) in a child process, beside the weight search (two cores).

On IOPDDL T the windows improve nearly every answer they are given (10 windows took a
weight-search answer from 9.56e11 to 8.60e11 in 39 s) but, run after the weight search,
they got only its last 15% of the time. Here they run the whole time on the second core:
the caller :meth:`LnsChild.offer` s each cheaper answer it finds, the child moves to it
when it is cheaper than its own (between two windows), and :meth:`LnsChild.best` reads
the child's best so far. Both directions go through files (:mod:`solver.child`).
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


class LnsChild:
    """Window search in a child process from ``start`` for ``seconds``."""

    def __init__(self, problem: Problem, start: np.ndarray, seconds: float, seed: int = 1):
        self.child = Child("lns_child", (problem, np.asarray(start, dtype=np.int64), seconds, seed),
                           prefix="autoshard-lns-")
        self.offers = 0

    def offer(self, choice: np.ndarray, cost: float) -> None:
        """Hand the child a feasible answer; it moves there if it is cheaper than its own."""
        self.offers += 1
        write(self.child.folder / "offer.pkl", (self.offers, np.asarray(choice, dtype=np.int64), float(cost)))

    def best(self) -> tuple[np.ndarray, float, dict] | None:
        """(choice, cost, counters) of the child's best answer so far, or None before its first."""
        self.child.wait(0)  # raises if the child failed
        return read(self.child.folder / "best.pkl")

    def close(self) -> None:
        self.child.close()


def _main(folder: str) -> None:
    folder = Path(folder)
    problem, start, seconds, seed = read(folder / "in.pkl")
    deadline = time.perf_counter() + seconds
    search = WindowSearch(problem, start, seed=seed)
    seen, restarts = 0, 0

    def publish():
        write(folder / "best.pkl", (search.current, search.cost,
                                    {"windows": search.windows, "improved": search.improved, "restarts": restarts}))

    publish()
    while deadline - time.perf_counter() > 0.5:
        offer = read(folder / "offer.pkl")
        if offer is not None and offer[0] > seen:
            seen = offer[0]
            if offer[2] < search.cost and evaluate(problem, offer[1]).feasible:
                search.restart(offer[1])
                restarts += 1
                publish()
        if search.step(deadline):
            publish()
    publish()


if __name__ == "__main__":
    _main(sys.argv[1])
