"""The overlap-aware objective: solve, simulate, re-weigh, re-solve.

The solver's objective is additive. A plan ``x`` (a strategy per node) costs

    A(x) = sum_v c_v(x_v) + sum_(e = u->v) M_e(x_u, x_v)

but the step runs each redistribute beside the compute that does not need it yet. The step
predicted is the simulation (:mod:`autoshard.planning.simulate`)

    S(x) = A(x) - eta * H(x)

with ``H(x)`` the communication that perfect overlap hides and ``eta`` the profile's overlap
share (:attr:`costmodel.Profile.overlap`). ``S`` is not a sum over edges: what an edge hides
depends on what the whole plan queues on the one communication stream. So the objective follows
the simulation by rounds (:func:`refine`). Round 0 is the additive solve. Round ``r >= 1``, from
the plans ``x_0 .. x_{r-1}``:

    s_e   = min over q < r of slack_e(x_q)              (:func:`autoshard.planning.simulate.plan_slack`)
    M'_e  = M_e - eta * min(M_e, s_e)                   (:func:`reweighed`; forbidden stays so)
    x_r   = argmin sum_v c_v(x_v) + sum_e M'_e(x_u, x_v)
            subject to the same memory rows, pins and ties (a re-solve started from x_{r-1})

An edge costs in round ``r`` what it would expose with the slack it had in the plans before: a
parameter's gather prefetched behind the forward costs little, an activation's move that its
consumer waits for costs its whole time, a gradient's reduction beside the rest of the backward
what the backward left cannot hide. Slacks only shrink, so costs only rise from round to round:
a plan that counted on more overlap than one stream gives (gathers queued behind each other)
loses the discount in the next round. Rounds stop when a plan repeats (the re-weighing's fixed
point), when one gains less than ``MIN_GAIN`` of the step, after ``MAX_ROUNDS`` or when the time
is spent. The plan kept is the one of least ``S`` among every round's plan (a round's only where
``MIN_GAIN`` faster) and the candidates given (the hand-written plans the solve started from),
so the overlap-aware plan is never predicted slower than the additive plan or than them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

import numpy as np

import solver
from autoshard.planning.simulate import plan_slack, simulate_plan

log = logging.getLogger(__name__)

#: The most re-solves after the additive one (each re-weighs by every plan before it).
MAX_ROUNDS = 4
#: A round needs at least this many seconds left of the solve's time limit, and takes all that
#: is left: the solver's stall rule ends it (a round capped at the additive solve's own time, a
#: fraction of a second where the memory-free optimum is proved, has no time to repair the
#: re-weighed optimum into memory).
MIN_ROUND_SECONDS = 1.0
#: A round's plan replaces the best only when it is predicted this share faster (less is within
#: the model's error, and it trades a plan the additive objective prefers), and rounds stop at
#: the first that is not (later rounds trade ties among plans of equal additive cost; the first
#: takes nearly all of the gain).
MIN_GAIN = 0.01


def reweighed(problem: solver.Problem, slack: np.ndarray, share: float) -> solver.Problem:
    """``problem`` with each edge's matrix ``M`` replaced by ``M - share * min(M, slack_e)``
    (forbidden pairs stay forbidden)."""
    mats = []
    for m, s in zip(problem.edge_costs, slack):
        if s <= 0 or share <= 0:
            mats.append(m)
            continue
        cut = m - share * np.minimum(m, s)
        mats.append(np.where(m >= solver.FORBIDDEN, m, cut))
    return problem.with_edge_costs(mats)


def relaxed(problem: solver.Problem, share: float) -> solver.Problem:
    """``problem`` with every edge cost scaled by ``1 - share`` (forbidden pairs stay so): as a
    step hides at most ``share`` of its communication, ``S(x) >= sum_v c_v + (1 - share) *
    sum_e M_e``, so this problem's optimum bounds every plan's simulated step from below."""
    return reweighed(problem, np.full(len(problem.edge_costs), np.inf), share)  # every edge hides all it may


def refine(problem: solver.Problem, gp, first: solver.Solution, share: float,
           solve: Callable[[solver.Problem, float, list], solver.Solution], deadline: float,
           candidates: Sequence[tuple[str, np.ndarray]] = (), rounds: int = MAX_ROUNDS
           ) -> tuple[solver.Solution, dict]:
    """The plan of least simulated step (module doc) from ``first`` (the additive solve of
    ``problem``, a problem of ``gp``'s graph), re-solving with ``solve(problem, seconds, starts)``
    until ``deadline`` (``time.perf_counter()`` seconds), at most ``rounds`` times (0: the least
    simulated of ``first`` and the candidates). Returns the plan, its ``cost`` the additive
    objective of its choice, and a record: the share, each round's additive, simulated and
    re-weighed objective and seconds, where the kept plan came from, why the rounds stopped,
    and the kept plan's simulated step (``simulated_us``)."""

    def simulated(choice) -> float:
        return simulate_plan(gp, choice, share).step_us

    best, best_us = first, simulated(first.choice)
    done = [{"additive_us": round(float(first.cost), 3), "simulated_us": round(best_us, 3)}]
    record = {"share": share, "rounds": done, "kept": "round 0",
              "stopped": "no overlap to follow" if share <= 0 else "rounds off" if rounds <= 0 else ""}
    for name, choice in candidates:
        choice = np.asarray(choice)
        ev = solver.evaluate(problem, choice)
        us = simulated(choice)
        if ev.feasible and us < best_us:
            best, best_us = solver.Solution(choice, float(ev.cost), solver.Status.HEURISTIC,
                                            peak_usage=float(ev.peak_usage), backend=first.backend,
                                            stats=first.stats, source=f"start:{name}"), us
            record["kept"] = f"start:{name}"
    if share <= 0 or rounds <= 0:
        return _with_bound(best, first), {**record, "simulated_us": best_us}
    slack = plan_slack(gp, first.choice)
    seen = {first.choice.tobytes()}
    prev = first.choice
    record["stopped"] = f"{rounds} rounds"
    for r in range(1, rounds + 1):
        left = deadline - time.perf_counter()
        if left < MIN_ROUND_SECONDS:
            record["stopped"] = "time limit"
            break
        t0 = time.perf_counter()
        weighed = reweighed(problem, slack, share)
        sol = solve(weighed, left, [(f"overlap round {r - 1}", prev), *candidates])
        additive = float(solver.evaluate(problem, sol.choice).cost)
        us = simulated(sol.choice)
        done.append({"additive_us": round(additive, 3), "simulated_us": round(us, 3),
                     "objective_us": round(float(sol.cost), 3), "seconds": round(time.perf_counter() - t0, 3)})
        log.info(f"overlap round {r}: simulated {us / 1e3:.3f} ms, additive {additive / 1e3:.3f} ms "
                 f"(best so far {min(best_us, us) / 1e3:.3f} ms)")
        gain = best_us - us
        if gain >= MIN_GAIN * best_us:
            best = dataclasses.replace(sol, cost=additive, status=solver.Status.HEURISTIC,
                                       source=f"overlap round {r} ({sol.source})")
            best_us = us
            record["kept"] = f"round {r}"
        key = sol.choice.tobytes()
        if key in seen:
            record["stopped"] = "plan repeated"
            break
        if gain < MIN_GAIN * best_us:
            record["stopped"] = f"gain below {MIN_GAIN:.0%}"
            break
        seen.add(key)
        slack = np.minimum(slack, plan_slack(gp, sol.choice))
        prev = sol.choice
    return _with_bound(best, first), {**record, "simulated_us": best_us}


def _with_bound(best: solver.Solution, first: solver.Solution) -> solver.Solution:
    """``best`` with the additive solve's proved bound and its record (bounds on every plan's
    additive objective: a re-weighed solve's are not) and, where it is that solve's own plan,
    its status."""
    if best is first:
        return first
    return dataclasses.replace(best, lower_bound=first.lower_bound, stats=first.stats)


def additive_solve(plan) -> float:
    """The additive objective of the plan its solve found before the overlap rounds: what the
    solver's proved bounds (memory-free optima, a mesh shape's bound) are bounds of."""
    return plan.summary.overlap["rounds"][0]["additive_us"]
