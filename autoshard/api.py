"""``plan``: model + example inputs + mesh -> Plan."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch

import solver
from autoshard.baselines import BASELINES, baseline_pins
from autoshard.errors import AutoshardError
from autoshard.mesh import axis_names_of, check_mesh
from autoshard.pins import resolve_pins, to_spec
from autoshard.plan import ParamPlacement, Plan
from autoshard.problem import build_problem, pin_indices
from autoshard.trace import trace
from costmodel import MeshTopology, Profile, load_profile, plan_steps


def human_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3f} {unit}"
    return f"{int(n)} B"


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
    pins: dict | None = None,
    input_specs: Sequence | None = None,
    seed_baselines: bool = True,
    export_problem: str | None = None,
    example_kwargs: dict | None = None,
) -> Plan:
    """Choose a spec for every node of ``model``'s training step on ``mesh``.

    ``memory_budget``: bytes per device; ``"auto"`` takes the profile's device
    memory, ``None`` plans without a memory constraint. ``loss_fn`` maps the
    model's output to a scalar loss (default: the mean of the output).
    ``tie_layers``: repeated layers (a ModuleList of identical blocks) take the
    same specs, so the solver sees one layer however deep the model is.
    ``pins``: ``{FQN glob (parameter or module): spec}`` fixes those parameters'
    specs (a spec is text such as ``"S(0)[1,0]S(0)"`` or ``{axis: placement}``);
    ``input_specs``: one spec (or None) per example input. ``seed_baselines``: unless
    the first solve (60% of ``time_limit``) proves its plan optimal, the hand-written
    plans (DDP, FSDP, TP, FSDP+TP) are solved under their pins and, with the first
    answer, start a second solve for the time left, so the plan is never dearer than any
    of them. ``plan.solver["source"]`` names the stage or start the answer came from.
    ``export_problem``: also write the solver's problem (pins applied) to this path in the
    IOPDDL contest format (``.json`` or ``.json.gz``; ties and pins as extra keys).
    ``example_kwargs``: keyword arguments of ``forward`` (``attention_mask``, ``labels`` ...);
    tensors are planned inputs after the positional ones (``input_specs`` lists them in that
    order), other values are constants of the plan.
    """
    session = _Session(model, example_inputs, mesh, profile, memory_budget, loss_fn, tie_layers, log,
                       example_kwargs)
    if export_problem is not None:
        solver.save_iopddl(session.problem(pins, input_specs), export_problem)
        session.say(f"wrote the solver problem to {export_problem}")
    if not seed_baselines:
        return session.solve(pins, input_specs, time_limit, backend)
    t0 = time.perf_counter()
    first, choice = session.solve_with_choice(pins, input_specs, 0.6 * time_limit, backend)
    if first.solver["status"] == "optimal":
        return first  # a proved optimum: no hand-written plan can beat it
    seeds = session.baselines(BASELINES, 0.1 * time_limit / len(BASELINES), backend, user_pins=pins)
    rest = max(1.0, time_limit - (time.perf_counter() - t0))
    return session.solve(pins, input_specs, rest, backend, seeds=seeds,
                         starts=[(f"first solve ({first.solver['source']})", choice)])


def compare(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    mesh,
    baselines: Sequence[str] = BASELINES,
    profile: str | Profile = "h100-sxm",
    memory_budget: float | None | str = "auto",
    loss_fn: Callable | None = None,
    time_limit: float = 60.0,
    log: Callable[[str], None] | None = None,
    example_kwargs: dict | None = None,
) -> dict[str, Plan | str]:
    """Our plan and each hand-written baseline (``ddp``, ``fsdp``, ``tp``, ``fsdp_tp``), costed alike.

    One trace and one problem serve them all; a baseline fixes the parameter and
    input specs (see :mod:`autoshard.baselines`) and the solver does the rest. A
    baseline that does not fit the memory budget maps to the error's message.
    Keys: ``"autoshard"`` and the baseline names.
    """
    session = _Session(model, example_inputs, mesh, profile, memory_budget, loss_fn, True, log, example_kwargs)
    seeds = session.baselines(baselines, time_limit, "highs")
    out: dict[str, Plan | str] = {"autoshard": session.solve(None, None, time_limit, "highs", seeds=seeds)}
    for name in baselines:
        seed = seeds[name]
        out[name] = seed.plan if isinstance(seed, _Seed) else seed
    return out


@dataclasses.dataclass(frozen=True)
class _Seed:
    """A hand-written plan solved under its pins: the plan and the solver's choice."""

    plan: Plan
    choice: object


