r"""A plan that fits, fast: the memory-free optimum repaired on the exact network's rows.

Over the exact network (:mod:`solver.exact`: one variable per tie group, unary costs ``c_g``,
pair tables ``C_gh``, knapsack rows ``sum_g a_kg(x_g) <= r_k``), with the usage of row ``k``

    U_k(x) = sum_g a_kg(x_g),      E(x) = sum_k max(0, U_k(x) - r_k)   (the total excess)

:func:`repair` starts from a plan that breaks rows (the memory-free optimum) and takes, while
``E > 0``, the move of least cost per byte of excess it removes:

    argmin over moves m with  E(x) - E(x after m) > 0   of   (F(x after m) - F(x)) / (E(x) - E(x after m))

where ``F`` is the network's cost. A move sets one variable to one of its values; where that
value is forbidden beside a neighbour's (a pair table entry at :data:`solver.cfn.TOP`: a view
that must follow its input's layout), the move carries those neighbours along, each to its
cheapest value beside the moved ones (:func:`_chain`, at most :data:`MAX_CHAIN` variables), so
a layout change propagates through the views that must follow it (LLaMA-70B's selective
network: every one of the 15 moves that free memory at its fullest segment is forbidden alone).
Every move lowers ``E``, so the repair ends, in at most as many moves as it takes; then
:func:`descend` takes moves that lower ``F`` and keep every row, the cheapest first, until none
does. Both are deterministic (a fixed order, ties to the lowest index); the deadline only guards.

On LLaMA-70B (8, 8, 8), 262 variables and 361 rows: 27 moves, 0.3 s, cost 5.2455e6 (the proved
optimum is 5.1594e6; DGVNS's first answer without a start came after 14 s at 1.74e7, the
node-by-node repair of :func:`solver.heuristic.repair_memory` found nothing).
"""

from __future__ import annotations

import time

import numpy as np

from solver.cfn import TOP, KnapsackRow

#: The most variables one move may set (the variable and the neighbours it carries along).
MAX_CHAIN = 9
#: Forbidden values tried as chained moves per variable and step, the most promising first.
CHAINS_PER_VARIABLE = 3
_HARD = TOP / 2


class RowNetwork:
    """The exact network's costs, tables and rows, indexed for moves."""

    def __init__(self, costs: list[np.ndarray], tables: dict[tuple[int, int], np.ndarray],
                 rows: list[KnapsackRow]):
        self.costs = [np.asarray(c, dtype=float) for c in costs]
        n = len(self.costs)
        self.neighbours: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(n)]
        for (a, b), m in sorted(tables.items()):
            m = np.asarray(m, dtype=float)
            self.neighbours[a].append((b, m))
            self.neighbours[b].append((a, m.T))
        self.rhs = np.array([rhs for _, rhs in rows], dtype=float)
        per: list[dict[int, np.ndarray]] = [{} for _ in range(n)]
        for k, (terms, _) in enumerate(rows):
            for var, w in terms:
                per[var][k] = per[var].get(k, 0) + np.asarray(w, dtype=float)
        self.rows_of = [np.array(sorted(d), dtype=np.int64) for d in per]
        """Per variable, the rows it has weight in."""
        self.weights = [np.array([d[k] for k in sorted(d)], dtype=float).reshape(len(d), self.costs[v].size)
                        for v, d in enumerate(per)]
        """Per variable, its weights in those rows: rows x values."""

    def usage(self, x: np.ndarray) -> np.ndarray:
        u = np.zeros(self.rhs.size)
        for v, rows in enumerate(self.rows_of):
            if rows.size:
                u[rows] += self.weights[v][:, x[v]]
        return u

    def delta(self, x: np.ndarray, v: int, hard_as_free: bool = False) -> np.ndarray:
        """Per value of ``v``, the cost change of setting it there (the others as in ``x``);
        ``hard_as_free``: a forbidden pair counts nothing (what the move costs once the
        neighbours it forbids have moved along)."""
        d = self.costs[v] - self.costs[v][x[v]]
        for u, m in self.neighbours[v]:
            col = m[:, x[u]] - m[x[v], x[u]]
            d = d + (np.where(m[:, x[u]] >= _HARD, 0.0, col) if hard_as_free else col)
        return d

    def shift(self, u: np.ndarray, x: np.ndarray, moves: list[tuple[int, int]]) -> np.ndarray:
        """Row usage ``u`` after ``moves`` from ``x`` (a copy)."""
        u = u.copy()
        for v, s in moves:
            if self.rows_of[v].size:
                u[self.rows_of[v]] += self.weights[v][:, s] - self.weights[v][:, x[v]]
        return u


def _excess(u: np.ndarray, rhs: np.ndarray) -> float:
    return float(np.maximum(u - rhs, 0.0).sum())


