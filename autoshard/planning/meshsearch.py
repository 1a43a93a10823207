"""Choose the mesh shape with the plan: every way to lay ``ranks`` out as 1-3 axes, planned.

    plan = autoshard.plan(model, example_inputs, mesh="auto", ranks=512)
    plan.summary["mesh_search"]          # one row per shape: step, memory, bound, seconds, outcome

Shapes (:func:`mesh_shapes`): the ordered factorizations of ``ranks`` into 1 to ``max_axes``
axes of size >= 2 whose innermost axis stays within a node (``devices_per_node`` of the
profile; a 1-D mesh is always tried). Shapes that differ only in the order of their
inter-node axes cost the same and are tried once.

The model is traced once (the trace does not depend on the mesh). Each shape's problem is
built and bounded from below: by its cheapest strategy per node, edges free, and by its
optimum with memory ignored (toulbar2 on the tied layers' quotient, seconds per shape; both
are proofs, since edges, memory and recomputation only add cost). Bounds, pruning and proofs
are on the objective the plans optimize (:func:`_bound_share`): the additive step by default;
with ``overlap_objective``, the step simulated with the profile's overlap share ``eta``, which
hides up to ``eta`` of a plan's communication, so the memory-free optimum is then taken with
every edge cost scaled by ``1 - eta`` (:meth:`Planner.overlap_free`), a bound of every
simulated step, and where it fits the budget its simulated step is a plan's, pruning the shapes
bounded above it. On the additive objective, a shape whose memory-free optimum is proved and
fits has its plan once bounded (that optimum is what planning it alone answers): it is kept as
planned, with the predicted step of that plan, never pruned by a bound of the additive
objective (a plan of higher additive cost may hide more of its communication and be
predicted faster). The shape chosen
is the one of least predicted (simulated) step among every plan found. Shapes are
bounded in the order of :func:`next_to_bound`, in worker processes where cores allow
(:func:`bounding_workers`; each keeps the planners of the shapes likeliest to be solved, which
are then solved there, not built again: :mod:`autoshard.planning.shapeworkers`), for ``BOUND_SHARE`` of
the time limit (``BOUND_SHARE_BINDING`` once memory binds the lowest bound), then solved
(those with a hand-written plan first, by its predicted step, then in increasing bound), each
as a plan on a given mesh is (hand-written seeds included) with half the time left while another
shape is worth solving after it, else all of it (the solver's stall rule ends it when it stops
improving, and what it leaves goes to the next); a shape whose bound is not below the best plan found is pruned
unsolved (on the additive objective this applies to the shapes where memory binds; planned
alone, their plan is the least predicted of their solve and their hand-written plans, which may
overlap far more than the additive objective sees: the bounding times the best of those, which
competes as a plan of the shape whether or not it is solved). Shapes kept by different workers
are solved at once, one core each; the solves end once as many in a row as run at once (two at
least) found no plan faster than the best known by the solver's stall gain (0.1%): the search's
stall rule, as a solve's own (the solves still running are stopped). ``time_limit`` is the whole
search's: raise it to bound or solve more shapes. ``mesh_margin`` (25%; None turns it off)
leaves out what is that much slower: a shape of k axes is not bounded where every shape of
k - 1 axes it refines has a plan predicted that much slower than the best of them, or, bounded
without a plan, a bound that much above the least of them, or was pruned (``coarse_slower`` in
:func:`search`), and a shape whose plan is predicted that much slower than the best found is
not solved (a heuristic, as a refinement may mix its coarser shapes' plans into a faster one
and a solve may gain much on its hand-written start; measured: the best refinement within 2%
of its best coarser shape's plan, the shapes left out planned alone 41-228% slower, and solves
gained 0-11% on their hand-written plans). Every shape goes in the table, with its bound and
why it was pruned or skipped or what it cost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from autoshard.errors import AutoshardError, ConfigError, MemoryBudgetError
from autoshard.options import PlanOptions
from autoshard.planfile import Plan
from autoshard.planning.overlap import additive_solve
from autoshard.planning.shapeworkers import HELD_NOT
from autoshard.planning.simulate import simulate_plan, step_floor
from costmodel import MeshTopology
from solver.stall import DEFAULT_STALL

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
    plan found before its turn), ``infeasible`` (nothing fits the memory budget), ``skipped``
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


def axis_names(k: int) -> tuple[str, ...]:
    return tuple(f"axis{a}" for a in range(k))


#: Share of ``time_limit`` for bounding shapes (building each one's problem and solving it
#: with memory ignored) while the lowest bound so far is a memory-free optimum that fits (its
#: shape's solve is then that optimum, assembled); the solves in bound order get the rest, and
#: at least ``MIN_SOLVE_SECONDS`` each.
BOUND_SHARE = 0.75
#: The share once memory binds the lowest bound (its memory-free optimum does not fit): plans
#: then lie far above their bounds (LLaMA-70B on 512 ranks: 25-35%) and are made by the solve,
#: which needs real time (its (64, 2, 4) shape: 30 s alone to 5,884 ms; starved to 15 s in a
#: search at 0.75, it gave 6,944).
BOUND_SHARE_BINDING = 0.5
#: The most a shape's memory-free search may take: a search cut off proves a weaker bound,
#: and one slow shape must not take the time of all that follow.
MAX_BOUND_SECONDS = 10.0
#: The least time a shape is solved with: below it the memory-free stage is cut off before it
#: proves (1-2 s on LLaMA-8B's 3-D meshes) and an answer says little about the shape.
MIN_SOLVE_SECONDS = 10.0


def search_order(shapes: list[tuple[int, ...]], devices_per_node: int) -> list[tuple[int, ...]]:
    """The shapes in the order they are listed, and bounded among equals (:func:`next_to_bound`):
    likeliest first where time runs out: the 1-D mesh
    (cheap to build), then shapes whose innermost axis is a whole node (tensor parallelism on
    the fast links), then the rest; fewer axes first within each."""
    return sorted(shapes, key=lambda s: (len(s) > 1, s[-1] != devices_per_node, len(s), s))


#: At most this many processes bound shapes at once (each holds one shape's problem: about
#: 0.5 GB for LLaMA-70B on a 3-D mesh).
MAX_BOUNDING_WORKERS = 4


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


class _Bounded(NamedTuple):
    """One shape bounded: what the solves need of it."""

    no_free: bool
    """Its memory-free search did not run (toulbar2 missing, cut off): only the cheap bound."""
    bound: float
    order: int
    shape: tuple[int, ...]
    planner: object | None
    """Its planner where it was built here; None where a worker built it."""
    free: object | None
    """Its memory-free answer (``solver.MemoryFree``), or None."""
    plan: Plan | None
    """Its plan where a worker made it (a proved memory-free optimum that fits, below every
    such plan known when the shape was submitted), else None."""
    cheapest: float = 0.0
    """Its cheapest-strategy bound: every plan's compute is at least this."""
    hints: tuple = ()
    """Plans its worker found (:attr:`_BoundResult.hints`)."""


