"""Run every rank's program in one process, collectives computed between them.

A lowered plan is one FX graph per rank of local aten ops and functional collectives
(``torch.ops._c10d_functional.*``). On real processes each rank runs its own graph and
the process group moves the data. Under LocalTensorMode (every rank in one process,
how the tests check numerics without a GPU or a cluster) :func:`run_ranks` runs the
same graphs side by side: each rank's graph advances until its next collective; a
collective runs once every member of its group has reached it, on the members' tensors,
in the group's rank order. The graphs are the ones real ranks run, node for node: what
is checked is the program, not a re-implementation of it.
"""

from __future__ import annotations

import operator
from typing import Iterator

import torch
import torch.distributed.tensor  # noqa: F401 (registers torch.ops._dtensor)
import torch.fx as fx

from autoshard import _torch_compat as tc

_F = torch.ops._c10d_functional
_WAIT = _F.wait_tensor.default


class SpmdError(RuntimeError):
    """The ranks' programs do not agree on their collectives (an internal lowering bug)."""


def _reduce(parts: list[torch.Tensor], op: str) -> torch.Tensor:
    op = op.lower()
    if op in ("sum", "avg"):
        total = parts[0].clone()
        for p in parts[1:]:
            total = total + p
        return total / len(parts) if op == "avg" else total
    if op == "max":
        return torch.stack(parts).amax(0)
    if op == "min":
        return torch.stack(parts).amin(0)
    if op == "product":
        return torch.stack(parts).prod(0)
    raise SpmdError(f"reduce op {op!r} is not simulated")


def _all_gather(parts, args):
    out = torch.cat(parts, dim=0)
    return [out.clone() for _ in parts]


def _reduce_scatter(parts, args):
    total = _reduce(parts, args[1])
    return [c.clone() for c in total.chunk(len(parts), dim=0)]


def _all_reduce(parts, args):
    total = _reduce(parts, args[1])
    return [total.clone() for _ in parts]


def _all_to_all(parts, args):
    n = len(parts)
    pieces = []
    for p, a in zip(parts, args):
        splits = a[2] if a[2] else [p.shape[0] // n] * n
        pieces.append(torch.split(p, list(splits), dim=0))
    return [torch.cat([pieces[i][j] for i in range(n)], dim=0) for j in range(n)]


def _shard_dim_alltoall(parts, args):
    # DTensor's own op: gather along one dim, keep this member's chunk along another.
    full = torch.cat(parts, dim=args[1])
    return [c.contiguous() for c in full.chunk(len(parts), dim=args[2])]


def _broadcast(parts, args):
    return [parts[args[1]].clone() for _ in parts]


_COLLECTIVES = {
    # op -> (simulation, index of the group name among the op's arguments)
    _F.all_gather_into_tensor.default: (_all_gather, 2),
    _F.reduce_scatter_tensor.default: (_reduce_scatter, 3),
    _F.all_reduce.default: (_all_reduce, 2),
    _F.all_to_all_single.default: (_all_to_all, 3),
    _F.broadcast.default: (_broadcast, 2),
    torch.ops._dtensor.shard_dim_alltoall.default: (_shard_dim_alltoall, 3),
}


_OUT_VARIANTS = {
    # Bucketing writes a merged all-gather into a preallocated flat buffer (``out=``).
    _F.all_gather_into_tensor_out.default: _F.all_gather_into_tensor.default,
}


def collective_ops() -> frozenset:
    """The functional collectives a per-rank program may contain (besides ``wait_tensor``)."""
    return frozenset(_COLLECTIVES) | frozenset(_OUT_VARIANTS)


def _program(gm: fx.GraphModule, args: list) -> Iterator:
    """One rank's graph as a generator that yields at each collective ``(op, args)`` and is
    sent back this rank's result; it returns the graph's outputs."""
    env: dict[fx.Node, object] = {}
    it = iter(args)
    nodes = list(gm.graph.nodes)
    last = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a] = i
    for i, n in enumerate(nodes):
        if n.op == "placeholder":
            env[n] = next(it)
            continue
        if n.op == "output":
            return fx.node.map_arg(n.args[0], lambda a: env[a])
        if n.op == "get_attr":
            env[n] = getattr(gm, n.target)
            continue
        a, kw = fx.node.map_arg((n.args, n.kwargs), lambda x: env[x])
        if n.op != "call_function":
            raise SpmdError(f"node {n.name}: {n.op} nodes are not simulated")
        if n.target in _COLLECTIVES:
            env[n] = yield n.target, a
        elif n.target in _OUT_VARIANTS:
            result = yield _OUT_VARIANTS[n.target], a
            env[n] = kw["out"].copy_(result)
        elif n.target is _WAIT:
            env[n] = a[0]
        elif n.target is operator.getitem:
            env[n] = a[0][a[1]]
        else:
            env[n] = n.target(*a, **kw)
        for x in n.all_input_nodes:
            if last.get(x) == i:
                env.pop(x, None)
    raise SpmdError("graph has no output node")


