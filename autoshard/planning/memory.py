"""What a plan holds in memory on a rank over its step: the account its peak is reported from.

The solver's memory rows (:mod:`autoshard.planning.problem`) charge each node's output shard
from the node to its last read, which a node's own choice decides. What the account adds
depends on a pair of choices, so it is counted here, on a chosen plan, over the same time axis
(the problem's intervals, recomputed copies included):

- **communication buffers**: an argument redistributed to its consumer's spec is a new buffer
  of that spec's local shard, live from the consumer to its last read through views (a gathered
  weight that a transpose keeps for the backward: FSDP's gathered weights held from forward to
  backward; a gathered activation read once lives for that read);
- **gradients**: the executor moves each gradient to its parameter's spec (data parallel's
  all-reduce, FSDP's reduce-scatter) with its group, as the backward makes them (groups of up to
  ``bucket_mb``, :mod:`autoshard.runtime.buckets`): the unreduced value (or a buffer it was
  gathered into) is held until then, the group's concatenated input for that moment, the shard
  from then into the optimizer step;
  a gradient that is one output of several (a norm's backward) holds only its own bytes;
- **buckets**: the executor merges collectives into buckets (:mod:`autoshard.runtime.buckets`);
  a bucket hands back views of one flat buffer, live while any member is read; a gathered
  member that anything but matmuls and copies reads is copied out of it (its rows are strided
  in the buffer), a buffer of its own from then to its last read;
- **the optimizer step**, after the backward: parameters, optimizer state and gradients, plus
  the optimizer's temporaries: AdamW's denominator is one parameter's shard at a time where the
  step loops over parameters (torch's default on a CPU), every parameter's at once where it
  runs its foreach kernels (its default on GPUs).

Categories (bytes at the peak): parameters (and buffers), optimizer state, gradients,
activations (forward values), temporaries (backward values, the loss), recomputed copies,
communication buffers, optimizer step temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from autoshard.graph.pricing import is_view
from autoshard.graph.strategies import is_getitem, output_val
from autoshard.graph.tracing import node_phase
from autoshard.planning.problem import (
    GRADIENT_SHARDS,
    GraphProblem,
    backward_start,
    block_bytes,
    caching_allocator,
    grad_views,
    live_root,
)
from autoshard.planning.simulate import problem_buckets
from costmodel.spec import local_bytes, on_mesh, shard_dim
from solver.evaluate import interval_profile

CATEGORIES = ("parameters", "optimizer state", "gradients", "activations", "temporaries", "recomputed",
              "communication buffers", "optimizer step")


@dataclass
class MemoryAccount:
    """A plan's memory per rank: its peak, where it is, and what is live there."""

    peak_bytes: int
    """The largest total over the step, the optimizer step included."""
    at_peak: dict[str, int] = field(default_factory=dict)
    """Bytes per category (:data:`CATEGORIES`) live at the peak."""
    peak_at: str = ""
    """The node running at the peak (``"optimizer step"`` when it is there)."""
    rows_peak_bytes: int = 0
    """The solver's rows' peak for the same choice (node outputs alone)."""
    at_step: dict[str, int] = field(default_factory=dict)
    """Bytes per category during the optimizer step (what is held to the end of the step, and
    the optimizer's temporaries)."""
    largest: list = field(default_factory=list)
    """The largest values live at the peak: ``(bytes, category, what)``, largest first."""
    saved_bytes: int = 0
    """The forward's values live when the backward starts: what the step keeps from its forward
    for its backward (a pipeline stage holds this much per microbatch in flight)."""
    headroom_bytes: dict = field(default_factory=dict)
    """Per program (``"forward"``, ``"backward"``), how far its own peak lies below
    :attr:`peak_bytes`: what the executor's overlap scheduler may hold above the program's peak to
    start collectives early and wait for them late without raising the step's
    (:func:`autoshard.runtime.passes.optimize`)."""

    def to_json(self) -> dict:
        return {"peak_bytes": int(self.peak_bytes), "at_peak": {k: int(v) for k, v in self.at_peak.items() if v},
                "peak_at": self.peak_at, "rows_peak_bytes": int(self.rows_peak_bytes),
                "at_step": {k: int(v) for k, v in self.at_step.items() if v}, "saved_bytes": int(self.saved_bytes),
                "headroom_bytes": {k: int(v) for k, v in self.headroom_bytes.items()},
                "largest": [[int(b), c, w] for b, c, w in self.largest]}


