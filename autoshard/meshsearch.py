"""Choose the mesh shape with the plan: every way to lay ``ranks`` out as 1-3 axes, planned.

    plan = autoshard.plan(model, example_inputs, mesh="auto", ranks=512)
    plan.summary["mesh_search"]          # one row per shape: step, memory, bound, seconds, outcome

Shapes (:func:`mesh_shapes`): the ordered factorizations of ``ranks`` into 1 to ``max_axes``
axes of size >= 2 whose innermost axis stays within a node (``devices_per_node`` of the
profile; a 1-D mesh is always tried). Shapes that differ only in the order of their
inter-node axes cost the same and are tried once.

The model is traced once (the trace does not depend on the mesh); each shape's problem is
built, then bounded from below by its cheapest strategy per node, edges free (a proof:
edges and memory only add cost); a shape whose bound is not below the best plan found so
far is not solved. The others are screened in :func:`search_order`, each with an equal share
of half the time limit (at least ``MIN_SCREEN_SECONDS``); shapes whose turn comes after that
half is spent are skipped. The cheapest is then solved in full (seeded by the hand-written
plans, as on a given mesh) for at least the other half. ``time_limit`` is the whole search's:
raise it to screen more shapes. Every shape goes in the table, with why it was pruned or
skipped or what it cost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from autoshard.errors import AutoshardError, ConfigError, MemoryBudgetError
from autoshard.options import PlanOptions
from autoshard.planfile import Plan
from costmodel import MeshTopology

log = logging.getLogger(__name__)


def mesh_shapes(ranks: int, devices_per_node: int, max_axes: int = 3) -> list[tuple[int, ...]]:
    """The candidate shapes, fewest axes first: 1-D, then every factorization into 2..max_axes
    axes of size >= 2 whose innermost axis lies within a node, one per class of shapes that
    differ only in the order of their inter-node axes."""
    if ranks < 1:
        raise ConfigError(f"ranks: expected >= 1, found {ranks}")
    if not 1 <= max_axes <= 4:
        raise ConfigError(f"max_axes: expected 1 to 4, found {max_axes}")

    def factorizations(n: int, k: int):
        if k == 1:
            if n >= 2:
                yield (n,)
            return
        for d in range(2, n + 1):
            if n % d == 0:
                for rest in factorizations(n // d, k - 1):
                    yield (d, *rest)

    out, seen = [(ranks,)], {(ranks,)}
    for k in range(2, max_axes + 1):
        for shape in factorizations(ranks, k):
            topo = MeshTopology(shape, devices_per_node)
            intra = [topo.group_is_intra_node((a,)) for a in range(k)]
            if not intra[-1]:
                continue
            inter = tuple(sorted((s for s, i in zip(shape, intra) if not i), reverse=True))
            key = (inter, tuple(s if i else 0 for s, i in zip(shape, intra)))
            if key in seen:
                continue
            seen.add(key)
            out.append(shape)
    return out


@dataclass
class ShapeResult:
    """One row of the search's table."""

    shape: tuple[int, ...]
    outcome: str
    """``chosen`` (the answer's shape), ``planned``, ``pruned`` (its bound is not below the best
    plan found before it), ``infeasible`` (nothing fits the memory budget), ``skipped`` (the
    screening time was spent before its turn) or ``error`` (the note says why: a pin written for
    another number of axes ...)."""
    step_us: float | None = None
    peak_mem_bytes: int | None = None
    bound_us: float | None = None
    """A proved lower bound on any plan of this shape (cheapest strategy per node)."""
    seconds: float = 0.0
    note: str = ""

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "outcome": self.outcome, "step_us": self.step_us,
                "peak_mem_bytes": self.peak_mem_bytes, "bound_us": self.bound_us,
                "seconds": round(self.seconds, 3), "note": self.note}


def axis_names(k: int) -> tuple[str, ...]:
    return tuple(f"axis{a}" for a in range(k))


#: Share of ``time_limit`` for the screening pass over the shapes; the chosen shape's full
#: solve (hand-written plans as seeds, as a plan on a given mesh) gets at least the rest.
SCREEN_SHARE = 0.5
#: The least time a shape is screened with: below it the memory-free search is cut off before
#: it proves (1-2 s on LLaMA-8B) and a screening answer says nothing about the shape.
MIN_SCREEN_SECONDS = 10.0


def search_order(shapes: list[tuple[int, ...]], devices_per_node: int) -> list[tuple[int, ...]]:
    """The order shapes are screened in, likeliest first where time runs out: the 1-D mesh
    (cheap to build), then shapes whose innermost axis is a whole node (tensor parallelism on
    the fast links), then the rest; fewer axes first within each."""
    return sorted(shapes, key=lambda s: (len(s) > 1, s[-1] != devices_per_node, len(s), s))


