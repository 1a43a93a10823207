"""The overlap-aware objective in the planner: windows, their solve, and the plan kept.

The solver's additive objective ``A(x)`` counts every redistribute's time; the step the plan
reports is the simulation (:mod:`autoshard.planning.simulate`), where a redistribute beside
compute costs what it leaves exposed. With ``overlap_objective`` (the default) the plan
minimizes the windows' objective (:mod:`solver.overlap`)

    F(x) = A(x) + sum_w (S_w(x) - C_w(x)) - eta * sum_w min(S_w(x), H_w(x))

over the windows of the run (:mod:`autoshard.planning.windows`: a layer's forward, its backward;
``C_w`` what each computes, ``S_w = max(C_w, I_w)`` how long it lasts, at least its ops' host
issue time ``I_w``, and ``H_w`` what may run beside it), with ``eta`` the profile's overlap
share, the same share the simulation prices contention with. :func:`follow` runs it from the additive solve's
answer; the plan kept is the one of least *simulated* step among the additive answer, the
windows' best few (by ``F``) and the candidates given (hand-written plans, the solve's pool), so
the plan is never predicted slower than the additive one or than them.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

import numpy as np

import solver
import solver.overlap
from autoshard.planning.simulate import simulate_plan

log = logging.getLogger(__name__)

#: Plans of the windows' solve that are simulated (least ``F`` first): ``F`` ranks plans a few
#: percent apart rightly, the simulation (0.1 s a plan on LLaMA-8B, 0.5 s on 70B) settles the rest.
SIMULATED = 4
#: The most rounds of the windows' solve weighed by the kept plan's walk (:func:`_walked`), and
#: the most solves in each: they propose plans for the simulation to judge, not proofs.
WALKED_ROUNDS = 2
WALKED_SOLVES = 2


def relaxed(problem: solver.Problem, share: float) -> solver.Problem:
    """``problem`` with every edge cost scaled by ``1 - share`` (forbidden pairs stay so): as a
    step hides at most ``share`` of its communication, ``S(x) >= sum_v c_v + (1 - share) *
    sum_e M_e``, so this problem's optimum bounds every plan's simulated step (and ``F``) from
    below."""
    mats = [np.where(m >= solver.FORBIDDEN, m, m * (1.0 - share)) if share > 0 else m for m in problem.edge_costs]
    return problem.with_edge_costs(mats)


def follow(problem: solver.Problem, gp, first: solver.Solution, share: float,
           windows: solver.OverlapWindows | None, solve: Callable[[solver.Problem, float, list], solver.Solution],
           deadline: float, candidates: Sequence[tuple[str, np.ndarray]] = (),
           simulated: Callable[[np.ndarray], float] | None = None, stall: int = solver.overlap.STALL
           ) -> tuple[solver.Solution, dict]:
    """The plan of least simulated step (module doc) from ``first`` (the additive solve of
    ``problem``, a problem of ``gp``'s graph): with ``windows``, their objective minimized by
    :func:`solver.solve_windows` (``solve(problem, seconds, starts)`` solves each additive
    problem it weighs) until ``deadline`` (``time.perf_counter()`` seconds); then ``first``,
    those plans and ``candidates`` ranked by simulated step. Returns the plan, its ``cost`` the
    additive objective of its choice, and a record: the share, the additive solve's objective
    and simulated step, the windows' solve (its solves, why it stopped, its best ``F`` and
    lower bound), where the kept plan came from and its simulated step (``simulated_us``) and
    ``F`` (``objective_us``). ``stall``: the decomposition's solves without a better plan
    after which it stops. ``simulated(choice)``: a plan's simulated step (default
    :func:`~autoshard.planning.simulate.simulate_plan` at ``share``; a caller's cache). With
    ``windows``, the windows' objective is then weighed by what the kept plan's walk hides
    (:func:`_walked`)."""
    record: dict = {"share": share, "additive_us": round(float(first.cost), 3), "additive_status": first.status.value}
    ranked: list[tuple[str, np.ndarray]] = list(candidates)
    if windows is not None:
        starts = [("additive optimum", first.choice), *candidates]
        answer = solver.solve_windows(problem, windows, solve, deadline, starts=starts, stall=stall)
        ranked = answer.candidates[:SIMULATED] + ranked
        record.update(windows=len(windows), window_layers=int(sum(windows.count)), solves=answer.record,
                      stopped=answer.stopped, objective_best_us=round(answer.cost, 3),
                      dual_us=None if answer.lower_bound is None else round(answer.lower_bound, 3))

    if simulated is None:
        def simulated(choice) -> float:
            return simulate_plan(gp, choice, share).step_us

    best, best_us = first, simulated(first.choice)
    record["additive_simulated_us"] = round(best_us, 3)
    kept, seen = "additive optimum", {first.choice.tobytes()}

    def rank(plans) -> bool:
        """The plans of ``plans`` not seen before simulated; whether one is kept."""
        nonlocal best, best_us, kept
        found = False
        for name, choice in plans:
            choice = np.asarray(choice)
            if choice.tobytes() in seen:
                continue
            seen.add(choice.tobytes())
            ev = solver.evaluate(problem, choice)
            if not ev.feasible:
                continue
            us = simulated(choice)
            if _before((us, float(ev.cost), choice), (best_us, float(best.cost), best.choice)):
                # The additive solve's bound and record stay: bounds of every plan's additive objective.
                best = solver.Solution(choice, float(ev.cost), solver.Status.HEURISTIC, lower_bound=first.lower_bound,
                                       peak_usage=float(ev.peak_usage), backend=first.backend, stats=first.stats,
                                       source=name)
                best_us, kept, found = us, name, True
        return found

    rank(ranked)
    if windows is not None:
        # The walked rounds get 6 times the decomposition's longest solve, not what is left of the
        # limit: they propose plans for the simulation to judge (LLaMA-70B: 40 s were left).
        longest = max((r["seconds"] for r in answer.record), default=solver.overlap.MIN_ORACLE_SECONDS)
        until = min(deadline, time.perf_counter() + 3 * WALKED_SOLVES * longest)
        record["walked"] = _walked(problem, gp, windows, answer.weighing, lambda: best, solve, until, rank,
                                   lambda: best_us)
    record.update(kept=kept, simulated_us=best_us)
    if windows is not None:
        objective = windows.cost(problem, best.choice)
        record["objective_us"] = round(objective, 3)
        # Proved optimal only for the objective it minimizes: within the decomposition's gap of
        # its proved lower bound.
        dual = answer.lower_bound
        proved = dual is not None and objective <= dual + solver.overlap.GAP * abs(objective)
        best = dataclasses.replace(best, status=solver.Status.OPTIMAL if proved else solver.Status.HEURISTIC)
        log.info(f"overlap objective: kept {kept}, simulated {best_us / 1e3:.3f} ms "
                 f"(additive optimum {record['additive_simulated_us'] / 1e3:.3f} ms)")
    return best, record


def _walked(problem, gp, windows, weighing, best, solve, deadline, rank, best_us) -> list[dict]:
    """Rounds of the windows' solve with each window's share the kept plan's walk shows
    (:func:`autoshard.planning.windows.walk_shares`), from that plan; each round's best few
    ranked by simulated step (``rank``). ``F`` assumes a window hides ``eta`` of what it may; the
    walk runs one communication stream in issue order, so a window whose gathers queue behind
    its reductions hides less (Mixtral's expert layers' backward: next to none), and ``F`` then
    prefers plans whose communication there is hidden only on paper. Weighed by the walk, the
    round prices that communication at what it costs the step, and proposes plans that move less
    there. The walk's shares are those of one plan: a round's answers are judged by their own
    simulated steps, and the rounds go on from each plan kept until one keeps none, ``F`` no
    longer understates the kept plan's step, the shares are the objective's (to ``GAP`` of the
    step) or :data:`WALKED_ROUNDS` ran. Returns per round
    its shares' least and mean, its solves, why it stopped and the step it kept."""
    from autoshard.planning.windows import walk_shares

    rounds: list[dict] = []
    for _ in range(WALKED_ROUNDS):
        terms = windows.terms(problem, best().choice)
        objective = windows.value(*terms)
        if objective >= best_us():
            break  # F does not understate the step: no window hides on paper what the walk does not
        shares = walk_shares(gp, windows, best().choice)
        weighed = windows.with_shares(shares)
        understated = weighed.value(*terms) - objective
        out_of_time = time.perf_counter() > deadline - solver.overlap.MIN_ORACLE_SECONDS
        if understated <= solver.overlap.GAP * best_us() or out_of_time:
            break
        answer = solver.solve_windows(problem, weighed, solve, deadline, starts=[("kept", best().choice)], stall=1,
                                      max_solves=WALKED_SOLVES, weighing=weighing)
        kept = rank([(f"walked {len(rounds) + 1} {name}", choice) for name, choice in answer.candidates[:SIMULATED]])
        rounds.append({"least_share": round(float(shares.min()), 3), "mean_share": round(float(shares.mean()), 3),
                       "understated_us": round(understated, 3), "solves": len(answer.record),
                       "stopped": answer.stopped, "simulated_us": round(best_us(), 3)})
        if not kept:
            break
    return rounds


def _before(a: tuple[float, float, np.ndarray], b: tuple[float, float, np.ndarray]) -> bool:
    """Whether plan ``a`` = (simulated step, additive cost, choice) is kept over ``b``: a shorter
    step; at an equal one (to 1e-9 relative) a smaller additive cost; at both equal the choice
    first in byte order. The last two make the plan kept among equals the same whatever order
    the searches offered them in (equal-cost optima, reached from different bounds, made
    different plan files of the same inputs)."""
    tol = 1e-9 * max(abs(a[0]), abs(b[0]), 1.0)
    if abs(a[0] - b[0]) > tol:
        return a[0] < b[0]
    if abs(a[1] - b[1]) > 1e-9 * max(abs(a[1]), abs(b[1]), 1.0):
        return a[1] < b[1]
    return a[2].tobytes() < np.asarray(b[2]).tobytes()


def additive_solve(plan) -> float:
    """The additive objective of the plan its solve found before the overlap objective: what the
    solver's proved bounds (memory-free optima, a mesh shape's bound) are bounds of."""
    return plan.summary.overlap["additive_us"]