class _Session:
    """One traced model and its problem on one mesh: solved once per set of pins."""

    def __init__(self, model, example_inputs, mesh, profile, memory_budget, loss_fn, tie_layers, log,
                 example_kwargs=None):
        self.say = log or (lambda _m: None)
        check_mesh(mesh)
        self.model, self.mesh = model, mesh
        self.prof = _resolve_profile(profile)
        budget = self.prof.memory_bytes if memory_budget == "auto" else memory_budget
        if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
            raise AutoshardError(f"memory_budget: expected bytes > 0, 'auto' or None, found {memory_budget!r}")
        self.budget = budget
        t0 = time.perf_counter()
        self.phases = {}
        from autoshard._torch_compat import quiet_tracing

        with quiet_tracing():  # called inside LocalTensorMode or CommDebugMode, the trace is the model's alone
            self.tg = tg = trace(model, example_inputs, loss_fn, tie_layers=tie_layers, example_kwargs=example_kwargs)
        self.phases["trace_s"] = time.perf_counter() - t0
        self.say(f"traced {len(tg.gm.graph.nodes)} graph nodes in {self.phases['trace_s']:.2f}s"
                 + (f"; repeated layers: {', '.join(f'{g[0]}..{g[-1]}' for g in tg.layer_groups)}"
                    if tg.layer_groups else ""))
        t1 = time.perf_counter()
        self.gp = gp = build_problem(tg, mesh, self.prof, budget, tie_layers=tie_layers)
        self.phases["build_s"] = time.perf_counter() - t1
        st = gp.problem.stats()
        self.say(f"built problem: {st['nodes']} nodes ({sum(len(t) for t in gp.problem.ties)} in "
                 f"{len(gp.problem.ties)} tie groups), {st['strategies']} strategies, {st['edges']} edges "
                 f"in {self.phases['build_s']:.2f}s")
        self.names = axis_names_of(mesh)

    def baselines(self, names, time_limit, backend, user_pins=None) -> dict[str, "_Seed | str"]:
        """Each hand-written plan solved under its pins (the user's pins, where given, win):
        name -> :class:`_Seed`, or the error message when it breaks the budget."""
        out: dict[str, _Seed | str] = {}
        mine = resolve_pins(user_pins or {}, self.tg.param_fqns + self.tg.buffer_fqns, self.names)
        for name in names:
            pins, inputs = baseline_pins(name, self.model, len(tuple(self.mesh.shape)))
            inputs = inputs * len(self.tg.input_nodes())
            pins = {**pins, **mine}
            try:
                plan, choice = self.solve_with_choice(pins, inputs, time_limit, backend)
            except AutoshardError as exc:
                out[name] = str(exc)
                self.say(f"baseline {name}: {exc}")
                continue
            out[name] = _Seed(plan, choice)
            self.say(f"baseline {name}: {plan.summary['step_us'] / 1e3:.1f} ms predicted")
        return out

    def solve(self, pins, input_specs, time_limit, backend, seeds=None, starts=()) -> Plan:
        """The plan under ``pins``; ``seeds`` (from :meth:`baselines`) and ``starts`` (named
        choices) start the solver."""
        seeds = seeds or {}
        starts = [*starts, *((name, s.choice) for name, s in seeds.items() if isinstance(s, _Seed))]
        plan, _ = self.solve_with_choice(pins, input_specs, time_limit, backend, starts)
        if seeds:
            plan.solver["seeds"] = {name: s.plan.summary["step_us"] if isinstance(s, _Seed) else None
                                    for name, s in seeds.items()}
        return plan

    def problem(self, pins, input_specs) -> solver.Problem:
        """The solver's problem with ``pins`` (parameter FQN globs -> spec) and ``input_specs`` fixed."""
        tg, gp = self.tg, self.gp
        pinned = resolve_pins(pins or {}, tg.param_fqns + tg.buffer_fqns, self.names)
        in_specs = None if input_specs is None else [
            None if s is None else to_spec(s, self.names, f"input_specs[{k}]") for k, s in enumerate(input_specs)]
        return dataclasses.replace(gp.problem, pins=pin_indices(gp, tg, pinned, in_specs),
                                   name=f"{type(self.model).__name__} on {tuple(self.mesh.shape)}")

    def solve_with_choice(self, pins, input_specs, time_limit, backend, starts=()) -> tuple[Plan, object]:
        """(plan, the solver's choice per problem node) under ``pins``."""
        tg, gp = self.tg, self.gp
        problem = self.problem(pins, input_specs)
        t1 = time.perf_counter()
        try:
            sol = solver.solve(problem, time_limit=time_limit, backend=backend, log=self.say, starts=starts)
        except solver.InfeasibleError as exc:
            raise AutoshardError(
                f"memory budget {human_bytes(self.budget)} per device is infeasible for this model"
                f"{' with these pins' if problem.pins else ''} on mesh {tuple(self.mesh.shape)}: the smallest "
                f"feasible budget is at least {human_bytes(exc.min_feasible_limit_bound)} "
                f"({int(exc.min_feasible_limit_bound)} bytes)"
            ) from exc
        phases = dict(self.phases, solve_s=time.perf_counter() - t1)
        t1 = time.perf_counter()
        result = _assemble(self.model, tg, gp, sol, self.mesh, self.prof, self.budget)
        phases["assemble_s"] = time.perf_counter() - t1
        result.summary["plan_seconds"] = round(sum(phases.values()), 3)
        result.summary["phases"] = {k: round(v, 3) for k, v in phases.items()}
        if problem.pins:
            result.summary["pinned"] = len(problem.pins)
        return result, sol.choice


