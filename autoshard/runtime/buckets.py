"""The executor's collective buckets, found on the planned graph.

A lowered program's collectives are merged by Inductor's bucketing passes
(:func:`autoshard.runtime.passes.optimize`, ``bucket_mb``): in the program's order, each kind's
collectives (all_reduce, all_gather, reduce_scatter) are split into runs of consecutive ones
with one key (group, dtype and, for reductions, the reduce op); within a run, buckets fill
greedily up to the cap, and a collective that depends on the bucket being filled stays out of
it. A bucket is one collective at its members' total bytes: one latency instead of one each,
which on gloo (about a millisecond each) is most of a small model's communication.

:func:`plan_buckets` applies the same rules to a plan's redistributes in planned-graph order
(:func:`autoshard.planning.simulate.run_order` gives it), with a redistribute's collectives where the
lowered program puts them: before its consumer, in the consumer's program (forward or
backward); the gradients' moves to their parameters' specs in the groups the backward moves
them in (:meth:`autoshard.runtime.lower.Lowering.lower`: up to the cap as the gradients are made,
a group moved once the next gradient would overflow it, before a recomputation and at the end),
each group's moves adjacent, so a bucket of them runs once the group is complete and holds the
unreduced gradients until then. Each collective of a
redistribute of several (all_reduce over ``dp`` then over ``tp``) is a candidate of its own
kind's run; the later ones depend on the earlier ones.

No bucket spans a recomputation (a layer's recomputed ops, in the backward): a bucket runs every
reader of its members after its last member, so one that spans a layer's recomputed ops would run
them ahead of the previous layer's backward, holding two layers' recomputed activations at once.

"Depends on the bucket": an earlier collective of the same redistribute is a member, or the
redistribute's producer is reachable in the planned graph from the consumer of a member (a
gradient's move has no reader in the step). The search for that only walks nodes up to the
producer's position in the order (a topological order: every path to a node runs through
earlier ones), so it is linear per bucket.

How the walk prices a bucket (:func:`autoshard.planning.simulate.simulate_plan`): its collective is
issued once every member's input is there (the overlap scheduler starts it as early as that),
a backward bucket not before the backward starts; each member's consumer waits for it.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from autoshard.graph.strategies import output_val
from autoshard.graph.tracing import node_phase
from costmodel import MeshTopology, plan_steps
from costmodel.profile import Profile
from costmodel.spec import local_bytes, partial_op

_BUCKETED = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass
class Buckets:
    """Collectives of a plan's redistributes merged into buckets of one collective each."""

    members: list[list[tuple[int, int]]] = field(default_factory=list)
    """Per bucket, its members in program order: (planned edge, index of the collective in that
    edge's redistribute)."""
    us: list[float] = field(default_factory=list)
    """Per bucket, the time of its one collective (the profile's fit at the members' bytes)."""
    backward: list[bool] = field(default_factory=list)
    """Per bucket, whether it runs in the backward program."""
    kinds: list[str] = field(default_factory=list)
    """Per bucket, its collective's kind (all_reduce, all_gather, reduce_scatter)."""
    chains: dict[int, list[tuple[float, int]]] = field(default_factory=dict)
    """Per edge with a collective in a bucket, its redistribute's collectives in order: (own
    time, bucket or -1 where it runs alone)."""
    backward_edges: set[int] = field(default_factory=set)
    """The edges of ``chains`` whose collectives run in the backward program."""
    own_us: dict[int, float] = field(default_factory=dict)
    """Per edge of ``chains``, the rest of its redistribute's time (local steps, the copies its
    bucketed collectives make), after its last collective."""
    moved_after: dict[int, int] = field(default_factory=dict)
    """Per gradient edge the backward moves, the node after which it moves it (its group's)."""
    saved_us: float = 0.0
    """The members' own collective times less the buckets': what bucketing saves."""


class _Reach:
    """Nodes reachable from a set of sources, explored only as far as queries need (see the
    module doc): ``pos`` is a topological position, ``succ`` the planned graph's readers."""

    def __init__(self, succ: dict[int, list[int]], pos: list[int]):
        self.succ, self.pos = succ, pos
        self.seen: set[int] = set()
        self.heap: list[tuple[int, int]] = []

    def add(self, v: int) -> None:
        if v not in self.seen:
            heapq.heappush(self.heap, (self.pos[v], v))

    def reaches(self, v: int) -> bool:
        target = self.pos[v]
        while self.heap and self.heap[0][0] <= target:
            _, n = heapq.heappop(self.heap)
            if n in self.seen:
                continue
            self.seen.add(n)
            for s in self.succ.get(n, ()):
                if s not in self.seen:
                    heapq.heappush(self.heap, (self.pos[s], s))
        return v in self.seen


