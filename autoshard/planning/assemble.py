"""A solved choice made into a :class:`~autoshard.planfile.Plan`: every parameter's and node's
specs, every redistribute with its steps, and the summary of what it predicts (the simulated
step with its buckets, peak memory, the solver's facts)."""

from __future__ import annotations

from autoshard.graph.attention import attention_summary
from autoshard.graph.recompute import Recompute
from autoshard.graph.strategies import output_val
from autoshard.mesh import axis_names_of
from autoshard.planfile import ParamPlacement, Plan
from autoshard.planning.memory import account
from autoshard.planning.problem import GraphProblem
from autoshard.planning.simulate import problem_buckets, simulate_plan
from autoshard.plansummary import PlanSummary
from costmodel import MeshTopology, Profile, plan_steps


def assemble_plan(model, tg, gp: GraphProblem, rc: Recompute, sol, mesh, prof: Profile, budget, overlap: dict,
                  once=()) -> Plan:
    """The plan file of ``sol`` on ``gp``; ``once``: the views whose parameter a step of several
    microbatches gathers once (:func:`~autoshard.planning.problem.gathered_once`)."""
    names = axis_names_of(mesh)
    mesh_shape = tuple(mesh.shape)
    topo = MeshTopology(mesh_shape, prof.devices_per_node)
    choice = sol.choice
    chosen = [gp.strategies[v][choice[v]] for v in range(len(gp.nodes))]

    params, inputs, input_names, nodes = {}, [], [], {}
    for v, n in enumerate(gp.nodes[:gp.num_originals]):  # a recomputed copy takes its original's specs
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
                input_names.append(tg.fqn_of[n.name])
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
        t = output_val(gp.nodes[u], ae.out)
        steps = plan_steps(src, dst, tuple(t.shape), t.element_size(), topo, prof)
        node_name = gp.nodes[v].name if ae.arg >= 0 else tg.fqn_of[gp.nodes[v].name]
        entry = {
            "node": node_name,
            "arg": ae.arg if ae.arg >= 0 else "grad",
            "from": str(src),
            "to": str(dst),
            "steps": [f"{st.kind}({','.join(names[a] for a in st.axes)})" for st in steps],
            "us": round(us, 3),
            # Per step: predicted microseconds and bytes of the full buffer (nccl-tests'
            # convention), what `autoshard measure` sets beside the measured collectives.
            "step_us": [round(st.us, 3) for st in steps],
            "step_bytes": [int(st.nbytes) for st in steps],
        }
        if v in gp.copy_of:
            entry["recompute"] = True  # run again in the backward, before the recomputed op
        redistributes.append(entry)
    compute = float(sum(gp.compute_us[v][choice[v]] for v in range(len(gp.nodes))))
    total = float(sol.cost)
    comm_total = max(0.0, total - compute)  # edges plus the loss reduction (input loading is negligible)
    shapes = {fqn: list(p.shape) for fqn, p in list(model.named_parameters()) + list(model.named_buffers())}
    buckets = problem_buckets(gp, choice)
    tl = simulate_plan(gp, choice, prof.overlap, buckets)
    held = [v for v in once if chosen[v].moved]
    memory = account(gp, tg, choice, held=held)
    summary = PlanSummary(
        step_us=round(tl.step_us, 3),
        additive_us=round(total, 3),
        compute_us=round(compute, 3),
        comm_us=round(comm_total, 3),
        peak_mem_bytes=memory.peak_bytes,
        memory=memory.to_json(),
        graph_nodes=gp.num_originals,
        strategies=int(sum(len(s) for s in gp.strategies[:gp.num_originals])),
        edges=len(gp.edges),
        fallback_ops=gp.fallback_ops,
        rule_errors=gp.rule_errors,
        flops_uncounted=gp.flops_uncounted,
        recompute={"mode": rc.mode, "nodes": rc.count, "layers": len(rc.nodes),
                   "compute_us": round(float(sum(gp.compute_us[c][choice[c]] for c in gp.copy_of)), 3)},
        attention=attention_summary(gp.nodes[:gp.num_originals], chosen, prof, mesh_shape) or None,
        load_imbalance=dict(gp.imbalance) if gp.imbalance else None,
        simulated={"step_us": round(tl.step_us, 3), "exposed_comm_us": round(max(0.0, tl.exposed_us), 3),
                   "comm_us": round(tl.comm_us, 3), "overlap_share": prof.overlap},
        overlap={k: v for k, v in overlap.items() if k != "simulated_us"},
    )
    summary["memory_budget_bytes"] = int(budget) if budget is not None else None  # null: no budget
    if buckets is not None:
        summary.simulated.update(bucket_mb=gp.bucket_mb, buckets=len(buckets.members),
                                 bucketed=sum(len(m) for m in buckets.members),
                                 bucket_saved_us=round(buckets.saved_us, 3))
    if tl.idle_us > 0:
        summary.simulated["host_idle_us"] = round(tl.idle_us, 3)
    return Plan(
        mesh_shape=list(mesh_shape),
        axis_names=names,
        params=params,
        inputs=inputs,
        input_names=input_names,
        nodes=nodes,
        redistributes=redistributes,
        summary=summary,
        solver={"backend": sol.backend, "status": sol.status.value, "objective": round(sol.cost, 3),
                "bound": None if sol.lower_bound is None else round(sol.lower_bound, 3),
                "gap": None if sol.gap is None else round(sol.gap, 6), "seconds": round(sol.seconds, 3),
                "memory_free_bound": (sol.stats.get("pairwise") or {}).get("bound"),
                "source": sol.source,
                "variables": sol.stats.get("variables"), "constraints": sol.stats.get("constraints"),
                **({"cut_by_clock": sol.stats["cut_by_clock"]} if sol.stats.get("cut_by_clock") else {})},
        profile=profile_entry(prof),
        model={"class": type(model).__name__, "fingerprint": Plan.fingerprint(shapes),
               **({"input_grads": sorted(tg.input_grad_of)} if tg.input_grad_of else {})},
        recompute=rc.to_json(),
        held=[gp.nodes[v].name for v in held],
    )


def profile_entry(prof) -> dict:
    """The plan's record of its profile: the name of a shipped one, or the whole profile (a
    calibrated or custom one), so that the plan can be lowered where that file is absent (the
    profile decides each redistribute's steps)."""
    from costmodel import builtin_profiles, load_profile

    entry = {"name": prof.name, "device": prof.device}
    if prof.name not in builtin_profiles() or load_profile(prof.name).to_json() != prof.to_json():
        entry["data"] = prof.to_json()
    return entry
