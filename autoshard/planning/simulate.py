"""The step as the lowered program runs it: one compute stream, one communication stream.

Two walks share the model: :func:`simulate` over a rank's lowered program (after torch's
bucketing and overlap passes: the program that runs), and :func:`simulate_plan` over the
planned graph itself, any size, at plan time: the executor's buckets found on the planned graph
(:mod:`autoshard.runtime.buckets`, one collective each), every other redistribute issued as soon as its
data is ready, and a view (an op of no compute) there when its inputs are, so that only its
readers wait (the overlap scheduler waits for a collective just before the first op that
computes on it; a gradient's transpose waiting for its reduction held the whole backward).

The plan's own prediction adds every op's compute and every redistribute's time. The program
that runs is different: torch's bucketing merged collectives (one latency per bucket), and the
overlap scheduler issues each collective early and waits for it late. This walks a rank's
lowered forward and backward programs in their order, with the plan's profile pricing each node
(:class:`autoshard.runtime.passes.Estimator`, the same figures the scheduler used):

    compute node      c   : t_c <- t_c + compute(c)
    collective k issued   : start_k = max(t_c, t_m);  t_m <- start_k + collective(k)
    wait for k            : exposed += max(0, t_m(k) - t_c);  t_c <- max(t_c, end_k)
    step                  = t_c after the last node (every collective has been waited for)

``t_c`` is the compute stream's clock and ``t_m`` the communication stream's: collectives run
one after another, beside compute. The compute of the step is the sum over compute nodes;
``exposed`` is the communication the compute did not hide.

Both walks hide perfectly: a collective beside compute costs nothing. Real streams contend (a
collective's kernels take SMs and memory bandwidth; gloo's threads take cores), so the step is
priced with the profile's overlap share ``eta`` (:attr:`costmodel.Profile.overlap`, measured by
calibration) between the two ends, additive and perfectly overlapped
(:meth:`Timeline.overlapped`):

    step(eta) = compute + comm - eta * hidden,    hidden = compute + comm - step(1)

``eta = 0`` is the additive step (every collective adds its time), ``eta = 1`` the walk's.

A GPU's ops are issued by a host thread, at ``h`` = :attr:`costmodel.Profile.host_op_us` each
(views too: they cost the host, not the device). Both walks keep a third clock ``t_h``:

    any node n            : t_h <- t_h + h;  n starts no sooner than t_h
    compute node c        : idle += max(0, t_h - t_c);  t_c <- max(t_c, t_h) + compute(c)

so a program of small ops lasts as long as its issue, and one of large ops hides its issue
behind them. ``idle`` is compute-stream time spent waiting for the host: neither compute nor
exposed communication. ``h = 0`` (CPU devices, uncalibrated GPU profiles) is the two-stream walk.

The solver's overlap objective (:mod:`autoshard.planning.overlap`) cuts this walk into windows
(:mod:`autoshard.planning.windows`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from autoshard.graph.tracing import node_phase
from autoshard.runtime.buckets import Buckets, plan_buckets
from autoshard.runtime.passes import KIND, Estimator
from costmodel.profile import Profile

_WAIT = torch.ops._c10d_functional.wait_tensor.default


@dataclass
class Timeline:
    """One program's simulated run, microseconds."""

    step_us: float = 0.0
    compute_us: float = 0.0
    comm_us: float = 0.0
    """Every collective's time, hidden or not."""
    exposed_us: float = 0.0
    """Communication the compute stream waited for."""
    collectives: int = 0
    idle_us: float = 0.0
    """Compute-stream time spent waiting for the host to issue the next op (module doc)."""

    def __add__(self, other: Timeline) -> Timeline:
        return Timeline(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))

    @property
    def hidden_us(self) -> float:
        """Communication that ran beside compute: what the additive step counts and this one not."""
        return max(0.0, self.compute_us + self.idle_us + self.comm_us - self.step_us)

    def overlapped(self, share: float) -> Timeline:
        """This walk (perfect overlap) with only ``share`` of its hidden communication hidden
        (the module doc): 1 gives it back, 0 the additive step."""
        step = self.step_us + (1.0 - share) * self.hidden_us
        return replace(self, step_us=step, exposed_us=step - self.compute_us - self.idle_us)


def _source(node):
    """The collective a wait reads (through the getitem of a multi-output collective)."""
    while isinstance(node, fx.Node) and node.target not in KIND and node.op == "call_function" and node.args:
        node = node.args[0]
    return node


