r"""Memory rows over tie groups: aggregated, deduplicated, pruned by dominance.

Every time segment k gives one memory row over the nodes live on it,

    sum_(v live on k) m_v(s_v) <= L   <=>   sum_(v in S_k) (m_v(s_v) - low_v) <= L - b_k,

with ``low_v`` the least allowed usage of v, ``S_k`` the live nodes whose usage varies
and ``b_k`` the least usage of everything live (:func:`memory_segments`
keeps the segments no neighbour implies). Tied nodes take one strategy, so in the tie
quotient the row reads, per group g with strategy i,

    sum_g  a_kg(i) x_g,i <= L - b_k,     a_kg(i) = sum_(v in S_k, v in g) (m_v(i) - low_v).

Members of a group with equal usage vectors form a *class*; a row is then a count of
live members per class. A model with 80 tied layers has thousands of segments but few
classes (LLaMA-70B on (8, 8, 8): 6,979 segments, 155 classes, at most 29 groups a row):

- rows with the same counts keep the smallest right-hand side (:func:`distinct_rows`);
- row k is implied by rows i and j when its counts are their mean and its right-hand side
  at least theirs (every coefficient is >= 0, so the mean of rows i and j is a valid row).
  Tied layers make such rows common: the segment at one place in layer l has the counts
  ``A + l * D`` (D: what each earlier layer leaves live), so along the layers the rows form
  arithmetic progressions and only each progression's ends bind (:func:`_midpoints`);
- row k is implied by row j when counts_j >= counts_k class by class and
  L - b_j <= L - b_k, since every coefficient is >= 0 (:func:`_undominated`).

On LLaMA-70B on (8, 8, 8) with full recomputation: 9,380 distinct rows, 293 after the
progressions (0.2 s), 225 after dominance.

Both the MILP (:mod:`solver.highs_model`) and the exact CFN (:mod:`solver.exact`) read
these rows, so the two solve the same memory model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.evaluate import memory_profile
from solver.problem import Problem, ProvedInfeasible

#: Largest number of live-node entries (summed over segments) materialized before
#: aggregation, and of (segment group x class) counts; the industrial IOPDDL instances
#: (untied, ~1e8) stop here.
MAX_NODE_ENTRIES = 2e7

#: Dominance checks (row x kept row x class comparisons) made before the rest are kept unchecked.
MAX_DOMINANCE_WORK = 2e9


class RowsTooLarge(Exception):
    """The memory rows would pass the entry budget."""


class MemoryInfeasible(ProvedInfeasible):
    """Some segment's least usage alone is above the limit."""

    def __init__(self, base: float, limit: float):
        super().__init__(f"memory limit {limit:g} is below the least usage {base:g} of one time segment")
        self.base, self.limit = base, limit


@dataclass(frozen=True)
class Row:
    """``sum_j coefs[j][x_groups[j]] <= rhs``: one memory row in tie-group space."""

    groups: np.ndarray
    """Tie-group heads (node ids) with a nonzero coefficient."""
    coefs: list[np.ndarray]
    """Per group, the usage above the least for each of its allowed strategies (>= 0)."""
    rhs: float


@dataclass(frozen=True)
class MemoryRows:
    """The rows of :func:`memory_rows` and what they came from."""

    rows: list[Row]
    segments: int
    """Segments before deduplication and dominance."""
    entries: int
    """Sum over rows and groups of the allowed strategy counts."""


@dataclass(frozen=True)
class _Segments:
    """The kept segment groups of :func:`kept_segments`: runs of time segments with the same
    live varying nodes, each keeping the largest base usage."""

    times: np.ndarray
    vn: np.ndarray
    """The live varying nodes."""
    gid: np.ndarray
    """``gid[t]``: the group of time segment t."""
    gfirst: np.ndarray
    """First segment of each group."""
    gbase: np.ndarray
    keep: np.ndarray
    """Groups whose row no neighbour implies."""


