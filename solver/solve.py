"""``solve``: incumbent heuristics, then the MILP, returning the best feasible answer."""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from solver import cfn, heuristic, highs_model, ilp, lns, rowrepair, weights
from solver.clock import WorkClock
from solver.core import cost_scale
from solver.evaluate import evaluate, memory_profile
from solver.exact import build_exact
from solver.exact import finish as exact_answer
from solver.exact_child import ROUND_MAX_ENTRIES, ROUND_RESTARTS, ExactChild, combine, search_again
from solver.lagrange import lagrange_memory
from solver.lns_child import LnsChild
from solver.local import Adjacency, onto_allowed
from solver.memrows import RowsTooLarge
from solver.milp_child import MilpChild
from solver.problem import FORBIDDEN, Problem, ProvedInfeasible
from solver.quotient import quotient, tie_heads
from solver.rowrepair import RowNetwork
from solver.schedule import DEFAULT as DEFAULT_SCHEDULE
from solver.schedule import Schedule
from solver.stall import DEFAULT_STALL, StallRule

log = logging.getLogger(__name__)

BACKENDS = ("highs", "cbc")


class InfeasibleError(ValueError):
    """No choice of strategies fits the memory limit."""

    def __init__(self, message: str, min_feasible_limit_bound: float, binding_times: list[int]):
        super().__init__(message)
        self.min_feasible_limit_bound = min_feasible_limit_bound
        """A lower bound on the smallest usage limit for which a solution exists."""
        self.binding_times = binding_times
        """Time points where even the least-usage choices exceed the limit."""


class Status(str, enum.Enum):
    """How good a :class:`Solution` is known to be. A ``str`` (``Status.OPTIMAL == "optimal"``),
    so it reads and serializes as its value."""

    OPTIMAL = "optimal"
    """Proved optimal (within ``mip_gap``)."""
    FEASIBLE = "feasible"
    """Feasible, found by the MILP, not proved (time limit or gap)."""
    HEURISTIC = "heuristic"
    """Feasible, from a start, a heuristic or a search with no proof."""

    def __str__(self) -> str:
        return self.value


@dataclass
class Solution:
    """One strategy per node, with how good it is known to be."""

    choice: np.ndarray
    """``choice[v]``: the strategy index of node v."""
    cost: float
    """Exact objective of ``choice``."""
    status: Status
    """:class:`Status`: ``optimal``, ``feasible`` (time limit or gap reached) or ``heuristic``."""
    lower_bound: float | None = None
    """Best proven lower bound on the optimum, when the backend reports one."""
    seconds: float = 0.0
    peak_usage: float = 0.0
    backend: str = ""
    stats: dict = field(default_factory=dict)
    source: str = ""
    """The stage whose answer this is: ``start:<name>`` (a given start), ``heuristic``, ``pairwise``
    (memory-free optimum that fits), ``exact`` (toulbar2 with memory rows), ``milp``,
    ``weights`` (per-node penalty search), ``lns`` or ``polish`` (local search at the end), ``repair``
    (the memory-free optimum moved group by group into the memory limit), ``lagrange`` (a pairwise
    solve with memory priced, :mod:`solver.lagrange`)."""
    pool: list = field(default_factory=list)
    """Other feasible answers the stages found, ``(source, choice)``, cheapest first, at most
    ``POOL_SIZE``: plans of about the same cost that a caller may rank by what the objective
    does not see (the planner: the step simulated with overlap)."""

    @property
    def gap(self) -> float | None:
        """Relative gap (cost - bound) / |cost|, when a bound is known."""
        if self.lower_bound is None:
            return None
        return max(0.0, (self.cost - self.lower_bound) / max(abs(self.cost), 1e-12))

    def to_list(self) -> list[int]:
        return [int(i) for i in self.choice]


def memory_lower_bound(problem: Problem) -> tuple[float, list[int]]:
    """Peak usage when every node takes its least-usage allowed strategy, and where it peaks."""
    usage = np.array(
        [problem.node_usages[v][problem.allowed(v)].min(initial=np.inf) for v in range(problem.num_nodes)]
    )
    times, total = memory_profile(problem, usage)
    if total.size == 0:
        return 0.0, []
    peak = float(total.max())
    limit = problem.usage_limit if problem.usage_limit is not None else np.inf
    binding = times[total > limit].tolist()
    return peak, [int(t) for t in binding]


def _solve_milp(problem, start, t0, time_limit, mip_gap, max_nonzeros, sched, backend, relaxed_bound=None):
    """Lazy memory: the MILP without memory rows first. Its optimum, when it fits the
    limit, is optimal for the full problem too (a relaxation's optimum that is feasible),
    and on planner graphs the limit often does not bind: the memory rows (thousands of
    them, half the nonzeros) then cost nothing. Otherwise its bound still holds and the
    full MILP gets the remaining time. Both backends solve the same model."""
    if problem.usage_limit is not None and relaxed_bound is None:
        # Never spend half the time on a relaxation whose full model cannot be built.
        highs_model.check_memory_rows(problem, max_nonzeros)
        deadline = sched.deadline("relaxation", t0, time_limit)
        choice, lower, optimal, stats = _run_milp(problem, start, t0, deadline, mip_gap, max_nonzeros, backend,
                                                  memory=False)
        if choice is not None and optimal and evaluate(problem, choice).feasible:
            stats["memory_rows_needed"] = False
            return choice, lower, True, stats
        relaxed_bound = lower  # a bound of the relaxation bounds the full problem too
        log.info("milp without memory rows breaks the limit: adding them")
    choice, lower, optimal, stats = _run_milp(problem, start, t0, t0 + time_limit, mip_gap, max_nonzeros, backend)
    if relaxed_bound is not None and (lower is None or relaxed_bound > lower):
        lower = relaxed_bound
    return choice, lower, optimal, stats


