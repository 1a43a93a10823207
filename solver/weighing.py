r"""The weighed problems of one problem and its windows, made without copying what does not change.

The overlap decomposition (:func:`solver.overlap.solve_windows`) solves, round after round, the
additive problem of ``L(.; a, b)``: node ``v`` of window ``w`` costs ``a_w c_v``, edge ``e`` of
window ``w`` costs ``(2 - eta_w - a_w - b_w) M_e``, everything else as in the problem, forbidden
entries forbidden. Every cost is its problem's cost times a *scale* ``s_p`` of one of
``2W + 1`` kinds ``p`` (window ``w``'s nodes, its edges, or 1 outside the windows), so
everything a round derives linearly from the costs is a fixed combination of per-kind parts,
computed once here:

- the weighed problem's arrays: the node costs in one flat array scaled by one vector product
  (not one ``np.where`` per node: 6,865 on LLaMA-8B), the windows' edges scaled, the rest
  shared, and nothing validated again (a finite cost times a scale in ``[0, 2]`` is finite;
  checking LLaMA-8B's 4.5M windowed edge entries for NaN would take two-thirds of a round's
  construction);
- its tie quotient (:func:`solver.quotient.quotient`): a group's cost is
  ``F_g + sum_p s_p Q_(g,p)`` where ``Q_(g,p)`` sums the finite costs of the group's members
  and inner edges (their diagonals) of kind ``p`` and ``F_g`` their forbidden entries, unscaled;
  a quotient edge likewise over the problem's edges between the two groups. The weighed
  problem carries it (:attr:`solver.problem.Problem.tie_quotient`), so the pairwise stage and
  the Lagrangian stage do not sum 16M edge entries again each round (LLaMA-8B on (8, 8): 35 ms
  a round).

Where the parts would not be much smaller than the problem (few ties: the quotient about as
large as the problem, and the parts a second copy of it), the quotient is left to be computed
when asked.
"""

from __future__ import annotations

import copy

import numpy as np

from solver.problem import FORBIDDEN, Problem
from solver.quotient import quotient

#: The parts may hold at most this share of the problem's entries, else no quotient is carried.
MAX_PARTS_SHARE = 0.25


