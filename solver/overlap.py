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
    I_w                                         (:attr:`OverlapWindows.floor`)

each node in at most one ``N_w``, each edge in at most one ``E_w``; ``I_w`` is a time the
window lasts whatever its compute (a GPU's host issuing its ops one by one: a window of small
ops lasts as long as their issue). A window lasts ``S_w(x) = max(C_w(x), I_w)`` and hides at
most that much of its hideable communication; with the overlap share ``eta`` (what a stream
beside compute really hides of it) the objective is

    F(x) = A(x) + sum_w (S_w(x) - C_w(x)) - eta * sum_w min(S_w(x), H_w(x))   (:meth:`OverlapWindows.cost`)

(with every ``I_w = 0``: ``A(x) - eta * sum_w min(C_w(x), H_w(x))``). ``eta`` may be given per
window (:attr:`OverlapWindows.shares`, ``eta_w``): everything below holds with ``eta_w`` in
window ``w``'s terms and rows. Windows that are one and
the same function of ``x`` (tied layers) are merged into one whose sets are their union and
whose floor is their floors' sum (:meth:`OverlapWindows.merged`): ``n`` equal windows hide ``n``
times what one does, so ``F`` is unchanged and the decomposition below has one weight for all
of them. As a MILP, over the additive MILP's columns and rows (:mod:`solver.highs_model`)
plus continuous ``s_w`` and ``h_w`` per window:

    min  A(x) + sum_w (s_w - C_w(x)) - eta * sum_w h_w
    s.t. s_w >= C_w(x),  s_w >= I_w      the window lasts its compute, at least its floor
         h_w <= s_w                      it hides no more than it lasts
         h_w <= H_w(x)                   nor more than the communication that may run beside it
         (one strategy per node, edge marginals, memory rows: as the additive MILP)

``F`` is non-decreasing in every node and edge cost (a cost enters ``A`` with weight 1 and
at most one window, where it moves ``S_w - eta min(S_w, H_w)`` or ``-eta min(S_w, H_w)`` by
no less than ``-eta`` times as much), so a strategy that costs no more everywhere is still never
worse: the dominance reductions stay exact.

That MILP's edge columns made it slow (LLaMA-8B on (8, 8): 174k columns, 30-50 s, where
toulbar2 proves the additive optimum in 0.3 s), so it is solved by decomposition
(:func:`solve_windows`). Per window, ``S + H - eta min(S, H)`` is the largest over
``a, b >= 0``, ``1 - eta <= a + b <= 1`` of ``a C + b I + (2 - eta - a - b) H`` (at
``a + b = 1`` where ``S > H``, ``1 - eta`` where not; ``a`` where ``C >= I``, ``b`` where
not), so

    F(x) = max over (a, b) of L(x; a, b)
    L(x; a, b) = A(x) - sum_w (C_w(x) + H_w(x)) + sum_w (a_w C_w(x) + b_w I_w + (2 - eta - a_w - b_w) H_w(x))