def simulate(gm: fx.GraphModule, est: Estimator) -> Timeline:
    """Run ``gm``'s nodes on a compute and a communication stream (see the module doc), priced
    by ``est``, hiding perfectly (:meth:`Timeline.overlapped` prices contention)."""
    t_compute = t_comm = t_host = 0.0
    ends: dict[fx.Node, float] = {}
    tl = Timeline()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        t_host += est.issue_us(node)
        if node.target in KIND:
            start = max(t_compute, t_comm, t_host)
            us = est.collective_us(node)
            t_comm = ends[node] = start + us
            tl.comm_us += us
            tl.collectives += 1
        elif node.target is _WAIT:
            end = ends.get(_source(node.args[0]), 0.0)
            if end > t_compute:
                tl.exposed_us += end - t_compute
                t_compute = end
        else:
            us = est.compute_us(node)
            if us > 0 and t_host > t_compute:
                tl.idle_us += t_host - t_compute
                t_compute = t_host
            t_compute += us
            tl.compute_us += us
    if t_host > t_compute:  # the host's last ops were views: the step ends when they are issued
        tl.idle_us += t_host - t_compute
        t_compute = t_host
    tl.step_us = max(t_compute, t_comm)
    return tl


def step_floor(additive_us: float, compute_us: float, share: float) -> float:
    """A lower bound of the simulated step, at overlap share ``share``, of every plan whose
    additive step is at least ``additive_us`` and whose compute is at least ``compute_us``.

    A plan of compute ``C`` and communication ``M`` is simulated at ``C + M - share * hidden``
    (plus the host's idle time), and ``hidden <= min(C, M)``: two streams run no shorter than the
    longer of them. Over ``C + M >= A`` and ``C >= L`` the least of ``C + M - share * min(C, M)``
    lies on ``C + M = A`` at ``C = max(L, A / 2)``:

        step >= A - share * min(A / 2, A - L)

    which is ``(1 - share) * A + share * L`` where compute takes at least half of ``A``, and
    ``(1 - share / 2) * A`` where it may take less (communication can hide no more compute than
    there is). A recomputing plan: ``A`` and ``L`` both plus the recomputed copies' cheapest
    compute. Of the step without buckets: the executor's buckets take a latency off each
    collective they merge, which ``A`` (a bound of the additive objective, one latency per
    collective) does not see."""
    return additive_us - share * min(additive_us / 2, max(0.0, additive_us - compute_us))


def simulate_step(program, rank: int, profile: Profile | None = None) -> Timeline:
    """Forward then backward of a :class:`autoshard.runtime.program.PlannedProgram` for ``rank``, priced
    by ``profile`` (default: the plan's, which the programs were scheduled with) and its overlap
    share."""
    profile = profile or program.lowering.profile
    est = Estimator(profile)
    tl = simulate(program.forward_program(rank).gm, est) + simulate(program.backward_program(rank).gm, est)
    return tl.overlapped(profile.overlap)


def run_order(gp) -> list[int]:
    """The planned graph's nodes in the order they run (:meth:`GraphProblem.run_order
    <autoshard.planning.problem.GraphProblem.run_order>`)."""
    return gp.run_order()


def _bucket_order(gp, order: list[int], buckets: Buckets) -> list[int] | None:
    """``order`` with every consumer of a bucketed redistribute after the producers of every
    bucket on its way (the executor's bucket waits for its last input), otherwise as close to
    ``order`` as the data allows; None where buckets wait on each other in a cycle."""
    n = len(gp.nodes)
    pos = {v: i for i, v in enumerate(order)}
    succ: dict[int, list[int]] = {}
    indeg = [0] * (n + len(buckets.members))

    def link(a: int, b: int) -> None:
        succ.setdefault(a, []).append(b)
        indeg[b] += 1

    for e in gp.edges:
        if e.arg >= 0:
            link(e.producer, e.consumer)
    for b, members in enumerate(buckets.members):  # bucket b: node n + b
        for k, i in members:
            link(gp.edges[k].producer, n + b)
            for _, earlier in buckets.chains[k][:i]:
                if earlier >= 0:
                    link(n + earlier, n + b)
    for k, chain in buckets.chains.items():
        if gp.edges[k].arg >= 0:
            for _, b in chain:
                if b >= 0:
                    link(n + b, gp.edges[k].consumer)
    heap = [(pos[v], v) for v in order if indeg[v] == 0]
    heapq.heapify(heap)
    out = []
    while heap:
        _, v = heapq.heappop(heap)
        if v < n:
            out.append(v)
        for w in succ.get(v, ()):
            indeg[w] -= 1
            if indeg[w] == 0:
                heapq.heappush(heap, (-1 if w >= n else pos[w], w))
    return out if len(out) == n else None