def _assemble(model, tg, gp, sol, mesh, prof: Profile, budget) -> Plan:
    names = axis_names_of(mesh)
    mesh_shape = tuple(mesh.shape)
    topo = MeshTopology(mesh_shape, prof.devices_per_node)
    choice = sol.choice
    chosen = [gp.strategies[v][choice[v]] for v in range(len(gp.nodes))]

    params, inputs, input_names, nodes = {}, [], [], {}
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
    }
    return Plan(
        mesh_shape=list(mesh_shape),
        axis_names=names,
        params=params,
        inputs=inputs,
        input_names=input_names,
        nodes=nodes,
        redistributes=redistributes,
        summary=summary,
        solver={"backend": sol.backend, "status": sol.status, "objective": round(sol.cost, 3),
                "bound": None if sol.lower_bound is None else round(sol.lower_bound, 3),
                "gap": None if sol.gap is None else round(sol.gap, 6), "seconds": round(sol.seconds, 3),
                "source": sol.source,
                "variables": sol.stats.get("variables"), "constraints": sol.stats.get("constraints")},
        profile=_profile_entry(prof),
        model={"class": type(model).__name__, "fingerprint": Plan.fingerprint(shapes)},
    )


def _profile_entry(prof) -> dict:
    """The plan's record of its profile: the name of a shipped one, or the whole profile (a
    calibrated or custom one), so that the plan can be lowered where that file is absent (the
    profile decides each redistribute's steps)."""
    from costmodel import builtin_profiles, load_profile

    entry = {"name": prof.name, "device": prof.device}
    if prof.name not in builtin_profiles() or load_profile(prof.name).to_json() != prof.to_json():
        entry["data"] = prof.to_json()
    return entry