def _view_ends(gp: GraphProblem, lo: np.ndarray, moved=None, until: dict[int, int] | None = None) -> np.ndarray:
    """Per node, the last time its output is read through views (its own slot + 1 at least);
    ``moved``: per node, whether it is a view whose argument was moved into a buffer of its own
    (its reads do not hold what it views: the move read that at once); ``until``: nodes read at
    a given time besides (a gradient, by its move to its parameter's spec)."""
    n = len(gp.nodes)
    # The backward reads a recomputed value's copy, not the forward's value (the planned graph
    # keeps the original's edge: the two are tied to one strategy).
    copy_by_original = {o: c for c, o in gp.copy_of.items()}
    readers: dict[int, list[int]] = {}
    for e in gp.edges:
        if e.arg >= 0:
            u = e.producer
            backward = e.consumer not in gp.copy_of and node_phase(gp.nodes[e.consumer]) == "backward"
            if u in copy_by_original and backward:
                u = copy_by_original[u]
            readers.setdefault(u, []).append(e.consumer)
    view = [_is_view(gp, v) and not (moved is not None and moved[v]) for v in range(n)]
    end = lo + 1
    for v, t in (until or {}).items():
        end[v] = max(end[v], t)
    # Readers come after their producer in the run: from the last node back, a view's end is known
    # before its producer's.
    for v in sorted(range(n), key=lambda x: lo[x], reverse=True):
        for c in readers.get(v, ()):
            end[v] = max(end[v], end[c] if view[c] else lo[c] + 1)
    return end