def _run_milp(problem, start, t0, deadline, mip_gap, max_nonzeros, backend, memory=True):
    model = highs_model.build(problem, max_nonzeros=max_nonzeros, memory=memory)
    log.info(f"milp ({backend}{'' if memory else ', memory rows left out'}): {model.stats['variables']} variables "
             f"({model.stats['edge_variables']} edge, {model.stats['dominated_strategies']} dominated strategies "
             f"dropped), {model.stats['constraints']} rows, {model.stats['nonzeros']} nonzeros "
             f"after {time.perf_counter() - t0:.2f}s")
    run = highs_model.solve_model if backend == "highs" else ilp.solve_model
    choice, lower, optimal = run(model, problem.num_nodes, deadline - time.perf_counter(), mip_gap, start)
    return choice, lower, optimal, model.stats


#: The pairwise search runs first on quotient graphs up to this size: planner graphs
#: (a few hundred groups once layers are tied) solve in seconds there. Larger graphs
#: (the IOPDDL instances, 30k nodes with binding memory) go to the MILP / penalty path.
PAIRWISE_MAX_NODES = 5000
#: The least ``mip_gap`` at which the Lagrangian stage runs (:mod:`solver.lagrange`): one it can
#: prove. Its bound creeps up by subgradient steps (LLaMA-8B on (8, 8), an overlap round: within
#: 0.1% in 9 rounds, 1.7 s); asked for 1e-6 it proves nothing, and the exact search after it
#: gained little from its plans (3.0 s against 3.5 s there; LLaMA-70B's first rounds found no
#: plan that fits, 1-1.8 s each lost).
LAGRANGE_MIN_GAP = 1e-4
#: toulbar2's smallest time limit (it counts whole seconds): the least the pairwise stage of
#: :func:`solve` is given, whatever its share of the time limit.
MIN_PAIRWISE_SECONDS = 1.0


def _pairwise_first(problem, deadline, at_least: float = 0.0, upper: tuple[float, np.ndarray] | None = None):
    """toulbar2 on the tie quotient without memory: (choice, evaluation, bound, proved) or None
    (also where less than a second is left of ``deadline``, unless ``at_least`` seconds are
    granted from when toulbar2 starts). ``upper``: (its cost, a tie-consistent allowed choice):
    toulbar2 searches only below it, and the choice is the answer where nothing is found below
    (a hand-written plan's pinned problem on LLaMA-8B's (8, 16, 4): 0.62 s without a bound,
    0.30 s from one 20% above its optimum).

    Its optimum, when proved, bounds the full problem from below (memory only adds
    constraints) and is the answer when it fits the memory limit; otherwise it is
    an incumbent and a bound for the MILP.
    """
    q, group = quotient(problem)
    if q.num_nodes > PAIRWISE_MAX_NODES:
        return None
    seconds = max(at_least, deadline - time.perf_counter())
    if seconds < MIN_PAIRWISE_SECONDS:
        return None
    up = None
    if upper is not None:
        member = np.zeros(q.num_nodes, dtype=np.int64)
        member[group] = np.arange(group.size)  # a member of each tie group (their choices agree)
        up = evaluate(q, upper[1][member]).cost
    picked, proved, slack = cfn.solve_pairwise(q, seconds, upper=up)
    if picked is None and up is None:
        return None
    choice = upper[1] if picked is None else picked[group]
    ev = evaluate(problem, choice)
    # toulbar2's costs are rounded integers; the known choice, where nothing was found below it
    # in time, bounds nothing
    bound = ev.cost - slack if picked is not None or proved else -math.inf
    log.info(f"pairwise (toulbar2, {q.num_nodes} tie groups, memory ignored): cost {ev.cost:.6g}, "
        f"{'proved optimal' if proved else 'time limit'}, memory {'fits' if ev.feasible else 'exceeds'} "
        f"after {time.perf_counter() - (deadline - seconds):.2f}s")
    return choice, ev, bound, proved


@dataclass
class MemoryFree:
    """The optimum of a problem's costs with memory ignored (:func:`memory_free`)."""

    choice: np.ndarray
    cost: float
    lower_bound: float
    """Proved: no choice costs less, memory or not (-inf where toulbar2 proved nothing in time)."""
    proved: bool
    """Whether ``cost`` is proved optimal (else ``lower_bound`` is toulbar2's bound at its time limit)."""
    fits: bool
    """Whether ``choice`` fits the memory limit: then it is the problem's optimum too, when proved."""
    peak_usage: float
    seconds: float

    def solution(self, backend: str = "highs") -> Solution:
        """The answer as :func:`solve` gives it where the memory-free optimum is proved and fits
        (its first stage's answer): optimal, from ``pairwise``."""
        if not (self.proved and self.fits):
            raise ValueError("only a proved memory-free optimum that fits is a solution")
        return Solution(self.choice, self.cost, Status.OPTIMAL, min(self.lower_bound, self.cost), self.seconds,
                        self.peak_usage, backend,
                        {"pairwise": {"proved": True, "seconds": round(self.seconds, 3), "bound": self.lower_bound}},
                        "pairwise")


def memory_free(problem: Problem, time_limit: float) -> MemoryFree | None:
    """toulbar2 on the tie quotient with memory ignored, for at most ``time_limit`` seconds (the
    first stage of :func:`solve`, alone): a lower bound on every answer, cheap where layers are
    tied (LLaMA-8B on a 3-D mesh: 2 s), so callers that compare problems (mesh shapes) can rank
    and prune them before solving any. None without toulbar2, on a quotient larger than
    ``PAIRWISE_MAX_NODES``, below a second, or when nothing was found in time."""
    if not cfn.available():
        return None
    t0 = time.perf_counter()
    found = _pairwise_first(problem, t0 + time_limit)
    if found is None:
        return None
    choice, ev, bound, proved = found
    return MemoryFree(choice, ev.cost, float(bound) if math.isfinite(bound) else -math.inf, proved, ev.feasible,
                      ev.peak_usage, time.perf_counter() - t0)


def cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def spare_cores() -> int:
    """Cores beside this process that another search would have to itself: the cores this
    process may run on, less the load average (this process counted). toulbar2's time limit
    counts CPU time, so on a loaded machine two searches sharing a core overran a 57 s budget
    to 78-105 s wall."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available: trust the core count
        load = 1.0
    return max(0, cores() - max(1, math.floor(load + 0.5)))


def second_core_free() -> bool:
    """Whether a second search would get a core of its own (:func:`spare_cores`)."""
    return spare_cores() >= 1


#: At most this many window searches in child processes (each holds a copy of the problem:
#: ~60 MB pickled for IOPDDL T, a few hundred MB once loaded).
MAX_LNS_CHILDREN = 7


def _exact_model(problem, reference):
    """The exact network (:mod:`solver.exact`), or None when its rows are too many."""
    try:
        return build_exact(problem, reference)
    except RowsTooLarge as exc:
        log.info(f"exact (toulbar2 with memory rows) skipped: {exc}")
        return None


def _exact_said(res, t_start):
    st = res.stats
    found = "nothing better" if res.choice is None else f"cost {res.evaluation.cost:.6g}"
    log.info(f"exact (toulbar2, {st['groups']} tie groups, {st['memory_rows']} memory rows of "
        f"{st['memory_segments']} segments): {found}, {'proved optimal' if res.proved else 'not proved'}, "
        f"bound {res.lower_bound}, {time.perf_counter() - t_start:.2f}s")


#: Feasible answers kept beside the best (:attr:`Solution.pool`).
POOL_SIZE = 4


class _Incumbent:
    """The best answer so far (a feasible one beats any infeasible one; among feasible ones
    the cheaper, a later stage on equal cost) and the stage it came from; and the
    ``POOL_SIZE + 1`` cheapest distinct feasible answers offered (:meth:`pool`)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.choice: np.ndarray | None = None
        self.ev = None
        self.source = ""
        self.kept: dict[bytes, tuple[float, int, str, np.ndarray]] = {}

    def pool(self) -> list[tuple[str, np.ndarray]]:
        """The kept feasible answers other than the incumbent, cheapest first (first offered on ties)."""
        mine = None if self.choice is None else self.choice.tobytes()
        return [(source, choice) for key, (_, _, source, choice) in sorted(self.kept.items(), key=lambda kv: kv[1][:2])
                if key != mine][:POOL_SIZE]

    @property
    def feasible(self) -> bool:
        return self.ev is not None and self.ev.feasible

    @property
    def cost(self) -> float:
        return self.ev.cost if self.feasible else math.inf

    def offer(self, choice, source: str, ev=None) -> bool:
        """Keep ``choice`` when it beats the incumbent; returns whether it was kept."""
        if choice is None:
            return False
        choice = np.asarray(choice, dtype=np.int64)
        ev = ev if ev is not None else evaluate(self.problem, choice)
        key = choice.tobytes()
        if ev.feasible and key not in self.kept:
            self.kept[key] = (float(ev.cost), len(self.kept), source, choice)
            if len(self.kept) > POOL_SIZE + 1:
                del self.kept[max(self.kept, key=lambda k: self.kept[k][:2])]
        if self.ev is None or (ev.feasible and (not self.ev.feasible or ev.cost <= self.ev.cost)):
            if self.choice is None or not np.array_equal(choice, self.choice):
                self.source = source  # a stage that hands the incumbent back leaves its source
            self.choice, self.ev = choice, ev
            return True
        return False


