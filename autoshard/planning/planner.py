"""The planner: model + example inputs + mesh -> :class:`~autoshard.planfile.Plan`.

    planner = Planner(model, example_inputs, mesh, memory_budget=70 * 2**30)   # traces and builds once
    plan = planner.solve()                                # the plan
    other = planner.solve(pins={"layers.*.attn.wq": "RS(0)"}, time_limit=10)  # same trace, other pins
    table = planner.compare()                             # ours and the hand-written plans, costed alike

:func:`plan` and :func:`compare` are the one-call forms.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from typing import Sequence

import numpy as np
import torch

import solver
import solver.overlap
from autoshard.errors import AutoshardError, ConfigError, MemoryBudgetError, first_line
from autoshard.gcpause import fewer_gc_passes
from autoshard.graph.recompute import NONE, Recompute, choose, parameter_views, recomputed
from autoshard.graph.tracing import node_phase, trace
from autoshard.graph.unroll import trace_unrolled
from autoshard.mesh import axis_names_of, check_mesh
from autoshard.options import SOLVE_FIELDS, TRACE_FIELDS, PlanOptions, resolve, resolve_budget
from autoshard.planfile import RECOMPUTE_MODES, Plan
from autoshard.planning.assemble import assemble_plan
from autoshard.planning.baselines import (
    CONTEXT_BASELINES,
    HandWritten,
    baseline_pins,
    baseline_recompute,
    baselines_for,
)
from autoshard.planning.netahead import NOT_STARTED, NetAhead
from autoshard.planning.overlap import follow, relaxed
from autoshard.planning.pins import resolve_pins, to_spec
from autoshard.planning.problem import (
    GraphProblem,
    accumulated,
    amortized_moves,
    build_problem,
    gathered_once,
    held_in_flight,
    once_per_step,
    pin_indices,
    with_recompute,
)
from autoshard.planning.simulate import simulate_plan, step_floor
from autoshard.planning.windows import overlap_windows
from autoshard.units import human_bytes
from costmodel import Profile, load_profile
from solver.stall import StallRule

log = logging.getLogger(__name__)

#: The least time :func:`plan` leaves the solve (or ``time_limit`` where smaller) when tracing
#: and building took it all (the memory-free optimum and its repair take about this on LLaMA-70B).
MIN_SOLVE_SECONDS = 5.0
#: What :func:`plan` keeps of ``time_limit`` for the work after the solve's deadline (simulating
#: and assembling its answer), as a share of the problem's build time: both walk every node
#: once (measured at 0.1-0.35 of the build on LLaMA-3 8B to 405B).
ASSEMBLY_OF_BUILD = 0.5
#: Share of ``time_limit`` for all the hand-written plans together when ``seed_baselines`` is on
#: (solved only when the solve's cheap stages prove nothing); the solve has the rest.
BASELINES_SHARE = 0.25
#: Solves again, at most, with the memory rows' limit lowered, where a plan's account
#: (:mod:`autoshard.planning.memory`) is above its budget and its rows are not.
ACCOUNT_ROUNDS = 3
#: The optimality gap the overlap objective's weighed solves stop at (:func:`solver.solve_windows`):
#: each is one plane of a decomposition, and an answer within this share of its bound is as good
#: to it as its optimum.
ROUND_GAP = 1e-3
#: The stall rule of those solves: a plane needs a good plan, not a proof of it (LLaMA-70B on
#: (8, 8, 8): the exact search found its answer in a second and proved it in four), and a search
#: that finds nothing better than its start ends soon after it is ready: the next weights are
#: the better use of the time.
ORACLE_STALL = StallRule(patience=0.5, min_seconds=1.0, from_ready=True)


@fewer_gc_passes()
def plan(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], mesh, *, ranks: int | None = None,
         options: PlanOptions | None = None, **overrides) -> Plan:
    """Choose a spec for every node of ``model``'s training step on ``mesh``.

    Keywords are :class:`~autoshard.options.PlanOptions` fields (``memory_budget``, ``pins``,
    ``time_limit``, ``profile``, ...), applied over ``options``. One call of
    ``Planner(model, example_inputs, mesh, ...).solve()``; ``plan.solver["source"]`` names the
    stage or start the answer came from. ``mesh="auto"`` with ``ranks=N`` chooses the mesh
    shape too (:mod:`autoshard.planning.meshsearch`: every shape of N ranks planned within ``time_limit``,
    the table in ``plan.summary.mesh_search``; axes named ``axis0``, ``axis1`` ...).
    """
    if isinstance(mesh, str):
        if mesh != "auto" or ranks is None:
            raise ConfigError(f"mesh: expected a DeviceMesh, or 'auto' with ranks=N, found {mesh!r} "
                              f"with ranks={ranks}")
        from autoshard.planning.meshsearch import search

        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        return search(model, example_inputs, ranks, resolve(options, overrides), Planner)
    if ranks is not None:
        raise ConfigError(f"ranks={ranks} is for mesh='auto'; the mesh given has its own shape {tuple(mesh.shape)}")
    t0 = time.perf_counter()
    planner = Planner(model, example_inputs, mesh, options=options, **overrides)
    return solve_within(planner, planner.options.time_limit, t0)


def solve_within(planner: Planner, limit: float, started: float) -> Plan:
    """``planner.solve()`` such that the call that began building ``planner`` at ``started``
    (``time.perf_counter()``) ends within ``limit`` seconds: the solve gets what tracing and
    building left (LLaMA-405B: 6.4 s of them, on top of a 60 s solve, made a 60 s plan take 66 s),
    less what simulating and assembling its answer will take after its deadline (1.1 s more at
    405B), and at least ``MIN_SOLVE_SECONDS`` (or ``limit`` where smaller)."""
    left = limit - (time.perf_counter() - started) - ASSEMBLY_OF_BUILD * planner.phases.get("build_s", 0.0)
    return planner.solve(time_limit=max(min(MIN_SOLVE_SECONDS, limit), left))


@fewer_gc_passes()
def compare(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], mesh, *,
            baselines: Sequence[str] | None = None, options: PlanOptions | None = None,
            **overrides) -> dict[str, Plan | str]:
    """Our plan and each hand-written baseline, costed alike: see :meth:`Planner.compare`."""
    return Planner(model, example_inputs, mesh, options=options, **overrides).compare(baselines)


class Planner:
    """One traced model and its problem on one mesh, solved as many times as asked.

    The trace and the problem depend on the model, the inputs, the mesh and the options in
    :data:`~autoshard.options.TRACE_FIELDS`; each :meth:`solve` may change the others
    (pins, budget, time limit ...). Solves and hand-written plans are cached by their
    options, so ``solve()`` then ``compare()`` solves each once. ``traced``: another planner's
    trace of the same model, inputs and trace options, reused on this mesh.
    """

    @fewer_gc_passes()
    def __init__(self, model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], mesh, *,
                 options: PlanOptions | None = None, traced=None, **overrides):
        self.options = opts = resolve(options, overrides)
        check_mesh(mesh)
        if isinstance(example_inputs, torch.Tensor):
            example_inputs = (example_inputs,)
        self.model, self.mesh = model, mesh
        self.profile = opts.profile if isinstance(opts.profile, Profile) else load_profile(opts.profile)
        if opts.compute_dtype:
            self.profile = self.profile.priced_as(opts.compute_dtype)
        self.axis_names = axis_names_of(mesh)
        self.phases: dict[str, float] = {}
        t0 = time.perf_counter()
        from autoshard._torch_compat import quiet_tracing

        if traced is not None:  # another planner's trace of this model: it does not depend on the mesh
            self.traced = tg = traced
        else:
            with quiet_tracing():  # called inside LocalTensorMode or CommDebugMode, the trace is the model's alone
                if opts.tie_layers and opts.unroll_layers:
                    self.traced = tg = trace_unrolled(model, example_inputs, opts.loss_fn,
                                                      example_kwargs=opts.example_kwargs,
                                                      input_grads=opts.input_grads)
                else:
                    self.traced = tg = trace(model, example_inputs, opts.loss_fn, tie_layers=opts.tie_layers,
                                             example_kwargs=opts.example_kwargs, input_grads=opts.input_grads)
        self.phases["trace_s"] = time.perf_counter() - t0
        log.info(f"traced {len(tg.gm.graph.nodes)} graph nodes in {self.phases['trace_s']:.2f}s"
                 + (f"; repeated layers: {', '.join(f'{g[0]}..{g[-1]}' for g in tg.layer_groups)}"
                    if tg.layer_groups else ""))
        t1 = time.perf_counter()
        # The budget only sets the problem's usage limit: each solve replaces it.
        self._single = build_problem(tg, mesh, self.profile, self._budget(opts), tie_layers=opts.tie_layers,
                                     load_imbalance=float(opts.load_imbalance), bucket_mb=opts.bucket_mb)
        self.built = gp = self._staged(self._single)
        self.phases["build_s"] = time.perf_counter() - t1
        st = gp.problem.stats()
        log.info(f"built problem: {st['nodes']} nodes ({sum(len(t) for t in gp.problem.ties)} in "
                 f"{len(gp.problem.ties)} tie groups), {st['strategies']} strategies, {st['edges']} edges "
                 f"in {self.phases['build_s']:.2f}s")
        self._variants: dict[str, tuple[Recompute, GraphProblem]] = {"none": (NONE, gp)}
        self._choices: dict[str, Recompute] = {"none": NONE}
        self._plans: dict[str, tuple[Plan, object]] = {}
        self._made: list[tuple[Plan, object]] = []
        """Every solve's (plan, choice), those a faster hand-written plan replaced in ``_plans`` too."""
        self._free: dict[str, solver.MemoryFree] = {}
        """Memory-free optima that are proved and fit their budget, by problem: a solve of that
        problem has its answer (:meth:`memory_free`)."""
        self._infeasible: dict[str, MemoryBudgetError] = {}
        """Problems (by :func:`_problem_key`) proved infeasible under their budget."""
        self._steps: dict[str, dict[bytes, float]] = {}
        """Simulated steps of the plans seen, by recompute mode and choice."""
        self._additive: dict[str, solver.Solution] = {}
        """The last additive solve's answer per problem (by :func:`_problem_key`): where the
        overlap objective starts from (:meth:`_with_windows`)."""
        self._hints: list[tuple[str, np.ndarray]] = []
        """Plans of this model on this mesh found by another planner (:meth:`hint`)."""
        self._net: NetAhead | None = None
        """The safety net of the plan being solved, where it may run ahead (:mod:`.netahead`)."""
        self._seeds: dict[str, tuple[HandWritten | str, float, bool]] = {}
        """Hand-written plans by options: (the plan or why it failed, the seconds it was given,
        whether more time cannot change it: proved optimal, or not writable for this model)."""

    def _staged(self, gp: GraphProblem) -> GraphProblem:
        """``gp`` as a pipeline stage's microbatch costs it: the microbatches in flight held, the
        gradients accumulated over the step and moved once, and the weights its views keep for
        the backward gathered once per step (``in_flight``, ``microbatches``; 1 and 1: ``gp``)."""
        once = self._gathered_once(gp)
        m = self.options.microbatches
        buffers = accumulated(gp, self.traced) if m > 1 else []
        return amortized_moves(held_in_flight(gp, self.options.in_flight, once), m, once, buffers)

    def _gathered_once(self, gp: GraphProblem) -> list[int]:
        """:func:`~autoshard.planning.problem.gathered_once` where a step runs several microbatches."""
        return gathered_once(gp, self.traced) if self.options.microbatches > 1 else []

    def _budget(self, opts: PlanOptions) -> float | None:
        return resolve_budget(opts.memory_budget, self.profile.memory_bytes)

    def _options(self, overrides) -> PlanOptions:
        fixed = sorted(set(overrides) & set(TRACE_FIELDS))
        if fixed:
            raise ConfigError(f"{fixed} are fixed when the model is traced: make a new Planner to change them "
                              f"(a solve may change {list(SOLVE_FIELDS)})")
        return self.options.replace(**overrides)

    @fewer_gc_passes()
    def problem(self, **overrides) -> solver.Problem:
        """The solver's problem with these options' pins, input specs and memory budget applied."""
        opts = self._options(overrides)
        tg, gp = self.traced, self.variant(opts.recompute)[1]
        pinned = resolve_pins(dict(opts.pins or {}), tg.param_fqns + tg.buffer_fqns, self.axis_names)
        in_specs = None if opts.input_specs is None else [
            None if s is None else to_spec(s, self.axis_names, f"input_specs[{k}]")
            for k, s in enumerate(opts.input_specs)]
        return gp.problem.replaced(pins=pin_indices(gp, tg, pinned, in_specs), usage_limit=self._budget(opts),
                                   name=f"{type(self.model).__name__} on {tuple(self.mesh.shape)}")

    def variant(self, mode: str) -> tuple[Recompute, GraphProblem]:
        """The recomputation of ``mode`` (``"auto"``: ``"none"``) and the problem with it."""
        mode = "none" if mode == "auto" else mode
        if mode not in self._variants:
            if not self.traced.layer_groups:
                raise ConfigError(f"recompute={mode!r}: recomputation is chosen per repeated layer, and "
                                  f"{type(self.model).__name__} has none found (a ModuleList of identical blocks, "
                                  "traced with tie_layers=True)")
            t0 = time.perf_counter()
            rc = self._choice(mode)
            # From the problem as built (usages one microbatch's), then charged for the in-flight ones.
            self._variants[mode] = (rc, self._staged(with_recompute(self._single, self.traced, rc)))
            log.info(f"recompute {mode}: {rc.count} nodes recomputed in {len(rc.nodes)} layers "
                     f"({time.perf_counter() - t0:.2f}s)")
        return self._variants[mode]

    def _choice(self, mode: str) -> Recompute:
        if mode not in self._choices:
            # A weight gathered once per step is held anyway: recomputing its view would gather again.
            keep = parameter_views(self.traced) if self.options.microbatches > 1 else ()
            self._choices[mode] = choose(self.traced, mode, keep)
        return self._choices[mode]

    def cheapest_bound(self, **overrides) -> float:
        """A proved lower bound on every plan's predicted step (microseconds): each node's cheapest
        allowed strategy, edges free (redistributes and memory only add)."""
        problem = self.problem(**overrides)
        return float(sum(np.min(problem.node_costs[v][problem.allowed(v)], initial=np.inf)
                         for v in range(problem.num_nodes)))

    @fewer_gc_passes()
    def overlap_free(self, time_limit: float = 60.0, **overrides) -> solver.MemoryFree | None:
        """The optimum with memory ignored, nothing recomputed and every edge cost scaled by
        ``1 - eta`` (the profile's overlap share): its ``lower_bound`` bounds every plan's
        predicted (simulated) step in any recompute mode, as a step hides at most ``eta`` of its
        communication, ``S >= compute + (1 - eta) * communication``
        (:mod:`autoshard.planning.overlap`), and recomputation only adds. With ``eta = 0`` it is
        :meth:`memory_free`'s problem."""
        opts = self._options(overrides).replace(recompute="none")
        problem = relaxed(self.problem(**_solve_fields(opts)), self.profile.overlap)
        return solver.memory_free(problem, time_limit)

    @fewer_gc_passes()
    def memory_free(self, time_limit: float = 60.0, found: solver.MemoryFree | None = None,
                    **overrides) -> solver.MemoryFree | None:
        """The optimum with memory ignored and nothing recomputed (:func:`solver.memory_free`),
        within ``time_limit`` seconds. Its ``lower_bound`` bounds every plan of this problem in
        any recompute mode (memory only constrains, recomputation only adds compute: the bound
        ``recompute="auto"`` prunes modes with); where it fits the budget and is proved, it is
        the plan. ``found``: this answer, computed for the same problem elsewhere (a mesh search's
        worker process), kept instead of searching again."""
        opts = self._options(overrides).replace(recompute="none")
        free = found if found is not None else solver.memory_free(self.problem(**_solve_fields(opts)), time_limit)
        if free is not None and free.proved and free.fits:
            self._free[_problem_key(opts)] = free
        return free

    @fewer_gc_passes()
    def solve(self, **overrides) -> Plan:
        """The plan under these options (:data:`~autoshard.options.SOLVE_FIELDS` may differ
        from the planner's): one solve, whose long searches start, where ``seed_baselines`` is
        on and its cheap stages prove nothing, from the hand-written plans solved under their
        pins, so the plan is never dearer than any of them. Raises
        :class:`~autoshard.errors.MemoryBudgetError` when nothing fits."""
        opts = self._options(overrides)
        key = _key(opts)
        if key in self._plans:
            return self._plans[key][0]
        if opts.export_problem is not None:
            solver.save_iopddl(self.problem(**_solve_fields(opts)), opts.export_problem)
            log.info(f"wrote the solver problem to {opts.export_problem}")
        started = time.perf_counter()
        result = self._within_account(opts, started)
        self._plans[key] = result
        self._made.append(result)
        return result[0]

    def _within_account(self, opts: PlanOptions, started: float) -> tuple[Plan, object]:
        """The plan under ``opts`` whose account (:mod:`autoshard.planning.memory`), not only its
        memory rows, meets the budget: where the rows fit and the account does not (transient
        buffers, the executor's buckets, the optimizer step), solved again with the rows' limit
        lowered by the excess, at most :data:`ACCOUNT_ROUNDS` times."""
        budget = self._budget(opts)
        result = self._solve_rows(opts, started)
        tried = result[0].summary.recompute_tried
        rows, least = opts, result
        # The overlap rounds rank plans by simulated step, not by their account: where theirs breaks
        # the budget, the additive answer they started from may meet it, and lowering the rows
        # could exclude it (a tiny LLaMA on (2, 2): its re-solve 1185.1 us against its 1176.2).
        additive = self._additive_answer(opts, result) if budget is not None \
            and result[0].summary.peak_mem_bytes > budget else None
        for _ in range(ACCOUNT_ROUNDS):
            peak = result[0].summary.peak_mem_bytes
            if budget is None or peak <= budget:
                break
            limit = self._budget(rows) - (peak - budget)
            log.info(f"plan: its peak {peak / 2**30:.3f} GiB is above the budget {budget / 2**30:.3f} GiB once "
                     f"buffers are counted; solving again with the rows' limit at {limit / 2**30:.3f} GiB")
            if limit <= 1:  # nothing left for the rows (and a number <= 1 would read as a share)
                raise self._over_account(budget, least, limit, "no room is left for them")
            rows = opts.replace(memory_budget=limit)
            try:
                result = self._resolve_rows(rows, opts, result)
            except MemoryBudgetError as exc:
                raise self._over_account(budget, least, limit, first_line(exc), exc.min_feasible_bytes) from exc
            if result[0].summary.peak_mem_bytes < least[0].summary.peak_mem_bytes:
                least = result
        if additive is not None and additive[0].summary.peak_mem_bytes <= budget and (
                result[0].summary.peak_mem_bytes > budget or additive[0].summary.step_us < result[0].summary.step_us):
            log.info(f"plan: the additive answer ({additive[0].summary.step_us / 1e3:.3f} ms) meets the budget and "
                     f"is kept over the plan solved under lowered rows ({result[0].summary.step_us / 1e3:.3f} ms)")
            plan = additive[0]
            plan.summary.solve_alone = {"step_us": plan.summary.step_us, "additive_us": plan.summary.additive_us,
                                        "source": plan.solver.get("source"), "seeded": "seeds" in plan.solver}
            if tried is not None:
                plan.summary.recompute_tried = {**tried, plan.recompute["mode"]: plan.summary.step_us}
            return additive
        if budget is not None and result[0].summary.peak_mem_bytes > budget:
            raise self._over_account(budget, least, self._budget(rows), f"after {ACCOUNT_ROUNDS} solves")
        if rows is not opts:
            plan = result[0]
            plan.summary["memory_budget_bytes"] = int(budget)
            plan.summary.memory["rows_budget_bytes"] = int(self._budget(rows))
            if tried is not None:  # the modes compared first; the kept mode's entry is this plan
                plan.summary.recompute_tried = {**tried, plan.recompute["mode"]: plan.summary.step_us}
        return result

    def _additive_answer(self, opts: PlanOptions, result: tuple[Plan, object]) -> tuple[Plan, object] | None:
        """The additive solve's answer behind ``result`` (its recompute mode's, before the overlap
        rounds), assembled, where it is another plan; None where there is none to offer."""
        mode = opts.replace(recompute=result[0].recompute.get("mode", "none"))
        sol = self._additive.get(_problem_key(mode))
        if sol is None or np.array_equal(np.asarray(sol.choice), np.asarray(result[1])):
            return None
        # Its own plan, not the least simulated of its pool (the rounds weighed those already).
        return self._solve_once(mode, MIN_SOLVE_SECONDS, additive=dataclasses.replace(sol, pool=[]), windows=False)

    @staticmethod
    def _over_account(budget: float, least: tuple[Plan, object], limit: float, why: str,
                      rows_bound: float | None = None) -> MemoryBudgetError:
        plan = least[0]
        memory = plan.summary.memory or {}
        largest = ", ".join(f"{w} {b / 2**30:.3f} GiB" for b, _, w in memory.get("largest", [])[:3])
        return MemoryBudgetError(
            f"memory budget {budget / 2**30:.3f} GiB per device is not met: the least plan found holds "
            f"{plan.summary.peak_mem_bytes / 2**30:.3f} GiB at its peak ({memory.get('peak_at')}; largest there: "
            f"{largest}) once its communication buffers, the executor's buckets and the optimizer step are "
            f"counted, which the solver's memory rows do not see; with the rows' limit lowered to "
            f"{limit / 2**30:.3f} GiB: {why}. A budget of {plan.summary.peak_mem_bytes / 2**30:.3f} GiB fits that "
            f"plan (a smaller bucket_mb shortens what buckets hold)",
            budget, rows_bound if rows_bound is not None else budget)

    def _resolve_rows(self, rows: PlanOptions, opts: PlanOptions, last: tuple[Plan, object]) -> tuple[Plan, object]:
        """The plan again under the rows' lowered limit of ``rows``, in the recompute mode ``last``
        (the plan above the budget) chose, then (``recompute="auto"``) with full recomputation,
        which holds least; each in a quarter of ``opts.time_limit`` at least (the first solve
        may have spent it all)."""
        seconds = max(1.0, BASELINES_SHARE * opts.time_limit)
        modes = [last[0].recompute["mode"]]
        if opts.recompute == "auto" and self.traced.layer_groups and modes[0] != "full":
            modes.append("full")
        for k, mode in enumerate(modes):
            try:
                fixed = rows.replace(recompute=mode, time_limit=seconds)
                return self._or_hand_written(fixed, self._solve_mode(fixed, seconds), seconds)
            except MemoryBudgetError:
                if k == len(modes) - 1:
                    raise

    def _solve_rows(self, opts: PlanOptions, started: float) -> tuple[Plan, object]:
        """One plan under ``opts``, its memory rows limited by ``opts.memory_budget``, in what is
        left of ``opts.time_limit`` since ``started``."""
        left = max(1.0, opts.time_limit - (time.perf_counter() - started))
        net = BASELINES_SHARE * opts.time_limit
        if opts.seed_baselines and opts.input_specs is None and opts.overlap_objective:
            def ahead() -> tuple[str, float] | None:  # runs in the worker: its name and step come back
                # Its share of the limit, within what is left of the limit when it starts (the
                # net solved after the solve gets it within what the solve left).
                left_now = opts.time_limit - (time.perf_counter() - started)
                found = self._hand_written_of(opts, max(1.0, min(net, left_now)), float("inf"))
                return None if found is None else (found[0], found[1].step_us)

            self._net = NetAhead(ahead)
        try:
            if opts.recompute != "auto":
                result = self._solve_mode(opts, left)
            elif not self.traced.layer_groups or self._budget(opts) is None:  # nothing to trade memory for
                result = self._solve_mode(opts.replace(recompute="none"), left)
            else:
                result = self._solve_auto(opts.replace(time_limit=left))
            left = opts.time_limit - (time.perf_counter() - started)
            return self._or_hand_written(opts, result, max(1.0, min(net, left)))
        finally:
            if self._net is not None:
                self._net.close()
                self._net = None

    def _or_hand_written(self, opts: PlanOptions, result: tuple[Plan, object],
                         seconds: float) -> tuple[Plan, object]:
        """``result``, or the hand-written plan predicted faster where the solve did not weigh
        them: its cheap stages proved the additive optimum, which the simulated step need not
        follow. In
        ``seconds`` for all of them: what the solve left of ``time_limit``, at most the share the
        seeds of a solve get, at least a second."""
        plan = result[0]
        plan.summary.solve_alone = {"step_us": plan.summary.step_us, "additive_us": plan.summary.additive_us,
                                    "source": plan.solver.get("source"), "seeded": "seeds" in plan.solver}
        if "seeds" in plan.solver or not opts.seed_baselines or opts.input_specs is not None:
            return result
        ahead = self._net.answer() if self._net is not None else NOT_STARTED
        if ahead is NOT_STARTED:
            found = self._hand_written_of(opts, seconds, plan.summary.step_us)
        elif ahead is None or ahead[1] >= plan.summary.step_us - 1e-3:
            found = None
        else:  # solved ahead in the worker: solved again here (the same pinned solve) to assemble it
            seed = self._baselines([ahead[0]], self._options(_net_fields(opts)), seconds)[ahead[0]]
            found = (ahead[0], seed) if isinstance(seed, HandWritten) else None
        if found is None or found[1].step_us >= plan.summary.step_us - 1e-3:
            return result
        name, seed = found
        log.info(f"plan: baseline {name} is predicted faster ({seed.step_us / 1e3:.3f} ms): it is the plan")
        taken = seed.as_ours(name, f"predicted faster than the solve's plan, {plan.summary.step_us / 1e3:.3f} ms")
        taken.summary.solve_alone = plan.summary.solve_alone
        return taken, seed.choice

    def _hand_written_of(self, opts: PlanOptions, seconds: float, below: float):
        """:meth:`hand_written` under ``opts``'s solve fields, in ``seconds``, bounded as the safety
        net bounds it: by compute alone (the bounds of the additive step bound no step the buckets
        price: a TP plan's collectives, merged, cost a fraction of its additive communication on
        gloo, while every step holds its compute; a recomputing plan its copies' too)."""
        compute = self.cheapest_bound(**_solve_fields(opts.replace(recompute="none")))
        return self.hand_written(seconds, additive_floor_us=compute, compute_floor_us=compute, below=below,
                                 **_net_fields(opts))

    def _solve_auto(self, opts: PlanOptions) -> tuple[Plan, object]:
        """``recompute="auto"``: the cheapest of the three modes, each solved in an equal share of
        the time left, except those a proved bound rules out: a plan that recomputes costs at
        least the memory-free optimum without recomputation plus its copies' cheapest costs.
        The modes are compared on their plans' predicted steps, and the plan kept is assembled
        alone; with the overlap objective, it follows that objective from its additive plan."""
        t0 = time.perf_counter()
        modes = RECOMPUTE_MODES
        solved: dict[str, HandWritten] = {}
        tried, failed, floor = {}, None, None
        for k, mode in enumerate(modes):
            # Bounds are on the additive objective the modes are solved with: a mode is not solved
            # when none of its plans can beat the best additive plan so far.
            best = min(solved.values(), key=lambda hw: hw.step_us, default=None)
            if best is not None and floor is not None \
                    and best.additive_us <= floor + self.recompute_floor(mode, opts):
                tried[mode] = "pruned"
                continue
            share = max(1.0, (opts.time_limit - (time.perf_counter() - t0)) / (len(modes) - k))
            try:
                # Assembled once chosen: a mode's plan that loses is never assembled (1-2 s each
                # on LLaMA-70B).
                solved[mode] = self._solve_mode(opts.replace(recompute=mode), share, windows=False, lazy=True)
            except MemoryBudgetError as exc:
                tried[mode], failed = "infeasible", exc
                log.info(f"recompute {mode}: {first_line(exc)}")
                continue
            tried[mode] = round(solved[mode].step_us, 3)  # as a plan's summary rounds it
            if mode == "none":
                floor = solved[mode].memory_free_bound
        if not solved:
            raise failed
        mode = min(solved, key=lambda m: solved[m].step_us)
        if opts.overlap_objective:
            # Once, in the mode chosen: where memory binds its solves each cost about what the
            # additive solve did.
            solved[mode] = self._with_windows(opts.replace(recompute=mode), solved[mode],
                                              max(1.0, opts.time_limit - (time.perf_counter() - t0)))
            tried[mode] = round(solved[mode].step_us, 3)  # the mode's plan, the objective followed
        chosen = solved[mode]
        best = (chosen.plan, chosen.choice)
        if chosen.seeds:
            best[0].solver["seeds"] = chosen.seeds
        best[0].summary.recompute_tried = tried
        return best

    def _with_windows(self, opts: PlanOptions, solved: HandWritten, seconds: float) -> HandWritten:
        """``solved`` (the plan of ``opts``'s mode, solved additively) followed by the overlap
        objective from its additive solve's answer, in ``seconds``; not assembled."""
        additive = self._additive.get(_problem_key(opts))
        if additive is None:
            return solved
        followed = self._solve_once(opts, seconds, starts=[("additive plan", solved.choice)], hints=self._hints,
                                    additive=additive, lazy=True)
        followed.seeds = solved.seeds
        # The additive pass's plan is one of its candidates: never slower, and it has the record.
        return followed if followed.step_us <= solved.step_us + 1e-3 else solved

    def recompute_floor(self, mode: str, opts: PlanOptions | None = None) -> float:
        """What recomputing in ``mode`` adds to any plan at least: each recomputed node's cheapest
        allowed compute (its copy's cost), summed. Needs no problem built for the mode."""
        problem = self.problem(**_solve_fields((opts or self.options).replace(recompute="none")))
        rec = recomputed(self.traced.gm, self._choice(mode))
        gp = self.built
        return float(sum(np.min(gp.compute_us[v][problem.allowed(v)], initial=np.inf)
                         for v, n in enumerate(gp.nodes) if n in rec))

    def _solve_mode(self, opts: PlanOptions, time_limit: float, windows: bool = True, lazy: bool = False):
        """The plan in ``opts.recompute``'s mode: one solve; where ``seed_baselines`` is on and
        its cheap stages prove nothing, it asks for the hand-written plans (solved under their
        pins in their share of the time) and starts its long searches from them
        (``solver.solve(late_starts=...)``), so the plan is never dearer than any of them and
        the exact search begins at the best of them (LLaMA-405B on (8, 16, 8): FSDP+TP+AC's
        57.7 s step, where the search from its own start ended at 63.7 s). ``windows``: follow
        the overlap objective where the options ask for it. ``lazy``: a :class:`HandWritten`
        whose plan is assembled when first asked for, else (plan, choice)."""
        if not opts.seed_baselines:
            return self._solve_once(opts, time_limit, hints=self._hints, windows=windows, lazy=lazy)
        seeds: dict[str, HandWritten | str] = {}

        def hand_written():
            seeds.update(self._baselines(self.baseline_names(), opts, BASELINES_SHARE * time_limit))
            return [(name, s.choice) for name, s in seeds.items() if isinstance(s, HandWritten)]

        result = self._solve_once(opts, (1 - BASELINES_SHARE) * time_limit, late_starts=hand_written,
                                  hints=self._hints, windows=windows, lazy=lazy)
        if seeds:
            steps = {name: round(s.step_us, 3) if isinstance(s, HandWritten) else None for name, s in seeds.items()}
            if lazy:
                result.seeds = steps
            else:
                result[0].solver["seeds"] = steps
        return result

    def pipeline_times(self, plan: Plan) -> tuple[float, float, float]:
        """``plan``'s step as a pipeline stage runs it, microseconds: (forward, backward) of one
        microbatch, the simulated step without the moves made once per step (the gradients' moves
        to their parameters' specs, the held weights' gathers:
        :func:`~autoshard.planning.problem.once_per_step`) cut in the ratio of the forward's and
        the backward's compute (the model's and the loss's nodes, then the backward's, recomputed
        copies with the backward), and what those moves add to one microbatch's step, paid once
        per step (a stage gathers its held weights in its first forward and accumulates its
        microbatches' gradients unreduced). ``plan``: one this planner made."""
        import dataclasses as dc

        choice = next((c for p, c in self._plans.values() if p is plan), None)
        if choice is None:
            raise ConfigError("pipeline_times: the plan given was not made by this planner")
        gp = self.variant(plan.recompute.get("mode", "none"))[1]
        forward = backward = 0.0
        for v, node in enumerate(gp.nodes):
            us = float(gp.compute_us[v][choice[v]])
            if v < gp.num_originals and node_phase(node) in ("forward", "loss"):
                forward += us
            else:
                backward += us
        once = set(once_per_step(gp, self._gathered_once(gp)))

        def moves(scale: float) -> float:
            costs = [m * scale if k in once else m for k, m in enumerate(gp.problem.edge_costs)]
            return simulate_plan(dc.replace(gp, problem=gp.problem.with_edge_costs(costs)), choice,
                                 self.profile.overlap).step_us

        # The problem charges each move 1 / microbatches: the step with them whole, and without.
        bare, whole = moves(0.0), moves(float(self.options.microbatches))
        share = forward / (forward + backward) if forward + backward > 0 else 1 / 3
        return bare * share, bare * (1 - share), max(0.0, whole - bare)

    @fewer_gc_passes()
    def compare(self, baselines: Sequence[str] | None = None, **overrides) -> dict[str, Plan | str]:
        """Our plan and each hand-written baseline (default: every one that applies here,
        :meth:`baseline_names`), costed alike.

        ``"autoshard"`` is what :meth:`solve` returns under the same options (pins included),
        unless a baseline that the options allow (no input specs given, its recompute mode the
        one asked for or ``"auto"``) is predicted faster: the solve minimizes the overlap
        objective (:mod:`autoshard.planning.overlap`), which the simulated step need not follow
        everywhere (buckets, prefetches further ahead). That baseline's plan then is ours, and :meth:`solve`
        returns it from then on. A baseline fixes the parameter
        and input specs as people write them by hand (see :mod:`autoshard.planning.baselines`; the pins
        given win over its own) and the solver chooses the rest. A baseline that does not fit
        the memory budget maps to the error's message; so does ours where the solve found no plan
        within it, unless a baseline the options allow fits (the fastest is then ours).
        """
        opts = self._options(overrides)
        out: dict[str, Plan | str] = {}
        try:
            out["autoshard"] = self.solve(**overrides)
        except MemoryBudgetError as exc:
            out["autoshard"] = str(exc)
        names = self.baseline_names() if baselines is None else baselines
        for name, seed in self._baselines(names, opts, opts.time_limit).items():
            out[name] = seed.plan if isinstance(seed, HandWritten) else seed
            allowed = opts.input_specs is None and opts.recompute in ("auto", baseline_recompute(name))
            ours = out["autoshard"]
            # Faster by more than the rounding of a plan's figures (to the nanosecond).
            if allowed and isinstance(seed, HandWritten) and (
                    isinstance(ours, str) or seed.step_us < ours.summary.step_us - 1e-3):
                out["autoshard"] = self._adopt(opts, name, seed)
        return out

    def baseline_names(self) -> tuple[str, ...]:
        """The hand-written plans that apply here: :func:`~autoshard.planning.baselines.baselines_for`
        the model, and FSDP + CP (with and without full recomputation) where the model has causal
        fused attention and its batch cannot be split over every rank (long sequences: FSDP's
        batch split cannot be written, FSDP + CP's is what people run)."""
        from autoshard.graph.attention import is_causal_cpu_kernel

        names = baselines_for(self.model)
        inputs = self.traced.input_nodes()
        val = inputs[0].meta.get("val") if inputs else None
        world = math.prod(tuple(self.mesh.shape))
        if (isinstance(val, torch.Tensor) and val.ndim >= 2 and val.shape[0] % world
                and any(n.op == "call_function" and is_causal_cpu_kernel(n) for n in self.traced.gm.graph.nodes)):
            names += CONTEXT_BASELINES
        return names

    @fewer_gc_passes()
    def hand_written(self, time_limit: float, additive_floor_us: float = 0.0, compute_floor_us: float = 0.0,
                     below: float = float("inf"), **overrides) -> tuple[str, HandWritten] | None:
        """The hand-written plan of least predicted step that these options allow (``seed_baselines``
        on, no input specs given, its recompute mode the one asked for or ``"auto"``), each solved
        under its pins as a solve seeds with them, in ``time_limit`` seconds for all: (its name, the
        seed; ``seed.plan`` assembles it), or None. Planned alone where memory binds, a shape's plan
        is the least predicted of its solve and these: a mesh search compares shapes by them.
        ``additive_floor_us``, ``compute_floor_us``: lower bounds of every plan's additive step and
        compute without recomputation (a plan in a recompute mode adds its recomputed copies'
        cheapest compute to both, :meth:`recompute_floor`); a hand-written plan whose predicted
        step they bound at or above ``below``, or above the best of those solved before it
        (:func:`~autoshard.planning.simulate.step_floor`), is not solved."""
        opts = self._options(overrides)
        if not opts.seed_baselines or opts.input_specs is not None:
            return None

        def floor(mode: str) -> float:
            extra = self.recompute_floor(mode, opts) if mode != "none" else 0.0
            return step_floor(additive_floor_us + extra, compute_floor_us + extra, self.profile.overlap)

        names = [n for n in self.baseline_names() if opts.recompute in ("auto", baseline_recompute(n))]
        end = time.perf_counter() + time_limit
        best: tuple[str, HandWritten] | None = None
        for k, name in enumerate(names):
            bar = min(below, best[1].step_us if best is not None else float("inf"))
            if bar < float("inf") and floor(baseline_recompute(name)) >= bar:
                continue
            share = max(1.0, (end - time.perf_counter()) / (len(names) - k))
            seed = self._baselines([name], opts, share)[name]
            if isinstance(seed, HandWritten) and (best is None or seed.step_us < best[1].step_us):
                best = (name, seed)
        return best

    def _adopt(self, opts: PlanOptions, name: str, seed: HandWritten) -> Plan:
        """Hand-written plan ``name`` as the plan of ``opts`` (it is predicted faster than the
        solve's), labelled as such."""
        solved = self._plans.get(_key(opts), (None,))[0]
        if solved is None:  # the solve found no plan within the budget
            return seed.as_ours(name, "the solve found no plan within the memory budget")
        ours = seed.as_ours(name, f"predicted faster than the solve's plan, {solved.summary.step_us / 1e3:.3f} ms")
        ours.summary.solve_alone = solved.summary.solve_alone
        log.info(f"plan: baseline {name} is predicted faster ({seed.step_us / 1e3:.3f} ms): it is the plan")
        self._plans[_key(opts)] = (ours, seed.choice)
        return ours

    def _baselines(self, names, opts: PlanOptions, time_limit: float) -> dict[str, HandWritten | str]:
        """Each hand-written plan solved under its pins (the user's pins, where given, win) and in
        its own recompute mode: name -> :class:`HandWritten`, or the error message when it breaks the
        budget or cannot be written for this model (a batch smaller than the ranks it would be
        split over). ``time_limit`` is for all of them: each takes an equal share of what the
        ones before it left (a pinned plan is often proved in a second). A cached answer is
        reused when it had at least the time offered now, or more would not change it
        (:func:`settled`: proved optimal, or every search in it ended by its work)."""
        out: dict[str, HandWritten | str] = {}
        mine = resolve_pins(dict(opts.pins or {}), self.traced.param_fqns + self.traced.buffer_fqns,
                            self.axis_names)
        end = time.perf_counter() + time_limit
        for k, name in enumerate(names):
            share = max(1.0, (end - time.perf_counter()) / (len(names) - k))
            pins, inputs = baseline_pins(name, self.model, len(tuple(self.mesh.shape)), tuple(self.mesh.shape))
            inputs = inputs * len(self.traced.input_nodes())
            # A hand-written plan fixes the parameters' specs, which is what the overlap objective
            # trades; the rest is its additive optimum (ranked by simulated step), as written.
            seed_opts = dataclasses.replace(opts, pins={**pins, **mine}, input_specs=inputs, export_problem=None,
                                            recompute=baseline_recompute(name), overlap_objective=False)
            key = _key(seed_opts.replace(time_limit=1.0))
            cached = self._seeds.get(key)
            # A hand-written plan only adds pins to the user's problem in its mode (its input
            # specs too, where the user gave none): if that problem has no plan within the
            # budget, neither has the baseline.
            unpinned = None if opts.input_specs is not None else self._infeasible.get(
                _problem_key(opts.replace(recompute=seed_opts.recompute)))
            if cached is None and unpinned is not None:
                self._seeds[key] = (f"{first_line(unpinned)} (so with this baseline's pins too)", share, True)
                log.info(f"baseline {name}: infeasible, as its recompute mode is without its pins")
            elif cached is None or (cached[1] < share and not cached[2]):
                try:
                    seed = self._solve_once(seed_opts, share, lazy=True, hints=self.known_choices())
                except AutoshardError as exc:  # breaks the budget, or its specs do not fit this model
                    # The solver may give up on a budget within its time without proving it infeasible.
                    self._seeds[key] = (str(exc), share, not isinstance(exc, MemoryBudgetError))
                    log.info(f"baseline {name}: {first_line(exc)}")
                else:
                    self._seeds[key] = (seed, share, seed.settled)
                    log.info(f"baseline {name}: {seed.step_us / 1e3:.1f} ms predicted ({seed.status})")
            out[name] = self._seeds[key][0]
        return out

    def hint(self, choices: Sequence[tuple[str, np.ndarray]]) -> None:
        """Start every later solve from ``choices`` ((name, a choice per node of this planner's
        problem in any recompute mode)): plans another planner of this model, mesh and options
        found (:meth:`known_choices`; a mesh search's worker that bounded the shape). They bound
        the searches and are offered as answers, so a solve's additive cost is never above the
        least of those that fit (a hand-written plan re-solved in a short share, with none, was
        predicted 75x slower than the one its worker had found: LLaMA-70B on (8, 2, 4))."""
        need = self.built.num_originals
        for name, choice in choices:
            if np.ndim(choice) != 1 or len(choice) < need:
                raise ConfigError(f"hint {name!r}: expected a choice per problem node (at least {need} "
                                  f"entries), found shape {np.shape(choice)}")
            self._hints.append((name, np.asarray(choice)))

    def choice_of(self, plan: Plan) -> np.ndarray:
        """The solver's choice, per node of the problem of ``plan``'s recompute mode
        (:meth:`variant`), behind a plan this planner made (a solve's, or a hand-written one's
        from :meth:`compare`)."""
        for made, choice in [*self._plans.values(), *self._made]:
            if made is plan:
                return np.asarray(choice)
        for seed in self._seeds.values():
            if isinstance(seed[0], HandWritten) and seed[0].__dict__.get("plan") is plan:
                return np.asarray(seed[0].choice)
        raise ConfigError("choice_of: the plan was not made by this planner")

    def known_choices(self) -> list[tuple[str, np.ndarray]]:
        """The plans found so far on this planner, in any mode and under any pins (the solves',
        the memory-free optima, the hand-written plans, the hints given): starts that bound a
        hand-written plan's search (one 20% above its optimum halves toulbar2's time)."""
        found = [("solve", choice) for _, choice in self._plans.values()]
        found += [("memory-free optimum", free.choice) for free in self._free.values()]
        found += [("hand-written plan", seed[0].choice) for seed in self._seeds.values()
                  if isinstance(seed[0], HandWritten)]
        found += self._hints
        # Once each: an adopted hand-written plan is also a solve's, a proved optimum often both.
        once: dict[bytes, tuple[str, np.ndarray]] = {}
        for name, choice in found:
            once.setdefault(np.asarray(choice).tobytes(), (name, choice))
        return list(once.values())

    def _solve_once(self, opts: PlanOptions, time_limit: float, starts=(), late_starts=None, lazy: bool = False,
                    hints=(), windows: bool = True, additive: solver.Solution | None = None):
        """(plan, the solver's choice per problem node): one solve under ``opts`` (``starts`` and
        ``late_starts``: choices made in any recompute mode, see :func:`solver.solve`). With
        ``lazy``, a :class:`HandWritten` whose plan is assembled when first asked for. ``hints``: more
        starts, made under other options, that are not candidates of their own: the solver moves
        them onto this problem's pins, and a moved hint is then a plan of it like any other the
        search offers (its answer, or one of its pool ranked by simulated step). With ``windows``
        and ``opts.overlap_objective``, the answer follows the overlap objective
        (:func:`autoshard.planning.overlap.follow`); ``additive``: the additive solve's answer, known
        (not solved again)."""
        problem = self.problem(**_solve_fields(opts))
        rc, gp = self.variant(opts.recompute)
        t1 = time.perf_counter()
        budget = self._budget(opts)
        starts = [(name, _project(choice, gp)) for name, choice in starts]
        hints = [(name, _project(choice, gp)) for name, choice in hints]
        # The mode is always named: a budget that only recomputation meets is not "infeasible
        # for this model" (a baseline without recomputation was said to be, beside our plan
        # that fit it).
        recomputing = f" ({'these pins, ' if problem.pins else ''}recompute={rc.mode!r})"
        free = self._free.get(_problem_key(opts))
        asked: list = []  # the late starts, once the solve asks for them: candidates of the overlap objective

        def late():
            asked.extend((name, _project(choice, gp)) for name, choice in late_starts())
            return asked

        try:
            if additive is not None:
                sol = additive
            elif free is not None:  # proved optimal where memory cannot bind: no start beats it
                sol = free.solution(opts.backend)
            else:
                sol = solver.solve(problem, time_limit=time_limit, backend=opts.backend, starts=starts + hints,
                                   late_starts=None if late_starts is None else late)
        except solver.InfeasibleError as exc:
            proved = problem.usage_limit is not None and exc.min_feasible_limit_bound > problem.usage_limit
            if proved:
                err = MemoryBudgetError(
                    f"memory budget {human_bytes(budget)} per device is infeasible for this model"
                    f"{recomputing} on mesh {tuple(self.mesh.shape)}: "
                    f"the smallest feasible budget is at least {human_bytes(exc.min_feasible_limit_bound)} "
                    f"({int(exc.min_feasible_limit_bound)} bytes)",
                    budget_bytes=budget, min_feasible_bytes=exc.min_feasible_limit_bound,
                )
                self._infeasible[_problem_key(opts)] = err  # proved: even the least-usage plan breaks it
            else:
                # Not proved: the searches ran out of time first (a busy machine gives them less of
                # it: LLaMA-70B on (8, 8, 8), planned beside two other jobs on two cores).
                err = MemoryBudgetError(
                    f"no plan within the memory budget {human_bytes(budget)} per device was found in the "
                    f"{time_limit:.3g} s its solve had for this model{recomputing} on mesh {tuple(self.mesh.shape)}, "
                    f"and none was proved impossible (the least-usage plan's memory rows peak at "
                    f"{human_bytes(exc.min_feasible_limit_bound)}): a longer time_limit may find one",
                    budget_bytes=budget, min_feasible_bytes=exc.min_feasible_limit_bound,
                )
            raise err from exc

        # Where memory bound the additive solve, its memory-free stage (the optimum without memory,
        # repaired into it) lost to its starts: the weighed solves skip it (a second each on
        # LLaMA-70B) and search from the plans they are given.
        free_stage = sol.source == "pairwise" or problem.usage_limit is None
        # Memory priced into pairwise solves (the Lagrangian stage) proves a weighed problem in a
        # round or two where the rows bind lightly (LLaMA-8B on (8, 8): 2 rounds, 0.4 s), or not
        # at all: once one weighed solve's rounds gave way to the exact search, the later ones skip
        # them, as they differ from it only in their weights and the rows bind them alike (LLaMA-8B
        # on (2, 4, 8): 12 rounds and 9.9 s to 0.2% of a plan the exact search then proved in 1.8 s;
        # in 8 later solves the first round found nothing that fits, 0.9 s each).
        pricing = True

        def solve_weighed(weighed: solver.Problem, seconds: float, round_starts) -> solver.Solution:
            nonlocal pricing
            got = solver.solve(weighed, time_limit=seconds, backend=opts.backend, starts=round_starts,
                               mip_gap=ROUND_GAP, stall=ORACLE_STALL, pairwise=free_stage, lagrange=pricing)
            pricing = pricing and ("lagrange" not in got.stats or got.stats["lagrange"]["answered"])
            return got

        # The solve's other answers of about its cost compete by their simulated step too: among
        # plans the additive objective barely tells apart, overlap moves the step by percents.
        given = {np.asarray(choice).tobytes() for _, choice in starts + asked}
        pool = [(f"{source} (pool)", choice) for source, choice in sol.pool if choice.tobytes() not in given]
        self._additive[_problem_key(opts)] = sol
        windows = overlap_windows(gp, self.profile.overlap) if windows and opts.overlap_objective else None
        steps = self._steps.setdefault(opts.recompute, {})

        def simulated(choice) -> float:  # a plan is simulated once per mode (0.5 s on LLaMA-70B)
            key = np.asarray(choice).tobytes()
            if key not in steps:
                steps[key] = simulate_plan(gp, choice, self.profile.overlap).step_us
            return steps[key]

        # Where memory binds, a weighed solve is a search of seconds (LLaMA-70B: 2.5-4 s), not a
        # proof of a fraction of one: the decomposition stops at its first solve without gain.
        if windows is not None and free_stage and not asked and self._net is not None:
            self._net.start()  # nothing of the rounds depends on the hand-written plans: they run beside
        sol, overlap = follow(problem, gp, sol, self.profile.overlap, windows, solve_weighed, t1 + time_limit,
                              candidates=starts + asked + pool, simulated=simulated,
                              stall=solver.overlap.STALL if free_stage else 1)
        phases = dict(self.phases, solve_s=time.perf_counter() - t1)

        def assemble() -> Plan:
            t1 = time.perf_counter()
            result = assemble_plan(self.model, self.traced, gp, rc, sol, self.mesh, self.profile, budget, overlap,
                                   self._gathered_once(gp))
            phases["assemble_s"] = time.perf_counter() - t1
            result.summary.plan_seconds = round(sum(phases.values()), 3)
            result.summary.phases = {k: round(v, 3) for k, v in phases.items()}
            if problem.pins:
                result.summary.pinned = len(problem.pins)
            return result

        if lazy:
            return HandWritten(overlap["simulated_us"], sol.choice, sol.status.value, assemble, settled(sol),
                               overlap["additive_us"], (sol.stats.get("pairwise") or {}).get("bound"))
        return assemble(), sol.choice


