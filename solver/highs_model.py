r"""The MILP, built as numpy arrays and solved with HiGHS (:mod:`solver.ilp` hands the same
arrays to CBC through PuLP, so both backends solve one model).

The problem first goes through the exact reductions it shares with the exact CFN
(:func:`reduce`): tied nodes become one node (one set of columns, costs summed, edges
re-attached, :func:`_tie_map`), parallel edges are summed, and dominated strategies dropped
(:func:`drop_dominated`). Over what is left (``A_v``: the allowed strategies of v):

Variables (:func:`_node_columns`, :func:`_edge_columns`)
    x[v,i] in {0,1}    node v takes strategy i, i in A_v        (nodes with |A_v| > 1)
    y[e,i,j] in [0,1]  edge e=(u,v) takes the pair (i,j)        (non-forbidden pairs only;
                        integral whenever x is, by the marginal rows)

Objective (:func:`_node_columns`, :func:`_edge_columns`; folds in :func:`_fold_edges`)
    min  sum_v sum_i c_v[i] x[v,i]  +  sum_e sum_(i,j) C_e[i,j] y[e,i,j]  +  const
    where an edge with a fixed endpoint (|A| = 1) folds into the other endpoint's cost, a
    rank-one matrix C[i,j] = r[i] + s[j] into both endpoints' costs, and fixed nodes into
    ``const``; none of them adds a y.

Constraints
    one strategy per node   sum_i x[v,i] = 1                        (:func:`_one_hot_rows`)
    edge marginals          sum_j y[e,i,j] = x[u,i]   for all i     (:func:`_edge_columns`)
                            sum_i y[e,i,j] = x[v,j]   for all j
    memory                  sum_v sum_i m_v[i] x[v,i] <= rhs_t      (:func:`_memory_rows`)
                            one row per distinct live set that matters, tie groups aggregated
                            and strategy-independent usage moved to the right-hand side
                            (:func:`solver.memrows.memory_rows`)
    ties                    by construction: tied nodes share their columns

PuLP creates one Python object per variable and per coefficient: on the IOPDDL instances
(2-3 million edge variables) its model build alone took over 10 minutes and 13 GB, so
the model is arrays and HiGHS gets them in a few calls.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from solver.evaluate import memory_profile
from solver.memrows import SPARSE_ENTRIES, RowsTooLarge, live_matrix, memory_rows
from solver.problem import FORBIDDEN, Problem, ProvedInfeasible


class ModelTooLarge(RuntimeError):
    """The MILP would exceed the nonzero budget: solve falls back to its heuristics."""


@dataclass
class ArrayModel:
    """Columns, rows and the maps back to the problem."""

    cost: np.ndarray
    upper: np.ndarray
    integer: np.ndarray
    """Boolean per column."""
    row_lower: list = field(default_factory=list)
    row_upper: list = field(default_factory=list)
    row_index: list = field(default_factory=list)
    """Per row block, (row ids repeated per nonzero, column ids, values)."""
    n_rows: int = 0
    const: float = 0.0
    node_cols: list = field(default_factory=list)
    """Per node: column of each strategy (-1 where not a variable)."""
    fixed: dict = field(default_factory=dict)
    edge_blocks: list = field(default_factory=list)
    """(u, v, first y column, i per y, j per y) per edge with y variables."""
    stats: dict = field(default_factory=dict)

    def add_rows(self, lower, upper, rows, cols, vals):
        rows = np.asarray(rows, dtype=np.int64)
        self.row_lower.append(np.asarray(lower, dtype=np.float64))
        self.row_upper.append(np.asarray(upper, dtype=np.float64))
        self.row_index.append((rows + self.n_rows, np.asarray(cols, dtype=np.int64), np.asarray(vals, np.float64)))
        self.n_rows += len(lower)


def _allowed(problem: Problem) -> list[np.ndarray]:
    return [np.nonzero(problem.allowed(v))[0] for v in range(problem.num_nodes)]


def _tie_map(problem: Problem, allowed: list[np.ndarray]) -> np.ndarray:
    """``rep[v]``: the first node of v's tie group (v itself when untied).

    Tied nodes share one set of columns, so a group of L tied layers costs the
    MILP one layer; the group's allowed strategies are the intersection of its
    members' (a pin or a forbidden strategy on one member binds them all).
    """
    from solver.quotient import tie_heads

    rep = tie_heads(problem)
    for group in problem.ties:
        common = allowed[group[0]]
        for w in group:
            a = allowed[w]
            # Members mostly allow the same strategies: compared first, intersected only where
            # they differ (intersect1d per member was 1.5 s of LLaMA-70B's 29k tied nodes).
            if a is not common and not (a.size == common.size and np.array_equal(a, common)):
                common = np.intersect1d(common, a, assume_unique=True)
        if common.size == 0:
            raise ProvedInfeasible(f"tie {sorted(group)[:5]}...: no strategy is allowed for every tied node")
        for w in group:
            allowed[w] = common
    return rep


def drop_dominated(problem: Problem, rep: np.ndarray, allowed: list[np.ndarray], linear: list[np.ndarray],
                   pairs: dict[tuple[int, int], np.ndarray], rounds: int = 3, use_usage: bool = True) -> int:
    """Remove strategies that another strategy of the same node beats everywhere; returns how many.

    Strategy i of (tie group) v is dominated by j when j costs no more on v itself,
    uses no more memory on any member, and costs no more on every incident edge
    against every allowed strategy of the neighbour. Swapping i for j in any
    solution then keeps it feasible and no dearer, so some optimum avoids i
    (exact). Equal strategies keep the first. Dropping strategies of a neighbour
    can create new dominance, hence a few rounds. On planner graphs this removes
    about 40% of the strategies (LLaMA blocks on an (8, 8) mesh).
    """
    n = problem.num_nodes
    members: dict[int, list[int]] = {}
    for v in range(n):
        members.setdefault(int(rep[v]), []).append(v)
    adj: dict[int, list] = {}
    for (u, v), m in pairs.items():
        adj.setdefault(u, []).append((v, m, False))
        adj.setdefault(v, []).append((u, m, True))
    total = 0
    visit = set(members)
    for _ in range(rounds):
        removed, changed = 0, []
        for v, mem in members.items():
            a = allowed[v]
            if a.size < 2 or v not in visit:
                continue
            cols = [linear[v][a][:, None]]
            if use_usage:
                usage = {problem.node_usages[w][a].tobytes(): problem.node_usages[w][a] for w in mem}
                cols += [u[:, None] for u in usage.values()]
            for w, m, transposed in adj.get(v, []):
                cols.append(m[np.ix_(allowed[w], a)].T if transposed else m[np.ix_(a, allowed[w])])
            keep = _undominated(np.hstack(cols))
            if not keep.all():
                removed += int((~keep).sum())
                changed.append(v)
                for w in mem:
                    allowed[w] = a[keep]
        total += removed
        if not removed:
            break
        # Only a node whose neighbour lost strategies can have new dominance (its own kept
        # strategies beat none of each other): the others' visits would remove nothing.
        visit = {w for v in changed for w, _, _ in adj.get(v, [])}
    return total


#: Columns a dominance is first tested on (every pair of strategies at once); only the pairs
#: that pass are tested on all columns.
_SKETCH_COLUMNS = 16
#: Pairs tested on all columns at once: bounds the comparison's temporary array (entries).
_PAIR_CHUNK = 1 << 22


def _undominated(rows: np.ndarray) -> np.ndarray:
    """Which rows no earlier-kept row beats: row j beats row i when it is no larger in every
    column (to a relative 1e-9); rows are visited by increasing sum, and a row beaten by a kept
    one is dropped (equal rows keep the first).

    ``j`` beats ``i`` only if it does on any subset of the columns, so every pair is first tested
    on a few columns at once, and only the pairs that pass are tested on all of them (testing
    each kept row against all rows was 40% of a pinned solve of LLaMA-8B on a 3-D mesh, 100k
    row comparisons)."""
    k = rows.shape[0]
    slack = rows + 1e-9 * np.abs(rows)
    sketch = np.unique(np.linspace(0, rows.shape[1] - 1, min(_SKETCH_COLUMNS, rows.shape[1])).astype(np.int64))
    beats = np.empty((k, k), dtype=bool)
    step = max(1, _PAIR_CHUNK // (k * sketch.size))
    for lo in range(0, k, step):
        beats[lo:lo + step] = (rows[lo:lo + step, None, sketch] <= slack[None, :, sketch]).all(axis=2)
    np.fill_diagonal(beats, False)
    js, is_ = np.nonzero(beats)
    step = max(1, _PAIR_CHUNK // max(1, rows.shape[1]))
    for lo in range(0, js.size, step):
        j, i = js[lo:lo + step], is_[lo:lo + step]
        beats[j, i] = (rows[j] <= slack[i]).all(axis=1)
    keep = np.ones(k, dtype=bool)
    beating = beats.any(axis=1)
    for j in np.argsort(rows.sum(axis=1), kind="stable").tolist():
        if keep[j] and beating[j]:
            keep &= ~beats[j]
    return keep


@dataclass
class Reduced:
    """The problem over tie groups after the exact reductions that the MILP and the exact
    CFN (:mod:`solver.exact`) share."""

    allowed: list[np.ndarray]
    """Per node, its allowed strategies after dominance (tied nodes share their head's)."""
    rep: np.ndarray
    """``rep[v]``: the head of v's tie group."""
    linear: list[np.ndarray]
    """Per head, the summed node costs of its group (plus diagonals of edges inside it); 0 elsewhere."""
    pairs: dict[tuple[int, int], np.ndarray]
    """Edges between heads, parallel ones summed, keyed (low, high)."""
    dropped: int
    """Strategies removed by dominance."""


def reduce(problem: Problem, memory: bool = True) -> Reduced:
    """Ties as shared strategies, edges merged per pair of groups, dominated strategies
    dropped (with ``memory``, a strategy that uses less memory is never dominated)."""
    n = problem.num_nodes
    allowed = _allowed(problem)
    for v, a in enumerate(allowed):
        if a.size == 0:
            raise ProvedInfeasible(f"node {problem._label(v)} has no allowed strategy (all forbidden or pinned away)")
    rep = _tie_map(problem, allowed)
    linear = [problem.node_costs[v].copy() for v in range(n)]
    for v in np.nonzero(rep != np.arange(n))[0].tolist():
        linear[rep[v]] = linear[rep[v]] + linear[v]
        linear[v] = np.zeros_like(linear[v])
    from solver.quotient import merge_edges

    pairs = merge_edges(problem, rep, linear)
    dropped = drop_dominated(problem, rep, allowed, linear, pairs,
                             use_usage=memory and problem.usage_limit is not None)
    return Reduced(allowed, rep, linear, pairs, dropped)


def build(problem: Problem, max_nonzeros: float = np.inf, memory: bool = True,
          reduced: Reduced | None = None) -> ArrayModel:
    """The MILP as arrays; :class:`ModelTooLarge` when it would pass ``max_nonzeros``.

    With ``memory=False`` the memory rows are left out (and memory plays no part in
    dominance): the relaxation that :func:`solver.solve` tries first. ``reduced``: the
    problem's :func:`reduce` (with ``memory``), computed before; ``problem``'s edges are
    then not read (:mod:`solver.milp_child` gets a copy without them).
    """
    n = problem.num_nodes
    red = reduced if reduced is not None else reduce(problem, memory)
    linear, const, fixed, pairs = _fold_edges(red)
    n_y = sum(int((sub < FORBIDDEN).sum()) for _, _, sub in pairs)
    if 3 * n_y > max_nonzeros:
        raise ModelTooLarge(f"{n_y} edge variables ({3 * n_y:.3g} nonzeros) exceed the budget of {max_nonzeros:.3g}")
    model = _node_columns(problem, red, linear, const, fixed)
    _edge_columns(model, red, pairs)
    _one_hot_rows(model, red, n)
    if memory:
        _memory_rows(model, problem, red.rep, red.allowed, max_nonzeros - 3 * n_y)
    else:
        model.stats["memory_rows"] = 0
    ncol = int(model.integer.sum())
    model.stats.update(dominated_strategies=red.dropped, tied_nodes=int((red.rep != np.arange(n)).sum()),
                       variables=int(model.cost.size), edge_variables=int(model.cost.size - ncol),
                       constraints=model.n_rows, kept_edges=len(pairs),
                       nonzeros=int(sum(r[0].size for r in model.row_index)))
    return model


def _fold_edges(red: Reduced):
    """(node costs, constant, fixed nodes, edges kept): edges at a fixed node fold into the
    other node's cost (or the constant), rank-one edges into both nodes' costs."""
    allowed = red.allowed
    linear = [x.copy() for x in red.linear]
    const = 0.0
    fixed = {v: int(a[0]) for v, a in enumerate(allowed) if a.size == 1}
    merged: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), m in red.pairs.items():
        if u in fixed and v in fixed:
            const += float(m[fixed[u], fixed[v]])
        elif u in fixed:
            linear[v] = linear[v] + m[fixed[u], :]
        elif v in fixed:
            linear[u] = linear[u] + m[:, fixed[v]]
        else:
            merged[(u, v)] = m
    pairs = []
    for (u, v), m in merged.items():
        sub = m[np.ix_(allowed[u], allowed[v])]
        if np.all(sub < FORBIDDEN):
            r = sub[:, 0] - sub[0, 0]
            s = sub[0, :]
            if np.allclose(sub, r[:, None] + s[None, :], rtol=0, atol=1e-9 * max(1.0, float(np.abs(sub).max()))):
                linear[u][allowed[u]] += r
                linear[v][allowed[v]] += s
                continue
        pairs.append((u, v, sub))
    return linear, const, fixed, pairs


