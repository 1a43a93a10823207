"""The MILP in a child process, beside toulbar2's exact search in the caller (two cores).

toulbar2 cannot be interrupted once it searches, and HiGHS only looks at its interrupt
callbacks between phases (LLaMA-70B on (8, 8, 8): 13 s of presolve without one). So
the caller runs toulbar2, whose model it has built anyway, and the MILP runs here, where
the caller can kill it the moment toulbar2 proves optimality, or read its answer at the
end. The child gets the problem without its edges plus the tie reductions already made
(:class:`solver.highs_model.Reduced`): ~60 MB for LLaMA-70B instead of ~1 GB of edge
matrices. It runs in a fresh interpreter (:mod:`solver.child`).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from solver import highs_model
from solver.child import Child, read, write
from solver.problem import Problem, ProvedInfeasible
from solver.stall import DEFAULT_STALL, Progress, StallRule

#: Seconds a child asked to stop may take to hand in its answer before it is given up.
STOP_GRACE = 3.0


@dataclass(frozen=True)
class MilpAnswer:
    choice: np.ndarray | None
    lower: float | None
    optimal: bool
    stats: dict
    too_large: str = ""
    """Why the model was not built (it would pass the nonzero budget); empty when it was."""
    infeasible: str = ""
    """The builder's proof that nothing is feasible (:class:`solver.problem.ProvedInfeasible`)."""


def without_edges(problem: Problem) -> Problem:
    """``problem`` with no edges: what :func:`highs_model.build` reads once ``reduced`` is given."""
    return replace(problem, edges=np.zeros((0, 2), dtype=np.int64), edge_costs=[])


def run(problem: Problem, reduced, start, seconds: float, mip_gap: float, max_nonzeros: float,
        stop=None, report=None) -> MilpAnswer:
    """Build and solve the MILP (memory rows included) within ``seconds`` (see
    :func:`highs_model.solve_model` for ``stop`` and ``report``)."""
    t0 = time.perf_counter()
    try:
        model = highs_model.build(problem, max_nonzeros=max_nonzeros, memory=True, reduced=reduced)
    except highs_model.ModelTooLarge as exc:
        return MilpAnswer(None, None, False, {}, too_large=str(exc))
    except ProvedInfeasible as exc:
        return MilpAnswer(None, None, False, {}, infeasible=str(exc))
    choice, lower, optimal = highs_model.solve_model(model, problem.num_nodes, t0 + seconds - time.perf_counter(),
                                                     mip_gap, start, stop=stop, report=report)
    return MilpAnswer(choice, lower, optimal, model.stats)


class MilpChild:
    """:func:`run` in a child process; :meth:`answer` waits for it, :meth:`close` kills it."""

    def __init__(self, problem: Problem, reduced, start, seconds: float, mip_gap: float, max_nonzeros: float):
        self.child = Child("milp_child", (without_edges(problem), reduced, start, seconds, mip_gap, max_nonzeros),
                           prefix="autoshard-milp-", watch=True)
        self._answer: MilpAnswer | None = None

    def answer(self, until: float, stall: StallRule | None = None, since: float | None = None,
               best: float = math.inf, best_bound: float = -math.inf) -> MilpAnswer | None:
        """The child's answer, waiting until the time ``until`` at most, or (with ``stall``)
        until its search stops paying, counted from ``since`` (when it started): then it is
        asked to stop and hand in its incumbent. Where it never reported an answer below
        ``best`` (the caller's), its last reported bound is the answer (no choice), at once.
        None when it had nothing by then.

        The caller's answer ``best`` and bound ``best_bound`` (found beside this search) are
        where its progress is measured from: only an incumbent below ``best`` or a bound that
        closes the gap above ``best_bound`` counts. A MILP that spent its time building and
        then reported bounds weaker than the caller's was waited on for as long again (24 s
        of LLaMA-70B's 64 s plan)."""
        progress = Progress(stall or DEFAULT_STALL)
        bound = None
        t_first = time.perf_counter() if since is None else since
        progress.begin(t_first, counts=True)
        progress.known(best, best_bound)
        asked, reported = None, False
        while self._answer is None:
            if self.child.proc.poll() is not None:
                self.child.wait(0)  # raises when it failed
                self._answer = read(self.child.folder / "out.pkl")
                if self._answer is None:
                    raise RuntimeError("the MILP's child process exited without an answer")
                break
            got = self.child.line(timeout=0.1)
            now = time.perf_counter()
            if got is not None and got[1]:
                kind, _, value = got[1].partition(" ")
                reported = True
                if kind == "@incumbent":
                    progress.incumbent(float(value), got[0])
                elif kind == "@bound":
                    progress.bound(float(value), got[0])
                    bound = float(value)
            if asked is None and (now >= until or (stall is not None and progress.stalled(now))):
                if progress.best >= best - 1e-9 * abs(best):  # its answer cannot win: no wind-down
                    return MilpAnswer(None, bound, False, {})
                (self.child.folder / "stop").touch()
                asked = now
            # Deaf to it (in presolve, where HiGHS calls nothing back): no answer. A child that
            # never reported is taken to be there after a second.
            if asked is not None and now - asked > (STOP_GRACE if reported else 1.0):
                return None
        return self._answer

    def close(self) -> None:
        self.child.close()


def _main(folder: str) -> None:
    problem, reduced, start, seconds, mip_gap, max_nonzeros = read(Path(folder) / "in.pkl")
    # Through the module's own name: run as ``__main__``, its answers would pickle as
    # ``__main__.MilpAnswer``, which the caller cannot load.
    from solver import milp_child

    stop_file, asked = Path(folder) / "stop", {"at": 0.0, "stop": False}

    def stop() -> bool:
        # HiGHS asks at every simplex iteration: look at the file a few times a second.
        now = time.perf_counter()
        if not asked["stop"] and now - asked["at"] >= 0.2:
            asked["at"], asked["stop"] = now, stop_file.exists()
        return asked["stop"]

    def report(kind: str, value: float) -> None:
        print(f"@{kind} {value!r}", flush=True)

    write(Path(folder) / "out.pkl", milp_child.run(problem, reduced, start, seconds, mip_gap, max_nonzeros,
                                                   stop=stop, report=report))


if __name__ == "__main__":
    _main(sys.argv[1])