def simulate_plan(gp, choice, overlap: float = 1.0, buckets: Buckets | None = None) -> Timeline:
    """The planned step on a compute and a communication stream, in planned-graph order, with
    ``overlap`` of the hidden communication hidden (:meth:`Timeline.overlapped`).

    Each node runs once every redistribute into it has arrived; a redistribute starts when its
    producer has finished (a parameter's: at the start, i.e. prefetched) and the communication
    stream is free; a gradient's move to its parameter's spec runs beside the rest of the
    backward and only ends the step. Node times are the problem's own costs (compute, plus the
    loss's reduction), edge times its edge costs.

    ``buckets`` (:func:`autoshard.runtime.buckets.plan_buckets`): redistributes the executor merges. A
    bucket is one collective, issued once its members' producers have all run (a backward
    bucket not before the backward starts), read by each member's consumer; its readers run
    after its last producer. Default: the buckets of the problem's ``bucket_mb``."""
    if buckets is None:
        buckets = problem_buckets(gp, choice)
    return _walk(gp, choice, buckets).overlapped(overlap)


def problem_buckets(gp, choice) -> Buckets | None:
    """The executor's buckets of ``choice`` at the problem's ``bucket_mb`` (None without one)."""
    if gp.bucket_mb <= 0 or gp.topo is None:
        return None
    return plan_buckets(gp, choice, run_order(gp), gp.topo, gp.profile, gp.bucket_mb)


def walk_trace(gp, choice) -> tuple[Timeline, list[tuple[int, float, float, float]]]:
    """The perfectly overlapped walk of :func:`simulate_plan` (the problem's buckets) and, per node
    in the order it ran, ``(node, compute clock before, after, how long the compute stream waited
    for its inputs or the host)``: where a plan's step goes, window by window
    (``benchmarks/objective_gap.py``)."""
    walk = _Walk(gp, choice, problem_buckets(gp, choice))
    walk.trace = []
    return walk.run(), walk.trace


def _walk(gp, choice, buckets: Buckets | None = None) -> Timeline:
    """:func:`simulate_plan` hiding perfectly."""
    return _Walk(gp, choice, buckets).run()


