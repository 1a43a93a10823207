r"""Merge search: the best answer that takes, node by node, a strategy one of several answers took.

Given a feasible answer ``F`` and others ``O^1 .. O^r`` (any: typically penalty rounds'
answers, cheaper than F and over the memory limit), let D be the nodes where some O^j
differs from F and ``A_v = {F_v, O^1_v, ..., O^r_v}``. The merge fixes every node outside D
at F and solves, exactly and with the memory rows,

    min  sum_(v in D) c'_v(s_v) + sum_((u,v) in E, u, v in D) C_uv(s_u, s_v)
    s.t. s_v in A_v                                                      for v in D
         sum_(v in D live at t) m_v(s_v) <= limit - (usage at t of the nodes outside D)

(``c'_v``: v's cost plus its edges to fixed neighbours, as in a window of :mod:`solver.lns`,
whose :func:`solver.lns.subproblem` builds it; the restriction to ``A_v`` makes every other
strategy forbidden). F and every O^j that fits are feasible points of it, so its optimum is
never worse than the best of them; and where the O^j break the limit it keeps what they gain
where memory allows, node by node. This is the "merge" step of Construct, Merge, Solve &
Adapt (Blum et al.): the answers' union is a far smaller problem than the whole, and an
exact solver on it combines them better than a local search can.

Why: the penalty rounds of :mod:`solver.weights` either fit with memory to spare or break
the limit by 10-30% (IOPDDL T: 0.91x at 7.9e11 against 1.29x at 5.8e11), so the rounds alone
never land near the limit, where the best answers are; one merge of the best fitting answer
with one overflowing round took T from 7.88e11 to 6.99e11.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from solver import highs_model, lns, local
from solver.clock import WALL, WallClock, WorkClock
from solver.evaluate import evaluate
from solver.problem import Problem, ProvedInfeasible

log = logging.getLogger(__name__)

#: Largest model (nonzeros, memory rows included) a merge builds; past it the merge is skipped.
MAX_NONZEROS = 2e7


def merge_problem(problem: Problem, adj: local.Adjacency, mem: local.Memory, base: np.ndarray,
                  others: list[np.ndarray]) -> tuple[Problem, np.ndarray]:
    """(the merge of ``base`` with ``others`` as a window problem, its free nodes D): ``mem`` is
    ``base``'s usage. The window's node i is ``D[i]``, allowed only the strategies the answers
    take there; fillers follow (:func:`solver.lns.subproblem`)."""
    opts = np.stack([base, *others])
    free = np.nonzero((opts != base).any(axis=0))[0]
    sub = lns.subproblem(problem, adj, mem, base, free)
    for i, v in enumerate(free.tolist()):
        keep = np.zeros(sub.node_costs[i].size, dtype=bool)
        keep[opts[:, v]] = True
        sub.node_costs[i] = np.where(keep, sub.node_costs[i], np.inf)
    return sub, free


def merge(problem: Problem, base: np.ndarray, others: list[np.ndarray], deadline: float,
          adj: local.Adjacency | None = None, clock: WorkClock | WallClock = WALL,
          report: dict | None = None) -> np.ndarray | None:
    """The merge's answer (see the module doc) found by HiGHS before ``deadline`` (on ``clock``,
    else the wall clock), started from ``base`` (feasible): a cheaper feasible answer, or None
    (nothing cheaper, no time, or a model over :data:`MAX_NONZEROS`). ``report`` (a dict) gets
    ``cut`` where ``deadline`` ended HiGHS, its LP ``iterations`` and the model's ``size``
    (:func:`solver.lns.solve_window`), and ``size`` alone where the merge was built and not run."""
    base = np.asarray(base, dtype=np.int64)
    others = [np.asarray(o, dtype=np.int64) for o in others if not np.array_equal(o, base)]
    before = evaluate(problem, base)
    if not others or not before.feasible:
        return None
    t0 = time.perf_counter()
    adj = adj if adj is not None else local.Adjacency(problem)
    sub, free = merge_problem(problem, adj, local.Memory(problem, base), base, others)
    try:
        model = highs_model.build(sub, max_nonzeros=MAX_NONZEROS)
    except (highs_model.ModelTooLarge, ProvedInfeasible) as exc:
        log.info(f"merge of {len(others) + 1} answers on {free.size} nodes skipped: {exc}")
        return None
    if report is not None:
        report["size"] = int(model.cost.size + model.n_rows)
    seconds = clock.seconds_until(deadline)
    if seconds < 0.5:
        return None
    start = np.concatenate([base[free], np.zeros(sub.num_nodes - free.size, dtype=np.int64)])
    found = lns.solve_window(sub, start, seconds, model, report)
    if found is None:
        return None
    trial = base.copy()
    trial[free] = found[: free.size]
    ev = evaluate(problem, trial)
    log.info(f"merge of {len(others) + 1} answers on {free.size} nodes ({model.stats['variables']} variables, "
             f"{model.n_rows} rows): {before.cost:.6g} -> {ev.cost:.6g} in {time.perf_counter() - t0:.1f}s")
    if not ev.feasible or ev.cost >= before.cost:
        return None
    return trial
