"""Choose the mesh shape with the plan: every way to lay ``ranks`` out as 1-3 axes, planned.

    plan = autoshard.plan(model, example_inputs, mesh="auto", ranks=512)
    plan.summary.mesh_search          # one row per shape: step, memory, bound, seconds, outcome

Shapes (:func:`mesh_shapes`): the ordered factorizations of ``ranks`` into 1 to ``max_axes``
axes of size >= 2 whose innermost axis stays within a node (``devices_per_node`` of the
profile; a 1-D mesh is always tried). Shapes that differ only in the order of their
inter-node axes cost the same and are tried once. The model is traced once.

:class:`MeshSearch` runs in three phases:

1. *Bounding* (:meth:`MeshSearch.bound`): each shape's problem is built and bounded from below
   (:func:`~autoshard.planning.shapebound.bound_shape`: its cheapest strategy per node and its
   memory-free optimum, both proofs), in the order of :func:`next_to_bound`, in worker processes
   where cores allow, for ``BOUND_SHARE`` of the time limit (``BOUND_SHARE_BINDING`` once memory
   binds the lowest bound). Bounds, pruning and proofs are on the additive step, the objective
   each shape's additive solve minimizes before its plan follows the overlap objective (the
   overlap objective's own bounds, a Lagrangian dual per shape, cost about what solving the shape
   does, and the overlap-relaxed optimum lies 20-35% below the plans: LLaMA-8B on 64 ranks);
   the step floors (:func:`~autoshard.planning.simulate.step_floor`) compare shapes by their
   predicted steps. Where the bounding finds a shape's plan alone (a proved memory-free optimum
   that fits, or where memory binds its best hand-written plan), the shape competes with that
   plan's predicted step.
2. *Solving* (:meth:`MeshSearch.solve`): shapes with a hand-written plan first, by its predicted
   step, then by increasing bound, the refinements of the best shape taken in turn by the axis of
   it they split (:meth:`MeshSearch.ordered`); each solved as a plan on a given mesh is, with half the time
   left while another shape is worth solving after it, else all of it; where its worker keeps its
   planner, there (shapes kept by different workers at once, a core each). A shape whose bounds'
   step floor is not below the best plan's predicted step is pruned unsolved, and, on the
   additive objective only, one whose bound is not below the best plan's additive cost (with the
   overlap objective shapes are chosen by predicted step, which an additive bound does not bound:
   LLaMA-8B on (2, 4, 8) is bounded at 517.5 ms and planned at 323.6). The solves
   end once as many in a row as run at once (two at least) found no plan faster than the best by
   the solver's stall gain (:class:`solver.stall.RunsWithoutGain`).
3. *Choice* (:meth:`MeshSearch.choose`): the least predicted step of every plan found, assembled
   where the bounding did not.

``mesh_margin`` (a heuristic; None turns it off) leaves out what is that much slower: a shape
whose every coarser shape is that much slower than the best of its axes is not bounded
(:meth:`MeshSearch.coarse_slower`), and a shape whose plan is that much slower than the best
found is not solved, unless it refines the best shape. Every shape goes in the table, with its
bound and why it was pruned or skipped or what it cost. Measured figures:
``benchmarks/mesh_search.py`` and ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from autoshard.errors import ConfigError, MemoryBudgetError
from autoshard.options import PlanOptions
from autoshard.planfile import Plan
from autoshard.planning.meshshapes import axis_names, coarsenings, may_start, mesh_shapes, next_to_bound, search_order
from autoshard.planning.overlap import additive_solve
from autoshard.planning.shapebound import (
    BoundedShape,
    BoundingPool,
    Shape,
    ShapeBound,
    ShapePlanner,
    bounding_workers,
    fits_alone,
    plan_held,
)
from autoshard.planning.shapeworkers import HELD_NOT
from autoshard.planning.simulate import step_floor
from solver.stall import DEFAULT_STALL, RunsWithoutGain

log = logging.getLogger(__name__)


@dataclass
class ShapeResult:
    """One row of the search's table."""

    shape: Shape
    outcome: str
    """``chosen`` (the answer's shape), ``planned``, ``pruned`` (its bound is not below the best
    plan found before its turn), ``infeasible`` (nothing found fits the memory budget), ``skipped``
    (the time was spent before it was bounded or solved) or ``error`` (the note says why: a pin
    written for another number of axes ...)."""
    step_us: float | None = None
    peak_mem_bytes: int | None = None
    bound_us: float | None = None
    """A proved lower bound on any plan of this shape: the larger of its cheapest strategy per
    node, its memory-free optimum's bound and the solver's own."""
    seconds: float = 0.0
    note: str = ""

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "outcome": self.outcome, "step_us": self.step_us,
                "peak_mem_bytes": self.peak_mem_bytes, "bound_us": self.bound_us,
                "seconds": round(self.seconds, 3), "note": self.note}