def _node_columns(problem: Problem, red: Reduced, linear, const: float, fixed: dict) -> ArrayModel:
    """The x columns (one per allowed strategy of each free tie head; tied nodes share their
    head's) with their costs; fixed nodes add their cost to the constant."""
    n, allowed, rep = problem.num_nodes, red.allowed, red.rep
    node_cols = [np.full(problem.num_strategies(v), -1, dtype=np.int64) for v in range(n)]
    cost_parts, ncol = [], 0
    for v in range(n):
        if rep[v] != v:
            continue
        if v in fixed:
            c = float(linear[v][fixed[v]])
            if c >= FORBIDDEN:
                raise ProvedInfeasible(f"node {problem._label(v)}: its only allowed strategy meets a forbidden edge")
            const += c
            continue
        a = allowed[v]
        node_cols[v][a] = np.arange(ncol, ncol + a.size)
        cost_parts.append(linear[v][a])
        ncol += a.size
    if const >= FORBIDDEN:
        raise ProvedInfeasible("the nodes with a single allowed strategy form a forbidden pair")
    for v in np.nonzero(rep != np.arange(n))[0].tolist():
        node_cols[v] = node_cols[rep[v]]
    x_cost = np.concatenate(cost_parts) if cost_parts else np.zeros(0)
    return ArrayModel(cost=np.where(x_cost >= FORBIDDEN, 0.0, x_cost), upper=np.where(x_cost >= FORBIDDEN, 0.0, 1.0),
                      integer=np.ones(ncol, bool), const=const, node_cols=node_cols, fixed=fixed)


