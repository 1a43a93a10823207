"""The strategy graph: what the solver optimizes.

A :class:`Problem` is a superset of the IOPDDL contest format. Every node ``v``
has ``k_v`` candidate strategies, each with a cost and a memory usage, and a
half-open liveness interval ``[lo, hi)``. Every edge ``(u, v)`` has a
``k_u x k_v`` cost matrix. At every integer time ``t`` the chosen usages of the
nodes live at ``t`` must sum to at most ``usage_limit``. On top of the contest
format: pins (node fixed to one strategy) and ties (nodes that must pick the
same strategy index: repeated layers). A cost at or above ``FORBIDDEN`` (or
``inf``) marks a choice that must never be made.

Everything is numpy arrays, one array per node or edge, never a Python object
per strategy: industrial instances have tens of thousands of nodes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

#: Costs at or above this value mark forbidden choices (the contest uses ~1e15+).
FORBIDDEN = 1e15


class ProblemError(ValueError):
    """A problem whose arrays are inconsistent with each other."""


class ProvedInfeasible(Exception):
    """A reduction proved that no choice of strategies is feasible (every strategy of a node is
    forbidden, forced choices meet a forbidden pair, a segment's least usage breaks the limit).
    Raised only by the code that proves it, so that any other error surfaces as itself."""


@dataclass
class Problem:
    """A strategy graph with memory liveness, pins and ties.

    Arrays are validated and normalized (to float64 / int64) in ``__post_init__``.
    """

    node_costs: list[np.ndarray]
    """``node_costs[v][i]``: cost of node ``v`` taking strategy ``i`` (length ``k_v >= 1``)."""
    node_usages: list[np.ndarray]
    """``node_usages[v][i]``: memory usage of node ``v`` under strategy ``i`` (>= 0)."""
    intervals: np.ndarray
    """``(n, 2)`` int64: node ``v`` is live at integer times ``lo <= t < hi``."""
    edges: np.ndarray
    """``(m, 2)`` int64: edge ``e`` joins nodes ``edges[e, 0] -> edges[e, 1]``."""
    edge_costs: list[np.ndarray]
    """``edge_costs[e]``: ``(k_u, k_v)`` matrix of the cost of each strategy pair."""
    usage_limit: float | None = None
    """Memory budget at every time point; ``None`` means unconstrained."""
    pins: dict[int, int] = field(default_factory=dict)
    """Node -> the only strategy index it may take."""
    ties: list[list[int]] = field(default_factory=list)
    """Groups of nodes with equal strategy counts that must all take the same index."""
    name: str = ""
    """Free-form label (instance name, model name) for reports."""
    node_names: list[str] | None = None
    """Optional label per node, used in error messages and reports."""
    tie_quotient: tuple | None = field(default=None, init=False, repr=False, compare=False)
    """Its tie quotient, ``(quotient problem, group per node)`` as :func:`solver.quotient.quotient`
    gives it, where whoever made the problem knew it for less than computing it
    (:class:`solver.weighing.Weighing`); None: computed when asked. Not a constructor argument;
    dropped by :meth:`replaced` when pins or ties change and by :meth:`with_costs`."""

    def __post_init__(self) -> None:
        n = len(self.node_costs)
        if len(self.node_usages) != n:
            raise ProblemError(
                f"node_usages has {len(self.node_usages)} entries but node_costs has {n}: "
                "expected one usage vector per node"
            )
        self.node_costs = [np.atleast_1d(np.asarray(c, dtype=np.float64)) for c in self.node_costs]
        self.node_usages = [np.atleast_1d(np.asarray(u, dtype=np.float64)) for u in self.node_usages]
        for v, (c, u) in enumerate(zip(self.node_costs, self.node_usages)):
            if c.ndim != 1 or c.size == 0:
                raise ProblemError(f"node {self._label(v)}: expected >= 1 strategy costs, found shape {c.shape}")
            if u.shape != c.shape:
                raise ProblemError(
                    f"node {self._label(v)}: {c.size} strategy costs but {u.size} usages; expected equal counts"
                )
        # Values are checked on all nodes at once (per node, four reductions each: 0.25 s of
        # LLaMA-70B's 21k nodes, for every problem the planner builds); the node is found after.
        if n and (np.isnan(np.concatenate(self.node_costs)).any()
                  or not (np.concatenate(self.node_usages) >= 0).all()):  # NaN fails >= too
            for v, (c, u) in enumerate(zip(self.node_costs, self.node_usages)):
                if np.any(u < 0) or np.any(np.isnan(u)):
                    raise ProblemError(f"node {self._label(v)}: usages must be >= 0, found {u.tolist()}")
                if np.any(np.isnan(c)):
                    raise ProblemError(f"node {self._label(v)}: cost is NaN")
        iv = np.asarray(self.intervals, dtype=np.int64).reshape(-1, 2) if n else np.zeros((0, 2), np.int64)
        if iv.shape != (n, 2):
            raise ProblemError(f"intervals: expected shape ({n}, 2), found {iv.shape}")
        bad = np.nonzero(iv[:, 0] > iv[:, 1])[0]
        if bad.size:
            v = int(bad[0])
            raise ProblemError(f"node {self._label(v)}: interval [{iv[v, 0]}, {iv[v, 1]}) has lo > hi")
        self.intervals = iv
        ed = np.asarray(self.edges, dtype=np.int64).reshape(-1, 2)
        if len(self.edge_costs) != ed.shape[0]:
            raise ProblemError(f"{ed.shape[0]} edges but {len(self.edge_costs)} edge cost matrices")
        if ed.size and (ed.min() < 0 or ed.max() >= n):
            raise ProblemError(f"edges reference nodes outside [0, {n}): min {ed.min()}, max {ed.max()}")
        self.edges = ed
        mats = []
        for e, m in enumerate(self.edge_costs):
            u, v = int(ed[e, 0]), int(ed[e, 1])
            ku, kv = self.num_strategies(u), self.num_strategies(v)
            m = np.asarray(m, dtype=np.float64)
            if m.size != ku * kv:
                raise ProblemError(
                    f"edge {e} ({self._label(u)} -> {self._label(v)}): cost matrix has {m.size} entries, "
                    f"expected {ku} x {kv} = {ku * kv}"
                )
            if np.any(np.isnan(m)):
                raise ProblemError(f"edge {e}: cost is NaN")
            mats.append(m.reshape(ku, kv))
        self.edge_costs = mats
        self._check_constraints()

    #: The fields :meth:`replaced` changes without validating the arrays again.
    CONSTRAINTS = ("usage_limit", "pins", "ties", "name", "node_names")

    def replaced(self, **changes) -> Problem:
        """This problem with ``changes`` to :data:`CONSTRAINTS` (budget, pins, ties, labels): the
        arrays are shared, not validated again as ``dataclasses.replace`` would (0.3-0.5 s per
        copy of LLaMA-70B's 1.4M strategies, and the planner makes one per solve and baseline)."""
        other = sorted(set(changes) - set(self.CONSTRAINTS))
        if other:
            raise ProblemError(f"replaced: only {list(self.CONSTRAINTS)} may change, found {other}")
        new = copy.copy(self)
        for name, value in changes.items():
            setattr(new, name, value)
        if "pins" in changes or "ties" in changes:
            new.tie_quotient = None  # the quotient's allowed strategies and groups follow them
        new._check_constraints()
        return new

    def with_edge_costs(self, edge_costs: list[np.ndarray]) -> Problem:
        """This problem with other edge cost matrices (:meth:`with_costs`)."""
        return self.with_costs(edge_costs=edge_costs)

    def with_usages(self, node_usages: list[np.ndarray]) -> Problem:
        """This problem with other node usage vectors, each of the shape of the one it replaces."""
        if len(node_usages) != len(self.node_usages):
            raise ProblemError(f"with_usages: expected {len(self.node_usages)} usage arrays, found {len(node_usages)}")
        arrays = [np.asarray(u, dtype=np.float64) for u in node_usages]
        for k, (u, old) in enumerate(zip(arrays, self.node_usages)):
            if u.shape != old.shape or np.isnan(u).any() or (u < 0).any():
                raise ProblemError(f"with_usages: node {k} expected shape {old.shape}, >= 0, found shape {u.shape}")
        new = copy.copy(self)
        new.node_usages = arrays
        return new

    def with_intervals(self, intervals) -> Problem:
        """This problem with other liveness intervals, one ``[lo, hi)`` per node, ``lo <= hi``."""
        iv = np.asarray(intervals, dtype=np.int64).reshape(-1, 2)
        if iv.shape != self.intervals.shape:
            raise ProblemError(f"with_intervals: expected shape {self.intervals.shape}, found {iv.shape}")
        bad = np.nonzero(iv[:, 0] > iv[:, 1])[0]
        if bad.size:
            v = int(bad[0])
            raise ProblemError(f"with_intervals: node {self._label(v)}: interval [{iv[v, 0]}, {iv[v, 1]}) has lo > hi")
        new = copy.copy(self)
        new.intervals = iv
        return new

    def with_costs(self, node_costs: list[np.ndarray] | None = None,
                   edge_costs: list[np.ndarray] | None = None) -> Problem:
        """This problem with other node cost vectors and/or edge cost matrices, each of the shape
        of the one it replaces (re-weighed costs: the rest of the arrays are shared, not
        validated again)."""
        new = copy.copy(self)
        new.tie_quotient = None
        for label, given, old_list in (("node", node_costs, self.node_costs), ("edge", edge_costs, self.edge_costs)):
            if given is None:
                continue
            if len(given) != len(old_list):
                raise ProblemError(f"with_costs: expected {len(old_list)} {label} cost arrays, found {len(given)}")
            arrays = [np.asarray(m, dtype=np.float64) for m in given]
            for k, (m, old) in enumerate(zip(arrays, old_list)):
                if m.shape != old.shape or np.isnan(m).any():
                    raise ProblemError(f"with_costs: {label} {k} expected shape {old.shape} without NaN, "
                                       f"found shape {m.shape}")
            setattr(new, f"{label}_costs", arrays)
        return new

    def _check_constraints(self) -> None:
        n = len(self.node_costs)
        if self.usage_limit is not None and not self.usage_limit >= 0:
            raise ProblemError(f"usage_limit must be >= 0 or None, found {self.usage_limit}")
        for v, i in self.pins.items():
            if not 0 <= v < n or not 0 <= i < self.num_strategies(v):
                raise ProblemError(
                    f"pin {v} -> {i}: node must be in [0, {n}) and strategy in [0, k_v)"
                )
        for group in self.ties:
            outside = [v for v in group if not 0 <= v < n]
            if outside:
                raise ProblemError(f"tie {group}: nodes {outside} are outside [0, {n})")
            ks = {self.num_strategies(v) for v in group}
            if len(ks) > 1:
                raise ProblemError(f"tie {group}: nodes have different strategy counts {sorted(ks)}")

    def _label(self, v: int) -> str:
        if self.node_names is not None and v < len(self.node_names):
            return f"{v} ({self.node_names[v]})"
        return str(v)

    @property
    def num_nodes(self) -> int:
        return len(self.node_costs)

    @property
    def num_edges(self) -> int:
        return int(self.edges.shape[0])

    def num_strategies(self, v: int) -> int:
        return int(self.node_costs[v].size)

    def allowed(self, v: int) -> np.ndarray:
        """Boolean mask of the strategies of ``v`` that are not forbidden or pinned away."""
        mask = self.node_costs[v] < FORBIDDEN
        if v in self.pins:
            pinned = np.zeros_like(mask)
            pinned[self.pins[v]] = True
            mask &= pinned
        return mask

    def stats(self) -> dict:
        ks = np.array([c.size for c in self.node_costs]) if self.num_nodes else np.zeros(1)
        return {
            "nodes": self.num_nodes,
            "edges": self.num_edges,
            "strategies": int(ks.sum()),
            "max_strategies": int(ks.max()),
            "edge_entries": int(sum(m.size for m in self.edge_costs)),
        }