#: Share of ``time_limit`` for bounding shapes (building each one's problem and solving it
#: with memory ignored) while the lowest bound so far is a memory-free optimum that fits (its
#: shape's solve is then that optimum, assembled); the solves in bound order get the rest, and
#: at least ``MIN_SHAPE_SOLVE_SECONDS`` each.
BOUND_SHARE = 0.75
#: The share once memory binds the lowest bound (its memory-free optimum does not fit): plans
#: then lie far above their bounds and are made by the solve, which needs real time.
BOUND_SHARE_BINDING = 0.5
#: The most a shape's memory-free search may take: a search cut off proves a weaker bound,
#: and one slow shape must not take the time of all that follow.
MAX_BOUND_SECONDS = 10.0
#: The least time a shape is solved with: below it the memory-free stage is cut off before it
#: proves and an answer says little about the shape.
MIN_SHAPE_SOLVE_SECONDS = 10.0


def _prune(row: ShapeResult, planned: bool, why: str) -> None:
    """``row`` not solved for ``why``: pruned, or still planned by its hand-written plan."""
    if planned:
        row.note += f"; not solved: {why}"
    else:
        row.outcome, row.note = "pruned", why


def _unsolved(row: ShapeResult, planned: bool, why: str) -> None:
    """``row`` not solved for ``why``, which is not its plans' (the time, the stall rule): skipped,
    or still planned by its hand-written plan."""
    row.note = f"{row.note}; not solved: {why}" if planned else why




def _name(shape: Shape) -> str:
    return "x".join(map(str, shape))


@dataclass(frozen=True)
class KnownPlan:
    """A plan of a shape the bounding found (:attr:`ShapeBound.step_us`): compared with the others
    by its predicted step, never pruned by a bound of another objective."""

    step_us: float
    plan: Plan | None
    """The plan where the bounding assembled it, else None (assembled if chosen)."""
    entry: BoundedShape
    hand: str | None
    """The hand-written plan's name, or None: the shape's memory-free optimum."""