def kept_segments(problem: Problem, varying: np.ndarray, base_usage: np.ndarray,
                  spread: np.ndarray | None = None) -> _Segments | None:
    """Time splits into segments between interval endpoints; on segment k the varying nodes
    S_k are live and the least usage of everything live is b_k. The row of k reads
    sum_(v in S_k) (usage_v - least_v) <= limit - b_k. It is implied by a neighbour j when
    S_k is a subset of S_j (no varying node starts or ends between them, in the right
    direction) and b_k <= b_j. Runs of segments with the same S keep the largest b;
    neighbours then differ in S, so no two rows drop each other, and the survivors imply
    every dropped row. With ``spread`` (per node, its largest allowed usage less its least)
    a row that cannot bind, b_k + sum_(v in S_k) spread_v <= limit, is dropped too: on a
    sub-problem around an answer that fits (:mod:`solver.recombine`) most rows are such. A row
    that a neighbour implies cannot bind when that neighbour cannot. None when there is no
    segment."""
    iv = problem.intervals
    live = iv[:, 1] > iv[:, 0]
    times, base_total = memory_profile(problem, np.where(live, base_usage, 0.0))
    if times.size < 2:
        return None
    vn = np.nonzero(varying & live)[0]
    # Per boundary (times[k]) whether a varying node starts / ends there.
    vstart = np.zeros(times.size, dtype=bool)
    vend = np.zeros(times.size, dtype=bool)
    vstart[np.searchsorted(times, iv[vn, 0])] = True
    vend[np.searchsorted(times, iv[vn, 1])] = True
    nseg = times.size - 1
    # Merge runs without varying changes: segment groups g, base = max over the run.
    new_group = vstart[:nseg] | vend[:nseg]
    new_group[0] = True
    gid = np.cumsum(new_group) - 1
    ng = int(gid[-1]) + 1
    gbase = np.full(ng, -np.inf)
    np.maximum.at(gbase, gid, base_total[:nseg])
    gfirst = np.nonzero(new_group)[0]
    keep = np.ones(ng, dtype=bool)
    for g in range(ng):
        t_left = gfirst[g]
        if g > 0 and not vstart[t_left] and gbase[g] <= gbase[g - 1]:
            keep[g] = False  # only ends at the left boundary: S_g is inside S_(g-1)
            continue
        if g + 1 < ng:
            t_right = gfirst[g + 1]
            if not vend[t_right] and gbase[g] <= gbase[g + 1]:
                keep[g] = False  # only starts at the right boundary: S_g is inside S_(g+1)
    if spread is not None and problem.usage_limit is not None:
        events = np.zeros(times.size)
        np.add.at(events, np.searchsorted(times, iv[vn, 0]), spread[vn])
        np.add.at(events, np.searchsorted(times, iv[vn, 1]), -spread[vn])
        most = gbase + np.cumsum(events)[gfirst]
        keep &= most > float(problem.usage_limit) * (1 + 1e-12)
    return _Segments(times, vn, gid, gfirst, gbase, keep)


def memory_segments(problem: Problem, varying: np.ndarray, base_usage: np.ndarray, max_entries: float = np.inf,
                    spread: np.ndarray | None = None):
    """The memory rows that are not implied by others (:func:`kept_segments`), as
    ``[(live varying nodes, base usage)]``; :class:`RowsTooLarge` when the live sets would
    hold more than ``max_entries`` nodes in all."""
    seg = kept_segments(problem, varying, base_usage, spread)
    if seg is None:
        return []
    iv, times, vn, gfirst, gbase, keep = problem.intervals, seg.times, seg.vn, seg.gfirst, seg.gbase, seg.keep
    ng = gfirst.size
    # Live-node entries of the kept rows, from live counts alone, before any set is built.
    w_start = np.zeros(times.size)
    np.add.at(w_start, np.searchsorted(times, iv[vn, 0]), 1.0)
    np.add.at(w_start, np.searchsorted(times, iv[vn, 1]), -1.0)
    entries = float(np.cumsum(w_start)[gfirst][keep].sum())
    if entries > max_entries:
        raise RowsTooLarge(f"{int(keep.sum())} memory rows with ~{entries:.3g} live-node entries exceed the "
                           f"budget of {max_entries:.3g}")
    # Sweep once more, materializing the kept sets.
    starts = {}
    ends = {}
    for v in vn.tolist():
        starts.setdefault(int(np.searchsorted(times, iv[v, 0])), []).append(v)
        ends.setdefault(int(np.searchsorted(times, iv[v, 1])), []).append(v)
    cur: set[int] = set()
    out = []
    for g in range(ng):
        for t in range(gfirst[g - 1] + 1 if g > 0 else 0, gfirst[g] + 1):
            for v in ends.get(t, []):
                cur.discard(v)
            cur.update(starts.get(t, []))
        if keep[g] and cur:
            out.append((np.array(sorted(cur), dtype=np.int64), float(gbase[g])))
        elif keep[g] and gbase[g] > (problem.usage_limit or np.inf):
            out.append((np.zeros(0, dtype=np.int64), float(gbase[g])))
    return out


