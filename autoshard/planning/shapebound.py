"""One mesh shape bounded for the mesh search (:mod:`autoshard.planning.meshsearch`): its problem
built, bounded from below, and, where the bounding finds one, a plan of it; here or in forked
worker processes that keep the planners for the shape's solve.

A shape's bound is the larger of its cheapest strategy per node (edges free) and its optimum
with memory ignored (toulbar2 on the tied layers' quotient): both are proofs, as edges, memory
and recomputation only add cost. On the additive objective, a memory-free optimum that is proved
and fits the budget is the plan the shape has alone, or its best hand-written plan where that is
predicted faster; where memory binds, the shape's best hand-written plan is timed as a plan of
it, since planned alone its plan is the least predicted of its solve and those.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from autoshard.errors import AutoshardError, MemoryBudgetError
from autoshard.options import PlanOptions
from autoshard.planfile import Plan
from autoshard.planning.shapeworkers import HELD_NOT
from autoshard.planning.simulate import simulate_plan

log = logging.getLogger(__name__)

Shape = tuple[int, ...]


class HandWrittenPlan(Protocol):
    """A hand-written plan solved under its pins (:class:`autoshard.planning.planner.HandWritten`)."""

    step_us: float
    choice: Any

    def as_ours(self, name: str, why: str) -> Plan: ...


class ShapePlanner(Protocol):
    """What the search asks of a shape's planner (:class:`autoshard.planning.planner.Planner`;
    the tests' scripted planners)."""

    profile: Any
    options: PlanOptions
    traced: Any
    built: Any

    def cheapest_bound(self) -> float: ...

    def memory_free(self, time_limit: float = ..., found: Any = ...) -> Any: ...

    def hand_written(self, time_limit: float, additive_floor_us: float = ..., compute_floor_us: float = ...,
                     below: float = ...) -> tuple[str, HandWrittenPlan] | None: ...

    def known_choices(self) -> list[tuple[str, np.ndarray]]: ...

    def hint(self, choices: Sequence[tuple[str, np.ndarray]]) -> None: ...

    def solve(self, time_limit: float) -> Plan: ...


@dataclass(frozen=True)
class ShapeBound:
    """One shape's bounding, as a worker or this process reports it."""

    shape: Shape
    seconds: float
    cheapest_us: float | None = None
    """Its cheapest-strategy bound (None on error): every plan's compute is at least this."""
    free: Any = None
    """Its memory-free answer (``solver.MemoryFree``), or None."""
    error: str | None = None
    planner: ShapePlanner | None = None
    """Its planner, kept where it was built here (None from a worker)."""
    plan: Plan | None = None
    """Its plan where the bounding assembled it (below every plan known when it was submitted)."""
    free_plan_objective: float | None = None
    """The additive objective of its memory-free optimum where that fits the budget: a plan of
    the shape, so an upper bound of the shape's additive optimum."""
    step_us: float | None = None
    """The predicted (simulated) step of the plan of the shape the bounding found, else None: on
    the additive objective, its memory-free optimum where proved and fitting (the plan the shape
    has alone), or where memory binds its best hand-written plan (``hand``)."""
    peak_bytes: float | None = None
    """That plan's peak memory, where known."""
    hand: str | None = None
    """The hand-written plan's name where ``step_us`` is one's."""
    hints: tuple = ()
    """The plans its planner found (:meth:`ShapePlanner.known_choices`), where it is solved later
    after being built again here: the solve's starts (:meth:`ShapePlanner.hint`)."""

    @property
    def fits(self) -> bool:
        return fits_alone(self.free)