class Weighing:
    """``problem``'s weighed problems under ``windows`` (module doc); call with ``(a, b)``."""

    def __init__(self, problem: Problem, windows, max_parts_share: float = MAX_PARTS_SHARE) -> None:
        self.problem, self.eta, self.max_parts_share = problem, windows.eta, max_parts_share
        W = len(windows)
        n, m = problem.num_nodes, problem.num_edges
        # kinds: 0..W-1 a window's nodes, W..2W-1 its edges, 2W outside (scale 1)
        node_kind = np.full(n, 2 * W, dtype=np.int64)
        edge_kind = np.full(m, 2 * W, dtype=np.int64)
        for w, (ns, es) in enumerate(zip(windows.nodes, windows.edges)):
            node_kind[ns] = w
            edge_kind[es] = W + w
        self.node_kind, self.edge_kind = node_kind, edge_kind
        sizes = np.array([c.size for c in problem.node_costs], dtype=np.int64)
        self._splits = np.cumsum(sizes)[:-1]
        flat = np.concatenate(problem.node_costs) if n else np.zeros(0)
        self._flat = flat
        self._flat_kind = np.repeat(node_kind, sizes)
        self._flat_forbidden = flat >= FORBIDDEN
        self._scaled_edges = np.nonzero(edge_kind < 2 * W)[0]
        self._forbidden_edges = {k: bad for k in self._scaled_edges.tolist()
                                 if (bad := problem.edge_costs[k] >= FORBIDDEN).any()}
        self._quotient = self._parts()
        self.tie_quotient_kept = self._quotient is not None
        """Whether the weighed problems carry their tie quotients (module doc)."""

    def at_shares(self, eta: np.ndarray) -> Weighing:
        """These weighed problems with the windows' shares ``eta`` (the parts are shared: they do
        not depend on the shares)."""
        eta = np.asarray(eta, dtype=np.float64)
        if eta.shape != self.eta.shape:
            raise ValueError(f"Weighing.at_shares: expected {self.eta.size} shares (one per window), found {eta.size}")
        other = copy.copy(self)
        other.eta = eta
        return other

    def scales(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Per kind, its scale: ``a_w``, then ``2 - eta_w - a_w - b_w``, then 1."""
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        return np.concatenate([a, 2.0 - self.eta - a - b, [1.0]])

    def __call__(self, a: np.ndarray, b: np.ndarray) -> Problem:
        """The additive problem of ``L(.; a, b)`` (without its constant), its tie quotient carried."""
        s = self.scales(a, b)
        problem = self.problem
        flat = np.where(self._flat_forbidden, self._flat, self._flat * s[self._flat_kind])
        edge_costs = list(problem.edge_costs)
        for k, kind in zip(self._scaled_edges.tolist(), self.edge_kind[self._scaled_edges].tolist()):
            scaled = problem.edge_costs[k] * s[kind]
            forbidden = self._forbidden_edges.get(k)
            edge_costs[k] = scaled if forbidden is None else np.where(forbidden, problem.edge_costs[k], scaled)
        new = copy.copy(problem)
        new.node_costs = np.split(flat, self._splits) if problem.num_nodes else []
        new.edge_costs = edge_costs
        new.tie_quotient = None if self._quotient is None else self._quotient_of(s)
        return new

    def _parts(self):
        """The quotient's parts (module doc), or None where they would be too large."""
        problem = self.problem
        if self.max_parts_share <= 0:  # a one-off weighed problem: nothing to share
            return None
        entries = sum(c.size for c in problem.node_costs) + sum(x.size for x in problem.edge_costs)
        q, group = quotient(problem)
        if sum(c.size for c in q.node_costs) + sum(x.size for x in q.edge_costs) > self.max_parts_share * entries:
            return None
        allowed = [c < FORBIDDEN for c in q.node_costs]
        nodes: dict[tuple[int, int], np.ndarray] = {}
        node_forbidden = [np.zeros(c.size) for c in q.node_costs]
        edges: dict[tuple[int, int], np.ndarray] = {}
        edge_forbidden = {}
        index = {tuple(e): k for k, e in enumerate(q.edges.tolist())}

        def add(parts, forbidden, key, x):
            bad = x >= FORBIDDEN
            fine = np.where(bad, 0.0, x)
            parts[key] = parts[key] + fine if key in parts else fine.astype(np.float64, copy=True)
            if bad.any():
                forbidden[key[0]] = forbidden[key[0]] + np.where(bad, x, 0.0)

        for v in range(problem.num_nodes):
            add(nodes, node_forbidden, (int(group[v]), int(self.node_kind[v])), problem.node_costs[v])
        for k, (u, v) in enumerate(problem.edges.tolist()):
            gu, gv, kind, x = int(group[u]), int(group[v]), int(self.edge_kind[k]), problem.edge_costs[k]
            if gu == gv:
                add(nodes, node_forbidden, (gu, kind), np.diag(x))
                continue
            key, x = ((gu, gv), x) if gu < gv else ((gv, gu), x.T)
            q_edge = index[key]
            if q_edge not in edge_forbidden:
                edge_forbidden[q_edge] = np.zeros(x.shape)
            add(edges, edge_forbidden, (q_edge, kind), x)
        held = sum(x.size for x in nodes.values()) + sum(x.size for x in edges.values())
        if held > self.max_parts_share * entries:
            return None
        by_node = [[] for _ in range(q.num_nodes)]
        for (g, kind), x in nodes.items():
            by_node[g].append((kind, x))
        by_edge = [[] for _ in range(q.num_edges)]
        for (k, kind), x in edges.items():
            by_edge[k].append((kind, x))
        return q, group, allowed, by_node, node_forbidden, by_edge, edge_forbidden

    def _quotient_of(self, s: np.ndarray) -> tuple[Problem, np.ndarray]:
        q, group, allowed, by_node, node_forbidden, by_edge, edge_forbidden = self._quotient

        def combine(parts, forbidden):
            total = forbidden.copy()
            for kind, x in parts:
                total += s[kind] * x
            return total

        costs = [np.where(ok, combine(parts, f), 2 * FORBIDDEN)
                 for ok, parts, f in zip(allowed, by_node, node_forbidden)]
        edge_costs = [combine(parts, edge_forbidden[k]) for k, parts in enumerate(by_edge)]
        new = copy.copy(q)
        new.node_costs, new.edge_costs = costs, edge_costs
        return new, group