def account(gp: GraphProblem, tg, choice, foreach: bool | None = None, held=()) -> MemoryAccount:
    """The memory account of ``choice`` (a strategy per node of ``gp``, built from ``tg``).
    ``foreach``: whether the optimizer steps every parameter at once (default: where the device
    allocates through torch's caching allocator, a GPU, whose rounding every buffer gets too).
    ``held``: views, taken moved, whose gathered weight is kept for every microbatch of the step
    (:func:`~autoshard.planning.problem.amortized_moves`), released before the optimizer step."""
    p = gp.problem
    choice = np.asarray(choice, dtype=np.int64)
    n = len(gp.nodes)
    mesh_shape = tuple(gp.topo.shape) if gp.topo is not None else ()
    caching = caching_allocator(gp.profile)
    if foreach is None:
        foreach = caching
    chosen = [gp.strategies[v][choice[v]] for v in range(n)]
    iv = np.asarray(p.intervals, dtype=np.int64)
    lo, hi = iv[:, 0].copy(), iv[:, 1].copy()
    usage = np.array([p.node_usages[v][choice[v]] for v in range(n)], dtype=np.float64)
    rows_peak = _peak(lo, hi, usage)[0]
    end = int(hi.max()) if n else 0
    buckets = problem_buckets(gp, choice)
    move_at = _gradient_moves(gp, chosen, lo, buckets, mesh_shape)
    # A gradient is read by its move to its parameter's spec; one already in that spec is the
    # parameter's gradient itself, held into the optimizer step.
    read_at = {gp.edges[k].producer: t + 1 for k, t in move_at.items()}
    for k, e in enumerate(gp.edges):
        if e.arg < 0 and k not in move_at:
            read_at[e.producer] = end
    view_end = _view_ends(gp, lo, until=read_at)
    moved = [s.moved for s in chosen]
    # Ends where a moved view's reads do not hold what it views (the same ends without one).
    own_end = _view_ends(gp, lo, moved, until=read_at) if any(moved) else view_end

    grads = {live_root(g)[0] for g in tg.grad_of.values()} | grad_views(tg)
    placeholder_of = {tg.fqn_of[x.name]: x for x in tg.placeholders}
    trainable = {placeholder_of[f].name for f in tg.grad_of}
    events = []  # (lo, hi, bytes, category, what)
    event_of: dict[int, int] = {}
    param_bytes = {}
    for v, node in enumerate(gp.nodes):
        if usage[v] == 0:
            continue
        if node.op == "placeholder" or node.op == "get_attr":
            kind = tg.kinds.get(node.name, "buffer")
            if kind == "input":
                events.append((lo[v], hi[v], usage[v], "activations", node.name))
                continue
            own = block_bytes(local_bytes(chosen[v].outs[0], node.meta["val"], mesh_shape), caching)
            events.append((lo[v], hi[v], own, "parameters", tg.fqn_of.get(node.name, node.name)))
            if node.name in trainable:
                param_bytes[v] = own
                # The rows charge the gradient's shard with its parameter (problem.GRADIENT_SHARDS):
                # here it is its own event, from the gradient's move.
                state = usage[v] - own * (1 + GRADIENT_SHARDS)
                if state > 0:
                    events.append((lo[v], hi[v], state, "optimizer state", tg.fqn_of[node.name]))
            continue
        if chosen[v].moved and node not in grads:
            cat = "communication buffers"  # a held view's redistributed argument
        elif v in gp.copy_of:
            cat = "recomputed"
        elif node in grads:
            cat = "gradients"
        else:
            cat = "activations" if tg.phase(node) == "forward" else "temporaries"
        event_of[v] = len(events)
        events.append((lo[v], hi[v], usage[v], cat, node.name + ("@recompute" if v in gp.copy_of else "")))

    def amend(v: int, last: int | None = None, nbytes: float | None = None) -> None:
        """Node ``v``'s event, ending at ``last`` (a slot after its start at least) or holding
        ``nbytes`` instead."""
        if v in event_of:
            a, b, held_bytes, cat, what = events[event_of[v]]
            events[event_of[v]] = (a, b if last is None else max(a + 1, int(last)),
                                   held_bytes if nbytes is None else nbytes, cat, what)

    # A gradient that is one output of several (a norm's backward gives its input's gradient
    # and its weight's): the other outputs die at their last reads, not with the gradient.
    for v, outs in _gradient_outputs(gp, tg).items():
        if v not in event_of or not isinstance(gp.nodes[v].meta["val"], (tuple, list)):
            continue
        vals = gp.nodes[v].meta["val"]
        held_bytes = sum(block_bytes(local_bytes(chosen[v].outs[i], vals[i], mesh_shape), caching)
                         for i in outs if i < len(chosen[v].outs) and chosen[v].outs[i] is not None
                         and isinstance(vals[i], torch.Tensor))
        rest = usage[v] - held_bytes
        reads = [view_end[e.consumer] if _is_view(gp, e.consumer) else lo[e.consumer] + 1
                 for e in gp.edges if e.arg >= 0 and e.producer == v and e.out not in outs]
        if rest > 0:
            amend(v, nbytes=float(held_bytes))
            events.append((lo[v], max([lo[v] + 1, *reads]), rest, "temporaries", f"{gp.nodes[v].name} (other outputs)"))

    # A value read through a view that moved it is held only until that move (the rows hold it to
    # the view's last read: they cannot tell which way the view went).
    if any(moved):
        for v in {ae.producer for ae in gp.edges if ae.arg >= 0 and moved[ae.consumer]}:
            if gp.nodes[v] not in grads and hi[v] < end:
                amend(v, last=min(hi[v], own_end[v]))

    whole_until_step: set[int] = set()  # events held to the end of the backward, not into the step

    def release(r: int) -> None:
        """The unreduced gradient ``r`` ends at its last read: the gradient is a moved buffer."""
        amend(r, last=own_end[r])

    for v, node in enumerate(gp.nodes):
        if chosen[v].moved and node in grads:
            release(gp.index.get(live_root(node)[0].name, v))
        elif node in grads and v not in gp.copy_of:
            amend(v, last=max(hi[v], own_end[v]))  # to its move, or into the step where none moves it
    # The weights gathered once per step are dropped with the gradients' reductions.
    whole_until_step.update(event_of[v] for v in held if v in event_of)

    # The executor's buckets (:mod:`autoshard.runtime.buckets`): a bucket's collective hands back
    # one flat buffer, which every member's view keeps alive (a layer's gathered weights live as
    # long as the last of them is read).
    bucket_of: dict[int, int] = {}
    for b, members in enumerate(buckets.members if buckets is not None else ()):
        if all(gp.edges[k].arg < 0 for k, _ in members):
            # Gradients' moves: the bucket concatenates the unreduced gradients into one input.
            at = max(move_at.get(k, end) for k, _ in members)
            raw = sum(local_bytes(chosen[gp.edges[k].producer].outs[gp.edges[k].out],
                                  output_val(gp.nodes[gp.edges[k].producer], gp.edges[k].out), mesh_shape)
                      for k in {k for k, _ in members})
            events.append((at, at + 1, block_bytes(raw, caching), "communication buffers",
                           f"bucket {b} ({len(members)} gradients)"))
            continue
        gathered = [k for k, _ in members if gp.edges[k].arg >= 0]
        if buckets.kinds[b] == "all_gather" and gathered:
            # Inductor's merge copies each member out of the flat buffer (its rows are strided
            # there) just before the member's first reader: each copy is a buffer of its own
            # from then to its last read, as unbucketed; the flat buffer lives from the first
            # member's reader to the last's.
            readers = [int(lo[gp.edges[k].consumer]) for k in gathered]
            raw = sum(local_bytes(chosen[gp.edges[k].consumer].ins[gp.edges[k].arg],
                                  output_val(gp.nodes[gp.edges[k].producer], gp.edges[k].out), mesh_shape)
                      for k in set(gathered))
            events.append((min(readers), max(readers) + 1, block_bytes(raw, caching), "communication buffers",
                           f"bucket {b} ({len(gathered)} gathered arguments)"))
            continue
        for e, _ in members:
            if gp.edges[e].arg >= 0:
                bucket_of.setdefault(e, b)
    flat: dict[int, list] = {}

    for e, ae in enumerate(gp.edges):
        u, v = ae.producer, ae.consumer
        src = chosen[u].outs[ae.out]
        if ae.arg < 0:
            dst = chosen[v].outs[0]
            if on_mesh(src, mesh_shape) == on_mesh(dst, mesh_shape):
                continue
            # The unreduced value lives to its move (its reads through views say so); the shard
            # the move makes, from then into the optimizer step.
            events.append((move_at.get(e, end), end, param_bytes.get(v, 0), "gradients",
                           f"{tg.fqn_of[gp.nodes[v].name]}.grad"))
            continue
        dst = chosen[v].ins[ae.arg]
        if on_mesh(src, mesh_shape) == on_mesh(dst, mesh_shape):
            continue
        val = output_val(gp.nodes[u], ae.out)
        if _broadcast_chunk(src, dst, val):
            continue
        raw = local_bytes(dst, val, mesh_shape)
        last = view_end[v] if _is_view(gp, v) else lo[v] + 1
        if e in bucket_of:
            if chosen[v].moved:  # the bucket's buffer holds it, not a buffer of its own
                amend(v, nbytes=0.0)
            flat.setdefault(bucket_of[e], []).append((lo[v], max(last, lo[v] + 1), raw))
            continue
        if chosen[v].moved:  # a moved view's buffer is its own usage
            continue
        # One read to the end is a gradient already in its parameter's spec: held into the step.
        events.append((lo[v], max(last, lo[v] + 1), block_bytes(raw, caching), "communication buffers",
                       f"{gp.nodes[u].name} -> {gp.nodes[v].name} ({src} -> {dst})"))
    for b, parts in flat.items():
        events.append((min(a for a, _, _ in parts), max(z for _, z, _ in parts),
                       block_bytes(sum(n for _, _, n in parts), caching), "communication buffers",
                       f"bucket {b} ({len(parts)} redistributed arguments)"))

    e_lo = np.array([e[0] for e in events], dtype=np.int64)
    e_hi = np.array([e[1] for e in events], dtype=np.int64)
    e_b = np.array([e[2] for e in events], dtype=np.float64)
    peak, at = _peak(e_lo, e_hi, e_b)
    live = (e_lo <= at) & (at < e_hi)
    at_peak = dict.fromkeys(CATEGORIES, 0)
    for k in np.flatnonzero(live):
        at_peak[events[k][3]] += int(e_b[k])
    peak_at = _node_at(gp, lo, at)
    t_b = backward_start(gp)
    saved = 0
    if t_b is not None:
        saved = int(sum(e_b[k] for k in np.flatnonzero((e_lo < t_b) & (t_b < e_hi))
                        if events[k][3] == "activations"))
    largest = sorted(((int(e_b[k]), events[k][3], events[k][4]) for k in np.flatnonzero(live)), reverse=True)[:8]

    # The optimizer step: what is held to the end, and AdamW's temporaries.
    held = e_hi >= end
    held[list(whole_until_step)] = False
    step = dict.fromkeys(CATEGORIES, 0)
    for k in np.flatnonzero(held):
        step[events[k][3]] += int(e_b[k])
    top = max(param_bytes.items(), key=lambda kv: kv[1], default=None)
    shards = list(param_bytes.values())
    step["optimizer step"] = int(sum(shards) if foreach else max(shards, default=0))
    if sum(step.values()) > peak:
        peak, at_peak, peak_at = float(sum(step.values())), step, "optimizer step"
        largest = sorted(((int(e_b[k]), events[k][3], events[k][4]) for k in np.flatnonzero(held)), reverse=True)[:7]
        what = "every parameter's shard (foreach)" if foreach else f"{tg.fqn_of[gp.nodes[top[0]].name]}'s shard"
        largest = sorted(largest + [(step["optimizer step"], "optimizer step", what)], reverse=True)
    return MemoryAccount(peak_bytes=int(peak), at_peak=at_peak, peak_at=peak_at, rows_peak_bytes=int(rows_peak),
                         at_step=step, largest=largest, saved_bytes=saved,
                         headroom_bytes=_headroom(e_lo, e_hi, e_b, t_b, peak))


