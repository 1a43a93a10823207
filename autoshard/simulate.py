"""The step as the lowered program runs it: one compute stream, one communication stream.

Two walks share the model: :func:`simulate` over a rank's lowered program (after torch's
bucketing and overlap passes: the program that runs), and :func:`simulate_plan` over the
planned graph itself, any size, at plan time (no buckets: one collective per planned
redistribute, each issued as soon as its data is ready).

The plan's own prediction adds every op's compute and every redistribute's time. The program
that runs is different: torch's bucketing merged collectives (one latency per bucket), and the
overlap scheduler issues each collective early and waits for it late. This walks a rank's
lowered forward and backward programs in their order, with the plan's profile pricing each node
(:class:`autoshard.passes.Estimator`, the same figures the scheduler used):

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

:func:`simulate_plan` also gives each planned edge its *slack* (:func:`plan_slack`): the time
between when its redistribute could start (its producer done, the communication stream free)
and when its consumer would run (a gradient's move: when the compute stream ends). An edge of
time ``c`` then costs ``c - eta * min(c, slack)``: the re-weighed edge costs the overlap-aware
objective is solved with (:mod:`autoshard.overlap`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.fx as fx

from autoshard.passes import KIND, Estimator
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
    compute."""
    return additive_us - share * min(additive_us / 2, max(0.0, additive_us - compute_us))


def simulate_step(program, rank: int, profile: Profile | None = None) -> Timeline:
    """Forward then backward of a :class:`autoshard.runtime.PlannedProgram` for ``rank``, priced
    by ``profile`` (default: the plan's, which the programs were scheduled with) and its overlap
    share."""
    profile = profile or program.lowering.profile
    est = Estimator(profile)
    tl = simulate(program.forward_program(rank).gm, est) + simulate(program.backward_program(rank).gm, est)
    return tl.overlapped(profile.overlap)


def _order(gp) -> list[int]:
    """The planned graph's nodes in the order they run: originals in graph order, a recomputed
    copy just before the first node that reads it (its chain of copies before that)."""
    readers: dict[int, list[int]] = {}
    for e in gp.edges:
        if e.arg >= 0:
            readers.setdefault(e.producer, []).append(e.consumer)
    n_orig = gp.num_originals
    keys = [float(v) for v in range(len(gp.nodes))]
    # Copies follow every original, each after the copies it reads (they are appended in graph
    # order): from the last one back, every reader's key is known.
    eps = 1e-6 / len(gp.nodes)
    for v in range(len(gp.nodes) - 1, n_orig - 1, -1):
        keys[v] = min((keys[c] for c in readers.get(v, [])), default=float(n_orig)) - eps * (1 + v - n_orig)
    return sorted(range(len(gp.nodes)), key=keys.__getitem__)


def simulate_plan(gp, choice, overlap: float = 1.0) -> Timeline:
    """The planned step on a compute and a communication stream, in planned-graph order, with
    ``overlap`` of the hidden communication hidden (:meth:`Timeline.overlapped`).

    Each node runs once every redistribute into it has arrived; a redistribute starts when its
    producer has finished (a parameter's: at the start, i.e. prefetched) and the communication
    stream is free; a gradient's move to its parameter's spec runs beside the rest of the
    backward and only ends the step. Node times are the problem's own costs (compute, plus the
    loss's reduction), edge times its edge costs."""
    return _walk(gp, choice, None).overlapped(overlap)


def plan_slack(gp, choice) -> np.ndarray:
    """Per planned edge, the time its redistribute could run beside compute in the walk of
    :func:`simulate_plan` (module doc), whether or not ``choice`` moves anything along it: an
    edge whose consumer runs right after its producer has none, a parameter's gather prefetched
    at the start as much as the compute before its consumer less the collectives queued ahead
    of it."""
    slack = np.zeros(len(gp.edges))
    _walk(gp, choice, slack)
    return slack


def _walk(gp, choice, slack: np.ndarray | None) -> Timeline:
    """:func:`simulate_plan` hiding perfectly; each edge's slack written into ``slack``."""
    costs, mats = gp.problem.node_costs, gp.problem.edge_costs
    into: dict[int, list[int]] = {}
    grads_from: dict[int, list[int]] = {}
    for k, e in enumerate(gp.edges):
        (grads_from if e.arg < 0 else into).setdefault(e.producer if e.arg < 0 else e.consumer, []).append(k)
    host = gp.issue_us()
    t_compute = t_comm = t_host = 0.0
    done: dict[int, float] = {}
    grad_starts: list[tuple[int, float]] = []
    tl = Timeline()
    order = _order(gp)
    last = order[-1] if order else -1
    for v in order:
        t_host += host[v]
        ready = t_compute
        for k in into.get(v, []):
            e = gp.edges[k]
            start = max(done.get(e.producer, t_compute), t_comm)
            if slack is not None:
                slack[k] = max(0.0, t_compute - start)
            us = float(mats[k][choice[e.producer], choice[v]])
            if us <= 0:
                continue
            t_comm = start + us
            ready = max(ready, t_comm)
            tl.comm_us += us
            tl.collectives += 1
        tl.exposed_us += ready - t_compute
        us = float(costs[v][choice[v]])
        if t_host > ready and (us > 0 or v == last):
            tl.idle_us += t_host - ready
            ready = t_host
        t_compute = done[v] = ready + us
        tl.compute_us += us
        for k in grads_from.get(v, []):
            e = gp.edges[k]
            start = max(t_compute, t_comm)
            grad_starts.append((k, start))
            us = float(mats[k][choice[v], choice[e.consumer]])
            if us > 0:
                t_comm = start + us
                tl.comm_us += us
                tl.collectives += 1
    if slack is not None:
        for k, start in grad_starts:  # a gradient's move is waited for when the compute ends
            slack[k] = max(0.0, t_compute - start)
    tl.step_us = max(t_compute, t_comm)
    tl.exposed_us += tl.step_us - t_compute
    return tl