def _edge_columns(model: ArrayModel, red: Reduced, pairs) -> None:
    """The y columns of each kept edge (its non-forbidden pairs) and its two marginal rows per
    endpoint strategy: sum_j y[e,i,j] - x[u,i] = 0 and sum_i y[e,i,j] - x[v,j] = 0."""
    allowed, node_cols = red.allowed, model.node_cols
    y_cost, row_r, row_c, row_v = [], [], [], []
    n_marg, ycol = 0, model.cost.size
    for u, v, sub in pairs:
        ii, jj = np.nonzero(sub < FORBIDDEN)
        k = ii.size
        cols = np.arange(ycol, ycol + k)
        y_cost.append(sub[ii, jj])
        model.edge_blocks.append((u, v, ycol, allowed[u][ii], allowed[v][jj]))
        ku, kv = sub.shape
        # rows n_marg + i (for u's strategy i) and n_marg + ku + j (for v's strategy j)
        row_r += [n_marg + ii, n_marg + ku + jj, n_marg + np.arange(ku), n_marg + ku + np.arange(kv)]
        row_c += [cols, cols, node_cols[u][allowed[u]], node_cols[v][allowed[v]]]
        row_v += [np.ones(k), np.ones(k), -np.ones(ku), -np.ones(kv)]
        n_marg += ku + kv
        ycol += k
    added = ycol - model.cost.size
    if y_cost:
        model.cost = np.concatenate([model.cost, *y_cost])
    model.upper = np.concatenate([model.upper, np.ones(added)])
    model.integer = np.concatenate([model.integer, np.zeros(added, bool)])
    if n_marg:
        model.add_rows(np.zeros(n_marg), np.zeros(n_marg), np.concatenate(row_r), np.concatenate(row_c),
                       np.concatenate(row_v))


