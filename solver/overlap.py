r"""The overlap-aware objective: communication beside compute costs only what it leaves exposed.

A plan ``x`` costs additively

    A(x) = sum_v c_v(x_v) + sum_(e = u->v) M_e(x_u, x_v)

but a step runs its communication on a stream of its own, beside the compute that does not wait
for it. The caller names *windows* ``w``: spans of the run (a layer's forward, its backward),
each with the compute that runs in it and the communication that may run beside that compute
(a parameter's gather prefetched one layer ahead, a gradient's reduction beside the layer
before it in the backward):

    C_w(x) = sum_(v in N_w) c_v(x_v)            (:attr:`OverlapWindows.nodes`)
    H_w(x) = sum_(e in E_w) M_e(x_u, x_v)       (:attr:`OverlapWindows.edges`)

each node in at most one ``N_w``, each edge in at most one ``E_w``. A window hides at most its
compute and at most its hideable communication; with the overlap share ``eta`` (what a stream
beside compute really hides of it) the objective is

    F(x) = A(x) - eta * sum_w min(C_w(x), H_w(x))                      (:meth:`OverlapWindows.cost`)

Windows that are one and the same function of ``x`` (tied layers) are merged into one whose
sets are their union (:meth:`OverlapWindows.merged`): ``n`` equal windows hide ``n`` times
what one does, ``min(n C, n H) = n min(C, H)``, so the objective is unchanged and the
decomposition below has one weight for all of them. As a MILP, over the additive MILP's
columns and rows (:mod:`solver.highs_model`) plus a continuous ``h_w >= 0`` per window:

    min  A(x) - eta * sum_w h_w
    s.t. h_w <= C_w(x)          a window hides no more than its compute
         h_w <= H_w(x)          nor more than the communication that may run beside it
         (one strategy per node, edge marginals, memory rows: as the additive MILP)

``F`` is non-decreasing in every node and edge cost (each enters ``A`` with weight 1 and at
most one ``min``, with weight at most ``eta <= 1``), so a strategy that costs no more everywhere
is still never worse: the dominance reductions stay exact.

That MILP's edge columns made it slow (LLaMA-8B on (8, 8): 174k columns, 30-50 s, where
toulbar2 proves the additive optimum in 0.3 s), so it is solved by decomposition
(:func:`solve_windows`). As ``min(C, H) = min over lam in [0, 1] of lam C + (1 - lam) H``,

    F(x) = max over lam in [0, 1]^W of  L(x, lam)
    L(x, lam) = A(x) - eta * sum_w (lam_w C_w(x) + (1 - lam_w) H_w(x))

and for a fixed ``lam``, ``L`` is additive: node ``v`` of ``N_w`` costs ``(1 - eta lam_w) c_v``,
edge ``e`` of ``E_w`` costs ``(1 - eta (1 - lam_w)) M_e`` (:meth:`OverlapWindows.weighed`), a
problem the portfolio (:func:`solver.solve`) solves as any other, toulbar2 and memory rows
included. The dual ``g(lam) = min_x L(x, lam)`` bounds ``min F`` from below and is concave;
``lam`` follows Kelley's cutting planes: each plan ``x_i`` found gives the plane
``L(x_i, .)``, and the next ``lam`` maximizes the least of the planes over the box (an LP of
``W + 1`` columns, :func:`_next_weights`). Every plan found is a candidate, kept by ``F``; the
largest ``g`` seen (each oracle's proved bound) is the lower bound. It stops when the planes'
maximum is within ``gap`` of the best dual value (the decomposition's answer cannot improve),
after ``stall`` solves without a better ``F``, or at the time limit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from solver.problem import FORBIDDEN, Problem, ProblemError

log = logging.getLogger(__name__)

#: Solves without a better objective after which :func:`solve_windows` stops.
STALL = 2
#: The relative distance between the planes' maximum and the best dual value at which the
#: decomposition has converged.
GAP = 1e-3
#: The least seconds an oracle solve is given.
MIN_ORACLE_SECONDS = 0.5


@dataclass(frozen=True)
class OverlapWindows:
    """Windows of a problem's run (module doc): per window the nodes whose compute it holds and
    the edges whose communication may run beside that compute."""

    share: float
    """``eta``: the share of hideable communication that running beside compute hides, in [0, 1]."""
    nodes: tuple[np.ndarray, ...]
    """Per window, the node indices of ``N_w`` (int64)."""
    edges: tuple[np.ndarray, ...]
    """Per window, the edge indices of ``E_w`` (int64)."""
    count: tuple[int, ...] = ()
    """Per window, how many equal windows of the run it is the union of (default: 1 each)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ProblemError(f"OverlapWindows.share must be in [0, 1], found {self.share}")
        if len(self.nodes) != len(self.edges):
            raise ProblemError(f"OverlapWindows: {len(self.nodes)} node sets but {len(self.edges)} edge sets "
                               f"(expected one of each per window)")
        object.__setattr__(self, "nodes", tuple(np.asarray(n, dtype=np.int64).reshape(-1) for n in self.nodes))
        object.__setattr__(self, "edges", tuple(np.asarray(e, dtype=np.int64).reshape(-1) for e in self.edges))
        if not self.count:
            object.__setattr__(self, "count", (1,) * len(self.nodes))
        if len(self.count) != len(self.nodes) or any(int(c) < 1 for c in self.count):
            raise ProblemError(f"OverlapWindows.count: expected {len(self.nodes)} counts >= 1, found {self.count}")
        for label, sets in (("node", self.nodes), ("edge", self.edges)):
            flat = np.concatenate(sets) if sets else np.zeros(0, np.int64)
            if np.unique(flat).size != flat.size:
                raise ProblemError(f"OverlapWindows: a {label} is in more than one window (each {label} may be "
                                   f"in at most one, or the objective would count it twice)")

    def __len__(self) -> int:
        return len(self.nodes)

    def check(self, problem: Problem) -> None:
        """Raise :class:`ProblemError` when an index is out of ``problem``'s range."""
        for label, sets, size in (("node", self.nodes, problem.num_nodes), ("edge", self.edges, problem.num_edges)):
            for w, s in enumerate(sets):
                if s.size and (s.min() < 0 or s.max() >= size):
                    raise ProblemError(f"OverlapWindows: window {w} names {label} {int(s.max())} but the problem "
                                       f"has {size} {label}s")

    @classmethod
    def merged(cls, problem: Problem, share: float, nodes, edges) -> OverlapWindows:
        """Windows ``(nodes[w], edges[w])`` with those that are the same function of the
        problem's choice (same tie heads, same costs: tied layers) merged into their union (module
        doc), and those with nothing to hide dropped."""
        from solver.quotient import tie_heads

        rep = tie_heads(problem)
        seen: dict[bytes, int] = {}
        out_n, out_e, count = [], [], []
        for ns, es in zip(nodes, edges):
            ns, es = np.asarray(ns, dtype=np.int64), np.asarray(es, dtype=np.int64)
            if es.size == 0:
                continue
            key = _signature(problem, rep, ns, es)
            if key in seen:
                w = seen[key]
                out_n[w], out_e[w] = np.concatenate([out_n[w], ns]), np.concatenate([out_e[w], es])
                count[w] += 1
                continue
            seen[key] = len(out_n)
            out_n.append(ns)
            out_e.append(es)
            count.append(1)
        return cls(share, tuple(out_n), tuple(out_e), tuple(count))

    def terms(self, problem: Problem, choice) -> tuple[float, np.ndarray, np.ndarray]:
        """``(A(x), C_w(x), H_w(x))`` of ``choice``."""
        choice = np.asarray(choice)
        c = np.array([float(problem.node_costs[v][choice[v]]) for v in range(problem.num_nodes)])
        e = problem.edges
        m = np.array([float(problem.edge_costs[k][choice[e[k, 0]], choice[e[k, 1]]]) for k in range(len(e))])
        return (float(c.sum() + m.sum()), np.array([c[s].sum() for s in self.nodes]),
                np.array([m[s].sum() for s in self.edges]))

    def cost(self, problem: Problem, choice) -> float:
        """``F(x)`` (module doc)."""
        a, c, h = self.terms(problem, choice)
        return a - self.share * float(np.minimum(c, h).sum())

    def hidden(self, problem: Problem, choice) -> float:
        """``A(x) - F(x)``: the communication the windows hide."""
        a, c, h = self.terms(problem, choice)
        return self.share * float(np.minimum(c, h).sum())

    def weighed(self, problem: Problem, lam: np.ndarray) -> Problem:
        """The additive problem of ``L(., lam)`` (module doc); forbidden entries stay forbidden."""
        node_costs, edge_costs = list(problem.node_costs), list(problem.edge_costs)
        for w, (ns, es) in enumerate(zip(self.nodes, self.edges)):
            node_scale, edge_scale = 1.0 - self.share * lam[w], 1.0 - self.share * (1.0 - lam[w])
            for v in ns.tolist():
                c = node_costs[v]
                node_costs[v] = np.where(c >= FORBIDDEN, c, c * node_scale)
            for k in es.tolist():
                m = edge_costs[k]
                edge_costs[k] = np.where(m >= FORBIDDEN, m, m * edge_scale)
        return problem.with_costs(node_costs=node_costs, edge_costs=edge_costs)