class _Walk:
    """One walk of a plan's nodes in run order on two streams, compute and communication: the
    clocks (``t_compute``, ``t_comm``, ``t_host``) and what is in flight, as attributes."""

    def __init__(self, gp, choice, buckets: Buckets | None):
        self.gp, self.choice, self.buckets = gp, choice, buckets
        self.costs, self.mats = gp.problem.node_costs, gp.problem.edge_costs
        self.into: dict[int, list[int]] = {}
        self.grads_from: dict[int, list[int]] = {}
        for k, e in enumerate(gp.edges):
            (self.grads_from if e.arg < 0 else self.into).setdefault(e.producer if e.arg < 0 else e.consumer,
                                                                     []).append(k)
        self.host = gp.issue_us()
        self.t_compute = self.t_comm = self.t_host = 0.0
        self.done: dict[int, float] = {}
        self.tl = Timeline()
        self.order = run_order(gp)
        self.chains = buckets.chains if buckets is not None else {}
        if self.chains:
            reordered = _bucket_order(gp, self.order, buckets)
            if reordered is None:  # buckets that wait on each other: priced as planned, one by one
                self.chains = {}
            else:
                self.order = reordered
        self.chained_from: dict[int, list[int]] = {}
        for k in self.chains:
            self.chained_from.setdefault(gp.edges[k].producer, []).append(k)
        self.ready_at = [0.0] * len(buckets.members) if self.chains else []
        self.remaining = [len(m) for m in buckets.members] if self.chains else []
        self.arrival: dict[int, float] = {}
        self.waiting: list[int] = []
        """Buckets of the backward program, ready before it starts."""
        self.later: list[tuple[int, float]] = []
        """Edges of the backward program, their inputs made before it starts."""
        self.in_backward = False
        self.trace: list[tuple[int, float, float, float]] | None = None
        """Where asked for (:func:`walk_trace`): per node in run order, the compute clock before
        and after it and how long the compute stream waited for it."""

    def advance(self, k: int, i: int, t: float) -> None:
        """Edge ``k``'s collectives from its ``i``-th on, the one before done at ``t``: alone
        ones issued now, a bucketed one waits for the rest of its bucket."""
        chain, buckets, tl = self.chains[k], self.buckets, self.tl
        while i < len(chain):
            us, b = chain[i]
            if b >= 0:
                self.ready_at[b] = max(self.ready_at[b], t)
                self.remaining[b] -= 1
                if self.remaining[b] == 0:
                    if buckets.backward[b] and not self.in_backward:
                        self.waiting.append(b)
                    else:
                        self.fire(b, self.ready_at[b])
                return
            t = self.t_comm = max(t, self.t_comm) + us
            tl.comm_us += us
            tl.collectives += 1
            i += 1
        self.arrival[k] = t + buckets.own_us[k]
        tl.comm_us += buckets.own_us[k]
        if self.gp.edges[k].arg < 0:  # a gradient's move ends the step at the latest
            self.t_comm = max(self.t_comm, self.arrival[k])

    def fire(self, b: int, at: float) -> None:
        end = self.t_comm = max(at, self.t_comm) + self.buckets.us[b]
        self.tl.comm_us += self.buckets.us[b]
        self.tl.collectives += 1
        for k, i in self.buckets.members[b]:
            self.advance(k, i + 1, end)

    def release_backward(self) -> None:
        """The backward program starts: what waited for it is issued."""
        for k, t in self.later:
            self.advance(k, 0, max(t, self.t_compute))
        for b in self.waiting:
            self.fire(b, max(self.ready_at[b], self.t_compute))
        self.later.clear()  # each edge's collectives are issued once
        self.waiting.clear()

    def inputs_arrive(self, v: int) -> float:
        """When ``v``'s inputs are all there, their moves issued on the communication stream."""
        gp, tl, arrived = self.gp, self.tl, 0.0
        for k in self.into.get(v, []):
            e = gp.edges[k]
            if k in self.chains:
                arrived = max(arrived, self.arrival[k])
                continue
            start = max(self.done.get(e.producer, self.t_compute), self.t_comm)
            us = float(self.mats[k][self.choice[e.producer], self.choice[v]])
            if us <= 0:
                arrived = max(arrived, self.done.get(e.producer, 0.0))
                continue
            self.t_comm = start + us
            arrived = max(arrived, self.t_comm)
            tl.comm_us += us
            tl.collectives += 1
        return arrived

    def compute(self, v: int, arrived: float, last: bool) -> float:
        """``v`` run on the compute stream once its inputs arrived: when it ends."""
        tl = self.tl
        us = float(self.costs[v][self.choice[v]])
        if us <= 0 and not last:
            # A view runs nowhere: it is there when its inputs are, and only its readers wait
            # (the overlap scheduler waits for a collective just before the first op that
            # computes on it).
            end = self.done[v] = max(arrived, self.t_compute)
            return end
        ready = max(self.t_compute, arrived)
        tl.exposed_us += ready - self.t_compute
        if self.t_host > ready:
            tl.idle_us += self.t_host - ready
            ready = self.t_host
        end = self.t_compute = self.done[v] = ready + us
        tl.compute_us += us
        return end

    def send_gradients(self, v: int, end: float) -> None:
        """The gradient moves of ``v``'s output, issued once it ends at ``end``."""
        for k in self.grads_from.get(v, []):
            if k in self.chains:
                continue
            e = self.gp.edges[k]
            start = max(end, self.t_comm)
            us = float(self.mats[k][self.choice[v], self.choice[e.consumer]])
            if us > 0:
                self.t_comm = start + us
                self.tl.comm_us += us
                self.tl.collectives += 1
        for k in self.chained_from.get(v, ()):
            if k in self.buckets.backward_edges and not self.in_backward:
                self.later.append((k, end))
            else:
                self.advance(k, 0, end)

    def run(self) -> Timeline:
        gp, tl = self.gp, self.tl
        last = self.order[-1] if self.order else -1
        for v in self.order:
            if self.chains and not self.in_backward and (v in gp.copy_of or node_phase(gp.nodes[v]) == "backward"):
                self.in_backward = True
                self.release_backward()
            self.t_host += self.host[v]
            before = self.t_compute
            end = self.compute(v, self.inputs_arrive(v), v == last)
            if self.trace is not None:  # a view waits for nothing on the compute stream
                ran = self.t_compute - before
                self.trace.append((v, before, self.t_compute, max(0.0, ran - float(self.costs[v][self.choice[v]]))))
            self.send_gradients(v, end)
        self.release_backward()  # a graph with no backward node
        tl.step_us = max(self.t_compute, self.t_comm)
        tl.exposed_us += tl.step_us - self.t_compute
        return tl
