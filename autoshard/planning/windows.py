"""The windows of a planned step: where communication may run beside compute.

The solver's overlap objective (:mod:`solver.overlap`) needs, per window of the run, the
compute that runs in it and the communication that may run beside it. The windows are the
simulator's (:mod:`autoshard.planning.simulate`: one compute stream, one communication
stream, nodes in :meth:`~autoshard.planning.problem.GraphProblem.run_order`), cut where the run
enters another layer or phase: the forward of what precedes the layers, each layer's forward,
what follows them, the backward in reverse. A model without repeated layers has two: its
forward and its backward.

Each planned edge has a *release* (the window after which its data exists: its producer's,
through views back to an op that computes; a parameter's: before the first) and a *deadline*
(the window whose compute first reads it: its consumer's, through views on to an op that
computes; a gradient's move, or a view chain that nothing computes on: the end of the step).
An edge may run beside the compute of the windows strictly between the two, and is given to
one of them, as the executors issue it:

- read by a later window (a parameter's gather, an activation kept for a later layer): the
  window just before its deadline (prefetched one layer ahead, as FSDP does);
- waited for by the end of the step (a gradient's reduction): the window just after its
  release (reduced beside the next layer's backward, as DDP's buckets and FSDP do);
- read within the window it is made in, or by the next: exposed (no window).

A window hides at most what it lasts: ``min(S_w, H_w)`` (its own exposed activation moves hold
both streams alike), where it lasts ``S_w = max(C_w, I_w)``, its compute or, where that is
shorter, the time the host takes to issue its ops (``I_w``: the simulator's host clock,
:meth:`~autoshard.planning.problem.GraphProblem.issue_us`). This is the walk's two streams cut
at layer boundaries, so the objective and the simulated step agree where one layer's
communication is hidden by one layer's compute (FSDP, DDP, TP+FSDP): the walk also lets a gather
run any number of windows ahead when the stream is free, which the windows do not count.
"""

from __future__ import annotations

import numpy as np

import solver
from autoshard.graph.layers import node_layer
from autoshard.graph.tracing import node_phase


def overlap_windows(gp, share: float) -> solver.OverlapWindows | None:
    """The windows of ``gp``'s step (module doc) at overlap share ``share``, tied layers'
    identical windows merged; None where nothing may hide or ``share`` is 0."""
    if share <= 0:
        return None
    segment, count = segments(gp)
    nodes = [[] for _ in range(count)]
    for v, s in enumerate(segment.tolist()):
        nodes[s].append(v)
    edges = [[] for _ in range(count)]
    for k, w in enumerate(edge_windows(gp, segment, count)):
        if w >= 0:
            edges[w].append(k)
    issue = gp.issue_us()
    floor = [sum(issue[v] for v in members) for members in nodes]
    windows = solver.OverlapWindows.merged(gp.problem, share, nodes, edges, floor)
    return windows if len(windows) else None


def edge_windows(gp, segment: np.ndarray, count: int) -> list[int]:
    """Per planned edge, the window whose compute it may run beside (module doc), -1 where none
    (exposed)."""
    release, deadline = reach(gp, segment, count)
    out = []
    for e in gp.edges:
        r = release[e.producer]
        d = count if e.arg < 0 else deadline[e.consumer]
        out.append(r + 1 if d == count and r + 1 < count else d - 1 if d < count and d - 1 > r else -1)
    return out


def window_terms(gp, choice) -> dict[str, np.ndarray]:
    """``choice``'s terms per window of the run, the windows not merged: ``compute`` (``C_w``),
    ``floor`` (``I_w``), ``hideable`` (``H_w``), ``exposed`` (the moves into the window's nodes
    that no window may hide), ``objective`` (the window's share of the overlap objective with every
    hideable move hidden: ``S_w + exposed_w + H_w - min(S_w, H_w)``), and ``segment`` (each node's
    window). A diagnostic of the objective against the walk (``benchmarks/objective_gap.py``)."""
    segment, count = segments(gp)
    problem = gp.problem
    choice = np.asarray(choice)
    compute, floor, hideable, exposed = (np.zeros(count) for _ in range(4))
    issue = gp.issue_us()
    for v in range(len(gp.nodes)):
        compute[segment[v]] += float(problem.node_costs[v][choice[v]])
        floor[segment[v]] += issue[v]
    for k, (e, w) in enumerate(zip(gp.edges, edge_windows(gp, segment, count))):
        us = float(problem.edge_costs[k][choice[e.producer], choice[e.consumer]])
        if w >= 0:
            hideable[w] += us
        else:
            exposed[segment[e.consumer if e.arg >= 0 else e.producer]] += us
    span = np.maximum(compute, floor)
    return {"compute": compute, "floor": floor, "hideable": hideable, "exposed": exposed, "segment": segment,
            "objective": span + exposed + hideable - np.minimum(span, hideable)}