def plan_buckets(gp, choice, order: list[int], topo: MeshTopology, profile: Profile, cap_mb: float) -> Buckets:
    """The buckets the executor makes of ``choice``'s redistributes (module doc), ``cap_mb`` MiB
    each at most; none where ``cap_mb`` is 0."""
    out = Buckets()
    if cap_mb <= 0:
        return out
    mats = gp.problem.edge_costs
    pos = [0] * len(gp.nodes)
    for i, v in enumerate(order):
        pos[v] = i
    into: dict[int, list[int]] = {}
    grads_from: dict[int, list[int]] = {}
    succ: dict[int, list[int]] = {}
    # The backward reads a recomputed value's copy (the planned graph keeps the original's edge:
    # the two are tied to one strategy), so a recomputed op reaches what the backward computes
    # from its copy.
    copy_by_original = {o: c for c, o in gp.copy_of.items()}
    for k, e in enumerate(gp.edges):
        if e.arg < 0:
            grads_from.setdefault(e.producer, []).append(k)
        else:
            into.setdefault(e.consumer, []).append(k)
            u = e.producer
            backward = e.consumer not in gp.copy_of and node_phase(gp.nodes[e.consumer]) == "backward"
            if u in copy_by_original and backward:
                u = copy_by_original[u]
            succ.setdefault(u, []).append(e.consumer)
    # Per kind, its collectives in program order: (edge, index in the edge's, key, bytes).
    runs: dict[str, list[tuple[int, int, tuple, int]]] = {k: [] for k in _BUCKETED}
    steps_of: dict[int, list] = {}

    def visit(k: int, where: tuple[bool, int]) -> None:
        """Edge ``k``'s collectives into their runs; ``where``: (in the backward program, the
        recomputation segment)."""
        backward = where[0]
        e = gp.edges[k]
        u, v = e.producer, e.consumer
        if mats[k][choice[u], choice[v]] <= 0:
            return
        src = gp.strategies[u][choice[u]].outs[e.out]
        dst = gp.strategies[v][choice[v]].ins[e.arg] if e.arg >= 0 else gp.strategies[v][choice[v]].outs[0]
        t = output_val(gp.nodes[u], e.out)
        steps_of[k] = steps = plan_steps(src, dst, tuple(t.shape), t.element_size(), topo, profile)
        if backward:
            out.backward_edges.add(k)
        for i, s in enumerate(steps):
            # A kind the passes do not merge (all_to_all) is not in runs: it breaks none.
            if s.kind in runs:
                op = partial_op(s.src.placements[s.axes[0]]) if s.kind != "all_gather" else None
                runs[s.kind].append((k, i, (where, s.axes, t.dtype, op), int(s.nbytes)))

    cap = int(cap_mb * 2**20)
    # The backward moves its gradients in groups of up to the cap, as they are computed
    # (:meth:`autoshard.runtime.lower.Lowering.lower`): the group is moved once the next gradient
    # would overflow it, before a recomputation starts, and at the end.
    group: list[int] = []
    filled = 0

    def move_group(after: int, segment: int) -> None:
        nonlocal filled
        for k in group:
            visit(k, (True, segment))
            out.moved_after[k] = after
        group.clear()
        filled = 0

    segment, inside, previous = 0, False, -1
    for v in order:
        # A recomputed layer's ops start a segment no bucket spans (module doc).
        if v in gp.copy_of and not inside and group:
            move_group(previous, segment)
        segment += v in gp.copy_of and not inside
        inside = v in gp.copy_of
        backward = inside or node_phase(gp.nodes[v]) == "backward"
        for k in into.get(v, ()):
            visit(k, (backward, segment))
        for k in grads_from.get(v, ()):
            e = gp.edges[k]
            if mats[k][choice[e.producer], choice[e.consumer]] <= 0:
                continue
            nbytes = local_bytes(gp.strategies[v][choice[v]].outs[e.out], output_val(gp.nodes[v], e.out), topo.shape)
            if group and filled + nbytes > cap:
                move_group(v, segment)
            group.append(k)
            filled += nbytes
        previous = v
    move_group(previous, segment)

    for kind, seq in runs.items():
        start = 0
        while start < len(seq):
            end = start
            while end + 1 < len(seq) and seq[end + 1][2] == seq[start][2]:
                end += 1
            if end > start:
                _fill(gp, seq[start:end + 1], cap, kind, topo, profile, succ, pos, out)
            start = end + 1
    bucket_of = {m: b for b, members in enumerate(out.members) for m in members}
    out.backward_edges &= {k for k, _ in bucket_of}
    for k in sorted({k for members in out.members for k, _ in members}):
        e = gp.edges[k]
        steps = steps_of[k]
        # A bucketed collective's local copies (a gather along a later dim concatenates its
        # output) stay its member's own, after the bucket: the rest of the redistribute.
        out.chains[k] = [(float(s.us - s.copy_us) if (k, i) in bucket_of else float(s.us), bucket_of.get((k, i), -1))
                         for i, s in enumerate(steps)]
        out.own_us[k] = max(0.0, float(mats[k][choice[e.producer], choice[e.consumer]])
                            - sum(us for us, _ in out.chains[k]))
    for b, members in enumerate(out.members):
        out.saved_us += sum(steps_of[k][i].us - steps_of[k][i].copy_us for k, i in members) - out.us[b]
    return out


def _fill(gp, run, cap: int, kind: str, topo: MeshTopology, profile: Profile, succ, pos, out: Buckets) -> None:
    """Greedy buckets of one run of same-key collectives, as Inductor fills them."""
    axes = run[0][2][1]
    group = math.prod(topo.shape[a] for a in axes)
    predict = profile.collective_predictor(kind, group, topo.group_is_intra_node(axes))
    backward = bool(run[0][2][0][0])

    def close(bucket: list[tuple[int, int]], nbytes: int) -> None:
        if len(bucket) > 1:
            out.members.append(bucket)
            out.us.append(float(predict(nbytes)))
            out.backward.append(backward)
            out.kinds.append(kind)

    bucket: list[tuple[int, int]] = []
    edges: set[int] = set()
    size = 0
    reach = _Reach(succ, pos)
    for k, i, _, nbytes in run:
        e = gp.edges[k]
        if bucket and (k in edges or reach.reaches(e.producer)):
            continue  # it follows a member's collective or reads a member's consumer: it stays alone
        if bucket and size + nbytes > cap:
            close(bucket, size)
            bucket, edges, size, reach = [], set(), 0, _Reach(succ, pos)
        bucket.append((k, i))
        edges.add(k)
        size += nbytes
        if e.arg >= 0:  # a gradient's move has no reader in the step
            reach.add(e.consumer)
    close(bucket, size)