def _one_hot_rows(model: ArrayModel, red: Reduced, n: int) -> None:
    """sum_i x[v,i] = 1 for each free tie head v."""
    var_nodes = [v for v in range(n) if v not in model.fixed and red.rep[v] == v]
    if var_nodes:
        cols = np.concatenate([model.node_cols[v][red.allowed[v]] for v in var_nodes])
        rows = np.concatenate([np.full(red.allowed[v].size, k) for k, v in enumerate(var_nodes)])
        model.add_rows(np.ones(len(var_nodes)), np.ones(len(var_nodes)), rows, cols, np.ones(cols.size))


def check_memory_rows(problem: Problem, max_entries: float) -> None:
    """Raise :class:`ModelTooLarge` when the memory rows alone would pass ``max_entries``.

    Counted over tie groups before dominance (an over-estimate): lets ``solve`` skip
    MILP work that could never be finished.
    """
    if problem.usage_limit is None:
        return
    allowed = _allowed(problem)
    rep = _tie_map(problem, allowed)
    try:
        memory_rows(problem, rep, allowed, max_entries)
    except RowsTooLarge as exc:
        raise ModelTooLarge(str(exc)) from exc


def _memory_rows(model: ArrayModel, problem: Problem, rep: np.ndarray, allowed, max_entries: float) -> None:
    """One row per memory row of :func:`solver.memrows.memory_rows` (tied groups aggregated,
    implied rows dropped), over the node columns; large untied problems through
    :func:`_sparse_memory_rows`."""
    if not problem.ties and _live_entries(problem, allowed) > SPARSE_ENTRIES:
        _sparse_memory_rows(model, problem, allowed, max_entries)
        return
    try:
        mr = memory_rows(problem, rep, allowed, max_entries)
    except RowsTooLarge as exc:
        raise ModelTooLarge(str(exc)) from exc
    rr, cc, vv = [], [], []
    for k, row in enumerate(mr.rows):
        for head, coef in zip(row.groups.tolist(), row.coefs):
            nz = coef != 0
            cc.append(model.node_cols[head][allowed[head]][nz])
            vv.append(coef[nz])
            rr.append(np.full(int(nz.sum()), k))
    if mr.rows:
        model.add_rows(np.full(len(mr.rows), -math.inf), np.array([r.rhs for r in mr.rows]),
                       np.concatenate(rr), np.concatenate(cc), np.concatenate(vv))
    model.stats["memory_rows"] = len(mr.rows)
    model.stats["memory_segments"] = mr.segments


