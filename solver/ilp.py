r"""The integer program, built with PuLP.

Variables
    x[v,i] in {0,1}   node v takes strategy i           (only allowed i: not forbidden, pins)
    y[e,i,j] in [0,1] edge e=(u,v) takes the pair (i,j) (only non-forbidden pairs;
                       integral whenever x is, by the two marginal rows below)

Objective (``_add_objective``)
    min  sum_v sum_i c_v[i] x[v,i]  +  sum_e sum_(i,j) C_e[i,j] y[e,i,j]  +  const
    Edges whose endpoint has a single allowed strategy are folded into the other
    endpoint's node cost, and constant matrices into ``const``, so they add no y.

Constraints
    one strategy per node       sum_i x[v,i] = 1                     (``_add_nodes``)
    edge marginals              sum_j y[e,i,j] = x[u,i]  for all i   (``_add_edges``)
                                sum_i y[e,i,j] = x[v,j]  for all j
    memory at each maximal      sum_(v live at t) sum_i m_v[i] x[v,i] <= limit
    live set t                  (only sets not contained in another; ``_add_memory``)
    ties                        x[v,i] = x[w,i] for w in v's tie group (``_add_ties``)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pulp

from solver.problem import FORBIDDEN, Problem, ProvedInfeasible


@dataclass
class IlpModel:
    """The PuLP model plus the maps back to the problem's indices."""

    lp: pulp.LpProblem
    x: list[dict[int, pulp.LpVariable]]
    """Per node, allowed strategy -> binary variable (absent when the node has one choice)."""
    fixed: dict[int, int]
    """Nodes with a single allowed strategy: node -> strategy."""
    stats: dict


def maximal_live_sets(problem: Problem, nodes_with_usage: np.ndarray) -> list[np.ndarray]:
    """Distinct live sets that are maximal along the time sweep.

    A live set can only grow at an interval start, so the candidates are the sets
    at each start time; a set contained in its successor or predecessor is dropped
    (a cheap test that removes most non-maximal sets on real graphs).
    """
    iv = problem.intervals[nodes_with_usage]
    if iv.size == 0:
        return []
    starts = np.unique(iv[:, 0])
    sets = []
    for t in starts:
        live = nodes_with_usage[(iv[:, 0] <= t) & (t < iv[:, 1])]
        if live.size:
            sets.append(frozenset(live.tolist()))
    uniq = list(dict.fromkeys(sets))
    keep = []
    for k, s in enumerate(uniq):
        nxt = uniq[k + 1] if k + 1 < len(uniq) else frozenset()
        prv = uniq[k - 1] if k > 0 else frozenset()
        if s <= nxt or s <= prv:
            continue
        keep.append(np.array(sorted(s), dtype=np.int64))
    return keep


def build(problem: Problem) -> IlpModel:
    lp = pulp.LpProblem(problem.name or "autoshard", pulp.LpMinimize)
    allowed = [np.nonzero(problem.allowed(v))[0] for v in range(problem.num_nodes)]
    for v, a in enumerate(allowed):
        if a.size == 0:
            raise ProvedInfeasible(f"node {problem._label(v)} has no allowed strategy (all forbidden or pinned away)")
    model = IlpModel(lp=lp, x=[{} for _ in range(problem.num_nodes)], fixed={}, stats={})
    linear = [problem.node_costs[v].copy() for v in range(problem.num_nodes)]
    const = _add_nodes(model, problem, allowed)
    const += _add_edges(model, problem, allowed, linear)
    _add_objective(model, problem, allowed, linear, const)
    _add_memory(model, problem, allowed)
    _add_ties(model, problem, allowed)
    model.stats.update(variables=len(lp.variables()), constraints=len(lp.constraints))
    return model


def _add_nodes(model: IlpModel, problem: Problem, allowed) -> float:
    for v, a in enumerate(allowed):
        if a.size == 1:
            model.fixed[v] = int(a[0])
            continue
        xs = {int(i): pulp.LpVariable(f"x_{v}_{i}", cat="Binary") for i in a}
        model.x[v] = xs
        model.lp += pulp.lpSum(xs.values()) == 1, f"one_{v}"
    return 0.0