def walk_shares(gp, windows: solver.OverlapWindows, choice) -> np.ndarray:
    """Per window of ``windows`` (merged, as :func:`overlap_windows` makes them), ``eta_w``: the
    share of what it may hide (``min(S_w, H_w)``) that ``choice``'s walk hides, times
    ``windows.share``. Cut into the run's windows, the walk (every hideable move hidden,
    :func:`autoshard.planning.simulate.walk_trace`) spends ``walk_u`` in window ``u`` where the
    objective counts ``S_u + exposed_u + H_u - min(S_u, H_u)`` (:func:`window_terms`); what it
    spends beyond that is hideable communication it did not hide, its ``deficit_u`` (a gather
    queued behind the reductions issued before it on the one communication stream: the walk's
    waits). A merged window hides what its windows may less their deficits:

        eta_w = share * max(0, sum_u min(S_u, H_u) - sum_u deficit_u) / sum_u min(S_u, H_u)

    (``share`` where it may hide nothing). A gather's wait falls in its reader's window, one after
    the window the objective hides it in; tied layers' windows are merged, so both lie in the same
    merged window but at a model's first and last layers."""
    from autoshard.planning.simulate import walk_trace

    terms = window_terms(gp, choice)
    segment = terms["segment"]
    walked = np.zeros(len(terms["compute"]))
    for v, before, after, _ in walk_trace(gp, choice)[1]:
        walked[segment[v]] += after - before
    deficit = np.maximum(0.0, walked - terms["objective"])
    hideable = np.minimum(np.maximum(terms["compute"], terms["floor"]), terms["hideable"])
    out = np.full(len(windows), float(windows.share))
    for w, members in enumerate(windows.nodes):
        runs = np.unique(segment[members])
        most = float(hideable[runs].sum())
        if most > 0:
            out[w] = windows.share * max(0.0, most - float(deficit[runs].sum())) / most
    return out


def segments(gp) -> tuple[np.ndarray, int]:
    """Per node its window in run order, and the number of windows: a new one wherever the run
    enters another (layer, phase); a recomputed copy runs in its original's layer's backward."""
    segment = np.empty(len(gp.nodes), dtype=np.int64)
    current, last = -1, None
    for v in gp.run_order():
        original = gp.copy_of.get(v, v)
        tag = node_layer(gp.nodes[original])
        backward = v in gp.copy_of or node_phase(gp.nodes[original]) == "backward"
        key = (tag[0] if tag else None, backward)
        if key != last:
            current, last = current + 1, key
        segment[v] = current
    return segment, current + 1


def reach(gp, segment: np.ndarray, count: int) -> tuple[list[int], list[int]]:
    """Per node, the window after which its data exists (-1: before the first) and the first
    window whose compute reads it (``count``: none, the end of the step); views pass both
    through (they compute nothing: the simulator runs them where their inputs are)."""
    n = len(gp.nodes)
    computes = np.array([bool(np.any((c > 0) & (c < solver.FORBIDDEN))) for c in gp.problem.node_costs])
    inputs: list[list[int]] = [[] for _ in range(n)]
    readers: list[list[int]] = [[] for _ in range(n)]
    for e in gp.edges:
        if e.arg >= 0:
            inputs[e.consumer].append(e.producer)
            readers[e.producer].append(e.consumer)
    order = gp.run_order()
    release = [-1] * n
    for v in order:  # producers run before their readers
        if gp.nodes[v].op == "placeholder":
            release[v] = -1
        elif computes[v]:
            release[v] = int(segment[v])
        else:
            release[v] = max((release[u] for u in inputs[v]), default=-1)
    deadline = [count] * n
    for v in reversed(order):
        if computes[v]:
            deadline[v] = int(segment[v])
        else:
            deadline[v] = min((deadline[c] for c in readers[v]), default=count)
    return release, deadline