def _signature(problem: Problem, rep: np.ndarray, nodes: np.ndarray, edges: np.ndarray) -> bytes:
    """Bytes equal for two windows whose ``C`` and ``H`` are the same function of a choice that
    respects the ties."""
    parts = []
    for v in sorted(nodes.tolist(), key=lambda v: (int(rep[v]), problem.node_costs[v].tobytes())):
        parts += [int(rep[v]).to_bytes(8, "little"), problem.node_costs[v].tobytes()]
    parts.append(b"|")
    keyed = sorted(((int(rep[problem.edges[k, 0]]), int(rep[problem.edges[k, 1]]), problem.edge_costs[k].tobytes())
                    for k in edges.tolist()))
    for u, v, m in keyed:
        parts += [u.to_bytes(8, "little"), v.to_bytes(8, "little"), m]
    return b"".join(parts)


@dataclass
class WindowsAnswer:
    """What :func:`solve_windows` found."""

    best: tuple[str, np.ndarray] | None
    """(where it came from, choice) of least ``F`` among the plans seen; None when none fits."""
    cost: float
    """``F`` of ``best``."""
    lower_bound: float | None
    """The largest dual value proved (a lower bound of ``min F``), or None."""
    candidates: list[tuple[str, np.ndarray]]
    """Every distinct plan seen, least ``F`` first."""
    record: list[dict]
    """Per oracle solve: its weights' summary, the plan's ``F`` and ``A``, the dual value, seconds."""
    stopped: str