@dataclass(frozen=True)
class BoundedShape:
    """A shape bounded and still to be solved (or planned by its bounding): what the solves need."""

    shape: Shape
    order: int
    """Its place in the search order (ties go to the first)."""
    bound_us: float
    """Its proved lower bound: the larger of the cheapest-strategy bound and the memory-free one."""
    cheapest_us: float
    free: Any
    planner: ShapePlanner | None
    plan: Plan | None
    """Its plan where the bounding assembled it and it is the shape's (a memory-free optimum that
    fits, or the hand-written plan predicted faster), else None."""
    hints: tuple = ()

    @property
    def no_free(self) -> bool:
        """Its memory-free search did not run (toulbar2 missing, cut off): only the cheap bound."""
        return self.free is None


def fits_alone(free) -> bool:
    """Whether a memory-free optimum is proved and fits the budget: then it, or a hand-written
    plan predicted faster, is the shape's plan alone."""
    return free is not None and free.proved and free.fits


def hand_written_plan(name: str, seed: HandWrittenPlan) -> Plan:
    """A hand-written plan as a search's answer, labelled."""
    return seed.as_ours(name, "hand-written, under its pins: predicted faster than the plans the mesh search solved")


def bound_shape(shape: Shape, seconds: float, make: Callable[[Shape], ShapePlanner],
                planner: ShapePlanner | None = None, plan_below: float = -1.0,
                best_us: float = float("inf")) -> ShapeBound:
    """One shape bounded, its planner built by ``make(shape)`` unless given. Where the shape's
    plan alone is found (its memory-free optimum proved and fitting, or its best hand-written plan)
    and predicted below ``plan_below``, it is assembled here (a worker's planner is not kept).
    ``best_us``: the least predicted step of the plans known of other shapes; a hand-written plan
    whose floor reaches it is not solved (:meth:`ShapePlanner.hand_written`)."""
    started = time.perf_counter()
    try:
        planner = make(shape) if planner is None else planner
        cheapest = planner.cheapest_bound()
        found = _bound_additive(planner, seconds, cheapest, plan_below, best_us, started)
    except AutoshardError as exc:  # e.g. a pin written for another number of axes
        return ShapeBound(shape, time.perf_counter() - started, error=str(exc))
    return replace(found, shape=shape, seconds=time.perf_counter() - started, cheapest_us=cheapest, planner=planner)


def _bound_additive(planner: ShapePlanner, seconds: float, cheapest: float, plan_below: float, best_us: float,
                    started: float) -> ShapeBound:
    free = planner.memory_free(time_limit=seconds)
    if free is None:
        return ShapeBound((), 0.0)
    upper = free.cost if free.fits else None
    if fits_alone(free):
        # The shape's plan alone: the least predicted of the optimum and the hand-written plans
        # (Planner.solve weighs them all), whose predicted steps the additive bound does not order.
        step, peak = simulate_plan(planner.built, free.choice, planner.profile.overlap).step_us, free.peak_usage
        # A hand-written plan whose compute alone cannot beat the optimum or the best plan known
        # is not solved.
        spent = time.perf_counter() - started
        found = planner.hand_written(time_limit=max(1.0, min(seconds, spent)), additive_floor_us=cheapest,
                                     compute_floor_us=cheapest, below=min(step, best_us))
        hand = None
        if found is not None and found[1].step_us < step - 1e-3:
            hand, step = found[0], found[1].step_us
        plan = None
        if step < plan_below:
            # The optimum or the hand-written plan, or with the overlap objective a faster one.
            plan = planner.solve(time_limit=max(1.0, seconds))
            step, peak = min(step, plan.summary.step_us), plan.summary.peak_mem_bytes
        return ShapeBound((), 0.0, free=free, plan=plan, free_plan_objective=upper, step_us=step, peak_bytes=peak,
                          hand=hand)
    # Memory binds: planned alone, the shape's plan is the least predicted of its solve and its
    # hand-written plans, which may hide far more communication than the additive objective (its
    # bound) says. Their predicted steps are bounded from below by the shape's additive and compute
    # bounds, as any plan's (simulate.step_floor): one that cannot beat the best plan found is not
    # solved. Not quite a proof: the executor's buckets save a latency per merged collective,
    # which the additive bound does not see.
    found = planner.hand_written(time_limit=max(1.0, seconds), additive_floor_us=max(cheapest, free.lower_bound),
                                 compute_floor_us=cheapest, below=best_us)
    if found is None:
        return ShapeBound((), 0.0, free=free, free_plan_objective=upper)
    hand, seed = found
    plan = peak = None
    if seed.step_us < plan_below:
        plan = hand_written_plan(hand, seed)
        peak = plan.summary.peak_mem_bytes
    return ShapeBound((), 0.0, free=free, plan=plan, free_plan_objective=upper, step_us=seed.step_us,
                      peak_bytes=peak, hand=hand)