def solve(
    problem: Problem,
    time_limit: float = 60.0,
    backend: str = "highs",
    mip_gap: float = 1e-6,
    max_nonzeros: float = 30e6,
    pairwise: bool = True,
    starts: Sequence[tuple[str, np.ndarray]] = (),
    exact: bool = True,
    schedule: Schedule = DEFAULT_SCHEDULE,
    stall: StallRule | None = DEFAULT_STALL,
    late_starts: Callable[[], Sequence[tuple[str, np.ndarray]]] | None = None,
    lagrange: bool = True,
) -> Solution:
    """Pick one strategy per node minimizing cost under the memory limit.

    Stages, each kept only when it beats the incumbent (:class:`_Incumbent`):
    ``starts`` (named choices, e.g. hand-written plans); with ``pairwise`` (and pytoulbar2
    installed), toulbar2 on the tie quotient without memory (:func:`_pairwise_first`), the
    answer when it is proved and fits, else repaired into the memory limit and, where
    ``mip_gap`` is at least :data:`LAGRANGE_MIN_GAP` and ``lagrange`` is on, memory priced into
    pairwise solves (:mod:`solver.lagrange`), the answer when proved within the gap; a heuristic start
    where nothing so far fits; where memory binds,
    with ``exact``, toulbar2 on the tie quotient with the memory rows as knapsacks
    (:mod:`solver.exact`) until ``schedule.exact`` of the time, the answer when proved; then
    the MILP, or on models too large for it the per-node weight search and windowed MILPs.
    Raises :class:`InfeasibleError` when even the least-usage strategies exceed the
    limit. ``late_starts`` is called once the cheap stages (memory-free optimum, heuristic
    start) have proved nothing, before the searches that take the time: the named choices it
    returns (a caller's hand-written plans, solved only when needed) join the starts, and steer
    the exact search; its own time does not count against ``time_limit``. Always returns the
    best feasible choice it found within ``time_limit``, sooner where
    the searches that remain stop improving (``stall``, :mod:`solver.stall`; None: search until
    proved or the time limit, as a contest's fixed budget wants). Progress goes to the
    ``solver`` loggers (INFO).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, found {backend!r}")
    if time_limit <= 0:
        raise ValueError(f"time_limit must be > 0 seconds, found {time_limit}")
    _check_memory_floor(problem)
    run = _Run(problem, time.perf_counter(), time_limit, backend, mip_gap, max_nonzeros, schedule, stall)
    _offer_starts(run, starts)
    if pairwise and cfn.available():
        done = _pairwise_stage(run)
        if done is not None:
            return done
        if lagrange and run.free is not None and run.mip_gap >= LAGRANGE_MIN_GAP:
            done = _lagrange_stage(run)
            if done is not None:
                return done
    if not run.inc.feasible:
        # Only as the fallback: where the memory-free optimum repaired fits, it is far better
        # (LLaMA-70B (8,8,8): 6.4e6 against 8.0e8, and the heuristic took 2.3 s per solve).
        _heuristic_start(run)
    if late_starts is not None:
        t_late = time.perf_counter()
        _offer_starts(run, late_starts())
        run.t0 += time.perf_counter() - t_late
    model = _network(run) if exact else None
    if model is None:
        return _milp_or_weights(run)
    model = dataclasses.replace(model, scale=cost_scale(problem, run.inc.cost if run.inc.feasible else np.inf))
    return _exact_stage(run, model)


@dataclass
class _Run:
    """One call of :func:`solve`: its problem, limits and schedule, the incumbent, what the
    stages found (``stats``) and the best lower bound a stage proved (``bound``)."""

    problem: Problem
    t0: float
    time_limit: float
    backend: str
    mip_gap: float
    max_nonzeros: float
    sched: Schedule
    stall: StallRule | None = None
    inc: _Incumbent = None
    stats: dict = field(default_factory=dict)
    bound: float | None = None
    free_upper: tuple[float, np.ndarray] | None = None
    """The least cost of the starts, memory ignored, and its choice: the memory-free search's
    first upper bound."""
    model: object = None
    """The exact network, once built (:func:`_network`; False: it cannot be)."""
    repairer: object = None
    """Its :class:`_Repairer`, once made."""
    free: tuple[np.ndarray, float] | None = None
    """The memory-free optimum, proved, where it breaks the limit, and its bound: where the
    Lagrangian stage starts."""

    def __post_init__(self):
        self.inc = _Incumbent(self.problem)
        self.stats = dict(self.problem.stats())

    def deadline(self, stage: str) -> float:
        return self.sched.deadline(stage, self.t0, self.time_limit)

    def raise_bound(self, lower: float | None) -> None:
        if lower is not None and (self.bound is None or lower > self.bound):
            self.bound = lower

    def finish(self, status: str, lower: float | None) -> Solution:
        """The incumbent as the :class:`Solution`; :class:`InfeasibleError` when nothing fits."""
        inc, problem = self.inc, self.problem
        if not inc.feasible:
            floor, binding = memory_lower_bound(problem)
            raise InfeasibleError(
                f"found no feasible assignment within {self.time_limit:g}s (the problem may still be feasible): "
                f"{inc.ev.reason}; the least-usage strategies peak at {floor:g}",
                floor,
                binding,
            )
        if status == "optimal":
            # Proved within mip_gap: no weaker bound carried from an earlier stage (CI once saw the
            # memory-free relaxation's 97 beside a proved 194, the MILP's own bound not finite).
            if lower is None or lower < inc.cost - self.mip_gap * abs(inc.cost):
                lower = inc.cost
        if lower is not None and lower > inc.cost:
            lower = inc.cost
        # The searches a wall-clock deadline ended rather than their work (proof, stall rule): where
        # the answer may differ between runs on a busy machine.
        cut = [f"exact ({ph['method']})" for ph in (self.stats.get("exact") or {}).get("phases", [])
               if ph.get("ended") == "time" or ph.get("clock")] + self.stats.pop("clock_cut", [])
        if cut and status != "optimal":
            self.stats["cut_by_clock"] = cut
        seconds = time.perf_counter() - self.t0
        log.info(f"solved: {status} ({inc.source}), cost {inc.cost:.6g}, bound {lower}, {seconds:.2f}s")
        return Solution(choice=inc.choice, cost=inc.cost, status=Status(status), lower_bound=lower,
                        seconds=seconds, peak_usage=inc.ev.peak_usage, backend=self.backend, stats=self.stats,
                        source=inc.source, pool=inc.pool())


def _check_memory_floor(problem: Problem) -> None:
    """:class:`InfeasibleError` when even the least-usage strategies break the memory limit."""
    if problem.usage_limit is not None:
        floor, binding = memory_lower_bound(problem)
        if floor > problem.usage_limit:
            raise InfeasibleError(
                f"memory limit {problem.usage_limit:g} is infeasible: even the least-usage strategies "
                f"need {floor:g} at time(s) {binding[:5]}; the limit must be >= {floor:g}",
                floor,
                binding,
            )


def _heuristic_start(run: _Run) -> None:
    """The heuristic start (least usage, local search, pair repair), its stages' shares of the
    time counted from when it begins (it may follow the memory-free stage)."""
    problem, inc = run.problem, run.inc
    t_start = time.perf_counter()

    def until(stage: str) -> float:
        return run.sched.deadline(stage, t_start, run.time_limit)

    start = heuristic.initial_choice(problem)
    start = heuristic.local_search(problem, start, deadline=until("start_descent"))
    start = heuristic.repair_pairs(problem, start, deadline=until("start_repair"))
    start = heuristic.local_search(problem, start, deadline=until("start_polish"))
    inc.offer(start, "heuristic")
    log.info(f"incumbent: cost {inc.ev.cost:.6g} (feasible={inc.feasible}, {inc.source}) "
             f"after {time.perf_counter() - run.t0:.2f}s")


def _offer_starts(run: _Run, starts) -> None:
    starts = list(starts)
    adj = Adjacency(run.problem) if starts else None  # once for every start moved onto the allowed strategies
    for name, choice in starts:
        choice = np.asarray(choice, dtype=np.int64)
        if choice.shape != (run.problem.num_nodes,):
            raise ValueError(f"start {name!r}: expected {run.problem.num_nodes} strategy indices, "
                             f"found shape {choice.shape}")
        # A plan made without this problem's pins (another hand-written plan, the optimum
        # without them) is a start too, moved onto the strategies it allows.
        choice, moved = onto_allowed(run.problem, choice, adj)
        ev = evaluate(run.problem, choice)
        run.inc.offer(choice, f"start:{name}", ev)
        if ev.cost < FORBIDDEN and (run.free_upper is None or ev.cost < run.free_upper[0]):
            run.free_upper = (ev.cost, choice)
        log.info(f"start {name}: cost {ev.cost:.6g} ({'feasible' if ev.feasible else ev.reason})"
                 + (f", {moved} tie groups moved onto allowed strategies" if moved else ""))


def _pairwise_stage(run: _Run) -> Solution | None:
    """toulbar2 without memory (:func:`_pairwise_first`): the answer when proved and it fits;
    otherwise its proved optimum bounds the rest from below."""
    # toulbar2 counts whole seconds, and a share of the limit below one would skip the stage
    # that proves most planner problems in under a second: a hand-written plan's pinned problem,
    # solved in a share of a share of the time (LLaMA-8B's FSDP+TP on (64, 4, 2): proved in 0.7 s
    # when its share was 1.05 s; at 0.98 s the stage was skipped and the heuristic start gave a
    # step 280x slower). So the stage gets at least one second, which may run a solve of under
    # two seconds past its limit by the rest of that second.
    found = _pairwise_first(run.problem, run.deadline("pairwise"), at_least=MIN_PAIRWISE_SECONDS,
                            upper=run.free_upper)
    if found is None:
        return None
    choice, ev, bound, proved = found
    # The proved memory-free optimum bounds every plan whose costs only add to these (a plan
    # that recomputes activations): the planner prunes with it.
    run.stats["pairwise"] = {"proved": proved, "seconds": round(time.perf_counter() - run.t0, 3),
                             "bound": float(bound) if proved else None}
    run.inc.offer(choice, "pairwise", ev)
    if proved and not ev.feasible:
        run.free = (choice, bound)
    if not ev.feasible:
        _repair_stage(run, choice)
    if not proved:
        return None
    run.bound = bound
    if ev.feasible:
        return run.finish("optimal", min(bound, run.inc.cost))
    if run.inc.feasible and run.inc.cost <= bound + run.mip_gap * abs(bound):
        # The repair lies within mip_gap of the memory-free optimum, a bound of every answer:
        # proved within the gap, as the MILP's answers are (overlap rounds ask a gap of 0.1%,
        # and LLaMA-8B's on (8, 8) spent 1.2 of their 1.5 s each proving a repair 0.05% above).
        return run.finish("optimal", bound)
    return None


def _repair_stage(run: _Run, choice: np.ndarray) -> None:
    """Where memory binds, the memory-free optimum given up a little at a time is often a far
    better start than the least-usage one (LLaMA-8B at sequence 8192: 3.6 s against 210 s), by
    :class:`_Repairer`."""
    t1 = time.perf_counter()
    repair = _repairer(run)
    # The rows' repair ends by its work (every move removes excess), in a fraction of a second
    # on the planner's networks: the whole limit guards it, so a share of the time cut short
    # by the network's build (1.5 s on LLaMA-70B) does not decide whether a plan fits.
    fixed = repair(choice, run.t0 + run.time_limit if repair.net is not None else run.deadline("repair"))
    if fixed is not None:
        run.inc.offer(fixed, "repair")
    log.info(f"repair of the memory-free optimum ({repair.how}): "
             f"{'nothing fits' if fixed is None else f'cost {evaluate(run.problem, fixed).cost:.6g}'} "
             f"after {time.perf_counter() - t1:.2f}s")


class _Repairer:
    """``repair(choice, until)``: ``choice`` moved into the memory limit, then improved (None
    where nothing fits): on the exact network's rows (:mod:`solver.rowrepair`: moves of whole tie
    groups carrying the views that must follow them) where it can be built, else, or where that
    finds nothing (pins may hold a chain's neighbour), node by node
    (:func:`solver.heuristic.repair_and_polish`, in the repair stage's share of the time).
    :attr:`how` says which answered last."""

    def __init__(self, run: _Run):
        self.run, self.model = run, _network(run)
        self.net = None if self.model is None else RowNetwork(self.model.costs, self.model.tables, self.model.rows)
        self.how = "rows" if self.net is not None else "nodes"

    def __call__(self, choice: np.ndarray, until: float) -> np.ndarray | None:
        run = self.run
        if self.net is not None:
            picked, _ = rowrepair.repair(self.net, self.model.values(choice), until)
            if picked is not None:
                self.how = "rows"
                return self.model.choice(rowrepair.descend(self.net, picked, until))
            self.how = "nodes: the rows' repair found nothing"
            until = min(until, max(run.deadline("repair"), time.perf_counter() + 1.0))
        return heuristic.repair_and_polish(run.problem, choice, until)


def _repairer(run: _Run) -> _Repairer:
    """``run``'s :class:`_Repairer`, made once."""
    if run.repairer is None:
        run.repairer = _Repairer(run)
    return run.repairer


def _network(run: _Run):
    """The exact network of ``run``'s problem (:mod:`solver.exact`), built once; None where
    there is no memory limit, no toulbar2, a quotient past ``PAIRWISE_MAX_NODES`` groups or
    too many rows. Its integer scale is set where the exact search starts."""
    if run.model is None:
        problem = run.problem
        groups = len(np.unique(tie_heads(problem)))
        run.model = False
        if problem.usage_limit is not None and cfn.available() and groups <= PAIRWISE_MAX_NODES:
            run.model = _exact_model(problem, 1.0) or False  # any reference: the scale is set later
    return run.model or None


def _lagrange_stage(run: _Run) -> Solution | None:
    """Memory priced into pairwise solves from the memory-free optimum (:mod:`solver.lagrange`),
    round by round until they stop paying: their plans offered, their bound taken; the answer
    when the incumbent is then proved within ``mip_gap`` (an overlap round's 0.1%: LLaMA-8B on
    (8, 8) in 1.7 s, where the exact search took 3.5)."""
    t1 = time.perf_counter()
    ans = lagrange_memory(run.problem, run.free[0], run.free[1], run.deadline("lagrange"), upper=run.inc.cost,
                          repair=_repairer(run), gap=run.mip_gap)
    for plan in ans.plans:
        run.inc.offer(plan, "lagrange")
    run.raise_bound(ans.lower if math.isfinite(ans.lower) else None)
    seconds = time.perf_counter() - t1
    proved = run.inc.feasible and run.bound is not None and run.inc.cost - run.bound <= run.mip_gap * abs(run.inc.cost)
    run.stats["lagrange"] = {"rounds": ans.rounds, "stopped": ans.stopped, "seconds": round(seconds, 3),
                             "bound": ans.lower if math.isfinite(ans.lower) else None, "answered": bool(proved)}
    log.info(f"lagrange (memory priced, {ans.rounds} rounds, {ans.stopped}): "
             f"{'no better plan' if ans.choice is None else f'cost {ans.cost:.6g}'}, bound {ans.lower:.6g}, "
             f"after {seconds:.2f}s")
    return run.finish("optimal", run.bound) if proved else None


def _exact_stage(run: _Run, model) -> Solution:
    """toulbar2 with the memory rows (:mod:`solver.exact`) in watched child processes
    (:mod:`solver.exact_child`): DGVNS, then branch and bound under its answer. Under the stall
    rule (the planner's solves), on networks of at most ``ROUND_MAX_ENTRIES`` table entries, DGVNS
    runs in rounds of ``ROUND_RESTARTS`` restarts, each ended by toulbar2's own branch and bound
    (:func:`solver.cfn.solve_lazy`), in one child, so where the search ends by its work its
    answer is the same in every run; branch and bound follows only where the time cut DGVNS
    short. On larger networks, with a core to spare, DGVNS in one child and branch and bound in
    another from DGVNS's first answer on (:func:`_exact_beside`), each ended when it stops
    paying (:mod:`solver.stall`). Without the stall rule (a fixed budget, as a contest's) DGVNS
    runs until its share of the time, with the MILP beside it in another child when a core is
    free (killed once toulbar2 proves), else the MILP after it."""
    problem, inc = run.problem, run.inc
    milp = None
    # Under the stall rule, rounds that end by their work where the network is small enough for
    # them to (``ROUND_MAX_ENTRIES``), with no search beside them: which of two searches side by
    # side answered first, and where one stood when the other ended it, hung on the machine's
    # load (a 4-layer LLaMA planned twice gave two plans: issue "reproducible solves").
    work = run.stall is not None and model.entries <= ROUND_MAX_ENTRIES
    # On larger networks, with a core to spare, branch and bound runs beside DGVNS from DGVNS's
    # first answer on instead of after its last: the bound no longer waits for DGVNS to stall
    # (LLaMA-70B (8, 8, 8): the two phases one after the other took 25-31 s, each posting and
    # preprocessing the network anew, 4-5 s; unseeded, DGVNS's first answer came after 16 s and
    # branch and bound beside it found the plan). The MILP beside never answered in time on the
    # planner's problems (70B: no bound in 30 s) and keeps that core under a fixed budget.
    beside = run.stall is not None and not work and second_core_free()
    if run.stall is None and run.backend == "highs" and second_core_free() and _milp_fits(model, run.max_nonzeros):
        milp = MilpChild(problem, model.reduced, inc.choice if inc.feasible else None,
                         run.t0 + run.time_limit - time.perf_counter() - 1.0, run.mip_gap, run.max_nonzeros)
        log.info(f"milp runs beside the exact search in a child process ({cores()} cores)")
    try:
        # Under the stall rule no MILP follows the exact search in this process (below): the
        # search has the time a MILP beside it would share.
        after = milp is None and run.stall is None
        deadline = run.deadline("exact" if after else "exact_beside_milp")
        if deadline - time.perf_counter() >= 1:
            t_start = time.perf_counter()
            upper = inc.cost if inc.feasible else None
            rule = run.stall or DEFAULT_STALL
            if beside:
                ans = _exact_beside(run, model, upper, deadline, rule)
            else:
                child = ExactChild(model, upper, deadline - t_start, restarts=ROUND_RESTARTS if work else None)
                try:
                    ans = child.run(deadline, rule, run.stall is not None, log.info)
                finally:
                    child.close()
            res = exact_answer(problem, model, ans.picked, ans.proved, ans.gap)
            run.stats["exact"] = dict(res.stats, proved=ans.proved, phases=ans.phases,
                                      seconds=round(time.perf_counter() - run.t0, 3))
            _offer_others(run, model, ans)
            inc.offer(res.choice, "exact", res.evaluation)
            if ans.picked is None and ans.proved and inc.feasible:  # nothing beats the incumbent
                res = dataclasses.replace(res, proved=True, lower_bound=inc.cost - ans.gap)
            if model.exact and math.isfinite(ans.lower):
                run.raise_bound(ans.lower)
            _exact_said(res, t_start)
            run.raise_bound(res.lower_bound)
            if res.proved:
                return run.finish("optimal", run.bound)
        if milp is None:
            if run.stall is not None and run.inc.feasible:
                # Searches end when they stop paying, and the exact search had the time: a MILP
                # after it starts from scratch on the same network and never beat it on the
                # planner's problems (LLaMA-70B: 1.75M variables, 29 s to the limit; 405B:
                # 15 s). With no stall rule (a fixed budget) it follows, as it may prove.
                log.info("milp skipped: the exact search had the time (stall rule on)")
                return run.finish("heuristic", run.bound)
            return _milp_or_weights(run)
        ans = milp.answer(until=run.t0 + run.time_limit, stall=run.stall, since=run.t0, best=inc.cost,
                          best_bound=-math.inf if run.bound is None else run.bound)
        status = "heuristic"
        if ans is None:
            log.info("milp (child): no answer within the time limit" if run.stall is None
                     else "milp (child): no answer before it stalled or the time limit")
        elif ans.too_large or ans.infeasible:
            log.info(f"milp (child): {ans.too_large or ans.infeasible}")
        else:
            run.stats.update(ans.stats)
            run.raise_bound(ans.lower)
            if ans.choice is not None and inc.offer(ans.choice, "milp") and inc.feasible:
                status = "feasible"
            if ans.optimal and inc.feasible:
                status = "optimal"
            log.info(f"milp (child): {'optimal' if ans.optimal else 'not proved'}, bound {ans.lower}")
        return run.finish(status, run.bound)
    finally:
        if milp is not None:
            milp.close()


def _offer_others(run: _Run, model, ans) -> None:
    """The answers a search found before its last (:attr:`ExactAnswer.others`), offered: the
    pool's plans of about the answer's cost."""
    for picked in ans.others:
        other = exact_answer(run.problem, model, picked, False, math.inf)
        run.inc.offer(other.choice, "exact", other.evaluation)


def _exact_beside(run: _Run, model, upper: float | None, deadline: float, rule: StallRule):
    """DGVNS in one child and, from its first answer on, branch and bound under that answer (or
    the incumbent, where cheaper) in another (how much its preprocessing prunes, and so its
    bound, follows the upper bound it is given); DGVNS's answer is offered to ``run``'s
    incumbent (:func:`_offer_dgvns`). Returns branch and bound's
    :class:`~solver.exact_child.ExactAnswer` (DGVNS's when it never started), both phases listed."""
    bnb: list[ExactChild] = []
    under_dgvns = []  # whether branch and bound's bound is DGVNS's answer (not the incumbent's)

    def under(cost: float) -> None:
        if not bnb and deadline - time.perf_counter() >= 1:
            under_dgvns.append(cost < run.inc.cost)
            cost = min(cost, run.inc.cost)
            log.info(f"exact: branch and bound beside DGVNS, under {cost:.6g}")
            bnb.append(ExactChild(model, cost, deadline - time.perf_counter(), phases=("hbfs",)))

    child = ExactChild(model, upper, deadline - time.perf_counter(), phases=("vns",))
    try:
        first = child.run(deadline, rule, True, log.info, beside=lambda: bnb[0] if bnb else None, on_answer=under)
        found = exact_answer(run.problem, model, first.picked, False, math.inf)
        if not bnb:
            _offer_dgvns(run, model, first, found, None, False)
            return first
        known = found.evaluation.cost if found.choice is not None else math.inf
        # Its lines queued while DGVNS was watched: their times are when they came.
        ans = bnb[0].run(deadline, rule, True, log.info, known=known)
        if search_again(ans, bnb[0].upper, known, rule) and deadline - time.perf_counter() >= 1:
            # Started under DGVNS's first answer, branch and bound prunes less than it could
            # under its last: where posting the network again is cheap, it searches again
            # under that (the planner corpus's LLaMA-8B on (8, 8, 8): proved in the second
            # search, left at a 0.09% gap by the first).
            log.info(f"exact: branch and bound again, under DGVNS's best {known:.6g}")
            bnb.append(ExactChild(model, known, deadline - time.perf_counter(), phases=("hbfs",)))
            ans = combine(ans, bnb[-1].run(deadline, rule, True, log.info, known=known))
        # A second search ran under DGVNS's best answer: a proof there is under DGVNS's answer.
        _offer_dgvns(run, model, first, found, ans, under_dgvns[0] or len(bnb) > 1)
    finally:
        child.close()
        for c in bnb:
            c.close()
    ans.phases = first.phases + ans.phases
    return ans


def _offer_dgvns(run: _Run, model, first, found, bnb, under_dgvns: bool) -> None:
    """DGVNS's answers (``first``, evaluated as ``found``) offered to ``run``'s incumbent, unless
    branch and bound beside it (``bnb``'s answer; None where it never started) proved: then DGVNS
    was stopped when the proof came, so how far it had got hung on the two children's speeds
    (the same inputs gave a different equal-cost plan in a second run). Its answer is offered
    then only where the proof was under it (``under_dgvns``) and found nothing cheaper: DGVNS's
    first answer of that cost is its last."""
    if bnb is not None and bnb.proved and not (bnb.picked is None and under_dgvns and found.choice is not None):
        return
    _offer_others(run, model, first)
    run.inc.offer(found.choice, "exact", found.evaluation)


def _milp_fits(model, max_nonzeros: float) -> bool:
    """Whether the MILP over the model's reductions stays within ``max_nonzeros`` (edge variables
    counted before the folds :func:`highs_model.build` makes, so an over-estimate)."""
    red = model.reduced
    n_y = sum(int((m[np.ix_(red.allowed[u], red.allowed[v])] < FORBIDDEN).sum()) for (u, v), m in red.pairs.items())
    return 3 * n_y + model.stats["knapsack_entries"] <= max_nonzeros


def _milp_or_weights(run: _Run) -> Solution:
    """The MILP in this process (or, on models too large for it, the weight search and LNS)."""
    status, lower, inc = "heuristic", None, run.inc
    try:
        warm = inc.choice if inc.feasible else None
        choice, lower, optimal, mstats = _solve_milp(run.problem, warm, run.t0, run.time_limit, run.mip_gap,
                                                     run.max_nonzeros, run.sched, run.backend, run.bound)
        run.stats.update(mstats)
        if inc.offer(choice, "milp") and inc.feasible:
            status = "optimal" if optimal else "feasible"
    except highs_model.ModelTooLarge as exc:
        log.info(f"milp skipped: {exc}; per-node weight search, then windowed MILPs, for the remaining time")
        run.stats["milp_skipped"] = str(exc)
        lower, cut = _weights_and_windows(run.problem, inc, run.t0, run.time_limit, run.bound, run.sched)
        if cut:
            run.stats["clock_cut"] = [f"weights ({', '.join(cut)})"]
    except ProvedInfeasible as exc:
        log.info(f"milp: {exc}")
        return run.finish(status, lower)
    if status != "optimal" and "milp_skipped" not in run.stats:  # HiGHS ends at its wall-clock share
        run.stats["clock_cut"] = ["milp"]
    return run.finish(status, lower)


#: Windows per epoch of the windows stage, in this process and in each window child, and per
#: answer the weight search hands a child: a child's work counted in windows (about ten seconds
#: of them on IOPDDL K), so that what it hands back is the same in every run.
EPOCH_WINDOWS = 30


def _weights_and_windows(problem, inc, t0, time_limit, lower, sched):
    """Models too large for the MILP: the per-node weight search, windowed MILPs (:mod:`solver.lns`)
    and a last polish improve ``inc``; returns (the best lower bound known, what a clock cut short:
    ``guard`` and the names of searches their own time limits ended; empty where every search ended
    by its work).

    The weight search's shares of the time limit are counted in this process's CPU seconds with
    its toulbar2 rounds at their priced work (:class:`solver.clock.WorkClock`), from when it
    begins, so a busy machine does not change where it goes; the windows stage that follows
    counts CPU seconds from the wall clock's time then, so whatever the prices made of the weight
    search's wall time, the windows take up the rest of their share. The wall clock at
    ``sched.polish`` of the limit is the guard.

    With more than one core, windows run in child processes (:mod:`solver.lns_child`, one per core
    beside this one, each with its own random windows) from the weight search's first answer on:
    each answer it finds is a task of ``EPOCH_WINDOWS`` windows for each child. Once the weight
    search ends (its share of the time, or stalled) the windows stage runs in epochs
    (:func:`_windows`). On one core the two run one after the other.
    """
    end = sched.deadline("windows", t0, time_limit)
    clock = WorkClock(guard=sched.deadline("polish", t0, time_limit))
    children: list[LnsChild] = []

    def share(choice, cost):
        if not children and clock.seconds_until(end) > 10:
            # One per core beside this one, however busy the machine looks: the load average
            # (what spare_cores reads) still holds the last solve's children a minute later, so
            # of two runs in a row one searched windows beside the weights and the next did not
            # (IOPDDL L after D). This process's stages count CPU seconds: a busy machine
            # stretches their wall time instead.
            spare = min(cores() - 1, MAX_LNS_CHILDREN)
            children.extend(LnsChild(problem, choice, clock.seconds_until(math.inf), seed=1 + i) for i in range(spare))
            if children:
                log.info(f"lns runs beside the weight search in {len(children)} child process(es) ({cores()} cores)")
        for child in children:
            child.task(choice, cost, EPOCH_WINDOWS)

    try:
        if inc.feasible:
            share(inc.choice, inc.cost)
        if problem.usage_limit is not None and cfn.available() and not problem.ties:
            # Its share counted from its own start, as if the stages before it had taken all of
            # theirs: how long they took hangs on the machine (IOPDDL K's start: 2.9 s in one run,
            # 5.1 s in another), and the weight search's rounds would follow it.
            share_of_weights = (sched.weights - sched.start_polish) * time_limit
            found, bound = weights.weight_search(problem, inc.choice if inc.feasible else None,
                                                 deadline=clock.origin + share_of_weights, on_best=share, clock=clock)
            if bound is not None and (lower is None or bound > lower):
                lower = bound
            inc.offer(found, "weights")
        if inc.feasible:
            weighed, clock = clock, WorkClock(guard=clock.guard)
            clock.cut_by.extend(weighed.cut_by)
            _windows(problem, inc, children, end, clock)
    finally:
        for child in children:
            child.close()
    cut = list(clock.cut_by)
    # The polish's own guard is the time limit's end, less the evaluations after it.
    clock = WorkClock(guard=sched.deadline("polish", t0, time_limit) + 0.02 * time_limit, origin=clock())
    more, until = inc.choice, sched.deadline("polish", t0, time_limit)
    for _ in range(100):
        before = evaluate(problem, more).cost
        more = heuristic.repair_pairs(problem, more, deadline=until, now=clock)
        more = heuristic.local_search(problem, more, max_rounds=10_000, deadline=until, now=clock)
        if evaluate(problem, more).cost >= before or clock() > until:
            break
    if not np.array_equal(more, inc.choice):
        inc.offer(more, "polish")
    return lower, cut + [c for c in clock.cut_by if c not in cut]


def _windows(problem, inc, children, deadline, clock):
    """Windowed MILPs until ``deadline`` on ``clock``, in epochs: each epoch, this process and each
    of the ``children`` run ``EPOCH_WINDOWS`` windows from the best answer known (a child from its
    own where that is cheaper), then the cheapest of their answers (this process's first, then
    the children's in order, on equal costs) is the next epoch's start. An epoch waits for the
    children's windows: the windows run and the answers taken are the same in every run, up to
    the epoch the deadline ends (where a slower child held an answer "so far", each run took
    another). Marks the clock (:meth:`~solver.clock.WorkClock.mark`) where the guard ended a wait or
    a window's time limit ended its HiGHS."""
    t0 = time.perf_counter()
    search = lns.WindowSearch(problem, inc.choice)
    results: list = [None] * len(children)

    def said():
        log.info(f"lns: {search.windows} windows, {search.improved} improved, cost {search.cost:.6g} "
                 f"({time.perf_counter() - t0:.1f}s)")

    epoch, epochs = 0.0, 0
    # ``deadline`` on both clocks: an epoch waits for its children, which this process's CPU
    # seconds do not count, and one that ran on past the guard would leave the polish no time.
    while min(clock.seconds_until(deadline), deadline - time.perf_counter()) > max(0.5, epoch):
        began, began_wall = clock(), time.perf_counter()
        tasks = [child.task(search.current, search.cost, EPOCH_WINDOWS) for child in children]
        for _ in range(EPOCH_WINDOWS):
            # A window's full time, not what is left to the deadline: one cut short would part runs.
            search.step(math.inf, clock)
        best, waited_out = (search.current, search.cost), False
        for i, (child, task) in enumerate(zip(children, tasks)):
            results[i] = child.result(task, timeout=max(0.0, clock.seconds_until(math.inf)))
            if results[i] is None:  # the guard came first
                clock.mark("guard")
                waited_out = True
            elif results[i][1] < best[1]:
                best = results[i][:2]
        if waited_out:
            break
        if best[1] < search.cost:
            search.restart(best[0])
        # The first epoch waits for the children's last tasks from the weight search too: no
        # measure of the next.
        epochs += 1
        epoch = clock() - began if epochs == 1 else max(clock() - began, time.perf_counter() - began_wall)
        said()
    said()
    # A child whose epoch never came (the stage had no time for one) hands back its last task's.
    results = [got if got is not None else child.best() for got, child in zip(results, children)]
    if search.cut or any(r is not None and r[2].get("cut") for r in results):
        clock.mark("windows")
    inc.offer(search.current, "lns")
    for i, got in enumerate(results):
        if got is not None:
            log.info(f"lns (child {i}): {got[2]['windows']} windows, {got[2]['improved']} improved, "
                     f"{got[2]['restarts']} restarts, cost {got[1]:.6g}")
            inc.offer(got[0], "lns")