def solve_windows(problem: Problem, windows: OverlapWindows,
                  solve: Callable[[Problem, float, list], object], deadline: float,
                  starts: Sequence[tuple[str, np.ndarray]] = (), stall: int = STALL, gap: float = GAP,
                  max_solves: int = 30) -> WindowsAnswer:
    """Minimize ``F`` by Lagrangian decomposition (module doc). ``solve(problem, seconds,
    starts)`` solves an additive problem and returns a :class:`solver.Solution` (the planner's
    solve with its backend and gap); ``starts``: plans known before (the additive optimum
    first), which give the first planes. Ends by ``deadline`` (``time.perf_counter()``
    seconds) and after at most ``max_solves`` solves."""
    windows.check(problem)
    from solver.evaluate import evaluate

    seen: dict[bytes, tuple[str, np.ndarray, float]] = {}
    planes: list[tuple[float, np.ndarray, np.ndarray]] = []
    record: list[dict] = []

    def offer(name: str, choice) -> float:
        choice = np.asarray(choice)
        key = choice.tobytes()
        if key not in seen:
            a, c, h = windows.terms(problem, choice)
            planes.append((a, c, h))
            ok = evaluate(problem, choice).feasible
            f = a - windows.share * float(np.minimum(c, h).sum())
            seen[key] = (name, choice, f if ok else np.inf)
        return seen[key][2]

    for name, choice in starts:
        offer(name, choice)
    best = min((f for _, _, f in seen.values()), default=np.inf)
    dual, stopped, dry = None, "solves", 0
    lam = np.full(len(windows), 0.5)
    for i in range(max_solves):
        if planes:
            lam, top = _next_weights(planes, windows)
            if dual is not None and top - dual <= gap * max(abs(top), 1e-9):
                stopped = "converged"
                break
        left = deadline - time.perf_counter()
        if left < MIN_ORACLE_SECONDS:
            stopped = "time limit"
            break
        t0 = time.perf_counter()
        ordered = sorted(seen.values(), key=lambda s: s[2])[:2]
        sol = solve(windows.weighed(problem, lam), max(MIN_ORACLE_SECONDS, left / 3),
                    [(f"windows {name}", choice) for name, choice, _ in ordered])
        f = offer(f"windows {i + 1} ({sol.source})", sol.choice)
        proved = sol.lower_bound if sol.lower_bound is not None else None
        if proved is not None:
            dual = proved if dual is None else max(dual, proved)
        record.append({"weights_mean": round(float(lam.mean()), 4), "objective_us": round(f, 3),
                       "dual_us": None if proved is None else round(float(proved), 3),
                       "seconds": round(time.perf_counter() - t0, 3)})
        log.info(f"overlap windows solve {i + 1}: objective {f / 1e3:.3f} ms (best {min(best, f) / 1e3:.3f} ms), "
                 f"dual {'-' if proved is None else f'{proved / 1e3:.3f} ms'}")
        if f < best * (1 - 1e-9):
            best, dry = f, 0
        else:
            dry += 1
            if dry >= stall:
                stopped = f"{stall} solves without a better plan"
                break
    ranked = sorted(seen.values(), key=lambda s: s[2])
    feasible = [(name, choice) for name, choice, f in ranked if np.isfinite(f)]
    return WindowsAnswer(feasible[0] if feasible else None, best, dual, feasible, record, stopped)


def _next_weights(planes, windows: OverlapWindows) -> tuple[np.ndarray, float]:
    """Kelley's step: ``lam`` in the box maximizing ``min_i L(x_i, lam)``, and that maximum."""
    import highspy

    W, eta = len(windows), windows.share
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    # columns: lam_0 .. lam_{W-1} in [0, 1], t free; maximize t (minimize -t)
    h.addCols(W + 1, np.concatenate([np.zeros(W), [-1.0]]), np.concatenate([np.zeros(W), [-highspy.kHighsInf]]),
              np.concatenate([np.ones(W), [highspy.kHighsInf]]), 0, np.zeros(0, np.int32), np.zeros(0, np.int32),
              np.zeros(0))
    # t <= L(x_i, lam) = A_i - eta * sum_w H_iw - eta * sum_w lam_w (C_iw - H_iw)
    for a, c, hh in planes:
        coef = np.concatenate([eta * (c - hh), [1.0]])
        h.addRow(-highspy.kHighsInf, a - eta * float(hh.sum()), W + 1, np.arange(W + 1, dtype=np.int32), coef)
    h.run()
    vals = np.asarray(h.getSolution().col_value)
    return np.clip(vals[:W], 0.0, 1.0), float(vals[W])