def search(model, example_inputs, ranks: int, options: PlanOptions, make_planner, max_axes: int = 3) -> Plan:
    """The best plan over :func:`mesh_shapes`, its table in ``plan.summary["mesh_search"]``.

    A screening pass solves each shape not pruned by its bound with an equal share of half the
    time, without the hand-written seeds; the cheapest shape is then solved as a plan on a given
    mesh is, for the time left, and its plan is the answer (never dearer than its screening)."""
    import torch.distributed as dist

    from autoshard.mesh import fake_mesh

    if dist.is_initialized() and dist.get_world_size() != ranks:
        raise ConfigError(f"ranks={ranks}, but a process group of world size {dist.get_world_size()} exists: "
                          "plan with mesh='auto' on a fake process group of that size (or none)")
    t0 = time.perf_counter()
    limit = options.time_limit
    first = make_planner(model, example_inputs, fake_mesh((ranks,), axis_names(1)), options=options)
    shapes = search_order(mesh_shapes(ranks, first.profile.devices_per_node, max_axes),
                          first.profile.devices_per_node)
    log.info(f"mesh search over {len(shapes)} shapes of {ranks} ranks: "
             f"{', '.join('x'.join(map(str, s)) for s in shapes)}")
    rows: list[ShapeResult] = []
    best: tuple[Plan, object, ShapeResult] | None = None  # (plan, its planner, its row)
    infeasible: list[MemoryBudgetError] = []
    for k, shape in enumerate(shapes):
        started = time.perf_counter()
        if best is not None and started - t0 > SCREEN_SHARE * limit:
            rows.append(ShapeResult(shape, "skipped", note=f"the screening time ({SCREEN_SHARE * limit:.0f} s of "
                                                           f"time_limit) is spent: raise time_limit to plan it"))
            continue
        planner = first if k == 0 else make_planner(model, example_inputs,
                                                    fake_mesh(shape, axis_names(len(shape))),
                                                    options=options, traced=first.traced)
        try:
            bound = planner.cheapest_bound()
        except AutoshardError as exc:  # e.g. a pin written for another number of axes
            rows.append(ShapeResult(shape, "error", seconds=time.perf_counter() - started, note=str(exc)))
            continue
        if best is not None and bound >= best[0].summary["step_us"]:
            rows.append(ShapeResult(shape, "pruned", bound_us=bound, seconds=time.perf_counter() - started,
                                    note=f"bound {bound / 1e3:.3f} ms >= best "
                                         f"{best[0].summary['step_us'] / 1e3:.3f} ms"))
            continue
        share = max(MIN_SCREEN_SECONDS, (t0 + SCREEN_SHARE * limit - time.perf_counter()) / (len(shapes) - k))
        try:
            plan = planner.solve(time_limit=share, seed_baselines=False)
        except MemoryBudgetError as exc:
            infeasible.append(exc)
            rows.append(ShapeResult(shape, "infeasible", bound_us=bound, seconds=time.perf_counter() - started,
                                    note=str(exc)))
            continue
        proved = plan.solver.get("bound")
        row = ShapeResult(shape, "planned", plan.summary["step_us"], plan.summary["peak_mem_bytes"],
                          max(bound, proved) if proved is not None else bound, time.perf_counter() - started,
                          str(plan.solver.get("status", "")))
        rows.append(row)
        log.info(f"mesh {'x'.join(map(str, shape))}: {plan.summary['step_us'] / 1e3:.3f} ms predicted "
                 f"({plan.solver.get('status')}) in {row.seconds:.1f}s")
        if best is None or plan.summary["step_us"] < best[0].summary["step_us"]:
            best = (plan, planner, row)
    if best is None and not infeasible:
        raise ConfigError(f"no mesh shape of {ranks} ranks could be planned: "
                          + "; ".join(f"{'x'.join(map(str, r.shape))}: {r.note}" for r in rows))
    if best is None:
        low = min(infeasible, key=lambda e: e.min_feasible_bytes)
        raise MemoryBudgetError(f"no mesh shape of {ranks} ranks fits the memory budget ({len(shapes)} tried); "
                                f"the closest: {low}", budget_bytes=low.budget_bytes,
                                min_feasible_bytes=low.min_feasible_bytes)
    plan, planner, row = best
    started = time.perf_counter()
    final = planner.solve(time_limit=max((1 - SCREEN_SHARE) * limit, limit - (started - t0)))
    row.outcome, row.seconds = "chosen", row.seconds + time.perf_counter() - started
    if final.summary["step_us"] <= plan.summary["step_us"]:
        plan = final
        row.step_us, row.peak_mem_bytes = final.summary["step_us"], final.summary["peak_mem_bytes"]
        row.note = str(final.solver.get("status", ""))
    plan.summary["mesh_search"] = [r.to_json() for r in rows]
    plan.summary["mesh_search_seconds"] = round(time.perf_counter() - t0, 3)
    return plan