def _headroom(lo: np.ndarray, hi: np.ndarray, nbytes: np.ndarray, t_b: int | None, peak: float) -> dict[str, int]:
    """Per program, the step's ``peak`` less the most the program holds at once (the forward runs
    before ``t_b``, the backward from it). The overlap scheduler may use it: a collective started
    early holds its output that much sooner, one waited for late its input that much longer. With
    none, an FSDP plan's gathers start only once the previous layer's memory is freed, exposed
    (LLaMA dim 512, 4 layers, FSDP on 8 ranks without buckets, h100 profile: 650 of the lowered
    programs' 1349 us of communication exposed where the scheduler may hold nothing more, 399 with
    the forward's headroom)."""
    times, total = interval_profile(lo, hi, nbytes)
    if t_b is None:  # no backward: the forward is the one program
        return {"forward": int(max(0.0, peak - float(total.max(initial=0.0))))}
    return {name: int(max(0.0, peak - float(total[part].max())))
            for name, part in (("forward", times < t_b), ("backward", times >= t_b)) if part.any()}


def _is_view(gp: GraphProblem, v: int) -> bool:
    return gp.nodes[v].op == "call_function" and is_view(gp.nodes[v])


def _gradient_moves(gp: GraphProblem, chosen, lo: np.ndarray, buckets, mesh_shape) -> dict[int, int]:
    """Per gradient edge whose gradient is moved to its parameter's spec, the time of the move:
    right after the gradient's op, or with buckets, after the op where its group is moved
    (:attr:`~autoshard.runtime.buckets.Buckets.moved_after`), and no sooner than its bucket's
    last member."""
    at: dict[int, int] = {}
    after = buckets.moved_after if buckets is not None else {}
    for k, e in enumerate(gp.edges):
        if e.arg < 0 and on_mesh(chosen[e.producer].outs[e.out], mesh_shape) != on_mesh(chosen[e.consumer].outs[0],
                                                                                           mesh_shape):
            at[k] = int(max(lo[e.producer], lo[after[k]] if k in after else 0))
    for members in buckets.members if buckets is not None else ():
        edges = {k for k, _ in members if k in at}
        if edges:
            t = max(at[k] for k in edges)
            for k in edges:
                at[k] = max(at[k], t)
    return at