class _BoundResult(NamedTuple):
    """One shape's bounding, as a worker or this process reports it."""

    shape: tuple[int, ...]
    bound: float | None
    """Its cheapest-strategy bound (None on error)."""
    free: object | None
    """Its memory-free answer (``solver.MemoryFree``), or None."""
    seconds: float
    error: str | None
    planner: object | None
    """Its planner, kept where it was built here (None from a worker)."""
    plan: Plan | None
    upper: float | None = None
    """The objective (:func:`_bound_share`) of a plan of it that the bounding found (its
    memory-free optimum, where that fits the budget), or None: an upper bound of the shape's."""
    step: float | None = None
    """The predicted (simulated) step of a plan of the shape the bounding found, else None: on the
    additive objective, its memory-free optimum where proved and fitting (the plan the shape has
    alone: :meth:`Planner.solve` answers with it), or where memory binds its best hand-written
    plan (``hand``; planned alone, the shape's plan is predicted no slower)."""
    peak: float | None = None
    """That plan's peak memory (bytes), where known (a hand-written plan's once assembled)."""
    hand: str | None = None
    """The hand-written plan's name where ``step`` is one's."""
    hints: tuple = ()
    """The plans its planner found (:meth:`Planner.known_choices`), where it may be solved later:
    the solve's starts (:meth:`Planner.hint`) once a worker's shape is built again here."""


def _bound_shape(shape: tuple[int, ...], seconds: float, make, planner=None, plan_below: float = -1.0,
                 best_us: float = float("inf")) -> _BoundResult:
    """One shape bounded, its planner built by ``make(shape)`` unless given. Where the
    memory-free optimum is proved, fits and costs less than ``plan_below``, it is the shape's
    plan, assembled here (a worker's planner is not kept: without the plan, the search would
    build the shape again to make it: 2.7 s of LLaMA-8B's search on 512 ranks). ``best_us``: the
    least predicted step of the plans known of other shapes; a hand-written plan whose floor
    reaches it is not solved (:meth:`Planner.hand_written`)."""
    started = time.perf_counter()
    plan = upper = step = peak = hand = None
    try:
        planner = make(shape) if planner is None else planner
        bound = planner.cheapest_bound()
        eta = _bound_share(planner)
        if eta > 0:
            # Plans are compared by their simulated step, which hides up to eta of each plan's
            # communication: the additive optimum bounds nothing, the overlap-relaxed one does.
            # Where it fits, it is a plan: its simulated step is an upper bound of the shape's.
            free = planner.overlap_free(time_limit=seconds)
            if free is not None and free.fits:
                upper = simulate_plan(planner.built, free.choice, eta).step_us
        else:
            free = planner.memory_free(time_limit=seconds)
            if free is not None and free.fits:
                upper = free.cost
            if _fits(free):
                # The shape's plan alone: the search compares shapes by its predicted step, which
                # need not follow the additive objective the bound and the pruning are on. Planned
                # alone, that is the least predicted of the optimum and the hand-written plans
                # (Planner.solve weighs them all: a bound of the additive step bounds no step the
                # buckets price, and under their pins they are proved in about the optimum's time).
                step = simulate_plan(planner.built, free.choice, planner.profile.overlap).step_us
                peak = free.peak_usage
                # Bounded by compute alone (what every step holds, buckets or not; a recomputing
                # plan's copies too): one that cannot beat this shape's optimum or the best plan
                # known of any shape is not solved (at 8B on 512 ranks, FSDP+TP+AC's compute
                # floor lies above the best plan: 1 s of each 3-D shape's bounding).
                spent = time.perf_counter() - started
                found_hand = planner.hand_written(time_limit=max(1.0, min(seconds, spent)), additive_floor_us=bound,
                                                  compute_floor_us=bound,
                                                  below=min(step, best_us)) \
                    if hasattr(planner, "hand_written") else None
                if found_hand is not None and found_hand[1].step_us < step - 1e-3:
                    hand, seed = found_hand
                    step = seed.step_us
                if step < plan_below:
                    # The optimum or the hand-written plan, assembled (the seeds are cached).
                    plan = planner.solve(time_limit=max(1.0, seconds))
                    peak = plan.summary["peak_mem_bytes"]
            elif free is not None and hasattr(planner, "hand_written"):
                # Memory binds: planned alone, the shape's plan is the least predicted of its solve
                # and its hand-written plans, which may hide far more communication than the
                # additive objective, so its bound, says (LLaMA-8B on (64, 4, 2): FSDP+TP at 545.4
                # ms, bounded at 575.6 additive). Solved under their pins, most are proved by their
                # memory-free optimum; others need the exact search, and the solves are ordered by
                # what these give: they get all of ``seconds`` (the stall rule ends them). Cut to the
                # time the shape's own memory-free search took, LLaMA-70B (8, 8)'s FSDP+TP+AC ended
                # at its repair, 4,803.0 ms, where its exact search gives 4,501.2 in 0.8 s more, and
                # (8, 8) was solved third, after the time was spent.
                # Their predicted steps are bounded from below by the shape's additive and compute
                # bounds, as any plan's (simulate.step_floor): one that cannot beat the best plan
                # found is not solved. Not quite a proof: the executor's buckets save a latency per
                # merged collective, which the additive bound does not see (on the shipped GPU
                # profiles 0.4-1.0% of LLaMA-8B's steps; on gloo's millisecond latencies far more).
                found_hand = planner.hand_written(time_limit=max(1.0, seconds),
                                                  additive_floor_us=max(bound, free.lower_bound),
                                                  compute_floor_us=bound,
                                                  below=best_us)
                if found_hand is not None:
                    hand, seed = found_hand
                    step = seed.step_us
                    if step < plan_below:
                        plan = _hand_written_plan(hand, seed)
                        peak = plan.summary["peak_mem_bytes"]
    except AutoshardError as exc:  # e.g. a pin written for another number of axes
        return _BoundResult(shape, None, None, time.perf_counter() - started, str(exc), None, None)
    return _BoundResult(shape, bound, free, time.perf_counter() - started, None, planner, plan, upper, step, peak,
                        hand)