def class_counts(problem: Problem, seg: _Segments, cls: np.ndarray, n_classes: int, limit: float):
    """The kept segments' rows as live members per class, ``[(classes, counts, limit - base)]``
    deduplicated as :func:`distinct_rows` does, without building any live set: every varying node
    starts and ends on a group boundary, so a (groups x classes) table of +1 at its first
    group and -1 after its last, summed down the groups, counts each group's live members."""
    iv, times, vn = problem.intervals, seg.times, seg.vn
    ng = seg.gfirst.size
    nseg = times.size - 1
    first_g = seg.gid[np.searchsorted(times, iv[vn, 0])]
    end_t = np.searchsorted(times, iv[vn, 1])
    end_g = np.where(end_t < nseg, seg.gid[np.minimum(end_t, nseg - 1)], ng)
    table = np.zeros((ng + 1, n_classes), dtype=np.int32)
    np.add.at(table, (first_g, cls[vn]), 1)
    np.add.at(table, (end_g, cls[vn]), -1)
    live = np.cumsum(table[:ng], axis=0, dtype=np.int32)[seg.keep]
    seen: dict[bytes, int] = {}
    out: list[tuple[np.ndarray, np.ndarray, float]] = []
    for counts, base in zip(live, seg.gbase[seg.keep].tolist()):
        c = np.nonzero(counts)[0]
        if c.size == 0:
            if base > limit:
                raise MemoryInfeasible(base, limit)
            continue
        key = counts.tobytes()
        k = seen.get(key)
        if k is None:
            seen[key] = len(out)
            out.append((c, counts[c].astype(np.int64), limit - base))
        elif limit - base < out[k][2]:
            out[k] = (out[k][0], out[k][1], limit - base)
    return out