#: At most this many processes bound shapes at once (each holds one shape's problem: about
#: 0.5 GB for LLaMA-70B on a 3-D mesh).
MAX_BOUNDING_WORKERS = 4
#: Planners each bounding worker keeps for the solves, the shapes likeliest to be solved first
#: (:meth:`BoundingPool.keep`): about 0.5 GB each for LLaMA-70B on a 3-D mesh.
HELD_PER_WORKER = 3


def bounding_workers(shapes: int) -> int:
    """Processes that bound shapes at once: one per core this process may use, up to
    ``MAX_BOUNDING_WORKERS``; 1 (bounded here) where processes cannot be forked, or where the
    process group is a real one (under torchrun: a forked child must not join its collectives,
    which making a mesh's groups is)."""
    import multiprocessing

    import torch.distributed as dist

    from solver.solve import cores

    if "fork" not in multiprocessing.get_all_start_methods():
        return 1
    if dist.is_initialized() and dist.get_backend() != "fake":
        return 1
    return max(1, min(cores(), MAX_BOUNDING_WORKERS, shapes))


#: What forked bounding workers run with: set before the pool forks (never pickled).
_WORK: dict = {}


def _bound_in_worker(shape: Shape, seconds: float, plan_below: float) -> tuple[ShapeBound, ShapePlanner | None]:
    """(the shape bounded, its planner): the planner stays in the worker, which solves the shape
    if asked (:func:`plan_held`); what it found goes back too, the starts of the shape's solve
    where it is built again here (the worker dropped it)."""
    res = bound_shape(shape, seconds, _WORK["make"], plan_below=plan_below, best_us=plan_below)
    found = res.planner.known_choices() if res.planner is not None else ()
    hints = tuple((f"bounding: {name}", np.asarray(choice, dtype=np.int32)) for name, choice in found)
    return replace(res, planner=None, hints=hints), res.planner


def plan_held(planner: ShapePlanner, how: str, seconds: float, cpus: set[int] | None = None) -> Plan:
    """The shape's plan from the planner that bounded it: its solve (``"solve"``), or its best
    hand-written plan (``"hand"``, where memory binds and that plan is the best found). ``cpus``:
    the cores it runs on (its search's child processes too), where solves run side by side."""
    kept = os.sched_getaffinity(0) if cpus is not None and hasattr(os, "sched_setaffinity") else None
    if kept is not None:
        os.sched_setaffinity(0, cpus)
    try:
        if how == "solve":
            return planner.solve(time_limit=seconds)
        name, seed = planner.hand_written(time_limit=seconds)
        return hand_written_plan(name, seed)
    finally:
        if kept is not None:
            os.sched_setaffinity(0, kept)


def _solve_held(planner: ShapePlanner, seconds: float, cpus: set[int] | None) -> Plan | MemoryBudgetError:
    """:func:`plan_held`'s solve, started beside others: a budget it cannot meet is its answer
    (its shape is then infeasible), not an error that would leave the shape unnamed."""
    try:
        return plan_held(planner, "solve", seconds, cpus)
    except MemoryBudgetError as exc:
        return exc