def _gradient_outputs(gp: GraphProblem, tg) -> dict[int, set[int]]:
    """Per node one of whose outputs is a parameter's gradient (through views), those outputs."""
    out: dict[int, set[int]] = {}
    for g in tg.grad_of.values():
        while g.op == "call_function" and is_view(g) and g.args and isinstance(g.args[0], torch.fx.Node):
            g = g.args[0]
        if is_getitem(g) and g.args[0].name in gp.index:
            out.setdefault(gp.index[g.args[0].name], set()).add(int(g.args[1]))
    return out


def _broadcast_chunk(src, dst, val) -> bool:
    """Whether the move only splits dims the value broadcasts (stride 0: a loss's expanded
    gradient seed), which the executor does by a view (:func:`costmodel._torch_compat.chunk`)."""
    for a, b in zip(src.placements, dst.placements):
        if a == b:
            continue
        d = shard_dim(b)
        if a != "R" or d is None or val.stride(d) != 0:
            return False
    return True


def _peak(lo: np.ndarray, hi: np.ndarray, nbytes: np.ndarray) -> tuple[float, int]:
    """(largest total of the intervals live at once, a time where it is reached)."""
    times, total = interval_profile(lo, hi, nbytes)
    if not len(times):
        return 0.0, 0
    k = int(np.argmax(total))
    return float(total[k]), int(times[k])


def _node_at(gp: GraphProblem, lo: np.ndarray, at: int) -> str:
    started = np.flatnonzero(lo <= at)
    if not len(started):
        return ""
    v = started[np.argmax(lo[started])]
    return gp.nodes[v].name + ("@recompute" if v in gp.copy_of else "")