def _add_edges(model: IlpModel, problem: Problem, allowed, linear) -> float:
    const = 0.0
    n_y = 0
    for e, (u, v) in enumerate(problem.edges.tolist()):
        m = problem.edge_costs[e][np.ix_(allowed[u], allowed[v])]
        if u in model.fixed and v in model.fixed:
            const += float(m[0, 0])
            continue
        if u in model.fixed or v in model.fixed or u == v:
            # One side is known (or a self-loop): the edge is linear in the other side.
            if u == v:
                diag = np.full(problem.num_strategies(u), np.inf)
                diag[allowed[u]] = np.diag(m)
                linear[u] = linear[u] + diag
            elif u in model.fixed:
                row = np.full(problem.num_strategies(v), np.inf)
                row[allowed[v]] = m[0, :]
                linear[v] = linear[v] + row
            else:
                col = np.full(problem.num_strategies(u), np.inf)
                col[allowed[u]] = m[:, 0]
                linear[u] = linear[u] + col
            continue
        if np.all(m == m.flat[0]) and m.flat[0] < FORBIDDEN:
            const += float(m.flat[0])
            continue
        # Rank-one matrices m[i,j] = r[i] + s[j] split into node costs without y.
        r = m[:, 0] - m[0, 0]
        s = m[0, :]
        tol = 1e-9 * max(1.0, np.abs(m).max())
        if np.all(m < FORBIDDEN) and np.allclose(m, r[:, None] + s[None, :], rtol=0, atol=tol):
            ru = np.zeros(problem.num_strategies(u))
            ru[allowed[u]] = r
            sv = np.zeros(problem.num_strategies(v))
            sv[allowed[v]] = s
            linear[u] = linear[u] + ru
            linear[v] = linear[v] + sv
            continue
        ys = {}
        for a_i, i in enumerate(allowed[u]):
            for a_j, j in enumerate(allowed[v]):
                if m[a_i, a_j] < FORBIDDEN:
                    ys[(int(i), int(j))] = (pulp.LpVariable(f"y_{e}_{i}_{j}", 0, 1), float(m[a_i, a_j]))
        n_y += len(ys)
        for i in allowed[u]:
            row = [y for (ii, _), (y, _) in ys.items() if ii == i]
            model.lp += pulp.lpSum(row) == model.x[u][int(i)], f"eu_{e}_{i}"
        for j in allowed[v]:
            col = [y for (_, jj), (y, _) in ys.items() if jj == j]
            model.lp += pulp.lpSum(col) == model.x[v][int(j)], f"ev_{e}_{j}"
        model.stats.setdefault("_edge_terms", []).extend((y, c) for y, c in ys.values() if c != 0)
    model.stats["edge_variables"] = n_y
    return const


def _add_objective(model: IlpModel, problem: Problem, allowed, linear, const: float) -> None:
    terms = []
    for v, a in enumerate(allowed):
        if v in model.fixed:
            c = float(linear[v][model.fixed[v]])
            if c >= FORBIDDEN:
                raise ProvedInfeasible(f"node {problem._label(v)}: its only allowed strategy meets a forbidden edge")
            const += c
            continue
        for i in a:
            c = float(linear[v][i])
            if c >= FORBIDDEN:
                model.x[v][int(i)].upBound = 0
            elif c != 0:
                terms.append((model.x[v][int(i)], c))
    terms += model.stats.pop("_edge_terms", [])
    model.lp += pulp.LpAffineExpression(terms, constant=const)


def _add_memory(model: IlpModel, problem: Problem, allowed) -> None:
    if problem.usage_limit is None:
        model.stats["memory_rows"] = 0
        return
    has_usage = np.array([problem.node_usages[v].max() > 0 for v in range(problem.num_nodes)], dtype=bool)
    sets = maximal_live_sets(problem, np.nonzero(has_usage)[0])
    rows = 0
    for k, live in enumerate(sets):
        rhs = problem.usage_limit
        terms = []
        for v in live.tolist():
            u = problem.node_usages[v]
            if v in model.fixed:
                rhs -= float(u[model.fixed[v]])
                continue
            base = float(u[allowed[v]].min())
            rhs -= base
            terms += [(model.x[v][int(i)], float(u[i]) - base) for i in allowed[v] if u[i] != base]
        if not terms:
            if rhs < -1e-9 * max(1.0, problem.usage_limit):
                model.lp += pulp.LpAffineExpression([], constant=1) <= 0, f"mem_{k}"
                rows += 1
            continue
        model.lp += pulp.LpAffineExpression(terms) <= rhs, f"mem_{k}"
        rows += 1
    model.stats["memory_rows"] = rows


def _add_ties(model: IlpModel, problem: Problem, allowed) -> None:
    for g, group in enumerate(problem.ties):
        head = group[0]
        for w in group[1:]:
            for i in range(problem.num_strategies(head)):
                a = model.x[head].get(i, 1 if model.fixed.get(head) == i else 0)
                b = model.x[w].get(i, 1 if model.fixed.get(w) == i else 0)
                if isinstance(a, int) and isinstance(b, int):
                    if a != b:
                        model.lp += pulp.LpAffineExpression([], constant=1) <= 0, f"tie_{g}_{w}_{i}"
                    continue
                model.lp += a == b, f"tie_{g}_{w}_{i}"


def extract(model: IlpModel, problem: Problem) -> np.ndarray | None:
    """The chosen index per node, or None when the solver holds no integral solution."""
    choice = np.zeros(problem.num_nodes, dtype=np.int64)
    for v in range(problem.num_nodes):
        if v in model.fixed:
            choice[v] = model.fixed[v]
            continue
        vals = {i: (x.varValue if x.varValue is not None else -1.0) for i, x in model.x[v].items()}
        best = max(vals, key=vals.get)
        if vals[best] < 0.5:
            return None
        choice[v] = best
    return choice


def set_start(model: IlpModel, problem: Problem, choice: np.ndarray) -> None:
    """Give every variable the value it takes under ``choice`` (a MIP start)."""
    for v in range(problem.num_nodes):
        for i, x in model.x[v].items():
            x.setInitialValue(1 if choice[v] == i else 0)
    for var in model.lp.variables():
        if var.name.startswith("y_"):
            _, e, i, j = var.name.split("_")
            u, w = problem.edges[int(e)]
            var.setInitialValue(1 if choice[u] == int(i) and choice[w] == int(j) else 0)