def _live_entries(problem: Problem, allowed) -> float:
    """Live-node entries summed over the time points where some node's usage can vary: an
    upper bound on what the rows hold, in one sweep."""
    spread = np.array([problem.node_usages[v][a].max() - problem.node_usages[v][a].min() if a.size else 0.0
                       for v, a in enumerate(allowed)])
    _, live = memory_profile(problem, (spread > 0).astype(np.float64))
    return float(live.sum()) if live.size else 0.0


def _sparse_memory_rows(model: ArrayModel, problem: Problem, allowed, max_entries: float) -> None:
    """The rows of :func:`solver.memrows.live_matrix`, expanded over each node's columns with numpy."""
    try:
        lm = live_matrix(problem, allowed, max_entries)
    except RowsTooLarge as exc:
        raise ModelTooLarge(str(exc)) from exc
    cols, coefs, length = [], [], np.zeros(problem.num_nodes, dtype=np.int64)
    for v in np.unique(lm.node).tolist():
        c = problem.node_usages[v][allowed[v]] - lm.low[v]
        nz = c != 0
        cols.append(model.node_cols[v][allowed[v]][nz])
        coefs.append(c[nz])
        length[v] = int(nz.sum())
    start = np.cumsum(length) - length  # nodes in increasing order, as the loop appended them
    per = length[lm.node]
    total = int(per.sum())
    if total > max_entries:
        raise ModelTooLarge(f"{lm.rhs.size} memory rows with {total:.3g} entries exceed the budget of "
                            f"{max_entries:.3g}")
    at = np.repeat(start[lm.node], per) + np.arange(total) - np.repeat(np.cumsum(per) - per, per)
    flat_cols = np.concatenate(cols) if cols else np.zeros(0, dtype=np.int64)
    flat_coefs = np.concatenate(coefs) if coefs else np.zeros(0)
    if lm.rhs.size:
        model.add_rows(np.full(lm.rhs.size, -math.inf), lm.rhs, np.repeat(lm.row, per), flat_cols[at],
                       flat_coefs[at])
    model.stats["memory_rows"] = int(lm.rhs.size)
    model.stats["memory_segments"] = int(lm.rhs.size)