def settled(sol: solver.Solution) -> bool:
    """Whether more time would leave ``sol`` as it is: proved optimal, or found by a search that
    ended by its work (the memory-free stage proved, the exact search ended by proof or its stall
    rule, nothing cut by the clock). A hand-written plan that is not is solved again when offered
    more time; one that is, is not (LLaMA-405B's pipeline stages solved FSDP+CP+AC three times, once
    per recompute mode, to the same plan: 1.4 s each)."""
    if sol.status == solver.Status.OPTIMAL:
        return True
    st = sol.stats
    return (not st.get("cut_by_clock") and "exact" in st
            and bool((st.get("pairwise") or {"proved": True}).get("proved")))


def _solve_fields(opts: PlanOptions) -> dict:
    """The fields of ``opts`` that shape the solver's problem."""
    return {"pins": opts.pins, "input_specs": opts.input_specs, "memory_budget": opts.memory_budget,
            "recompute": opts.recompute}


def _net_fields(opts: PlanOptions) -> dict:
    """The options the safety net's hand-written plans are solved under: ``opts``'s solve fields
    but its time limit (the net has its own share)."""
    return {f: getattr(opts, f) for f in SOLVE_FIELDS if f != "time_limit"}


def _project(choice, gp: GraphProblem) -> np.ndarray:
    """A choice made in any recompute mode as a start for ``gp``: its original nodes' strategies,
    each copy taking its original's (they are tied)."""
    base = np.asarray(choice)[:gp.num_originals]
    return np.concatenate([base, base[[gp.copy_of[c] for c in range(gp.num_originals, len(gp.nodes))]]
                           ]).astype(base.dtype)


def _problem_key(opts: PlanOptions) -> str:
    """The key of the solver's problem under ``opts`` (what :meth:`Planner.problem` depends on)."""
    return json.dumps(_solve_fields(opts), sort_keys=True, default=repr)


def _key(opts: PlanOptions) -> str:
    """A solve's cache key: the options that change its answer."""
    return json.dumps([opts.pins, opts.input_specs, opts.memory_budget, opts.recompute, opts.time_limit,
                       opts.backend, opts.seed_baselines, opts.overlap_objective], sort_keys=True, default=repr)
