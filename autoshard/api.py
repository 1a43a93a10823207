"""``plan``: model + example inputs + mesh -> Plan."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

import solver
from autoshard.errors import AutoshardError
from autoshard.mesh import axis_names_of, check_mesh
from autoshard.plan import ParamPlacement, Plan
from autoshard.problem import build_problem
from autoshard.trace import trace
from costmodel import MeshTopology, Profile, load_profile, plan_steps


def _resolve_profile(profile: str | Profile) -> Profile:
    return profile if isinstance(profile, Profile) else load_profile(profile)


def plan(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    mesh,
    profile: str | Profile = "h100-sxm",
    memory_budget: float | None | str = "auto",
    loss_fn: Callable | None = None,
    time_limit: float = 60.0,
    backend: str = "highs",
    log: Callable[[str], None] | None = None,
    tie_layers: bool = True,
) -> Plan:
    """Choose a spec for every node of ``model``'s training step on ``mesh``.

    ``memory_budget``: bytes per device; ``"auto"`` takes the profile's device
    memory, ``None`` plans without a memory constraint. ``loss_fn`` maps the
    model's output to a scalar loss (default: the mean of the output).
    ``tie_layers``: repeated layers (a ModuleList of identical blocks) take the
    same specs, so the solver sees one layer however deep the model is.
    """
    say = log or (lambda _m: None)
    check_mesh(mesh)
    prof = _resolve_profile(profile)
    budget = prof.memory_bytes if memory_budget == "auto" else memory_budget
    if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
        raise AutoshardError(f"memory_budget: expected bytes > 0, 'auto' or None, found {memory_budget!r}")
    t0 = time.perf_counter()
    phases = {}
    tg = trace(model, example_inputs, loss_fn, tie_layers=tie_layers)
    phases["trace_s"] = time.perf_counter() - t0
    say(f"traced {len(tg.gm.graph.nodes)} graph nodes in {phases['trace_s']:.2f}s"
        + (f"; repeated layers: {', '.join(f'{g[0]}..{g[-1]}' for g in tg.layer_groups)}"
           if tg.layer_groups else ""))
    gp = build_problem(tg, mesh, prof, budget, tie_layers=tie_layers)
    st = gp.problem.stats()
    phases["build_s"] = time.perf_counter() - t0 - phases["trace_s"]
    say(f"built problem: {st['nodes']} nodes ({sum(len(t) for t in gp.problem.ties)} in "
        f"{len(gp.problem.ties)} tie groups), {st['strategies']} strategies, {st['edges']} edges "
        f"in {phases['build_s']:.2f}s")
    try:
        t1 = time.perf_counter()
        sol = solver.solve(gp.problem, time_limit=time_limit, backend=backend, log=say)
        phases["solve_s"] = time.perf_counter() - t1
    except solver.InfeasibleError as exc:
        raise AutoshardError(
            f"memory budget {budget / 2**30:.3f} GiB per device is infeasible for this model on mesh "
            f"{tuple(mesh.shape)}: the smallest feasible budget is at least "
            f"{exc.min_feasible_limit_bound / 2**30:.3f} GiB"
        ) from exc
    t1 = time.perf_counter()
    result = _assemble(model, tg, gp, sol, mesh, prof, budget, 0.0)
    phases["assemble_s"] = time.perf_counter() - t1
    result.summary["plan_seconds"] = round(time.perf_counter() - t0, 3)
    result.summary["phases"] = {k: round(v, 3) for k, v in phases.items()}
    return result


def _assemble(model, tg, gp, sol, mesh, prof: Profile, budget, seconds) -> Plan:
    names = axis_names_of(mesh)
    mesh_shape = tuple(mesh.shape)
    topo = MeshTopology(mesh_shape, prof.devices_per_node)
    choice = sol.choice
    chosen = [gp.strategies[v][choice[v]] for v in range(len(gp.nodes))]

    params, inputs, nodes = {}, [], {}
    for v, n in enumerate(gp.nodes):
        s = chosen[v]
        if n.op == "placeholder":
            kind = tg.kinds[n.name]
            spec = s.outs[0]
            if kind in ("param", "buffer"):
                params[tg.fqn_of[n.name]] = ParamPlacement(
                    placements=dict(zip(names, spec.placements)),
                    shard_order={str(d): [names[a] for a in axes] for d, axes in spec.shard_order},
                    shape=list(n.meta["val"].shape),
                )
            else:
                inputs.append(str(spec))
        else:
            nodes[n.name] = {
                "op": str(n.target),
                "out": [str(o) if o is not None else None for o in s.outs] if len(s.outs) > 1 else str(s.outs[0]),
                "in": [str(i) for i in s.ins],
            }

    redistributes, comm = [], 0.0
    for e, ae in enumerate(gp.edges):
        u, v = ae.producer, ae.consumer
        src = chosen[u].outs[ae.out]
        dst = chosen[v].ins[ae.arg] if ae.arg >= 0 else chosen[v].outs[0]
        us = float(gp.problem.edge_costs[e][choice[u], choice[v]])
        comm += us
        if src == dst or us == 0:
            continue
        t = gp.nodes[u].meta["val"]
        t = t[ae.out] if isinstance(t, (tuple, list)) else t
        steps = plan_steps(src, dst, tuple(t.shape), t.element_size(), topo, prof)
        node_name = gp.nodes[v].name if ae.arg >= 0 else tg.fqn_of[gp.nodes[v].name]
        redistributes.append({
            "node": node_name,
            "arg": ae.arg if ae.arg >= 0 else "grad",
            "from": str(src),
            "to": str(dst),
            "steps": [f"{st.kind}({','.join(names[a] for a in st.axes)})" for st in steps],
            "us": round(us, 3),
        })
    compute = float(sum(gp.compute_us[v][choice[v]] for v in range(len(gp.nodes))))
    total = float(sol.cost)
    comm_total = max(0.0, total - compute)  # edges plus the loss reduction (input loading is negligible)
    shapes = {fqn: list(p.shape) for fqn, p in list(model.named_parameters()) + list(model.named_buffers())}
    summary = {
        "step_us": round(total, 3),
        "compute_us": round(compute, 3),
        "comm_us": round(comm_total, 3),
        "peak_mem_bytes": int(sol.peak_usage),
        "memory_budget_bytes": int(budget) if budget is not None else None,
        "graph_nodes": len(gp.nodes),
        "strategies": int(sum(len(s) for s in gp.strategies)),
        "edges": len(gp.edges),
        "fallback_ops": gp.fallback_ops,
        "plan_seconds": round(seconds, 3),
    }
    return Plan(
        mesh_shape=list(mesh_shape),
        axis_names=names,
        params=params,
        inputs=inputs,
        nodes=nodes,
        redistributes=redistributes,
        summary=summary,
        solver={"backend": sol.backend, "status": sol.status, "objective": round(sol.cost, 3),
                "bound": None if sol.lower_bound is None else round(sol.lower_bound, 3),
                "gap": None if sol.gap is None else round(sol.gap, 6), "seconds": round(sol.seconds, 3),
                "variables": sol.stats.get("variables"), "constraints": sol.stats.get("constraints")},
        profile={"name": prof.name, "device": prof.device},
        model={"class": type(model).__name__, "fingerprint": Plan.fingerprint(shapes)},
    )