def _interrupt_after(h, deadline: float, stop=None) -> None:
    """Stop HiGHS at ``deadline`` (or once ``stop()`` says so): its own time limit overran by a
    third (44.7 s of 40) on LLaMA-70B's 1.7M columns. Interrupt callbacks come only between
    phases, so this bounds the overrun, it does not remove it."""

    def check(event):
        if time.perf_counter() > deadline or (stop is not None and stop()):
            event.interrupt()

    h.cbMipInterrupt += check
    h.cbSimplexInterrupt += check
    h.cbIpmInterrupt += check


def _report_to(h, const: float, report) -> None:
    seen = {"bound": -math.inf}

    def improved(event):
        report("incumbent", float(event.data_out.objective_function_value) + const)

    def bound(event):
        lower = float(event.data_out.mip_dual_bound)
        if math.isfinite(lower) and lower > seen["bound"]:
            seen["bound"] = lower
            report("bound", lower + const)

    h.cbMipImprovingSolution += improved
    h.cbMipInterrupt += bound


def row_matrix(model: ArrayModel):
    """The rows in compressed form: (row starts, columns, values, lower bounds, upper bounds)."""
    r = np.concatenate([b[0] for b in model.row_index])
    c = np.concatenate([b[1] for b in model.row_index])
    v = np.concatenate([b[2] for b in model.row_index])
    order = np.argsort(r, kind="stable")
    r, c, v = r[order], c[order], v[order]
    starts = np.searchsorted(r, np.arange(model.n_rows)).astype(np.int32)
    return starts, c.astype(np.int32), v, np.concatenate(model.row_lower), np.concatenate(model.row_upper)