def _fits(free) -> bool:
    """Whether a memory-free optimum is proved and fits the budget: then it, or a hand-written
    plan predicted faster, is the shape's plan alone."""
    return free is not None and free.proved and free.fits


def _hand_written_plan(name: str, seed) -> Plan:
    """A hand-written plan (a :class:`~autoshard.planning.planner._Seed`) as a search's answer, labelled."""
    return seed.as_ours(name, "hand-written, under its pins: predicted faster than the plans the mesh search solved")


def _bound_share(planner) -> float:
    """The overlap share the search bounds with: the profile's where plans follow the simulated
    step (``overlap_objective``), else 0: shapes are then bounded, pruned and proved on the
    additive objective their plans optimize (the overlap-relaxed bounds lie far below plans
    that do not seek overlap: LLaMA-8B on 64 ranks pruned nothing and the search ran to its
    limit, 60 s against 16.7), and chosen by their predicted steps."""
    options = getattr(planner, "options", None)
    return planner.profile.overlap if options is not None and options.overlap_objective else 0.0


def _bound_in_worker(shape: tuple[int, ...], seconds: float, plan_below: float) -> tuple[_BoundResult, object]:
    """(the shape bounded, its planner): the planner stays in the worker, which solves the shape
    if asked (:func:`_plan_held`); what it found goes back too, the starts of the shape's solve
    where it is built again here (the worker dropped it)."""
    res = _bound_shape(shape, seconds, _WORK["make"], plan_below=plan_below, best_us=plan_below)
    found = res.planner.known_choices() if hasattr(res.planner, "known_choices") else ()
    return res._replace(planner=None, hints=tuple((f"bounding: {name}", np.asarray(choice, dtype=np.int32))
                                                  for name, choice in found)), res.planner


def _plan_held(planner, how: str, seconds: float, cpus: set[int] | None = None) -> Plan:
    """The shape's plan from the planner that bounded it: its solve (``"solve"``), or its best
    hand-written plan (``"hand"``, where memory binds and that plan is the best found). ``cpus``:
    the cores it runs on (its search's child processes too), where solves run side by side."""
    import os

    kept = os.sched_getaffinity(0) if cpus is not None and hasattr(os, "sched_setaffinity") else None
    if kept is not None:
        os.sched_setaffinity(0, cpus)
    try:
        if how == "solve":
            return planner.solve(time_limit=seconds)
        name, seed = planner.hand_written(time_limit=seconds)
        return _hand_written_plan(name, seed)
    finally:
        if kept is not None:
            os.sched_setaffinity(0, kept)


def _solve_held(planner, seconds: float, cpus: set[int] | None) -> Plan | MemoryBudgetError:
    """:func:`_plan_held`'s solve, started beside others: a budget it cannot meet is its answer
    (its shape is then infeasible), not an error that would leave the shape unnamed."""
    try:
        return _plan_held(planner, "solve", seconds, cpus)
    except MemoryBudgetError as exc:
        return exc


#: Planners each bounding worker keeps for the solves, the shapes likeliest to be solved first
#: (:meth:`_Bounding.keep`): about 0.5 GB each for LLaMA-70B on a 3-D mesh.
HELD_PER_WORKER = 3