def least_usage(problem: Problem, allowed: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(``low[v]``: least allowed usage, ``varying[v]``: whether v's allowed usages differ)."""
    low = np.array([problem.node_usages[v][a].min() for v, a in enumerate(allowed)])
    high = np.array([problem.node_usages[v][a].max() for v, a in enumerate(allowed)])
    return low, high > low


def tie_classes(problem: Problem, rep: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """(``cls[v]``, a member of each class): nodes of one tie group with equal usage vectors."""
    keys: dict = {}
    cls = np.empty(problem.num_nodes, dtype=np.int64)
    first: list[int] = []
    for v in range(problem.num_nodes):
        k = (int(rep[v]), problem.node_usages[v].tobytes())
        c = keys.get(k)
        if c is None:
            c = keys[k] = len(first)
            first.append(v)
        cls[v] = c
    return cls, first


def distinct_rows(segments, cls: np.ndarray, limit: float) -> list[tuple[np.ndarray, np.ndarray, float]]:
    seen: dict[tuple[bytes, bytes], tuple[np.ndarray, np.ndarray, float]] = {}
    for live, base in segments:
        if live.size == 0:
            if base > limit:
                raise MemoryInfeasible(base, limit)
            continue
        c, count = np.unique(cls[live], return_counts=True)
        key = (c.tobytes(), count.tobytes())
        old = seen.get(key)
        if old is None or limit - base < old[2]:
            seen[key] = (c, count, limit - base)
    return list(seen.values())


#: Work (row comparisons) :func:`_midpoints` may spend looking for each pass's period.
MAX_PERIOD_WORK = 5e7


def _count_matrix(rows: list[tuple[np.ndarray, np.ndarray, float]]) -> tuple[np.ndarray, np.ndarray]:
    """(``counts[k, j]``: live members of the j-th class used anywhere in row k, ``rhs[k]``)."""
    used = np.unique(np.concatenate([c for c, _, _ in rows]))
    pos = np.full(int(used.max()) + 1, -1, dtype=np.int64)
    pos[used] = np.arange(used.size)
    counts = np.zeros((len(rows), used.size), dtype=np.int64)
    for k, (c, count, _) in enumerate(rows):
        counts[k, pos[c]] = count
    return counts, np.array([h for _, _, h in rows])


def _midpoints(rows: list[tuple[np.ndarray, np.ndarray, float]]) -> list[int]:
    """Indices of ``rows`` (in time order) left once every row that is the mean of the rows P
    before and P after it (counts exactly, right-hand side at most) is dropped.

    A maximal run of such rows, P apart, lies on one arithmetic progression whose two ends
    are not dropped; each dropped row is a convex combination of those ends, so the ends
    imply it. Each pass finds the period P that most rows fit by a random linear hash of
    the counts (a match is then checked exactly) and drops those rows; passes repeat on
    what is left, each implied by its own survivors, while they drop at least 1%.
    """
    if len(rows) < 3:
        return list(range(len(rows)))
    counts, rhs = _count_matrix(rows)
    tol = 1e-12 * float(np.abs(rhs).max())  # sums of the same terms in another order
    hash_weights = np.random.default_rng(0).integers(1, 1 << 20, counts.shape[1])
    alive = np.arange(len(rows))
    while alive.size >= 3:
        c, h_rhs = counts[alive], rhs[alive]
        n = alive.size
        h = c @ hash_weights
        best_m, best_p = 0, 0
        for p in range(1, min((n - 1) // 2, int(MAX_PERIOD_WORK // n)) + 1):
            m = int(np.count_nonzero(h[:-2 * p] + h[2 * p:] == 2 * h[p:-p]))
            if m > best_m:
                best_m, best_p = m, p
        if best_m < max(1, 0.01 * n):
            break
        p = best_p
        mid = np.zeros(n, dtype=bool)
        mid[p:-p] = ((c[:-2 * p] + c[2 * p:]) == 2 * c[p:-p]).all(axis=1) & (
            2 * h_rhs[p:-p] >= h_rhs[:-2 * p] + h_rhs[2 * p:] - tol)
        if not mid.any():
            break
        alive = alive[~mid]
    return alive.tolist()


def _undominated(rows: list[tuple[np.ndarray, np.ndarray, float]]) -> list[int]:
    """Indices of rows no other kept row implies, tightest first. Each row is checked against
    the rows kept so far; past :data:`MAX_DOMINANCE_WORK` the rest are kept unchecked (an
    implied row left in is harmless)."""
    if not rows:
        return []
    counts, rhs = _count_matrix(rows)
    r, width = counts.shape
    # Tightest first (then fullest), so a row is only ever checked against rows that can imply it.
    order = np.lexsort((-counts.sum(axis=1), rhs)).tolist()
    kept = np.empty((r, width), dtype=counts.dtype)
    out: list[int] = []
    work = 0.0
    for pos_k, k in enumerate(order):
        work += float(len(out)) * width
        if work > MAX_DOMINANCE_WORK:
            return out + order[pos_k:]
        if out and (kept[: len(out)] >= counts[k]).all(axis=1).any():
            continue
        kept[len(out)] = counts[k]
        out.append(k)
    return out


@dataclass(frozen=True)
class LiveMatrix:
    """Memory rows of an untied problem as (row, node) pairs: row ``row[j]`` holds node ``node[j]``
    with coefficients ``m_v(i) - low_v``; ``rhs[r]`` is its right-hand side."""

    rhs: np.ndarray
    row: np.ndarray
    node: np.ndarray
    low: np.ndarray
    """``low[v]``: the least allowed usage of v (its coefficients are the usage above it)."""


#: Live-node entries past which an untied problem's rows are built by :func:`live_matrix`.
SPARSE_ENTRIES = 2e5


def live_matrix(problem: Problem, allowed: list[np.ndarray], max_entries: float = np.inf) -> LiveMatrix:
    """The rows of :func:`kept_segments` (those that can bind and that no neighbour implies) for
    a problem without ties, built as arrays: each varying node is live on a contiguous range of
    kept rows, so its (row, node) pairs are one ``arange``. Rows are neither deduplicated nor
    checked for dominance (a repeated or implied row is harmless to the MILP): where every node
    is its own class, that materialization cost a Python step per entry (IOPDDL T's merges: 5e6
    entries, 100 s). :class:`RowsTooLarge` past ``max_entries``, :class:`MemoryInfeasible` where a
    row with nothing to choose already breaks the limit."""
    limit = float(problem.usage_limit)
    low, varying = least_usage(problem, allowed)
    spread = np.array([problem.node_usages[v][a].max() for v, a in enumerate(allowed)]) - low
    seg = kept_segments(problem, varying, low, spread)
    empty = np.zeros(0, dtype=np.int64)
    if seg is None:
        return LiveMatrix(np.zeros(0), empty, empty, low)
    iv, times, vn = problem.intervals, seg.times, seg.vn
    ng, nseg = seg.gfirst.size, times.size - 1
    first_g = seg.gid[np.searchsorted(times, iv[vn, 0])]
    end_t = np.searchsorted(times, iv[vn, 1])
    end_g = np.where(end_t < nseg, seg.gid[np.minimum(end_t, nseg - 1)], ng)
    kept_before = np.concatenate([[0], np.cumsum(seg.keep)])  # kept row index of group g
    lo, hi = kept_before[first_g], kept_before[end_g]
    counts = hi - lo
    total = int(counts.sum())
    if total > max_entries:
        raise RowsTooLarge(f"{int(seg.keep.sum())} memory rows with {total:.3g} live-node entries exceed the "
                           f"budget of {max_entries:.3g}")
    row = np.repeat(lo, counts) + np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    node = np.repeat(vn, counts)
    rhs = limit - seg.gbase[seg.keep]
    used = np.zeros(rhs.size, dtype=bool)
    used[row] = True
    if (rhs[~used] < 0).any():
        raise MemoryInfeasible(float(limit - rhs[~used].min()), limit)
    renumber = np.cumsum(used) - 1
    return LiveMatrix(rhs[used], renumber[row], node, low)


def memory_rows(problem: Problem, rep: np.ndarray, allowed: list[np.ndarray],
                max_entries: float = np.inf, progressions: bool = True, binding: bool = True) -> MemoryRows:
    """The memory rows of ``problem`` over tie-group heads ``rep`` with the final ``allowed``
    strategies (after reductions; tied nodes share their head's). :class:`RowsTooLarge` past
    ``max_entries``; :class:`MemoryInfeasible` when a segment's least usage breaks the limit.
    ``progressions=False`` keeps the rows inside progressions (:func:`_midpoints`), ``binding=False``
    the rows that cannot bind (:func:`kept_segments`), for comparison."""
    if problem.usage_limit is None:
        return MemoryRows([], 0, 0)
    limit = float(problem.usage_limit)
    low, varying = least_usage(problem, allowed)
    spread = np.array([problem.node_usages[v][a].max() for v, a in enumerate(allowed)]) - low if binding else None
    cls, first = tie_classes(problem, rep)
    seg = kept_segments(problem, varying, low, spread)
    if seg is None:
        segments, distinct = 0, []
    elif seg.gfirst.size * len(first) <= MAX_NODE_ENTRIES:  # tied layers: few classes, count them
        segments = int(seg.keep.sum())
        distinct = class_counts(problem, seg, cls, len(first), limit)
    else:  # about a class per node (untied graphs): the live sets themselves
        live_sets = memory_segments(problem, varying, low, min(max_entries, MAX_NODE_ENTRIES), spread)
        segments = len(live_sets)
        distinct = distinct_rows(live_sets, cls, limit)
    if progressions:
        distinct = [distinct[k] for k in _midpoints(distinct)]
    keep = _undominated(distinct)
    rows: list[Row] = []
    entries = 0
    for k in keep:
        c, count, rhs = distinct[k]
        terms: dict[int, np.ndarray] = {}
        for ci, times in zip(c.tolist(), count.tolist()):
            v = first[ci]
            head = int(rep[v])
            extra = times * (problem.node_usages[v][allowed[head]] - low[v])
            terms[head] = terms[head] + extra if head in terms else extra
        heads = sorted(h for h, e in terms.items() if e.any())
        entries += sum(allowed[h].size for h in heads)
        if entries > max_entries:
            raise RowsTooLarge(f"{len(keep)} memory rows (of {segments} segments) with over "
                               f"{entries:.3g} entries exceed the budget of {max_entries:.3g}")
        if not heads:
            continue
        rows.append(Row(np.array(heads, dtype=np.int64), [terms[h] for h in heads], rhs))
    return MemoryRows(rows, segments, entries)