class _Groups:
    """Each rank's group of a collective, from the group's name as traced.

    Every rank's graph was traced in this process, whose mesh holds this process's
    groups: a name identifies mesh axes (where its members' coordinates differ), and
    rank r's group on those axes is the ranks that share r's other coordinates, in the
    same order."""

    def __init__(self, mesh):
        self.ranks = mesh.mesh
        self.coords = {int(r): tuple(int(c) for c in (self.ranks == r).nonzero()[0]) for r in self.ranks.flatten()}
        self.cache: dict[tuple[str, int], tuple[int, ...]] = {}

    def of(self, name: str, rank: int) -> tuple[int, ...]:
        key = (name, rank)
        if key not in self.cache:
            members = [self.coords[m] for m in tc.group_ranks(name)]
            axes = [a for a in range(self.ranks.ndim) if len({c[a] for c in members}) > 1]
            mine = list(self.coords[rank])
            group = []
            for c in members:
                coord = list(mine)
                for a in axes:
                    coord[a] = c[a]
                group.append(int(self.ranks[tuple(coord)]))
            if rank not in group:
                raise SpmdError(f"rank {rank} is not in its own group {group} for {name}")
            self.cache[key] = tuple(group)
        return self.cache[key]


def run_ranks(programs: dict[int, fx.GraphModule], args: dict[int, list], mesh) -> dict[int, object]:
    """Run ``programs[r](*args[r])`` for every rank r together; returns each rank's outputs."""
    groups = _Groups(mesh)
    gens = {r: _program(gm, list(args[r])) for r, gm in programs.items()}
    pending: dict[int, tuple] = {}
    done: dict[int, object] = {}

    def advance(r, value):
        try:
            pending[r] = gens[r].send(value)
        except StopIteration as stop:
            done[r] = stop.value

    for r in sorted(gens):
        advance(r, None)
    with torch.no_grad():
        while pending:
            progressed = False
            for r in sorted(pending):
                if r not in pending:
                    continue
                op, a = pending[r]
                fn, name_at = _COLLECTIVES[op]
                members = groups.of(a[name_at], r)
                # Every member must be at this collective on this group: a member waiting on
                # the same kind of collective over another group is not there yet.
                if not all(m in pending and pending[m][0] is op and groups.of(pending[m][1][name_at], m) == members
                           for m in members):
                    continue
                results = fn([pending[m][1][0] for m in members], [pending[m][1] for m in members]
                             if op is _F.all_to_all_single.default else a)
                for m in members:
                    del pending[m]
                for m, value in zip(members, results):
                    advance(m, value)
                progressed = True
            if not progressed:
                waiting = {r: (str(op), groups.of(a[_COLLECTIVES[op][1]], r)) for r, (op, a) in pending.items()}
                raise SpmdError(f"the ranks' programs wait on collectives no group completes: {waiting} "
                                f"(finished: {sorted(done)})")
    return done