class _Bounding:
    """Shapes bounded (built, then solved with memory ignored) in forked worker processes that
    keep their planners (:class:`~autoshard.planning.shapeworkers.ShapeWorkers`), or here with one worker:
    :meth:`submit` a shape, :meth:`next` the next one done, as :func:`_bound_shape` gives it (the
    planner None where a worker built it); :meth:`plan` solves a shape where its worker keeps it."""

    def __init__(self, first, make, workers: int, best=lambda: float("inf")):
        self.first, self.make, self.best = first, make, best
        self.here: list[tuple[tuple[int, ...], float]] = []
        """Shapes to bound here, with their seconds: bounded by :meth:`next`, while the workers
        bound theirs (the 1-D shape's 1-3 s no longer idle them), once a worker has answered."""
        self.answered = False
        self.pool = None
        if workers > 1:
            from autoshard.planning.shapeworkers import ShapeWorkers

            _WORK["make"] = make
            self.pool = ShapeWorkers(workers, _bound_in_worker, hold=HELD_PER_WORKER)

    @property
    def running(self) -> set[tuple[int, ...]]:
        return {shape for shape, _ in self.here} | (self.pool.running if self.pool is not None else set())

    def has_room(self) -> bool:
        return self.pool.has_room() if self.pool is not None else not self.here

    def submit(self, shape: tuple[int, ...], seconds: float, plan_below: float) -> None:
        """Bound ``shape`` in at most ``seconds``, ``plan_below`` the best plan known (its
        hand-written plans that cannot beat it are not solved); a worker also makes its plan where
        it is below that (here, its planner is kept instead)."""
        if self.pool is None or len(shape) == 1:
            # The 1-D shape's planner exists (it traced the model); without workers, every one
            # is built here and kept for the solves.
            self.here.append((shape, seconds))
        else:
            self.pool.submit(shape, seconds, plan_below)

    def next(self) -> _BoundResult:
        # A shape bounded here waits for a worker's first answer: its hand-written plans that
        # cannot beat the plans found by then are not solved (LLaMA-70B's 1-D shape on 512 ranks:
        # FSDP+TP+AC, 3 s for a plan 45x slower than (64, 8)'s), and three processes no longer
        # share the two cores meanwhile.
        if self.here and (self.pool is None or self.answered or not self.pool.busy):
            shape, seconds = self.here.pop(0)
            return _bound_shape(shape, seconds, self.make, self.first if len(shape) == 1 else None,
                                best_us=self.best())
        self.answered = True
        return self.pool.next()

    def plan(self, shape: tuple[int, ...], how: str, seconds: float):
        """:func:`_plan_held` in the worker that keeps ``shape``'s planner (no build again, no stage
        of the bounding done twice), or :data:`~autoshard.planning.shapeworkers.HELD_NOT`."""
        return HELD_NOT if self.pool is None else self.pool.run(shape, _plan_held, how, seconds)

    @property
    def workers(self) -> int:
        """Solves that may run at once."""
        return 1 if self.pool is None else len(self.pool.conns)

    def abandon(self, shapes=None) -> list[tuple[int, ...]]:
        """Stop the solves of ``shapes`` (default: all) started and not ended (their workers end):
        their shapes."""
        return [] if self.pool is None else self.pool.abandon(shapes)

    def holder_idle(self, shape: tuple[int, ...]) -> bool | None:
        """Whether the worker that keeps ``shape``'s planner is idle; None where none keeps it."""
        k = None if self.pool is None else self.pool.held(shape)
        return None if k is None else self.pool.idle(k)

    def start_solve(self, shape: tuple[int, ...], seconds: float, alone: bool) -> bool:
        """``shape`` solved in the worker that keeps it, without waiting (:meth:`next_solved`); on
        one core of its own unless ``alone`` (no other solve runs beside it). False where no worker
        keeps it."""
        import os

        k = self.pool.held(shape)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        cpus = None if alone or len(cores) < 2 else {cores[k % len(cores)]}
        return self.pool.start(shape, _solve_held, seconds, cpus)

    def next_solved(self) -> tuple[tuple[int, ...], object]:
        """(shape, its plan, a MemoryBudgetError, or HELD_NOT) of the next solve started to end."""
        return self.pool.next_run()

    def keep(self, ranked: list[tuple[int, ...]]) -> None:
        """Workers keep the planners of ``ranked``'s first shapes (in solve order) and drop the rest."""
        if self.pool is not None:
            self.pool.keep(ranked)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            _WORK.clear()