def _chain(net: RowNetwork, x: np.ndarray, v: int, s: int) -> list[tuple[int, int]] | None:
    """``v`` to ``s``, and each neighbour left in a forbidden pair moved to its cheapest value
    beside the moved ones (breadth first); None where one has no such value or the chain grows
    past :data:`MAX_CHAIN`."""
    y = x.copy()
    y[v] = s
    moves, queue, moved = [(v, s)], [v], {v}
    while queue:
        w = queue.pop(0)
        for u, m in net.neighbours[w]:
            if u in moved or m[y[w], y[u]] < _HARD:
                continue
            if len(moves) >= MAX_CHAIN:
                return None
            # Pairs with neighbours not moved yet may be forbidden too: they join the chain next.
            cost = net.costs[u].copy()
            for z, n in net.neighbours[u]:
                col = n[:, y[z]]
                cost = cost + (col if z in moved else np.where(col >= _HARD, 0.0, col))
            t = int(np.argmin(cost))
            if cost[t] >= _HARD:
                return None
            y[u] = t
            moves.append((u, t))
            moved.add(u)
            queue.append(u)
    return moves


def _cost_of(net: RowNetwork, x: np.ndarray, moves: list[tuple[int, int]]) -> float:
    y, total = x.copy(), 0.0
    for v, s in moves:
        total += float(net.delta(y, v)[s])
        y[v] = s
    return total


def repair(net: RowNetwork, x: np.ndarray, deadline: float,
           now=time.perf_counter) -> tuple[np.ndarray | None, int]:
    """The plan ``x`` moved, least cost per byte of excess removed first, until every row holds
    (see the module doc): (the plan or None where no move removes excess, or at ``deadline``;
    moves made)."""
    x = np.asarray(x, dtype=np.int64).copy()
    u = net.usage(x)
    made = 0
    while now() < deadline:
        e = u - net.rhs
        total = float(np.maximum(e, 0.0).sum())
        if total <= 0:
            return x, made
        best: tuple[float, list[tuple[int, int]]] | None = None
        for v, rows in enumerate(net.rows_of):
            if rows.size == 0 or (e[rows] <= 0).all():
                continue
            w = net.weights[v]
            ev = e[rows]
            after = ev[:, None] - w[:, [x[v]]] + w
            removed = np.maximum(ev, 0.0).sum() - np.maximum(after, 0.0).sum(axis=0)
            if not (removed > 0).any():
                continue
            dc = net.delta(x, v)
            ok = (removed > 0) & (dc < _HARD)
            if ok.any():
                rate = np.where(ok, dc / np.where(ok, removed, 1.0), np.inf)
                s = int(np.argmin(rate))
                if best is None or rate[s] < best[0]:
                    best = (float(rate[s]), [(v, s)])
            forbidden = np.nonzero((removed > 0) & (dc >= _HARD))[0]
            if forbidden.size:
                # The cost without the forbidden pairs ranks which to try as chains.
                hopeful = net.delta(x, v, hard_as_free=True)
                order = forbidden[np.argsort(hopeful[forbidden] / removed[forbidden], kind="stable")]
                for s in order[:CHAINS_PER_VARIABLE].tolist():
                    moves = _chain(net, x, v, s)
                    if moves is None:
                        continue
                    dc_chain = _cost_of(net, x, moves)
                    gone = total - _excess(net.shift(u, x, moves), net.rhs)
                    if dc_chain >= _HARD or gone <= 0:
                        continue
                    if best is None or dc_chain / gone < best[0]:
                        best = (dc_chain / gone, moves)
        if best is None:
            return None, made
        u = net.shift(u, x, best[1])
        for v, s in best[1]:
            x[v] = s
        made += 1
    return None, made


def descend(net: RowNetwork, x: np.ndarray, deadline: float, now=time.perf_counter) -> np.ndarray:
    """``x`` (every row holding) improved by single moves that lower the cost and keep every
    row, each variable's cheapest such move in turn, until a sweep finds none or ``deadline``."""
    x = np.asarray(x, dtype=np.int64).copy()
    u = net.usage(x)
    improved = True
    while improved and now() < deadline:
        improved = False
        for v, rows in enumerate(net.rows_of):
            dc = net.delta(x, v)
            better = np.nonzero(dc < -1e-9)[0]
            if better.size and rows.size:
                after = u[rows][:, None] - net.weights[v][:, [x[v]]] + net.weights[v][:, better]
                better = better[(after <= net.rhs[rows][:, None]).all(axis=0)]
            if better.size == 0:
                continue
            s = int(better[np.argmin(dc[better])])
            u = net.shift(u, x, [(v, s)])
            x[v] = s
            improved = True
    return x


__all__ = ["MAX_CHAIN", "RowNetwork", "descend", "repair"]