def to_highs(model: ArrayModel, time_limit: float, mip_gap: float, threads: int = 1, log: bool = False,
             stop=None):
    import highspy

    h = highspy.Highs()
    _interrupt_after(h, time.perf_counter() + max(0.1, time_limit) + 0.5, stop)
    h.setOptionValue("output_flag", bool(log))
    h.setOptionValue("time_limit", float(max(0.1, time_limit)))
    h.setOptionValue("mip_rel_gap", float(mip_gap))
    h.setOptionValue("threads", int(threads))
    h.setOptionValue("random_seed", 0)
    nc = model.cost.size
    h.addCols(nc, model.cost, np.zeros(nc), model.upper, 0, np.zeros(0, np.int32), np.zeros(0, np.int32),
              np.zeros(0))
    ints = np.nonzero(model.integer)[0].astype(np.int32)
    if ints.size:
        h.changeColsIntegrality(ints.size, ints, np.ones(ints.size, dtype=np.uint8))
    if model.n_rows:
        starts, c, v, lower, upper = row_matrix(model)
        h.addRows(model.n_rows, np.where(np.isinf(lower), -highspy.kHighsInf, lower),
                  np.where(np.isinf(upper), highspy.kHighsInf, upper), c.size, starts, c, v)
    return h


def solve_model(model: ArrayModel, n: int, seconds: float, mip_gap: float, start: np.ndarray | None = None,
                stop=None, report=None) -> tuple[np.ndarray | None, float | None, bool]:
    """HiGHS on ``model`` (of a problem with ``n`` nodes) for ``seconds``, from ``start`` when
    given: (choice or None, proven lower bound or None, proved optimal). It ends early, with
    its incumbent, once ``stop()`` is true (asked between HiGHS's phases); ``report(kind,
    value)`` hears of each improving answer (``"incumbent"``) and raised dual bound
    (``"bound"``), in the problem's cost units."""
    import highspy

    if model.cost.size == 0:  # the reductions fixed every node
        return extract(model, np.zeros(0), n), model.const, True
    h = to_highs(model, seconds, mip_gap, stop=stop)
    if report is not None:
        _report_to(h, model.const, report)
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = start_vector(model, start).tolist()
        sol.value_valid = True
        h.setSolution(sol)
    h.run()
    info = h.getInfo()
    lower = float(info.mip_dual_bound) + model.const if math.isfinite(info.mip_dual_bound) else None
    choice = None
    if info.primal_solution_status >= 2:
        choice = extract(model, np.asarray(h.getSolution().col_value), n)
    return choice, lower, h.getModelStatus() == highspy.HighsModelStatus.kOptimal


def start_vector(model: ArrayModel, choice: np.ndarray) -> np.ndarray:
    x = np.zeros(model.cost.size)
    for v, cols in enumerate(model.node_cols):
        c = cols[choice[v]]
        if c >= 0:
            x[c] = 1.0
    for u, v, first, ii, jj in model.edge_blocks:
        hit = np.nonzero((ii == choice[u]) & (jj == choice[v]))[0]
        if hit.size:
            x[first + hit[0]] = 1.0
    return x


def extract(model: ArrayModel, values: np.ndarray, n: int) -> np.ndarray | None:
    choice = np.zeros(n, dtype=np.int64)
    for v in range(n):
        if v in model.fixed:
            choice[v] = model.fixed[v]
            continue
        cols = model.node_cols[v]
        idx = np.nonzero(cols >= 0)[0]
        vals = values[cols[idx]]
        k = int(np.argmax(vals))
        if vals[k] < 0.5:
            return None
        choice[v] = idx[k]
    return choice