class MeshSearch:
    """The best plan over :func:`mesh_shapes` of ``ranks`` (:meth:`run`), its table in
    ``plan.summary.mesh_search``. ``make_planner(model, example_inputs, mesh, options=,
    traced=)`` makes a :class:`~autoshard.planning.shapebound.ShapePlanner`."""

    def __init__(self, model, example_inputs, ranks: int, options: PlanOptions,
                 make_planner: Callable[..., ShapePlanner], max_axes: int = 3):
        import torch.distributed as dist

        from autoshard.mesh import fake_mesh

        if dist.is_initialized() and dist.get_world_size() != ranks:
            raise ConfigError(f"ranks={ranks}, but a process group of world size {dist.get_world_size()} exists: "
                              "plan with mesh='auto' on a fake process group of that size (or none)")
        self.t0 = time.perf_counter()
        self.ranks, self.options, self.limit = ranks, options, options.time_limit
        self.model, self.example_inputs, self.make_planner = model, example_inputs, make_planner
        self.first = make_planner(model, example_inputs, fake_mesh((ranks,), axis_names(1)), options=options)
        per_node = self.first.profile.devices_per_node
        self.shapes = search_order(mesh_shapes(ranks, per_node, max_axes), per_node)
        log.info(f"mesh search over {len(self.shapes)} shapes of {ranks} ranks: "
                 f"{', '.join(map(_name, self.shapes))}")
        self.rows = {shape: ShapeResult(shape, "skipped") for shape in self.shapes}
        self.todo = list(self.shapes)
        self.bounded: list[BoundedShape] = []
        """Shapes bounded and still worth solving (a plan of them may beat the one they have)."""
        self.bounds: dict[Shape, float] = {}
        self.spent: dict[int, list[float]] = {}
        """Seconds per shape bounded, by number of axes."""
        self.free_plan_us, self.free_plan_shape = float("inf"), None
        """The least objective of a memory-free optimum that fits the budget (a plan: shapes bounded
        at or above it are pruned as soon as it is known) and its shape."""
        self.known: dict[Shape, KnownPlan] = {}
        self.solved: dict[Shape, Plan] = {}
        self.infeasible: list[MemoryBudgetError] = []
        self.running: dict[Shape, tuple[BoundedShape, float]] = {}
        """Shapes solving in the workers that keep them: (the bounded shape, when its solve began)."""
        self.queue: list[BoundedShape] = []
        self.stall: RunsWithoutGain | None = None
        self.pool = BoundingPool(self.first, self._planner, workers=bounding_workers(len(self.shapes)),
                                 best=self.best_known)

    def _planner(self, shape: Shape) -> ShapePlanner:
        from autoshard.mesh import fake_mesh

        return self.make_planner(self.model, self.example_inputs, fake_mesh(shape, axis_names(len(shape))),
                                 options=self.options, traced=self.first.traced)

    def _left(self, now: float | None = None) -> float:
        return self.limit - ((time.perf_counter() if now is None else now) - self.t0)

    def run(self) -> Plan:
        try:
            self.bound()
            self.solve()
            return self.choose()
        finally:
            self.pool.close()

    # -- what the plans found say of a shape ------------------------------------------------

    def best_known(self) -> float:
        return min((k.step_us for k in self.known.values()), default=float("inf"))

    def solve_order(self, b: BoundedShape) -> tuple:
        """Shapes without a memory-free bound last (theirs lies far below any plan); those with a
        hand-written plan first, the best first (a solve starts from it and only improves on it,
        while where memory binds a bound lies far below the plans); then by bound."""
        k = self.known.get(b.shape)
        return b.no_free, k is None, k.step_us if k is not None else b.bound_us, b.order

    def best_shape(self) -> Shape | None:
        """The shape of the least predicted step found so far (bounding or solve)."""
        steps = {s: k.step_us for s, k in self.known.items()}
        for shape, p in self.solved.items():
            steps[shape] = min(steps.get(shape, float("inf")), p.summary.step_us)
        return min(steps, key=lambda shape: (steps[shape], self.shapes.index(shape)), default=None)

    def ordered(self, entries) -> list[BoundedShape]:
        """``entries`` in :meth:`solve_order`, but the refinements of the best shape found taken in
        turn by the axis of it they split, in the places they hold: a refinement lays out every plan
        of the shape it refines and more (:func:`~autoshard.planning.meshshapes.next_to_bound`),
        and those that split the same axis gain or not alike. LLaMA-8B on 64 ranks: (8, 2, 4) and
        (8, 4, 2) split (8, 8)'s tensor axis, come first by their hand-written plans and gain
        nothing on (8, 8)'s plan; (2, 4, 8) splits its data axis, with a hand-written plan 25%
        slower: taken second, its solve is the best plan (325.2 ms against 327.3), where after
        the other two the stall rule ended the search before it."""
        ranked = sorted(entries, key=self.solve_order)
        best = self.best_shape()
        split = [next((a for a, c in enumerate(coarsenings(b.shape)) if c == best), None) for b in ranked]
        families: dict[int, list[BoundedShape]] = {}
        for b, a in zip(ranked, split):
            if a is not None:
                families.setdefault(a, []).append(b)
        turns = []  # the refinements in turn by family, each family in its own order
        while any(families.values()):
            turns += [f.pop(0) for f in families.values() if f]
        # They take the places the refinements held in the ranking; the other shapes keep theirs.
        return [turns.pop(0) if a is not None else b for b, a in zip(ranked, split)]

    def plan_floor(self, b: BoundedShape) -> float:
        """What every plan of ``b`` is predicted at least, by its bounds: on the additive objective
        the floor of a step with that additive and compute (:func:`step_floor`)."""
        return step_floor(b.bound_us, b.cheapest_us, self.first.profile.overlap)

    def unpromising(self, b: BoundedShape) -> str | None:
        """Why shape ``b`` is not worth solving now, by the plans found so far, or None."""
        objective = [*(additive_solve(p) for p in self.solved.values()),
                     *([self.free_plan_us] if self.free_plan_shape not in (None, b.shape) else [])]
        best_us = min(objective, default=None)
        # On the additive objective only (module doc): plans are otherwise chosen by predicted step.
        if best_us is not None and b.bound_us >= best_us and not self.options.overlap_objective:
            return f"bound {b.bound_us / 1e3:.3f} ms >= best {best_us / 1e3:.3f} ms"
        # Shapes are chosen by predicted step: one whose every plan is predicted at or above the
        # best plan found, by its bounds, has nothing to give (on the additive objective too).
        found_us = min([*(k.step_us for s, k in self.known.items() if s != b.shape),
                        *(p.summary.step_us for p in self.solved.values())], default=float("inf"))
        floor_us = self.plan_floor(b)
        if floor_us >= found_us:
            return (f"every plan of it is predicted at least {floor_us / 1e3:.3f} ms (its bounds) >= "
                    f"{found_us / 1e3:.3f} ms, the best plan found")
        # Heuristic (mesh_margin): a solve starts from the shape's hand-written plan and gains
        # little on it, so one whose plan is mesh_margin slower than the best found is left as it is.
        # Not for a refinement of the best shape: it lays out that shape's plans, which its own
        # hand-written plans do not (LLaMA-8B on (2, 4, 8): FSDP+TP 409.7 ms, 25.2% slower than (8,
        # 8)'s plan; solved, 323.6 ms, faster).
        margin, own = self.options.mesh_margin, self.known.get(b.shape)
        refines_best = self.best_shape() in coarsenings(b.shape)
        if margin is not None and own is not None and not refines_best and own.step_us >= (1 + margin) * found_us:
            return (f"its plan is predicted {own.step_us / 1e3:.3f} ms, {own.step_us / found_us - 1:.0%} slower than "
                    f"the best found ({found_us / 1e3:.3f} ms; mesh_margin={margin}, None solves it)")
        return None

    def coarse_slower(self, shape: Shape) -> str | None:
        """Why ``shape`` is not bounded (``options.mesh_margin``), or None: every shape of one axis
        fewer that it refines is bounded and slow: it has a plan predicted at least ``1 + margin``
        times the best plan of that many axes, or, bounded without a plan, its bounds' floor is
        there or its bound is ``1 + margin`` times the least bound of that many axes, or it was
        pruned."""
        margin, k = self.options.mesh_margin, len(shape) - 1
        fewer = {s: v.step_us for s, v in self.known.items() if len(s) == k}
        if margin is None or not fewer:
            return None
        best = min(fewer.values())
        least = min((v for s, v in self.bounds.items() if len(s) == k), default=float("inf"))
        entries = {b.shape: b for b in self.bounded}
        why = []
        for c in coarsenings(shape):
            if c not in self.rows:  # not a candidate (its inner axis spans nodes): never bounded
                continue
            if c in fewer:
                if fewer[c] < (1 + margin) * best:
                    return None
                why.append(f"{_name(c)} has plans predicted at least {fewer[c] / 1e3:.3f} ms, "
                           f"{fewer[c] / best - 1:.0%} slower than the best of {k} axes ({best / 1e3:.3f} ms)")
            elif self.rows[c].outcome == "pruned":
                why.append(f"{_name(c)} was pruned")
            elif c in entries:  # bounded without a plan
                floor = self.plan_floor(entries[c])
                if floor >= (1 + margin) * best:
                    why.append(f"every plan of {_name(c)} is predicted at least {floor / 1e3:.3f} ms, "
                               f"{floor / best - 1:.0%} slower than the best of {k} axes ({best / 1e3:.3f} ms)")
                elif c in self.bounds and self.bounds[c] >= (1 + margin) * least:
                    # Its plans are not timed: its bound against the least is the measure that compares.
                    why.append(f"{_name(c)} is bounded at {self.bounds[c] / 1e3:.3f} ms, "
                               f"{self.bounds[c] / least - 1:.0%} above the least bound of {k} axes "
                               f"({least / 1e3:.3f} ms)")
                else:
                    return None
            else:  # not bounded yet, or failed
                return None
        if not why:
            return None
        return f"not bounded: the shapes it refines are slow: {'; '.join(why)} (mesh_margin={margin}; " \
            "None bounds every shape)"

    # -- phase 1: bounding ----------------------------------------------------------------

    def bound(self) -> None:
        """Bound every shape the time allows, starting the first solves on idle workers once
        nothing is left to bound."""
        while self.todo or self.pool.running:
            self._submit_bounds()
            if not self.todo and self.pool.running and self._left() >= MIN_SHAPE_SOLVE_SECONDS:
                self._solve_on_idle_workers()
            if self.pool.running:
                self._take(self.pool.next())

    def _submit_bounds(self) -> None:
        # Shapes of more axes wait for those of fewer while the coarse shapes' bounds may still
        # order them (may_start).
        while self.todo and self.pool.has_room() and may_start(self.todo, self.pool.running, self.bounds):
            shape = next_to_bound(self.todo, self.bounds)
            self.todo.remove(shape)
            why = self.coarse_slower(shape)
            if why is not None:
                self.rows[shape].note = why
                continue
            lowest = min([*self.bounded, *(k.entry for k in self.known.values())],
                         key=lambda b: (b.no_free, b.bound_us), default=None)
            binding = lowest is not None and lowest.free is not None and not lowest.free.fits
            share = BOUND_SHARE_BINDING if binding else BOUND_SHARE
            left = self.t0 + share * self.limit - time.perf_counter()
            like = self.spent.get(len(shape))
            if (self.bounded or self.known or self.pool.running) and (left <= 0 or (like and left < min(like))):
                self.rows[shape].note = (f"the bounding time ({share * self.limit:.0f} s of time_limit"
                                         f"{', memory binding' if binding else ''}) is spent: "
                                         "raise time_limit to plan it")
                continue
            # A worker assembles the plan it finds only where it is the best so far (else the
            # chosen shape's would be built again here to make it).
            self.pool.submit(shape, max(1.0, min(MAX_BOUND_SECONDS, left)), self.best_known())

    def _solve_on_idle_workers(self) -> None:
        # Nothing left to bound: an idle worker solves a shape it keeps among those that would be
        # solved first, at once (the best, one per worker), while the last shapes bound.
        left = self._left()
        leading = [b for b in self.ordered(self.bounded) if b.plan is None and self.unpromising(b) is None]
        for b in leading[:self.pool.workers]:
            if b.shape not in self.running and self.pool.holder_idle(b.shape) \
                    and self.pool.start_solve(b.shape, max(MIN_SHAPE_SOLVE_SECONDS, left / 2), alone=False):
                self.running[b.shape] = (b, time.perf_counter())

    def _take(self, res: ShapeBound) -> None:
        """A shape's bounding: its row, its bound, the plan it found, and the shapes it prunes."""
        shape, row = res.shape, self.rows[res.shape]
        row.seconds = res.seconds
        if res.error is not None:  # e.g. a pin written for another number of axes
            row.outcome, row.note = "error", res.error
            return
        bound = res.cheapest_us
        if res.free is not None:
            bound = self.bounds[shape] = max(bound, res.free.lower_bound)
        row.bound_us = bound
        self.spent.setdefault(len(shape), []).append(res.seconds)
        entry = BoundedShape(shape, self.shapes.index(shape), bound, res.cheapest_us, res.free, res.planner,
                             res.plan if res.hand is None or res.fits else None, res.hints)
        if res.step_us is not None:
            self.known[shape] = KnownPlan(res.step_us, res.plan, entry, res.hand)
            row.outcome, row.step_us = "planned", round(res.step_us, 3)
            row.peak_mem_bytes = None if res.peak_bytes is None else int(res.peak_bytes)
            row.note = "its memory-free optimum (proved, fits): its plan" if res.hand is None else \
                f"hand-written {res.hand}: its plan (predicted faster than its memory-free optimum, which fits)" \
                if res.fits else f"hand-written {res.hand}, its best (memory binds)"
        # A plan may beat its hand-written one where memory binds; with the overlap objective, a
        # solve may beat the memory-free optimum and the hand-written plans alike.
        if res.step_us is None or (res.hand is not None and not res.fits) \
                or (self.options.overlap_objective and res.plan is None):
            self.bounded.append(entry)
        found = res.free_plan_objective
        log.info(f"mesh {_name(shape)}: bound {bound / 1e3:.3f} ms"
                 + (f"; its plan (the memory-free optimum, fits) at {res.step_us / 1e3:.3f} ms predicted"
                    if res.step_us is not None and res.hand is None else
                    f"; hand-written {res.hand} at {res.step_us / 1e3:.3f} ms predicted" if res.step_us is not None
                    else f"; a plan of it at {found / 1e3:.3f} ms" if found is not None else "")
                 + f" in {res.seconds:.1f}s")
        if found is not None and found < self.free_plan_us:
            self.free_plan_us, self.free_plan_shape = found, shape
        # An additive bound prunes on the additive objective only (module doc).
        pruned = [] if self.options.overlap_objective else \
            [b for b in self.bounded if b.shape != self.free_plan_shape and b.bound_us >= self.free_plan_us]
        for b in pruned:
            self.bounded.remove(b)
            _prune(self.rows[b.shape], b.shape in self.known,
                   f"bound {b.bound_us / 1e3:.3f} ms >= {self.free_plan_us / 1e3:.3f} ms, the "
                   f"memory-free plan of {_name(self.free_plan_shape)} that fits")
        self._keep_planners()

    def _keep_planners(self) -> None:
        # The workers keep the planners of the shapes likeliest to be solved (or, the best plan
        # found where the bounding did not assemble it, assembled): the others' memory goes back.
        listed = {b.shape for b in self.bounded}
        waiting = [*self.bounded, *(k.entry for s, k in self.known.items() if k.plan is None and s not in listed)]
        self.pool.keep([b.shape for b in self.ordered(waiting)])

    # -- phase 2: solving -----------------------------------------------------------------

    def solve(self) -> None:
        """Solve the bounded shapes in :meth:`solve_order` until the time or the stall rule ends it."""
        self.stall = RunsWithoutGain(DEFAULT_STALL, max(2, self.pool.workers), known=self.best_known())
        self.bounded = self.ordered(self.bounded)
        self.queue = [b for b in self.bounded if b.shape not in self.running]
        while (self.queue or self.running) and not self.stall.stalled:
            self._start_solves()
            if self.running:
                self._end_one_solve()
        self._stop_the_rest()

    def _start_solves(self) -> None:
        i = 0
        while i < len(self.queue) and not self.stall.stalled:
            b = self.queue[i]
            row, started = self.rows[b.shape], time.perf_counter()
            why = self.unpromising(b)
            if why is not None:
                _prune(row, b.shape in self.known, why)
                self.queue.pop(i)
                continue
            left = self._left(started)
            if (self.solved or self.known or self.running) and left < MIN_SHAPE_SOLVE_SECONDS:
                _unsolved(row, b.shape in self.known, "the time limit is spent: raise time_limit to plan it")
                self.queue.pop(i)
                continue
            if b.plan is not None:  # the bounding made it
                self.queue.pop(i)
                self._record(b, started, b.plan)
                continue
            idle = self.pool.holder_idle(b.shape)
            if idle is False or (idle is None and self.running):
                i += 1  # its worker solves another, or it is built here once nothing runs beside
                continue
            # Half the time left while another shape is worth solving after it: the hand-written
            # plans that order the shapes do not say what a solve gains on them. A solve that
            # stalls sooner leaves its time to the next.
            self.queue.pop(i)
            others = [c for c in self.queue if c.plan is None and self.unpromising(c) is None]
            share = max(MIN_SHAPE_SOLVE_SECONDS, left / 2 if others and left >= 2 * MIN_SHAPE_SOLVE_SECONDS else left)
            if idle is None:
                self._record(b, started, self._solve_here(b, started, share))
                continue
            # On a core of its own where another solve may run beside it.
            beside = bool(self.running) or any(self.pool.holder_idle(c.shape) for c in others)
            if self.pool.start_solve(b.shape, max(1.0, share), alone=not beside):
                self.running[b.shape] = (b, started)
            else:  # dropped meanwhile
                self._record(b, started, self._solve_here(b, started, share))

    def _end_one_solve(self) -> None:
        shape, plan = self.pool.next_solved()
        b, started = self.running.pop(shape)
        if plan is HELD_NOT:
            plan = self._solve_here(b, started, self._left(started))
        self._record(b, started, plan)
        # A solve started before the plans found since is stopped where they leave its shape
        # nothing to give.
        late = {s: self.unpromising(c) for s, (c, _) in self.running.items()}
        for shape in self.pool.abandon([s for s, why in late.items() if why is not None]):
            _, began = self.running.pop(shape)
            self.rows[shape].seconds += time.perf_counter() - began
            _prune(self.rows[shape], shape in self.known, f"{late[shape]}; its solve stopped")

    def _stop_the_rest(self) -> None:
        why = (f"the last {self.stall.dry} solves found no plan {DEFAULT_STALL.gain:.1%} faster than the best "
               "(the search's stall rule)")
        for shape in self.pool.abandon():
            _, started = self.running.pop(shape)
            self.rows[shape].seconds += time.perf_counter() - started
            _unsolved(self.rows[shape], shape in self.known, f"{why}, its solve stopped")
        for b in self.queue:
            if b.plan is not None:  # the bounding made it: no solve to stop
                self._record(b, time.perf_counter(), b.plan)
            elif (pruned := self.unpromising(b)) is not None:
                _prune(self.rows[b.shape], b.shape in self.known, pruned)
            else:
                _unsolved(self.rows[b.shape], b.shape in self.known, why)

    def _built_here(self, b: BoundedShape) -> ShapePlanner:
        """The shape's planner: the one that bounded it here, or (bounded in a worker) built again,
        given the memory-free answer its worker found and its plans as the starts of its solves."""
        if b.planner is not None:
            return b.planner
        planner = self._planner(b.shape)
        if b.free is not None:  # the additive optimum
            planner.memory_free(found=b.free)
        if b.hints:
            planner.hint(b.hints)
        return planner

    def _solve_here(self, b: BoundedShape, started: float, share: float) -> Plan | MemoryBudgetError:
        planner = self._built_here(b)  # built again, which is part of its share
        try:
            return planner.solve(time_limit=max(1.0, share - (time.perf_counter() - started)))
        except MemoryBudgetError as exc:
            return exc

    def _record(self, b: BoundedShape, started: float, plan: Plan | MemoryBudgetError) -> None:
        """Shape ``b``'s solve, begun at ``started``: its plan, or the budget it cannot meet."""
        row = self.rows[b.shape]
        row.seconds += time.perf_counter() - started
        if isinstance(plan, MemoryBudgetError):
            self.infeasible.append(plan)
            if b.shape in self.known:  # its hand-written plan fits: still its plan (LLaMA-70B on (8, 8))
                row.note += f"; its solve found none faster that fits: {plan}"
            else:
                row.outcome, row.note = "infeasible", str(plan)
            return
        row.outcome, row.step_us = "planned", plan.summary.step_us
        row.peak_mem_bytes = plan.summary.peak_mem_bytes
        proved = plan.solver.get("bound")
        if proved is not None:
            row.bound_us = max(row.bound_us, proved)  # the additive solve's bound: the search's objective
        row.note = str(plan.solver.get("status", ""))
        log.info(f"mesh {_name(b.shape)}: {plan.summary['step_us'] / 1e3:.3f} ms predicted "
                 f"({plan.solver.get('status')}) in {row.seconds:.1f}s")
        self.solved[b.shape] = plan
        if b.plan is None:  # a solve, not a plan the bounding made
            self.stall.result(plan.summary.step_us)

    # -- phase 3: the choice --------------------------------------------------------------

    def choose(self) -> Plan:
        """The least predicted step of every plan found (ties: the search order's first), with the
        table; the closest budget where no shape fits."""
        best = self.best_shape()
        if best in self.known and (best not in self.solved
                                   or self.known[best].step_us < self.solved[best].summary.step_us):
            self._adopt_known(best)
        table = [self.rows[s] for s in self.shapes]
        if best is None and not self.infeasible:
            raise ConfigError(f"no mesh shape of {self.ranks} ranks could be planned: "
                              + "; ".join(f"{_name(r.shape)}: {r.note}" for r in table))
        if best is None:
            low = min(self.infeasible, key=lambda e: e.min_feasible_bytes)
            raise MemoryBudgetError(f"no mesh shape of {self.ranks} ranks fits the memory budget "
                                    f"({len(self.shapes)} tried); the closest: {low}", budget_bytes=low.budget_bytes,
                                    min_feasible_bytes=low.min_feasible_bytes)
        plan, row = self.solved[best], self.rows[best]
        row.outcome = "chosen"
        plan.summary.mesh_search = [r.to_json() for r in table]
        plan.summary.mesh_search_seconds = round(time.perf_counter() - self.t0, 3)
        return plan

    def _adopt_known(self, best: Shape) -> None:
        """The bounding's plan of ``best`` as its answer, assembled where it was not."""
        started = time.perf_counter()
        k = self.known[best]
        made = k.plan
        if made is None:
            left = max(1.0, self._left(started))
            # With the hand-written plan where it is faster; where memory binds, that plan.
            how = "solve" if k.hand is None or fits_alone(k.entry.free) else "hand"
            made = self.pool.plan(best, how, left)
            if made is HELD_NOT:
                made = plan_held(self._built_here(k.entry), how, left)
        self.solved[best] = made
        row = self.rows[best]
        row.step_us, row.peak_mem_bytes = made.summary.step_us, made.summary.peak_mem_bytes
        if k.hand is not None and not fits_alone(k.entry.free):
            row.note = f"hand-written {k.hand} (memory binds): predicted faster than every plan solved"
        row.seconds += time.perf_counter() - started


def search(model, example_inputs, ranks: int, options: PlanOptions, make_planner, max_axes: int = 3) -> Plan:
    """The best plan over :func:`mesh_shapes` (:class:`MeshSearch`), its table in
    ``plan.summary.mesh_search``."""
    return MeshSearch(model, example_inputs, ranks, options, make_planner, max_axes).run()