and for fixed weights ``L`` is additive: node ``v`` of ``N_w`` costs ``a_w c_v``, edge ``e`` of
``E_w`` costs ``(2 - eta - a_w - b_w) M_e``, plus the constant ``sum_w b_w I_w``
(:meth:`OverlapWindows.weighed`), a problem the portfolio (:func:`solver.solve`) solves as any
other, toulbar2 and memory rows included. The dual ``g(a, b) = min_x L(x; a, b)`` bounds
``min F`` from below and is concave; the weights follow Kelley's cutting planes: each plan
``x_i`` found gives the plane ``L(x_i; .)``, and the next weights maximize the least of the
planes over their polytope (an LP of ``2W + 1`` columns, :func:`_next_weights`), within a box
``|a - a*|, |b - b*| <= r`` around the weights ``(a*, b*)`` of the best dual value proved: ``r``
starts at :data:`RADIUS` and halves after every solve that does not raise the best dual value.
Kelley's planes alone zigzag between far-apart weights (LLaMA-8B on (8, 8): plans of objective
335, 369, 334, 362, 333, 365 ms, solve after solve); the box keeps the next weights near the best
ones once a step away from them did not pay. Every plan found is a candidate, kept by ``F``;
the largest dual value proved (each solve's bound plus its constant) is the lower bound. It
stops when the planes' maximum over the whole polytope is within ``gap`` of the best dual value,
after ``stall`` solves without a better ``F``, or at the time limit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from solver.problem import Problem, ProblemError
from solver.weighing import Weighing

log = logging.getLogger(__name__)

#: Solves without a better objective after which :func:`solve_windows` stops (Kelley's planes
#: zigzag: GPT-2 on (8, 8) found its best plan after two dry solves).
STALL = 3
#: The most solves :func:`solve_windows` makes (the planner's problems converged in 7).
MAX_SOLVES = 12
#: The relative distance between the planes' maximum and the best dual value at which the
#: decomposition has converged.
GAP = 1e-3
#: The least seconds an oracle solve is given.
MIN_ORACLE_SECONDS = 0.5
#: The half-width of the box the weights may move in around the best dual point (module doc),
#: at first: 1 lets them go anywhere in their polytope, as Kelley's own step does.
RADIUS = 1.0


@dataclass(frozen=True)
class OverlapWindows:
    """Windows of a problem's run (module doc): per window the nodes whose compute it holds, the
    edges whose communication may run beside that compute, and the time it lasts at least."""

    share: float
    """``eta``: the share of hideable communication that running beside compute hides, in [0, 1]."""
    nodes: tuple[np.ndarray, ...]
    """Per window, the node indices of ``N_w`` (int64)."""
    edges: tuple[np.ndarray, ...]
    """Per window, the edge indices of ``E_w`` (int64)."""
    floor: tuple[float, ...] = ()
    """Per window, ``I_w >= 0``: the time it lasts whatever its compute (default: 0 each)."""
    count: tuple[int, ...] = ()
    """Per window, how many equal windows of the run it is the union of (default: 1 each)."""
    shares: tuple[float, ...] = ()
    """Per window, ``eta_w`` in [0, 1]: the share of its hideable communication it hides
    (default: ``share`` each). A caller that knows a window hides less than ``share`` (the
    planner's walk, where a window's gathers queue behind its reductions on the one
    communication stream) weighs it by what it does hide (:meth:`with_shares`)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.share <= 1.0:
            raise ProblemError(f"OverlapWindows.share must be in [0, 1], found {self.share}")
        if len(self.nodes) != len(self.edges):
            raise ProblemError(f"OverlapWindows: {len(self.nodes)} node sets but {len(self.edges)} edge sets "
                               f"(expected one of each per window)")
        object.__setattr__(self, "nodes", tuple(np.asarray(n, dtype=np.int64).reshape(-1) for n in self.nodes))
        object.__setattr__(self, "edges", tuple(np.asarray(e, dtype=np.int64).reshape(-1) for e in self.edges))
        for name, default, kind in (("floor", 0.0, float), ("count", 1, int), ("shares", self.share, float)):
            given = getattr(self, name)
            value = tuple(kind(x) for x in given) if len(given) else (default,) * len(self.nodes)
            object.__setattr__(self, name, value)
        if len(self.floor) != len(self.nodes) or not all(np.isfinite(f) and f >= 0 for f in self.floor):
            raise ProblemError(f"OverlapWindows.floor: expected {len(self.nodes)} finite times >= 0, "
                               f"found {self.floor}")
        if len(self.shares) != len(self.nodes) or not all(0.0 <= x <= 1.0 for x in self.shares):
            raise ProblemError(f"OverlapWindows.shares: expected {len(self.nodes)} shares in [0, 1], "
                               f"found {self.shares}")
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
    def merged(cls, problem: Problem, share: float, nodes, edges, floor=None) -> OverlapWindows:
        """Windows ``(nodes[w], edges[w], floor[w])`` with those that are the same function of
        the problem's choice (same tie heads, same costs, same floor: tied layers) merged into
        their union (module doc), and those with nothing to hide dropped."""
        from solver.quotient import tie_heads

        rep = tie_heads(problem)
        floor = [0.0] * len(nodes) if floor is None else list(floor)
        seen: dict[bytes, int] = {}
        out_n, out_e, out_f, count = [], [], [], []
        for ns, es, f in zip(nodes, edges, floor):
            ns, es = np.asarray(ns, dtype=np.int64), np.asarray(es, dtype=np.int64)
            if es.size == 0:
                continue
            key = _signature(problem, rep, ns, es) + np.float64(f).tobytes()
            if key in seen:
                w = seen[key]
                out_n[w], out_e[w] = np.concatenate([out_n[w], ns]), np.concatenate([out_e[w], es])
                out_f[w] += float(f)
                count[w] += 1
                continue
            seen[key] = len(out_n)
            out_n.append(ns)
            out_e.append(es)
            out_f.append(float(f))
            count.append(1)
        return cls(share, tuple(out_n), tuple(out_e), tuple(out_f), tuple(count))

    def terms(self, problem: Problem, choice) -> tuple[float, np.ndarray, np.ndarray]:
        """``(A(x), C_w(x), H_w(x))`` of ``choice``."""
        choice = np.asarray(choice)
        c = np.array([float(problem.node_costs[v][choice[v]]) for v in range(problem.num_nodes)])
        e = problem.edges
        m = np.array([float(problem.edge_costs[k][choice[e[k, 0]], choice[e[k, 1]]]) for k in range(len(e))])
        return (float(c.sum() + m.sum()), np.array([c[s].sum() for s in self.nodes]),
                np.array([m[s].sum() for s in self.edges]))

    @property
    def eta(self) -> np.ndarray:
        """``eta_w`` per window (:attr:`shares`) as an array."""
        return np.asarray(self.shares, dtype=np.float64)

    def with_shares(self, shares) -> OverlapWindows:
        """These windows with ``eta_w`` = ``shares[w]``."""
        return OverlapWindows(self.share, self.nodes, self.edges, self.floor, self.count,
                              tuple(float(x) for x in shares))

    def value(self, a: float, c: np.ndarray, h: np.ndarray) -> float:
        """``F`` from a plan's :meth:`terms`."""
        span = np.maximum(c, np.asarray(self.floor))
        return float(a + (span - c).sum() - np.dot(self.eta, np.minimum(span, h)))

    def cost(self, problem: Problem, choice) -> float:
        """``F(x)`` (module doc)."""
        return self.value(*self.terms(problem, choice))

    def weighed(self, problem: Problem, a: np.ndarray, b: np.ndarray) -> tuple[Problem, float]:
        """The additive problem of ``L(.; a, b)`` and its constant (module doc): ``L(x; a, b)`` is
        that problem's cost of ``x`` plus the constant. Forbidden entries stay forbidden. One
        problem's weighed problems, round after round: :class:`solver.weighing.Weighing`."""
        return Weighing(problem, self, max_parts_share=0.0)(a, b), self.constant(b)

    def constant(self, b: np.ndarray) -> float:
        """``L``'s constant at weights ``b``: ``sum_w b_w I_w``."""
        return float(np.dot(b, self.floor))

    def plane(self, a_total: float, c: np.ndarray, h: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """``L(x; a, b) = k + sum_w a_w p_w + b_w q_w`` for a plan of :meth:`terms` ``(a_total, c,
        h)``: ``(k, p, q)``."""
        k = a_total - c.sum() - h.sum() + np.dot(2.0 - self.eta, h)
        return float(k), c - h, np.asarray(self.floor) - h


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
    """Per weighed solve: its plan's ``F`` (``objective_us``), its proved dual value (``dual_us``,
    None where the solve proved no bound) and its seconds."""
    stopped: str
    weighing: Weighing | None = None
    """The weighed problems' maker it used: another decomposition over the same windows at other
    shares reuses it (:meth:`solver.weighing.Weighing.at_shares`)."""


def solve_windows(problem: Problem, windows: OverlapWindows,
                  solve: Callable[[Problem, float, list], object], deadline: float,
                  starts: Sequence[tuple[str, np.ndarray]] = (), stall: int = STALL, gap: float = GAP,
                  max_solves: int = MAX_SOLVES, weighing: Weighing | None = None) -> WindowsAnswer:
    """Minimize ``F`` by Lagrangian decomposition (module doc). ``solve(problem, seconds,
    starts)`` solves an additive problem and returns a :class:`solver.Solution` (the planner's
    solve with its backend and gap); ``starts``: plans known before (the additive optimum
    first), which give the first planes. Ends by ``deadline`` (``time.perf_counter()``
    seconds) and after at most ``max_solves`` solves. ``weighing``: an earlier answer's
    (:attr:`WindowsAnswer.weighing`), for these windows at other shares."""
    windows.check(problem)
    from solver.evaluate import evaluate

    # Weighing's parts depend on which window holds each node and edge, not on the shares.
    weigh = Weighing(problem, windows) if weighing is None else weighing.at_shares(windows.eta)
    seen: dict[bytes, tuple[str, np.ndarray, float]] = {}
    planes: list[tuple[float, np.ndarray, np.ndarray]] = []
    record: list[dict] = []

    def offer(name: str, choice) -> float:
        choice = np.asarray(choice)
        key = choice.tobytes()
        if key not in seen:
            terms = windows.terms(problem, choice)
            planes.append(windows.plane(*terms))
            f = windows.value(*terms) if evaluate(problem, choice).feasible else np.inf
            seen[key] = (name, choice, f)
        return seen[key][2]

    for name, choice in starts:
        offer(name, choice)
    best = min((f for _, _, f in seen.values()), default=np.inf)
    dual, stopped, dry = None, "solves", 0
    a, b = 1.0 - windows.eta / 2, np.zeros(len(windows))
    center, radius = (a, b), RADIUS
    for i in range(max_solves):
        if planes:
            a, b, top = _next_weights(planes, windows)
            if dual is not None and top - dual <= gap * max(abs(top), 1e-9):
                stopped = "converged"
                break
            if radius < 1.0:  # a box of half-width 1 holds the whole polytope: Kelley's step is the step
                a, b, _ = _next_weights(planes, windows, center, radius)
        left = deadline - time.perf_counter()
        if left < MIN_ORACLE_SECONDS:
            stopped = "time limit"
            break
        t0 = time.perf_counter()
        ordered = sorted(seen.values(), key=lambda s: s[2])[:2]
        weighed, constant = weigh(a, b), windows.constant(b)
        sol = solve(weighed, max(MIN_ORACLE_SECONDS, left / 3),
                    [(f"windows {name}", choice) for name, choice, _ in ordered])
        f = offer(f"windows {i + 1} ({sol.source})", sol.choice)
        proved = None if sol.lower_bound is None else float(sol.lower_bound) + constant
        if proved is not None and (dual is None or proved > dual + 1e-9 * max(abs(proved), 1.0)):
            dual, center = proved, (a, b)
        else:
            radius /= 2
        record.append({"objective_us": round(f, 3), "dual_us": None if proved is None else round(proved, 3),
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
    return WindowsAnswer(feasible[0] if feasible else None, best, dual, feasible, record, stopped, weigh)


def _next_weights(planes, windows: OverlapWindows, center=None, radius: float = 1.0
                  ) -> tuple[np.ndarray, np.ndarray, float]:
    """Kelley's step: the weights ``(a, b)`` maximizing ``min_i L(x_i; a, b)`` over ``a, b >= 0``,
    ``1 - eta <= a_w + b_w <= 1`` and, with a ``center`` ``(a*, b*)``, ``|a - a*|, |b - b*| <=
    radius``; and that maximum. The center satisfies the rows, so the box never empties them."""
    import highspy

    W, eta = len(windows), windows.eta
    inf = highspy.kHighsInf
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    # HiGHS's thread pool is global and sized by the first model run: every model here asks for
    # one thread (solver.highs_model.to_highs), or the MILPs after this LP fail to start.
    h.setOptionValue("threads", 1)
    # columns: a_0 .. a_{W-1}, b_0 .. b_{W-1} in [0, 1], t free; maximize t (minimize -t)
    n = 2 * W + 1
    lo, hi = np.zeros(2 * W), np.ones(2 * W)
    if center is not None:
        c = np.concatenate(center)
        lo, hi = np.maximum(lo, c - radius), np.minimum(hi, c + radius)
    h.addCols(n, np.concatenate([np.zeros(2 * W), [-1.0]]), np.concatenate([lo, [-inf]]),
              np.concatenate([hi, [inf]]), 0, np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0))
    for w in range(W):  # 1 - eta_w <= a_w + b_w <= 1
        h.addRow(1.0 - float(eta[w]), 1.0, 2, np.array([w, W + w], dtype=np.int32), np.ones(2))
    for k, p, q in planes:  # t - sum_w (a_w p_w + b_w q_w) <= k
        h.addRow(-inf, k, n, np.arange(n, dtype=np.int32), np.concatenate([-p, -q, [1.0]]))
    h.run()
    vals = np.asarray(h.getSolution().col_value)
    return np.clip(vals[:W], 0.0, 1.0), np.clip(vals[W:2 * W], 0.0, 1.0), float(vals[2 * W])