class BoundingPool:
    """Shapes bounded in forked worker processes that keep their planners
    (:class:`~autoshard.planning.shapeworkers.ShapeWorkers`), or here with one worker:
    :meth:`submit` a shape, :meth:`next` the next one done (its planner None where a worker built
    it); :meth:`plan` and :meth:`start_solve` solve a shape where its worker keeps it."""

    def __init__(self, first: ShapePlanner, make: Callable[[Shape], ShapePlanner], workers: int,
                 best: Callable[[], float] = lambda: float("inf")):
        self.first, self.make, self.best = first, make, best
        self.here: list[tuple[Shape, float]] = []
        """Shapes to bound here, with their seconds: bounded by :meth:`next` while the workers
        bound theirs, once a worker has answered."""
        self.answered = False
        self.pool = None
        if workers > 1:
            from autoshard.planning.shapeworkers import ShapeWorkers

            _WORK["make"] = make
            self.pool = ShapeWorkers(workers, _bound_in_worker, hold=HELD_PER_WORKER)

    @property
    def running(self) -> set[Shape]:
        return {shape for shape, _ in self.here} | (self.pool.running if self.pool is not None else set())

    def has_room(self) -> bool:
        return self.pool.has_room() if self.pool is not None else not self.here

    def submit(self, shape: Shape, seconds: float, plan_below: float) -> None:
        """Bound ``shape`` in at most ``seconds``, ``plan_below`` the best plan known (its
        hand-written plans that cannot beat it are not solved); a worker also makes its plan where
        it is below that (here, its planner is kept instead)."""
        if self.pool is None or len(shape) == 1:
            # The 1-D shape's planner exists (it traced the model); without workers, every one
            # is built here and kept for the solves.
            self.here.append((shape, seconds))
        else:
            self.pool.submit(shape, seconds, plan_below)

    def next(self) -> ShapeBound:
        # A shape bounded here waits for a worker's first answer: its hand-written plans that
        # cannot beat the plans found by then are not solved, and three processes do not share
        # two cores meanwhile.
        if self.here and (self.pool is None or self.answered or not self.pool.busy):
            shape, seconds = self.here.pop(0)
            return bound_shape(shape, seconds, self.make, self.first if len(shape) == 1 else None,
                               best_us=self.best())
        self.answered = True
        return self.pool.next()

    def plan(self, shape: Shape, how: str, seconds: float):
        """:func:`plan_held` in the worker that keeps ``shape``'s planner (no build again, no stage
        of the bounding done twice), or :data:`~autoshard.planning.shapeworkers.HELD_NOT`."""
        return HELD_NOT if self.pool is None else self.pool.run(shape, plan_held, how, seconds)

    @property
    def workers(self) -> int:
        """Solves that may run at once."""
        return 1 if self.pool is None else len(self.pool.conns)

    def abandon(self, shapes=None) -> list[Shape]:
        """Stop the solves of ``shapes`` (default: all) started and not ended (their workers end):
        their shapes."""
        return [] if self.pool is None else self.pool.abandon(shapes)

    def holder_idle(self, shape: Shape) -> bool | None:
        """Whether the worker that keeps ``shape``'s planner is idle; None where none keeps it."""
        k = None if self.pool is None else self.pool.held(shape)
        return None if k is None else self.pool.idle(k)

    def start_solve(self, shape: Shape, seconds: float, alone: bool) -> bool:
        """``shape`` solved in the worker that keeps it, without waiting (:meth:`next_solved`); on
        one core of its own unless ``alone`` (no other solve runs beside it). False where no worker
        keeps it."""
        k = self.pool.held(shape)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        cpus = None if alone or len(cores) < 2 else {cores[k % len(cores)]}
        return self.pool.start(shape, _solve_held, seconds, cpus)

    def next_solved(self) -> tuple[Shape, object]:
        """(shape, its plan, a MemoryBudgetError, or HELD_NOT) of the next solve started to end."""
        return self.pool.next_run()

    def keep(self, ranked: list[Shape]) -> None:
        """Workers keep the planners of ``ranked``'s first shapes (in solve order) and drop the rest."""
        if self.pool is not None:
            self.pool.keep(ranked)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            _WORK.clear()