def coarsenings(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes of one axis fewer that ``shape`` refines: two adjacent axes merged into one."""
    return [shape[:a] + (shape[a] * shape[a + 1],) + shape[a + 2:] for a in range(len(shape) - 1)]


def next_to_bound(todo: list[tuple[int, ...]], bounds: dict[tuple[int, ...], float]) -> tuple[int, ...]:
    """The shape to bound next: fewest axes first; among shapes of as many axes, those refining
    the coarser shape of lowest bound first (a mesh with an axis split in two can lay out every
    plan of the coarser one, a dim split by both halves for one split by the whole, so the best
    coarse shapes' refinements are the likeliest to be best: LLaMA-8B's best 3-D shapes on 64
    and 512 ranks split the inner axis of the best 2-D shape), then in ``todo``'s order."""
    fewest = min(len(s) for s in todo)

    def key(item):
        order, shape = item
        coarse = [bounds[c] for c in coarsenings(shape) if c in bounds]
        return (min(coarse, default=float("inf")), order)

    return min(((i, s) for i, s in enumerate(todo) if len(s) == fewest), key=key)[1]


def may_start(todo: list[tuple[int, ...]], running, bounds: dict[tuple[int, ...], float]) -> bool:
    """Whether the next shape to bound (of the fewest axes in ``todo``, :func:`next_to_bound`) may
    start while shapes of fewer axes are ``running``: where their bounds could not change which
    one is next (every candidate refines the same coarser shapes: all 2-D shapes refine the one
    1-D shape), or once a shape of one axis fewer is bounded (the order is then informed; a
    worker no longer idles while the last coarse shape finishes: LLaMA-8B's 32x2 is bounded
    last of the 2-D shapes, in 1.4 s, its bound the worst)."""
    k = min(map(len, todo))
    if not any(len(r) < k for r in running):
        return True
    candidates = {tuple(sorted(coarsenings(s))) for s in todo if len(s) == k}
    return len(candidates) == 1 or any(len(s) == k - 1 for s in bounds)


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


def _planner_of(shape, planner, free, make_planner, model, example_inputs, options, first, hints=()):
    """The shape's planner: the one that bounded it here, or (bounded in a worker process) built
    again, given the memory-free answer its worker found instead of searching again, and the plans
    it found as the starts of its solves."""
    from autoshard.mesh import fake_mesh

    if planner is not None:
        return planner
    planner = make_planner(model, example_inputs, fake_mesh(shape, axis_names(len(shape))), options=options,
                           traced=first.traced)
    if free is not None and _bound_share(planner) <= 0:  # the additive optimum
        planner.memory_free(found=free)
    if hints:
        planner.hint(hints)
    return planner


def search(model, example_inputs, ranks: int, options: PlanOptions, make_planner, max_axes: int = 3) -> Plan:
    """The best plan over :func:`mesh_shapes`, its table in ``plan.summary["mesh_search"]``.

    Two passes. *Bounds*: each shape's problem is built and solved with memory ignored
    (:meth:`Planner.memory_free`), in the order of :func:`next_to_bound`, for ``BOUND_SHARE`` of
    the time (``BOUND_SHARE_BINDING`` while memory binds the lowest bound): a proved lower bound
    per shape. *Solves*: shapes in increasing bound, each planned as a plan on a given mesh is
    (hand-written seeds included where ``seed_baselines``), with half the time left while another
    shape is worth solving after it, else all of it: two shapes share the time rather than the
    many that its plans may prune (an equal share gave LLaMA-70B's best-bounded shape on 512 ranks
    15 s and a plan 18% above its own), as the order does not say what a solve gains over the
    hand-written plan (all the time to the first, LLaMA-70B on 64 ranks: 4,468.8 ms; halved:
    4,276.8); a shape whose bound is not below the best plan found is pruned, as no plan of it
    can be cheaper. Where the memory-free optimum of the lowest bound
    fits the budget, that shape's plan is proved the best of all bounded shapes at once."""
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
    rows = {shape: ShapeResult(shape, "skipped") for shape in shapes}
    bounded: list[_Bounded] = []
    bounds: dict[tuple[int, ...], float] = {}
    spent: dict[int, list[float]] = {}  # seconds per shape bounded, by number of axes
    # The cheapest memory-free optimum that fits the budget is a plan: shapes bounded at or above
    # its cost are pruned as soon as it is known (and their problems freed).
    upper, upper_shape = float("inf"), None
    # Shapes with a plan the bounding found (a proved memory-free optimum that fits is the plan
    # the shape has alone; where memory binds, its best hand-written plan): shape -> (its
    # predicted step, the plan where it was assembled, the bounded shape, the hand-written
    # plan's name or None). They are compared by that step, not pruned by a bound of another
    # objective.
    known: dict[tuple[int, ...], tuple[float, Plan | None, _Bounded, str | None]] = {}

    def best_known() -> float:
        return min((k[0] for k in known.values()), default=float("inf"))

    def solve_order(b: _Bounded) -> tuple:
        # Shapes whose memory-free search did not run (toulbar2 missing, cut off) hold only the
        # cheapest-strategy bound, far below any plan: they are solved after those that have one.
        # Those with a hand-written plan go first, the best first: their solve starts from it and
        # only improves on it, while where memory binds a bound lies 25-35% below the plans
        # (LLaMA-70B on 64 ranks: by bound, (8, 2, 4) took the time and gave 5,059.7 ms; (8, 8),
        # whose hand-written plan was the best, planned alone gives 4,772.6).
        return b.no_free, b.shape not in known, known[b.shape][0] if b.shape in known else b.bound, b.order

    def plan_floor(b: _Bounded) -> float:
        # What every plan of a bounded shape is predicted at least, by its bounds: on the additive
        # objective, the floor of a step with that additive and compute (the buckets' latency
        # savings aside, as for the hand-written plans in _bound_shape).
        return b.bound if eta > 0 else step_floor(b.bound, b.cheapest, first.profile.overlap)

    def coarse_slower(shape: tuple[int, ...]) -> str | None:
        """Why ``shape`` is not bounded (``options.mesh_margin``), or None: every shape of one axis
        fewer that it refines is bounded and slow: it has a plan predicted at least ``1 + margin``
        times the best plan of that many axes, or, bounded without a plan, its bounds' floor is
        there or its bound is ``1 + margin`` times the least bound of that many axes, or it was
        pruned."""
        margin = options.mesh_margin
        k = len(shape) - 1
        fewer = {s: v[0] for s, v in known.items() if len(s) == k}
        if margin is None or not fewer:
            return None
        best = min(fewer.values())
        least = min((v for s, v in bounds.items() if len(s) == k), default=float("inf"))
        entries = {b.shape: b for b in bounded}
        why = []
        for c in coarsenings(shape):
            name = "x".join(map(str, c))
            if c not in rows:  # not a candidate (its inner axis spans nodes): never bounded
                continue
            if c in fewer:
                if fewer[c] < (1 + margin) * best:
                    return None
                why.append(f"{name} has plans predicted at least {fewer[c] / 1e3:.3f} ms, "
                           f"{fewer[c] / best - 1:.0%} slower than the best of {k} axes ({best / 1e3:.3f} ms)")
            elif rows[c].outcome == "pruned":
                why.append(f"{name} was pruned")
            elif c in entries:  # bounded without a plan
                floor = plan_floor(entries[c])
                if floor >= (1 + margin) * best:
                    why.append(f"every plan of {name} is predicted at least {floor / 1e3:.3f} ms, "
                               f"{floor / best - 1:.0%} slower than the best of {k} axes ({best / 1e3:.3f} ms)")
                elif c in bounds and bounds[c] >= (1 + margin) * least:
                    # Its plans are not timed: its bound against the least is the measure of it that
                    # compares (LLaMA-70B's (256, 2): 90% above (64, 8)'s, its plans unknown).
                    why.append(f"{name} is bounded at {bounds[c] / 1e3:.3f} ms, {bounds[c] / least - 1:.0%} above "
                               f"the least bound of {k} axes ({least / 1e3:.3f} ms)")
                else:
                    return None
            else:  # not bounded yet, or failed
                return None
        if not why:
            return None
        return f"not bounded: the shapes it refines are slow: {'; '.join(why)} (mesh_margin={margin}; " \
            "None bounds every shape)"

    def keep_planners() -> None:
        # The workers keep the planners of the shapes likeliest to be solved (or, the best plan
        # found where the bounding did not assemble it, assembled): the others' memory goes back.
        listed = {b.shape for b in bounded}
        waiting = [*bounded, *(k[2] for s, k in known.items() if k[1] is None and s not in listed)]
        jobs.keep([b.shape for b in sorted(waiting, key=solve_order)])

    eta = _bound_share(first)
    todo = list(shapes)
    jobs = _Bounding(first, lambda shape: make_planner(model, example_inputs, fake_mesh(shape, axis_names(len(shape))),
                                                       options=options, traced=first.traced),
                     workers=bounding_workers(len(shapes)), best=best_known)
    try:
        solved: dict[tuple[int, ...], Plan] = {}
        infeasible: list[MemoryBudgetError] = []
        # Shapes solving in the workers that keep them: (the bounded shape, when its solve began).
        running: dict[tuple[int, ...], tuple[_Bounded, float]] = {}

        def unpromising(b: _Bounded) -> str | None:
            """Why shape ``b`` is not worth solving now, by the plans found so far, or None."""
            # Bounds of the objective the plans optimize: the simulated step, or the additive one.
            objective = [*(p.summary["step_us"] if eta > 0 else additive_solve(p) for p in solved.values()),
                         *([upper] if upper_shape is not None and upper_shape != b.shape else [])]
            best_us = min(objective, default=None)
            if best_us is not None and b.bound >= best_us:
                return f"bound {b.bound / 1e3:.3f} ms >= best {best_us / 1e3:.3f} ms"
            # Shapes are chosen by predicted step: one whose every plan is predicted at or above the
            # best plan found, by its bounds, has nothing to give (on the additive objective too).
            found_us = min([*(k[0] for s, k in known.items() if s != b.shape),
                            *(p.summary["step_us"] for p in solved.values())], default=float("inf"))
            floor_us = plan_floor(b)
            if floor_us >= found_us:
                return (f"every plan of it is predicted at least {floor_us / 1e3:.3f} ms (its bounds) >= "
                        f"{found_us / 1e3:.3f} ms, the best plan found")
            # Heuristic (mesh_margin): a solve starts from the shape's hand-written plan and gained
            # 0-11% on it (LLaMA-70B, 64 and 512 ranks), so one whose plan is mesh_margin slower than
            # the best found is left as it is (70B's (16, 4), 46% slower: an 11 s solve for nothing).
            margin = options.mesh_margin
            if margin is not None and b.shape in known and known[b.shape][0] >= (1 + margin) * found_us:
                own = known[b.shape][0]
                return (f"its plan is predicted {own / 1e3:.3f} ms, {own / found_us - 1:.0%} slower than the best "
                        f"found ({found_us / 1e3:.3f} ms; mesh_margin={margin}, None solves it)")
            return None

        while todo or jobs.running:
            # Shapes of more axes wait for those of fewer while the coarse shapes' bounds may
            # still order them (may_start).
            while todo and jobs.has_room() and may_start(todo, jobs.running, bounds):
                shape = next_to_bound(todo, bounds)
                todo.remove(shape)
                why = coarse_slower(shape)
                if why is not None:
                    rows[shape].note = why
                    continue
                lowest = min([*bounded, *(k[2] for k in known.values())], key=lambda b: (b.no_free, b.bound),
                             default=None)
                share = BOUND_SHARE_BINDING if lowest is not None and lowest.free is not None \
                    and not lowest.free.fits else BOUND_SHARE
                left = t0 + share * limit - time.perf_counter()
                like = spent.get(len(shape))
                if (bounded or known or jobs.running) and (left <= 0 or (like and left < min(like))):
                    rows[shape].note = (f"the bounding time ({share * limit:.0f} s of time_limit"
                                        f"{', memory binding' if share == BOUND_SHARE_BINDING else ''}) is spent: "
                                        "raise time_limit to plan it")
                    continue
                # A worker assembles the plan it finds only where it is the best so far (else the
                # chosen shape's would be built again here to make it).
                jobs.submit(shape, max(1.0, min(MAX_BOUND_SECONDS, left)), best_known())
            left = limit - (time.perf_counter() - t0)
            if not todo and jobs.running and left >= MIN_SOLVE_SECONDS:
                # Nothing left to bound: an idle worker solves a shape it keeps among those that
                # would be solved first, at once, once bounding ends (the best, one per worker), while
                # the last shapes bound (LLaMA-70B on 512 ranks: (64, 4, 2) bounds for 9 s, the other
                # core idle).
                leading = [b for b in sorted(bounded, key=solve_order) if b.plan is None and unpromising(b) is None]
                for b in leading[:jobs.workers]:
                    if b.shape not in running and jobs.holder_idle(b.shape) \
                            and jobs.start_solve(b.shape, max(MIN_SOLVE_SECONDS, left / 2), alone=False):
                        running[b.shape] = (b, time.perf_counter())
            if not jobs.running:
                continue
            shape, bound, free, seconds, error, planner, made, found, step, peak, hand, hints = jobs.next()
            row = rows[shape]
            row.seconds = seconds
            if error is not None:  # e.g. a pin written for another number of axes
                row.outcome, row.note = "error", error
                continue
            cheapest = bound
            if free is not None:
                bound = bounds[shape] = max(bound, free.lower_bound)
            row.bound_us = bound
            spent.setdefault(len(shape), []).append(seconds)
            fits = _fits(free)
            entry = _Bounded(free is None, bound, shapes.index(shape), shape, planner, free,
                             made if hand is None or fits else None, cheapest, hints)
            if step is not None:
                known[shape] = (step, made, entry, hand)
                row.outcome, row.step_us = "planned", round(step, 3)
                row.peak_mem_bytes = None if peak is None else int(peak)
                row.note = "its memory-free optimum (proved, fits): its plan" if hand is None else \
                    f"hand-written {hand}: its plan (predicted faster than its memory-free optimum, which fits)" \
                    if fits else f"hand-written {hand}, its best (memory binds)"
            if step is None or (hand is not None and not fits):  # a plan of it may beat its hand-written one
                bounded.append(entry)
            log.info(f"mesh {'x'.join(map(str, shape))}: bound {bound / 1e3:.3f} ms"
                     + (f"; its plan (the memory-free optimum, fits) at {step / 1e3:.3f} ms predicted"
                        if step is not None and hand is None else
                        f"; hand-written {hand} at {step / 1e3:.3f} ms predicted" if step is not None else
                        f"; a plan of it at {found / 1e3:.3f} ms" if found is not None else "")
                     + f" in {seconds:.1f}s")
            if found is not None and found < upper:
                upper, upper_shape = found, shape
            for b in [b for b in bounded if b.shape != upper_shape and b.bound >= upper]:
                bounded.remove(b)
                _prune(rows[b.shape], b.shape in known, f"bound {b.bound / 1e3:.3f} ms >= {upper / 1e3:.3f} ms, the "
                       f"memory-free plan of {'x'.join(map(str, upper_shape))} that fits")
            keep_planners()
        def record(b: _Bounded, started: float, plan) -> None:
            """Shape ``b``'s solve, begun at ``started``: its plan, or the budget it cannot meet."""
            nonlocal dry, paid
            row = rows[b.shape]
            row.seconds += time.perf_counter() - started
            if isinstance(plan, MemoryBudgetError):
                infeasible.append(plan)
                row.outcome, row.note = "infeasible", str(plan)
                return
            row.outcome, row.step_us = "planned", plan.summary["step_us"]
            row.peak_mem_bytes = plan.summary["peak_mem_bytes"]
            proved = plan.solver.get("bound")
            if proved is not None and eta <= 0:
                row.bound_us = max(row.bound_us, proved)  # the solver's bound is additive: a step's only then
            row.note = str(plan.solver.get("status", ""))
            log.info(f"mesh {'x'.join(map(str, b.shape))}: {plan.summary['step_us'] / 1e3:.3f} ms predicted "
                     f"({plan.solver.get('status')}) in {row.seconds:.1f}s")
            solved[b.shape] = plan
            if b.plan is None:  # a solve, not a plan its worker made
                step = plan.summary["step_us"]
                dry = 0 if step <= paid - gain * paid else dry + 1
                paid = min(paid, step) if dry else step

        def solve_here(b: _Bounded, started: float, share: float):
            # Bounded here, or in a worker that dropped it: built again, which is part of its share.
            planner = _planner_of(b.shape, b.planner, b.free, make_planner, model, example_inputs, options, first,
                                  b.hints)
            try:
                return planner.solve(time_limit=max(1.0, share - (time.perf_counter() - started)))
            except MemoryBudgetError as exc:
                return exc

        # Shapes are solved in solve order, each where its planner is kept; those kept by different
        # workers at once, one core each (a solve's stages are mostly one process: LLaMA-70B (64, 8)
        # solved in 6.0 s on one core, 4.6-4.9 s on two: two at once take about the time of one).
        # The solves' stall rule: once as many solves in a row as run at once (two at least) found
        # nothing better than the best plan known by the stall rule's gain, the search has stopped
        # paying (LLaMA-70B on 512 ranks: after (2, 32, 8) gave 4,438.9 ms, five more solves gave
        # nothing 0.01% faster, 30 s). Those still running are stopped, the rest not solved.
        gain, dry, paid = DEFAULT_STALL.gain, 0, min((k[0] for k in known.values()), default=float("inf"))
        patience = max(2, jobs.workers)
        bounded.sort(key=solve_order)
        queue = [b for b in bounded if b.shape not in running]
        while (queue or running) and dry < patience:
            i = 0
            while i < len(queue) and dry < patience:
                b = queue[i]
                row, started = rows[b.shape], time.perf_counter()
                why = unpromising(b)
                if why is not None:
                    _prune(row, b.shape in known, why)
                    queue.pop(i)
                    continue
                left = limit - (started - t0)
                if (solved or known or running) and left < MIN_SOLVE_SECONDS:
                    _unsolved(row, b.shape in known, "the time limit is spent: raise time_limit to plan it")
                    queue.pop(i)
                    continue
                if b.plan is not None:  # its worker made it (its memory-free optimum)
                    queue.pop(i)
                    record(b, started, b.plan)
                    continue
                idle = jobs.holder_idle(b.shape)
                if idle is False or (idle is None and running):
                    i += 1  # its worker solves another, or it is built here once nothing runs beside
                    continue
                # Half the time left while another shape is worth solving after it: the hand-written
                # plans that order the shapes do not say what a solve gains on them (LLaMA-70B: nothing
                # on (2, 4, 8) or (2, 32, 8), whose hand-written plans are the best, 4% on (8, 8), 8% on
                # (4, 16, 8)). On 64 ranks (2, 4, 8) took all 30 s and gave 4,468.8 ms; halved, (8, 8)
                # had 21 s and gave 4,276.8. A solve that stalls sooner leaves its time to the next.
                queue.pop(i)
                others = [c for c in queue if c.plan is None and unpromising(c) is None]
                share = max(MIN_SOLVE_SECONDS, left / 2 if others and left >= 2 * MIN_SOLVE_SECONDS else left)
                if idle is None:
                    record(b, started, solve_here(b, started, share))
                    continue
                # On a core of its own where another solve may run beside it.
                beside = bool(running) or any(jobs.holder_idle(c.shape) for c in others)
                if jobs.start_solve(b.shape, max(1.0, share), alone=not beside):
                    running[b.shape] = (b, started)
                else:  # dropped meanwhile
                    record(b, started, solve_here(b, started, share))
            if running:
                shape, plan = jobs.next_solved()
                b, started = running.pop(shape)
                if plan is HELD_NOT:
                    plan = solve_here(b, started, limit - (started - t0))
                record(b, started, plan)
                # A solve started before the plans found since is stopped where they leave its shape
                # nothing to give (LLaMA-70B on 64 ranks: (8, 4, 2), its hand-written plan 24.7% above
                # the best when started, 26.2% once (8, 2, 4)'s solve beside it ended: 15 s).
                late = {s: unpromising(c) for s, (c, _) in running.items()}
                for shape in jobs.abandon([s for s, why in late.items() if why is not None]):
                    c, began = running.pop(shape)
                    rows[shape].seconds += time.perf_counter() - began
                    _prune(rows[shape], shape in known, f"{late[shape]}; its solve stopped")
        why = f"the last {dry} solves found no plan {gain:.1%} faster than the best (the search's stall rule)"
        for shape in jobs.abandon():
            b, started = running.pop(shape)
            rows[shape].seconds += time.perf_counter() - started
            _unsolved(rows[shape], shape in known, f"{why}, its solve stopped")
        for b in queue:
            if b.plan is not None:  # its worker made it: no solve to stop
                record(b, time.perf_counter(), b.plan)
            elif unpromising(b) is not None:
                _prune(rows[b.shape], b.shape in known, unpromising(b))
            else:
                _unsolved(rows[b.shape], b.shape in known, why)
        # The answer: the least predicted step of every plan found (ties: the search order's first).
        steps = {shape: k[0] for shape, k in known.items()}
        for shape, p in solved.items():
            steps[shape] = min(steps.get(shape, float("inf")), p.summary["step_us"])
        best = min(steps, key=lambda shape: (steps[shape], shapes.index(shape)), default=None)
        if best in known and (best not in solved or known[best][0] < solved[best].summary["step_us"]):
            started = time.perf_counter()
            _, made, b, hand = known[best]
            if made is None:
                left = max(1.0, limit - (started - t0))
                # With the hand-written plan where it is faster; where memory binds, that plan.
                how = "solve" if hand is None or _fits(b.free) else "hand"
                made = jobs.plan(best, how, left)
                if made is HELD_NOT:
                    planner = _planner_of(best, b.planner, b.free, make_planner, model, example_inputs, options,
                                          first, b.hints)
                    made = _plan_held(planner, how, left)
            solved[best] = made
            rows[best].step_us, rows[best].peak_mem_bytes = made.summary["step_us"], made.summary["peak_mem_bytes"]
            if hand is not None and not _fits(b.free):
                rows[best].note = f"hand-written {hand} (memory binds): predicted faster than every plan solved"
            rows[best].seconds += time.perf_counter() - started
        table = [rows[s] for s in shapes]
        if best is None and not infeasible:
            raise ConfigError(f"no mesh shape of {ranks} ranks could be planned: "
                              + "; ".join(f"{'x'.join(map(str, r.shape))}: {r.note}" for r in table))
        if best is None:
            low = min(infeasible, key=lambda e: e.min_feasible_bytes)
            raise MemoryBudgetError(f"no mesh shape of {ranks} ranks fits the memory budget ({len(shapes)} tried); "
                                    f"the closest: {low}", budget_bytes=low.budget_bytes,
                                    min_feasible_bytes=low.min_feasible_bytes)
        plan, row = solved[best], rows[best]
        row.outcome = "chosen"
        plan.summary["mesh_search"] = [r.to_json() for r in table]
        plan.summary["mesh_search_seconds"] = round(time.perf_counter() - t0, 3)
        return plan
    finally:
        jobs.close()
