"""mesh="auto": the mesh shape chosen with the plan."""

import pytest
import torch
from helpers import SHARDING_PROFILE, spy_on_starts

import autoshard
import autoshard.planning.shapebound as sb
from autoshard.models import llama
from autoshard.planning.meshsearch import coarsenings, may_start, mesh_shapes, next_to_bound, search_order
from autoshard.planning.overlap import additive_solve
from autoshard.plansummary import PlanSummary


def test_shapes_are_factorizations_with_the_inner_axis_in_a_node():
    assert mesh_shapes(8, 8) == [(8,), (2, 4), (4, 2), (2, 2, 2)]
    shapes = mesh_shapes(64, 8)
    assert shapes[0] == (64,) and (8, 8) in shapes and (2, 4, 8) in shapes
    assert (4, 2, 8) not in shapes  # the same as (2, 4, 8): both outer axes cross nodes
    assert (8, 16) not in shapes  # its inner axis (16) spans two nodes
    for s in mesh_shapes(512, 8):
        assert torch.Size(s).numel() == 512 and len(s) <= 3
    with pytest.raises(autoshard.ConfigError, match="max_axes: expected 1 to 4, found 5"):
        mesh_shapes(8, 8, max_axes=5)
    # 1-D first, then a whole node as the inner axis, fewer axes first
    assert search_order(mesh_shapes(64, 8), 8)[:3] == [(64,), (8, 8), (2, 4, 8)]


def test_shapes_are_bounded_fewest_axes_first_refining_the_best_coarse_shape():
    assert coarsenings((8, 2, 4)) == [(16, 4), (8, 8)]
    assert coarsenings((64,)) == []
    todo = [(2, 4, 8), (16, 4), (8, 2, 4), (4, 4, 4), (32, 2)]
    assert next_to_bound(todo, {}) == (16, 4)  # fewer axes first, then todo's order
    bounds = {(8, 8): 600.0, (16, 4): 702.0, (32, 2): 994.0}
    three = [(2, 4, 8), (4, 4, 4), (8, 2, 4), (2, 16, 2)]
    # (2, 4, 8) refines (8, 8) too: ties keep todo's order
    assert next_to_bound(three, bounds) == (2, 4, 8)
    assert next_to_bound(three[1:], bounds) == (8, 2, 4)  # refines (8, 8), before (4, 4, 4) of (16, 4)
    assert next_to_bound([(4, 4, 4), (2, 16, 2)], bounds) == (4, 4, 4)
    assert next_to_bound([(2, 16, 2), (4, 4, 4)], {}) == (2, 16, 2)  # nothing bounded: todo's order


def test_shapes_of_more_axes_start_once_their_order_is_informed():
    """2-D shapes all refine the one 1-D shape: they start while it is bounded. 3-D shapes refine
    different 2-D shapes: they wait while 2-D shapes run and none is bounded yet, and start
    (in the order the bounds known give) once one is."""
    two = [(8, 8), (16, 4), (32, 2)]
    three = [(2, 4, 8), (2, 8, 4), (8, 2, 4)]
    assert may_start(two + three, running={(64,)}, bounds={})
    assert not may_start(three, running={(8, 8), (16, 4)}, bounds={(64,): 1.0})
    assert may_start(three, running={(16, 4)}, bounds={(64,): 1.0, (8, 8): 2.0})
    assert may_start(three, running=set(), bounds={})  # nothing coarser runs
    assert may_start(three, running={(4, 4, 4)}, bounds={})  # as many axes: no order to wait for


def test_memory_free_optimum_that_fits_is_the_plan(world):
    world(4)
    model = llama("tiny", n_layers=2)
    tokens = torch.randint(0, 256, (8, 16))
    from autoshard.planning.planner import Planner

    mesh = autoshard.fake_mesh((2, 2), ("dp", "tp"))
    screened = Planner(model, (tokens,), mesh, profile=SHARDING_PROFILE, memory_budget=None, overlap_objective=False)
    free = screened.memory_free(time_limit=30)
    assert free.proved and free.fits and free.lower_bound <= free.cost
    plan = screened.solve()
    assert plan.solver["status"] == "optimal" and plan.solver["source"] == "pairwise"
    alone = autoshard.plan(model, (tokens,), mesh, profile=SHARDING_PROFILE, memory_budget=None,
                           overlap_objective=False)
    assert plan.summary["step_us"] == pytest.approx(alone.summary["step_us"], rel=1e-9)
    assert additive_solve(plan) == pytest.approx(free.cost / 1.0, rel=1e-9)


@pytest.mark.slow
def test_auto_mesh_plan_is_the_best_shape_and_lists_every_shape(world):
    world(8)
    with torch.device("meta"):
        model = llama("tiny", n_layers=2)
    tokens = torch.empty(8, 32, dtype=torch.long, device="meta")
    plan = autoshard.plan(model, (tokens,), "auto", ranks=8, profile=SHARDING_PROFILE, memory_budget=None,
                          time_limit=120)  # every shape proves in a second or two: none is skipped
    rows = plan.summary["mesh_search"]
    dpn = SHARDING_PROFILE.devices_per_node
    assert [tuple(r["shape"]) for r in rows] == search_order(mesh_shapes(8, dpn), dpn)
    chosen = [r for r in rows if r["outcome"] == "chosen"]
    assert len(chosen) == 1 and chosen[0]["shape"] == plan.mesh_shape
    assert plan.axis_names == [f"axis{k}" for k in range(len(plan.mesh_shape))]
    assert {r["outcome"] for r in rows} <= {"chosen", "planned", "pruned"}
    for r in rows:  # every shape planned on its own is no cheaper than the chosen one
        mesh = autoshard.fake_mesh(tuple(r["shape"]), tuple(f"axis{k}" for k in range(len(r["shape"]))))
        alone = autoshard.plan(model, (tokens,), mesh, profile=SHARDING_PROFILE, memory_budget=None, time_limit=30)
        assert plan.summary["step_us"] <= alone.summary["step_us"] * (1 + 1e-6), r
        if r["bound_us"] is not None:
            assert r["bound_us"] <= alone.summary["additive_us"] * (1 + 1e-6), r  # bounds the additive step
    from autoshard.explain import explain

    assert "mesh search: 4 shapes" in explain(plan)
    again = autoshard.Plan.from_json(plan.to_json())
    assert again.summary["mesh_search"] == rows
    with pytest.raises(autoshard.ConfigError, match="'auto' with ranks=N"):
        autoshard.plan(model, (tokens,), "auto")
    with pytest.raises(autoshard.ConfigError, match="ranks=8 is for mesh='auto'"):
        autoshard.plan(model, (tokens,), autoshard.fake_mesh((8,), ("dp",)), ranks=8)


def test_shapes_bounded_in_worker_processes_as_here(world, monkeypatch):
    """Forked workers bound shapes (build, memory-free optimum) exactly as this process does:
    the same bounds, outcomes and answer."""
    import autoshard.planning.meshsearch as ms

    world(8)
    with torch.device("meta"):
        model = llama("tiny", n_layers=2)
    tokens = torch.empty(8, 32, dtype=torch.long, device="meta")

    def search(workers):
        monkeypatch.setattr(ms, "bounding_workers", lambda shapes: workers)
        plan = autoshard.plan(model, (tokens,), "auto", ranks=8, profile=SHARDING_PROFILE, memory_budget=None,
                              time_limit=120)
        return plan, [(r["shape"], r["outcome"], r["bound_us"]) for r in plan.summary["mesh_search"]]

    forked, rows = search(2)
    here, rows_here = search(1)
    assert rows == rows_here and forked.mesh_shape == here.mesh_shape
    assert forked.summary["step_us"] == here.summary["step_us"]
    assert all(bound is not None for _, outcome, bound in rows if outcome != "skipped")


def _memory_binding_search(world, monkeypatch, held: int):
    """A search of 4 ranks where memory binds, (2, 2) bounded in a forked worker that keeps up to
    ``held`` planners: the plan, its rows by shape, the starts of every solve here, and the mesh
    shapes of the planners built here."""
    import autoshard.planning.meshsearch as ms
    from autoshard.planning.planner import Planner

    world(4)
    model = llama("tiny", n_layers=2)
    tokens = torch.randint(0, 256, (8, 16))
    free = Planner(model, (tokens,), autoshard.fake_mesh((2, 2), ms.axis_names(2)), profile=SHARDING_PROFILE,
                   memory_budget=None).solve()
    monkeypatch.setattr(ms, "bounding_workers", lambda shapes: 2)
    monkeypatch.setattr(sb, "HELD_PER_WORKER", held)
    built: list[tuple[int, ...]] = []
    init = Planner.__init__

    def counted(self, model, inputs, mesh, *args, **kwargs):
        built.append(tuple(mesh.shape))  # in this process only: a forked worker appends to its copy
        init(self, model, inputs, mesh, *args, **kwargs)

    monkeypatch.setattr(Planner, "__init__", counted)
    given = spy_on_starts(monkeypatch)  # the workers' solves append to their own copies
    plan = autoshard.plan(model, (tokens,), "auto", ranks=4, profile=SHARDING_PROFILE, time_limit=60,
                          memory_budget=free.summary["peak_mem_bytes"] * 0.9)  # memory binds
    return plan, {tuple(r["shape"]): r for r in plan.summary["mesh_search"]}, given, built


def test_a_shape_is_solved_in_the_worker_that_bounded_it(world, monkeypatch):
    """The worker that bounded a shape keeps its planner: the shape's solve (or its plan's assembly)
    runs there, nothing built again here (LLaMA-70B on a 3-D mesh: 3 s of a 10 s solve)."""
    import solver

    plan, rows, given, built = _memory_binding_search(world, monkeypatch, held=3)
    assert rows[(2, 2)]["outcome"] in ("chosen", "planned") and rows[(2, 2)]["step_us"] is not None
    assert rows[(2, 2)]["note"] in {s.value for s in solver.Status}  # solved (its note: the solve's status)
    assert (2, 2) not in built, built  # traced once, the 1-D shape bounded here; (2, 2) never
    assert not any(n.startswith("bounding: ") for names in given for n in names)


def test_a_workers_plans_start_the_shapes_solve_here(world, monkeypatch):
    """A worker that dropped a shape's planner (here: it keeps none) sends what it found (the
    memory-free optimum, the hand-written plans where memory binds) as int32 choices: they
    start every solve of the shape built again here (its hand-written plans' too)."""
    plan, rows, given, built = _memory_binding_search(world, monkeypatch, held=0)
    assert rows[(2, 2)]["outcome"] in ("chosen", "planned")
    assert (2, 2) in built
    hinted = [names for names in given if any(n.startswith("bounding: ") for n in names)]
    assert hinted, given  # the shape built again here started from its worker's plans
    assert any("bounding: hand-written plan" in names for names in hinted)


def test_no_bounding_workers_beside_a_real_process_group(tmp_path, monkeypatch):
    """Under torchrun (a real process group) shapes are bounded in this process: a forked child
    must not join the group's collectives, which making a mesh does."""
    import importlib

    import torch.distributed as dist

    import autoshard.planning.meshsearch as ms

    monkeypatch.setattr(importlib.import_module("solver.solve"), "cores", lambda: 8)
    if dist.is_initialized():
        dist.destroy_process_group()
    assert ms.bounding_workers(6) == 4  # no group yet: the fake one the search makes
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert ms.bounding_workers(6) == 1
    finally:
        dist.destroy_process_group()


class _ScriptedPlanner:
    """A planner whose shapes bound and solve by script, on the search's own clock: a bound
    takes 20 s, memory binds every shape (no memory-free optimum fits), a plan costs 1.5x its
    bound and each solve records the time it was given."""

    clock = [0.0]
    solves: list = []

    def __init__(self, model, example_inputs, mesh, options=None, traced=None):
        from autoshard.options import PlanOptions
        from costmodel import load_profile

        self.shape, self.traced, self.built = tuple(mesh.shape), "traced", None
        self.profile = load_profile("h100-sxm")
        self.options = options or PlanOptions(overlap_objective=False)

    def overlap_free(self, time_limit=60.0):
        raise AssertionError("scripted searches plan on the additive objective (overlap_objective=False)")

    def hand_written(self, time_limit, additive_floor_us=0.0, compute_floor_us=0.0, below=float("inf")):
        return None

    def known_choices(self):
        return []

    def hint(self, choices):
        pass

    def bound(self) -> float:
        return {1: 900.0, 2: 500.0, 3: 400.0}[len(self.shape)] + self.shape[0]

    def cheapest_bound(self):
        return 0.0

    def memory_free(self, time_limit):
        from types import SimpleNamespace

        self.clock[0] += 20.0
        return SimpleNamespace(lower_bound=self.bound(), cost=self.bound(), proved=True, fits=False)

    def solve(self, time_limit):
        from types import SimpleNamespace

        self.solves.append((self.shape, time_limit))
        self.clock[0] += 5.0  # the stall rule ends it early
        return SimpleNamespace(summary=PlanSummary(step_us=1.5 * self.bound(), peak_mem_bytes=1,
                                                   overlap={"additive_us": 1.5 * self.bound()}),
                               solver={"status": "heuristic", "bound": None})


def test_where_memory_binds_bounding_stops_at_half_and_two_shapes_share_the_solve_time(world, monkeypatch):
    """Where memory binds, a bound says little of a plan (LLaMA-70B: plans 25-35% above), so the
    bounding stops at BOUND_SHARE_BINDING of the limit; the lowest bound is solved with half the
    time left, as another shape is worth solving after it, not an equal share with every shape
    its plan may prune; the next, the last worth solving, gets all that is left."""
    from types import SimpleNamespace

    import autoshard.planning.meshsearch as ms
    from autoshard.options import PlanOptions

    world(8)
    monkeypatch.setattr(ms, "bounding_workers", lambda shapes: 1)
    monkeypatch.setattr(ms, "time", SimpleNamespace(perf_counter=lambda: _ScriptedPlanner.clock[0]))
    monkeypatch.setattr(sb, "time", SimpleNamespace(perf_counter=lambda: _ScriptedPlanner.clock[0]))
    _ScriptedPlanner.clock[0], _ScriptedPlanner.solves = 0.0, []
    assert mesh_shapes(8, 8) == [(8,), (2, 4), (4, 2), (2, 2, 2)]
    plan = ms.search(None, (), 8, PlanOptions(time_limit=100.0, overlap_objective=False), _ScriptedPlanner)
    rows = {tuple(r["shape"]): r for r in plan.summary["mesh_search"]}
    # bounded at 20, 40 (the 2-D shapes' cost is known: 20 s > 50 - 40 left), the 3-D one at 60
    assert rows[(4, 2)]["outcome"] == "skipped" and "50 s of time_limit, memory binding" in rows[(4, 2)]["note"]
    # The lowest bound is solved first and leaves time for the next: (2, 4) and (8,) may follow.
    first, seconds = _ScriptedPlanner.solves[0]
    assert first == (2, 2, 2) and ms.MIN_SHAPE_SOLVE_SECONDS <= seconds < 100.0 - 60.0
    assert rows[(2, 2, 2)]["outcome"] == "chosen"
    # then the next bound with all its solve left (its stall rule ended it after 5 s): (2, 4), bound
    # 502 < 1.5 * 402, is the last worth solving ((8,)'s bound 908 is above that plan)
    # The last shape worth solving gets all that is left, more than the first's share.
    assert _ScriptedPlanner.solves[1][0] == (2, 4) and _ScriptedPlanner.solves[1][1] > seconds
    assert len(_ScriptedPlanner.solves) == 2
    assert rows[(8,)]["outcome"] == "pruned"


class _FittingPlanner(_ScriptedPlanner):
    """Every shape's memory-free optimum is proved and fits (it is the shape's plan), and the
    plans' predicted (simulated) steps order the shapes otherwise than their additive costs."""

    additive = {(8,): 900.0, (2, 4): 500.0, (4, 2): 520.0, (2, 2, 2): 510.0}
    simulated = {(8,): 880.0, (2, 4): 470.0, (4, 2): 430.0, (2, 2, 2): 505.0}

    def __init__(self, model, example_inputs, mesh, options=None, traced=None):
        super().__init__(model, example_inputs, mesh, options, traced)
        from types import SimpleNamespace

        self.built = SimpleNamespace(shape=self.shape)

    def memory_free(self, time_limit=None, found=None):
        from types import SimpleNamespace

        self.clock[0] += 1.0
        cost = self.additive[self.shape]
        return SimpleNamespace(lower_bound=cost, cost=cost, proved=True, fits=True, peak_usage=1.0,
                               choice=self.shape)

    def solve(self, time_limit):
        from types import SimpleNamespace

        self.solves.append((self.shape, time_limit))
        step = self.simulated[self.shape]
        return SimpleNamespace(summary=PlanSummary(step_us=step, peak_mem_bytes=1,
                                                   overlap={"additive_us": self.additive[self.shape]}),
                               solver={"status": "optimal", "bound": self.additive[self.shape]})


def _search_fitting(world, monkeypatch, planner_cls):
    """A search of 8 ranks with ``planner_cls`` (a :class:`_FittingPlanner`): the plan and its
    table by shape."""
    from types import SimpleNamespace

    import autoshard.planning.meshsearch as ms
    from autoshard.options import PlanOptions

    world(8)
    monkeypatch.setattr(ms, "bounding_workers", lambda shapes: 1)
    monkeypatch.setattr(ms, "time", SimpleNamespace(perf_counter=lambda: _FittingPlanner.clock[0]))
    monkeypatch.setattr(sb, "time", SimpleNamespace(perf_counter=lambda: _FittingPlanner.clock[0]))
    monkeypatch.setattr(sb, "simulate_plan",
                        lambda built, choice, eta: SimpleNamespace(step_us=_FittingPlanner.simulated[choice]))
    _FittingPlanner.clock[0], _FittingPlanner.solves = 0.0, []
    plan = ms.search(None, (), 8, PlanOptions(time_limit=100.0, overlap_objective=False), planner_cls)
    return plan, {tuple(r["shape"]): r for r in plan.summary["mesh_search"]}


def test_shapes_whose_plan_the_bounding_found_are_chosen_by_predicted_step(world, monkeypatch):
    """A proved memory-free optimum that fits is the shape's plan alone; shapes are compared by
    its predicted (simulated) step, not pruned by the additive objective the bounds are on: (4, 2)
    costs more than (2, 4) additively, yet is predicted faster, and is the answer."""
    plan, rows = _search_fitting(world, monkeypatch, _FittingPlanner)
    assert plan.summary["step_us"] == 430.0 and rows[(4, 2)]["outcome"] == "chosen"
    assert {s: r["outcome"] for s, r in rows.items() if s != (4, 2)} == {(8,): "planned", (2, 4): "planned",
                                                                         (2, 2, 2): "planned"}
    assert rows[(2, 4)]["step_us"] == 470.0 and rows[(2, 4)]["bound_us"] == 500.0
    # bounded here, every planner is kept: only the chosen shape's plan is assembled, once
    assert [shape for shape, _ in _FittingPlanner.solves] == [(4, 2)]


class _FittingHandPlanner(_FittingPlanner):
    """As :class:`_FittingPlanner`, and (2, 4)'s hand-written plan is predicted at 400, below
    its memory-free optimum's 470 and (4, 2)'s 430: planned alone, (2, 4)'s plan is that one."""

    hand = {(2, 4): 400.0}
    asked: list = []

    def cheapest_bound(self):
        return 10.0 * len(self.shape)

    def hand_written(self, time_limit, additive_floor_us=0.0, compute_floor_us=0.0, below=float("inf")):
        from types import SimpleNamespace

        self.asked.append((self.shape, additive_floor_us, compute_floor_us, below))
        step = self.hand.get(self.shape)
        if step is None or step >= below:
            return None
        return "fsdp", SimpleNamespace(step_us=step)

    def solve(self, time_limit):
        plan = super().solve(time_limit)
        if self.shape in self.hand:  # Planner.solve adopts the faster hand-written plan
            plan.summary["step_us"] = self.hand[self.shape]
        return plan


def test_a_fitting_shapes_hand_written_plan_predicted_faster_is_its_plan(world, monkeypatch):
    """Planned alone, a shape whose memory-free optimum fits gets the hand-written plan where one
    is predicted faster (``Planner.solve`` weighs them): the search weighs them too, so its
    answer is no slower than any shape planned alone."""
    _FittingHandPlanner.asked = []
    plan, rows = _search_fitting(world, monkeypatch, _FittingHandPlanner)
    assert plan.summary["step_us"] == 400.0 and rows[(2, 4)]["outcome"] == "chosen"
    assert "hand-written fsdp: its plan" in rows[(2, 4)]["note"]
    assert rows[(4, 2)]["step_us"] == 430.0
    # Bounded by the shape's compute alone (an additive bound does not bound a step the buckets
    # price), below the least of its optimum's step and the best plan of every shape bounded
    # before it: 880 for (8,), then (2, 4)'s hand-written 400.
    assert _FittingHandPlanner.asked[:4] == [((8,), 10.0, 10.0, 880.0), ((2, 4), 20.0, 20.0, 470.0),
                                             ((4, 2), 20.0, 20.0, 400.0), ((2, 2, 2), 30.0, 30.0, 400.0)]


class _HandWrittenPlanner(_ScriptedPlanner):
    """Memory binds every shape; each shape's best hand-written plan is predicted at ``hand``."""

    hand = {(8,): 2000.0, (2, 4): 800.0, (4, 2): 300.0, (2, 2, 2): 700.0}

    def hand_written(self, time_limit, additive_floor_us=0.0, compute_floor_us=0.0, below=float("inf")):
        from types import SimpleNamespace

        # While bounding: the shape's additive and compute bounds (cheapest: 0 here), which bound
        # every plan's predicted step; the chosen one's, assembled at the end, asks with none.
        assert (additive_floor_us, compute_floor_us) == (self.bound(), 0.0) or \
            (additive_floor_us, below) == (0.0, float("inf"))
        step = self.hand[self.shape]
        plan = SimpleNamespace(summary=PlanSummary(step_us=step, peak_mem_bytes=2), solver={"source": "fsdp"},
                               mesh_shape=list(self.shape))
        return "fsdp", SimpleNamespace(step_us=step, plan=plan)


def _search_scripted(monkeypatch, planner, overlap_objective=False, ranks=8, time_limit=200.0, **options):
    """A search of ``ranks`` by ``planner`` (a :class:`_HandWrittenPlanner`) on its own clock, in
    one process: the plan and its table's rows by shape."""
    from types import SimpleNamespace

    import autoshard.planning.meshsearch as ms
    from autoshard.options import PlanOptions

    monkeypatch.setattr(ms, "bounding_workers", lambda shapes: 1)
    monkeypatch.setattr(ms, "time", SimpleNamespace(perf_counter=lambda: _HandWrittenPlanner.clock[0]))
    monkeypatch.setattr(sb, "time", SimpleNamespace(perf_counter=lambda: _HandWrittenPlanner.clock[0]))
    monkeypatch.setattr(sb, "hand_written_plan", lambda name, seed: seed.plan)
    _HandWrittenPlanner.clock[0], _HandWrittenPlanner.solves = 0.0, []
    plan = ms.search(None, (), ranks, PlanOptions(time_limit=time_limit, **options,
                                                  overlap_objective=overlap_objective), planner)
    return plan, {tuple(r["shape"]): r for r in plan.summary["mesh_search"]}


class _HidingPlanner(_ScriptedPlanner):
    """Memory binds every shape; a plan costs 1.5x its shape's bound additively, and hides much of
    that: its predicted step (``steps``) lies far below, and orders the shapes otherwise."""

    bounds = {(8,): 908.0, (2, 4): 620.0, (4, 2): 504.0, (2, 2, 2): 402.0}
    steps = {(8,): 900.0, (2, 4): 350.0, (4, 2): 453.6, (2, 2, 2): 361.8}

    def bound(self) -> float:
        return self.bounds[self.shape]

    def solve(self, time_limit):
        plan = super().solve(time_limit)
        plan.summary["step_us"] = self.steps[self.shape]
        return plan


@pytest.mark.parametrize("overlap_objective", [False, True])
def test_additive_bounds_prune_only_on_the_additive_objective(world, monkeypatch, overlap_objective):
    """(2, 4)'s bound, 620 additive, lies above (2, 2, 2)'s plan's additive cost, 603: on the
    additive objective it is pruned by it. With the overlap objective shapes are chosen by
    predicted step, which an additive bound does not bound: (2, 4) is pruned only where its bound's
    step floor (0.55 x 620 = 341 at eta 0.9) is not below the best step found (361.8); it is not,
    and (2, 4) is solved and chosen at 350."""
    world(8)
    plan, rows = _search_scripted(monkeypatch, _HidingPlanner, overlap_objective=overlap_objective)
    if overlap_objective:
        assert rows[(2, 4)]["outcome"] == "chosen" and plan.summary["step_us"] == 350.0
    else:
        assert rows[(2, 4)]["outcome"] == "pruned" and "bound 0.620 ms >= best 0.603 ms" in rows[(2, 4)]["note"]
        assert rows[(2, 2, 2)]["outcome"] == "chosen"
    assert rows[(8,)]["outcome"] == "pruned"


class _RefiningPlanner(_HandWrittenPlanner):
    """16 ranks: (2, 8)'s plan is the best of the 2-D shapes; (4, 2, 2) refines only (8, 2) and
    (4, 4), whose plans are 67% and 200% slower."""

    hand = {(16,): 5000.0, (2, 8): 300.0, (4, 4): 500.0, (8, 2): 900.0, (2, 2, 4): 290.0, (2, 4, 2): 700.0,
            (4, 2, 2): 250.0}


def test_shapes_that_refine_only_slow_shapes_are_not_bounded(world, monkeypatch):
    """A shape of k axes is not bounded where every shape of k - 1 axes it refines has a plan at
    least 1 + mesh_margin times the best of them (a refinement lays out its coarser shapes' plans
    and mixes them; the best came within 2% of its best coarser shape's); mesh_margin=None bounds
    every shape, here finding the (contrived) faster one."""
    from types import SimpleNamespace

    import autoshard.planning.meshsearch as ms
    from autoshard.options import PlanOptions

    world(16)
    monkeypatch.setattr(ms, "bounding_workers", lambda shapes: 1)
    monkeypatch.setattr(ms, "time", SimpleNamespace(perf_counter=lambda: _HandWrittenPlanner.clock[0]))
    monkeypatch.setattr(sb, "time", SimpleNamespace(perf_counter=lambda: _HandWrittenPlanner.clock[0]))
    monkeypatch.setattr(sb, "hand_written_plan", lambda name, seed: seed.plan)

    def search(margin):
        _HandWrittenPlanner.clock[0], _HandWrittenPlanner.solves = 0.0, []
        plan = ms.search(None, (), 16, PlanOptions(time_limit=1000.0, mesh_margin=margin,
                                                     overlap_objective=False), _RefiningPlanner)
        return plan, {tuple(r["shape"]): r for r in plan.summary["mesh_search"]}

    plan, rows = search(0.25)
    assert rows[(4, 2, 2)]["outcome"] == "skipped" and rows[(4, 2, 2)]["bound_us"] is None
    assert "the shapes it refines are slow: 8x2 has plans predicted at least 0.900 ms, 200% slower than the " \
        "best of 2 axes (0.300 ms); 4x4 has plans predicted at least 0.500 ms, 67% slower" in rows[(4, 2, 2)]["note"]
    assert rows[(2, 4, 2)]["bound_us"] is not None  # refines (2, 8), the best
    assert plan.mesh_shape == [2, 2, 4] and plan.summary["step_us"] == 290.0
    plan, rows = search(None)
    assert rows[(4, 2, 2)]["bound_us"] is not None
    assert plan.mesh_shape == [4, 2, 2] and plan.summary["step_us"] == 250.0
    with pytest.raises(autoshard.ConfigError, match="mesh_margin: expected a share >= 0"):
        PlanOptions(mesh_margin=-0.1)


def test_where_memory_binds_a_shapes_hand_written_plan_competes(world, monkeypatch):
    """Planned alone where memory binds, a shape's plan is the least predicted of its solve and
    its hand-written plans, which may overlap far more than the additive bound says: the search
    times them while bounding, and one predicted faster than every solve is the answer, its
    shape's row planned though its bound pruned its solve."""
    world(8)
    plan, rows = _search_scripted(monkeypatch, _HandWrittenPlanner, mesh_margin=None)
    assert plan.summary["step_us"] == 300.0 and rows[(4, 2)]["outcome"] == "chosen"
    assert rows[(4, 2)]["bound_us"] == 504.0 and "hand-written fsdp" in rows[(4, 2)]["note"]
    # Solved best hand-written plan first (its solve starts from it), while bounded below the best
    # additive step (1.5 x 402 = 603 for (2, 2, 2)); (8,), bounded at 908, is not, and keeps its
    # hand-written plan.
    # Neither solve found a plan faster than (4, 2)'s hand-written one: two solves in a row that
    # pay nothing end the solves (the search's stall rule), so (2, 4) is not solved.
    assert [shape for shape, _ in _HandWrittenPlanner.solves] == [(4, 2), (2, 2, 2)]
    assert rows[(2, 2, 2)]["step_us"] == 603.0
    assert rows[(2, 4)]["step_us"] == 800.0 and "not solved: the last 2 solves found no plan 0.1% faster than " \
        "the best (the search's stall rule)" in rows[(2, 4)]["note"]
    assert rows[(8,)]["outcome"] == "planned" and rows[(8,)]["step_us"] == 2000.0
    assert "not solved: bound 0.908 ms >= best 0.603 ms" in rows[(8,)]["note"]


class _PayingPlanner(_HandWrittenPlanner):
    """As :class:`_HandWrittenPlanner`, but (2, 2, 2)'s solve finds the fastest plan."""

    steps = {(8,): 3000.0, (4, 2): 310.0, (2, 2, 2): 280.0, (2, 4): 290.0}

    def solve(self, time_limit):
        plan = super().solve(time_limit)
        plan.summary["step_us"] = self.steps[self.shape]
        return plan


def test_a_solve_that_pays_restarts_the_stall_count(world, monkeypatch):
    """The solves end once as many in a row as run at once (two at least) paid nothing: (4, 2)'s
    did not, (2, 2, 2)'s did (280 against 300), so (2, 4) is solved after them (its floor, 0.55 x
    502, is below 280)."""
    world(8)
    plan, rows = _search_scripted(monkeypatch, _PayingPlanner, mesh_margin=None)
    assert [shape for shape, _ in _HandWrittenPlanner.solves] == [(4, 2), (2, 2, 2), (2, 4)]
    assert rows[(2, 2, 2)]["outcome"] == "chosen" and plan.summary["step_us"] == 280.0
    assert rows[(2, 4)]["step_us"] == 290.0


class _OutOfTimePlanner(_HandWrittenPlanner):
    """As :class:`_HandWrittenPlanner`, but (2, 2, 2)'s solve finds no plan that fits in its time."""

    def solve(self, time_limit):
        from autoshard.errors import MemoryBudgetError

        if self.shape == (2, 2, 2):
            self.solves.append((self.shape, time_limit))
            raise MemoryBudgetError("no plan within the memory budget was found in the time its solve had",
                                    budget_bytes=10, min_feasible_bytes=5)
        return super().solve(time_limit)


def test_a_shape_whose_solve_finds_nothing_in_time_keeps_its_hand_written_plan(world, monkeypatch):
    """A solve that finds no plan fitting the budget in its time leaves its shape planned by its
    hand-written plan, which fits (the row says so), not infeasible; a faster shape still wins."""
    world(8)
    plan, rows = _search_scripted(monkeypatch, _OutOfTimePlanner, mesh_margin=None)
    assert (2, 2, 2) in [shape for shape, _ in _HandWrittenPlanner.solves]
    row = rows[(2, 2, 2)]
    assert row["outcome"] == "planned" and row["step_us"] == 700.0
    assert "its solve found none faster that fits: no plan within the memory budget" in row["note"]
    assert rows[(4, 2)]["outcome"] == "chosen" and plan.summary["step_us"] == 300.0


class _NearHandWrittenPlanner(_HandWrittenPlanner):
    hand = {**_HandWrittenPlanner.hand, (2, 4): 360.0}


class _MarginPlanner(_HandWrittenPlanner):
    hand = {**_HandWrittenPlanner.hand, (2, 4): 650.0}


def test_shapes_whose_plan_is_mesh_margin_slower_than_the_best_are_not_solved(world, monkeypatch):
    """A solve starts from its shape's hand-written plan and gains a few percent on it: a shape
    whose plan is predicted mesh_margin (25%) slower than the best found is not solved ((2, 4) at
    650 against (4, 2)'s 300), unless it refines the best shape ((2, 2, 2), at 700: it lays out
    (4, 2)'s plans, which its own hand-written plans do not); mesh_margin=None leaves it to the
    rest."""
    world(8)
    plan, rows = _search_scripted(monkeypatch, _MarginPlanner)
    assert plan.summary["step_us"] == 300.0 and rows[(4, 2)]["outcome"] == "chosen"
    assert [shape for shape, _ in _HandWrittenPlanner.solves] == [(4, 2), (2, 2, 2)]
    assert rows[(2, 4)]["outcome"] == "planned" and rows[(2, 4)]["step_us"] == 650.0
    assert "its plan is predicted 0.650 ms, 117% slower than the best found (0.300 ms; mesh_margin=0.25" \
        in rows[(2, 4)]["note"]
    plan, rows = _search_scripted(monkeypatch, _MarginPlanner, mesh_margin=None)
    # Not left out by the margin: (2, 4) is solved second, by its plan; neither solve paid, and the
    # stall rule ends the solves before (2, 2, 2).
    assert [shape for shape, _ in _HandWrittenPlanner.solves] == [(4, 2), (2, 4)]
    assert "mesh_margin" not in rows[(2, 2, 2)]["note"] and "stall rule" in rows[(2, 2, 2)]["note"]


class _FastHandWrittenPlanner(_HandWrittenPlanner):
    hand = {**_HandWrittenPlanner.hand, (4, 2): 100.0}


def test_shapes_whose_bounds_say_no_plan_beats_the_best_found_are_not_solved(world, monkeypatch):
    """A step hides at most the overlap share of the smaller of its compute and communication
    (simulate.step_floor): with (4, 2)'s hand-written plan at 100, (2, 2, 2) and (2, 4), bounded
    at 402 and 502 additive with compute that may be nil, are predicted at least 0.55 x that
    (eta 0.9): above 100, so neither is solved, though both bound below every additive plan."""
    world(8)
    plan, rows = _search_scripted(monkeypatch, _FastHandWrittenPlanner)
    assert plan.summary["step_us"] == 100.0 and rows[(4, 2)]["outcome"] == "chosen"
    assert [shape for shape, _ in _HandWrittenPlanner.solves] == [(4, 2)]
    assert "predicted at least 0.221 ms (its bounds) >= 0.100 ms" in rows[(2, 2, 2)]["note"]
    assert "predicted at least 0.276 ms" in rows[(2, 4)]["note"]


def test_step_floor_bounds_every_split_of_compute_and_communication():
    """step_floor(A, L, eta) <= C + M - eta * min(C, M) for every C >= L, C + M >= A, and some
    such split meets it."""
    import numpy as np

    from autoshard.planning.simulate import step_floor

    rng = np.random.default_rng(0)
    for _ in range(200):
        a, eta = rng.uniform(1, 100), rng.uniform(0, 1)
        low = rng.uniform(0, a)
        floor = step_floor(a, low, eta)
        c = rng.uniform(low, 2 * a, 500)
        m = np.maximum(a - c, 0) + rng.uniform(0, a, 500) * (rng.random(500) < 0.5)
        assert np.all(c + m - eta * np.minimum(c, m) >= floor - 1e-9)
        best_c = max(low, a / 2)
        assert best_c + (a - best_c) - eta * min(best_c, a - best_c) == pytest.approx(floor)
    assert step_floor(100.0, 30.0, 0.9) == pytest.approx(55.0)  # compute may be half: (1 - eta / 2) A
    assert step_floor(100.0, 80.0, 0.9) == pytest.approx(0.1 * 100 + 0.9 * 80)  # at least 80 of it is


class _RestartPlanner(_HandWrittenPlanner):
    """16 ranks: hand-written plans within 10% of each other; solves that pay nothing, pay, then
    pay nothing twice."""

    hand = {(16,): 5000.0, (2, 8): 300.0, (4, 4): 305.0, (8, 2): 310.0, (2, 2, 4): 315.0, (2, 4, 2): 320.0,
            (4, 2, 2): 325.0}
    steps = {(2, 8): 310.0, (4, 4): 280.0, (8, 2): 320.0, (2, 2, 4): 330.0, (2, 4, 2): 340.0, (4, 2, 2): 350.0}

    def solve(self, time_limit):
        plan = super().solve(time_limit)
        plan.summary["step_us"] = self.steps[self.shape]
        return plan


def test_the_stall_count_starts_over_after_a_solve_that_pays(world, monkeypatch):
    """(2, 8)'s solve pays nothing (1), (4, 4)'s pays (0 again, not still 1), (8, 2)'s and
    (2, 2, 4)'s pay nothing (1, 2): four solves, where a count that only skipped paying solves would
    have stopped after three."""
    world(16)
    plan, rows = _search_scripted(monkeypatch, _RestartPlanner, ranks=16, time_limit=1000.0)
    assert [shape for shape, _ in _HandWrittenPlanner.solves] == [(2, 8), (4, 4), (8, 2), (2, 2, 4)]
    assert rows[(4, 4)]["outcome"] == "chosen" and plan.summary["step_us"] == 280.0
    assert "not solved: the last 2 solves found no plan 0.1% faster" in rows[(2, 4, 2)]["note"]


class _FamiliesPlanner(_HandWrittenPlanner):
    """32 ranks: (4, 8)'s hand-written plan is the best; (4, 2, 4) and (4, 4, 2) split its inner
    axis, with hand-written plans near it, and their solves pay nothing; (2, 2, 8) splits its outer
    axis, with a hand-written plan 40% slower, and its solve finds the fastest plan."""

    hand = {(32,): 5000.0, (4, 8): 300.0, (8, 4): 330.0, (16, 2): 340.0, (2, 2, 8): 420.0, (2, 4, 4): 350.0,
            (2, 8, 2): 360.0, (4, 2, 4): 310.0, (4, 4, 2): 315.0, (8, 2, 2): 365.0}
    steps = {(4, 8): 290.0, (4, 2, 4): 300.0, (4, 4, 2): 305.0, (2, 2, 8): 250.0}

    def solve(self, time_limit):
        plan = super().solve(time_limit)
        plan.summary["step_us"] = self.steps.get(self.shape, 1.5 * self.bound())
        return plan


def test_refinements_of_the_best_shape_are_solved_in_turn_by_the_axis_they_split(world, monkeypatch):
    """After (4, 8), the refinements of it take their turns by the axis of it they split: (4, 2, 4)
    (its inner axis), then (2, 2, 8) (its outer axis: not left out by mesh_margin, though its
    hand-written plan is 40% slower, as it lays out (4, 8)'s plans), then (4, 4, 2); by their
    hand-written plans alone (4, 4, 2) came before (2, 2, 8), and two solves that paid nothing ended
    the search before it."""
    world(32)
    plan, rows = _search_scripted(monkeypatch, _FamiliesPlanner, ranks=32, time_limit=400.0)
    solved = [shape for shape, _ in _HandWrittenPlanner.solves]
    assert solved[:3] == [(4, 8), (4, 2, 4), (2, 2, 8)]
    assert rows[(2, 2, 8)]["outcome"] == "chosen" and plan.summary["step_us"] == 250.0


class _SideBySidePlanner(_HandWrittenPlanner):
    """As :class:`_HandWrittenPlanner`; its first two solves meet at a barrier shared by the
    forked workers (they run at once, or the barrier breaks) and report their cores."""

    hand = _NearHandWrittenPlanner.hand
    barrier = None
    count = None
    cores = None

    def bound(self) -> float:
        # (2, 2, 2)'s bounds put every plan of it above (4, 2)'s: two shapes to solve, not three.
        return {1: 900.0, 2: 500.0, 3: 700.0}[len(self.shape)] + self.shape[0]

    def solve(self, time_limit):
        import os

        with self.count.get_lock():
            self.count.value += 1
            k = self.count.value
        if k <= 2:
            self.barrier.wait(timeout=60)
            self.cores[k - 1] = len(os.sched_getaffinity(0))
        return super().solve(time_limit)


def test_shapes_kept_by_different_workers_are_solved_side_by_side_on_a_core_each(world, monkeypatch):
    """The solves run where the shapes' planners are kept, two at once where two workers keep
    them, each on one core where there are two (its search's children too)."""
    import multiprocessing
    import os
    from types import SimpleNamespace

    import autoshard.planning.meshsearch as ms
    from autoshard.options import PlanOptions

    world(8)
    ctx = multiprocessing.get_context("fork")
    monkeypatch.setattr(_SideBySidePlanner, "barrier", ctx.Barrier(2))
    monkeypatch.setattr(_SideBySidePlanner, "count", ctx.Value("i", 0))
    monkeypatch.setattr(_SideBySidePlanner, "cores", ctx.Array("i", 2))
    monkeypatch.setattr(ms, "bounding_workers", lambda shapes: 2)
    monkeypatch.setattr(ms, "time", SimpleNamespace(perf_counter=lambda: _HandWrittenPlanner.clock[0]))
    monkeypatch.setattr(sb, "time", SimpleNamespace(perf_counter=lambda: _HandWrittenPlanner.clock[0]))
    monkeypatch.setattr(sb, "hand_written_plan", lambda name, seed: seed.plan)
    _HandWrittenPlanner.clock[0] = 0.0
    plan = ms.search(None, (), 8, PlanOptions(time_limit=200.0, overlap_objective=False), _SideBySidePlanner)
    rows = {tuple(r["shape"]): r for r in plan.summary["mesh_search"]}
    assert plan.summary["step_us"] == 300.0 and rows[(4, 2)]["outcome"] == "chosen"
    # (4, 2) and (2, 4), bounded by the two workers at once, solved at once (else the barrier
    # breaks and the search fails); (2, 2, 2)'s bounds leave it nothing to give.
    assert _SideBySidePlanner.count.value == 2 and rows[(2, 4)]["note"] == "heuristic"
    one = 1 if len(os.sched_getaffinity(0)) >= 2 else len(os.sched_getaffinity(0))
    assert list(_SideBySidePlanner.cores) == [one, one]
    assert "every plan of it is predicted at least" in rows[(2, 2, 2)]["note"]


def test_a_shape_refining_only_shapes_bounded_far_above_the_least_is_not_bounded(world, monkeypatch):
    """A coarse shape bounded without a plan (no hand-written plan fits, say) counts as slow where
    its bound is 1 + mesh_margin times the least bound of its axes, though the floor of its plans
    (0.55 x 650) is not that far above the best plan: (4, 2, 2) refines (8, 2), planless and bounded
    29% above (2, 8), and (4, 4), whose plan is 67% slower than the best."""
    from types import SimpleNamespace

    import autoshard.planning.meshsearch as ms
    from autoshard.options import PlanOptions

    class Planless(_RefiningPlanner):
        def bound(self):
            return {(8, 2): 650.0}.get(self.shape, super().bound())

        def hand_written(self, time_limit, additive_floor_us=0.0, compute_floor_us=0.0, below=float("inf")):
            return None if self.shape == (8, 2) else super().hand_written(time_limit, additive_floor_us,
                                                                          compute_floor_us, below)

    world(16)
    monkeypatch.setattr(ms, "bounding_workers", lambda shapes: 1)
    monkeypatch.setattr(ms, "time", SimpleNamespace(perf_counter=lambda: _HandWrittenPlanner.clock[0]))
    monkeypatch.setattr(sb, "time", SimpleNamespace(perf_counter=lambda: _HandWrittenPlanner.clock[0]))
    monkeypatch.setattr(sb, "hand_written_plan", lambda name, seed: seed.plan)
    _HandWrittenPlanner.clock[0], _HandWrittenPlanner.solves = 0.0, []
    plan = ms.search(None, (), 16, PlanOptions(time_limit=1000.0, overlap_objective=False), Planless)
    rows = {tuple(r["shape"]): r for r in plan.summary["mesh_search"]}
    assert rows[(8, 2)]["bound_us"] == 650.0 and rows[(8, 2)]["step_us"] is None
    assert rows[(4, 2, 2)]["bound_us"] is None
    assert "8x2 is bounded at 0.650 ms, 29% above the least bound of 2 axes (0.502 ms); 4x4 has plans " \
        "predicted at least 0.500 ms, 67% slower" in rows[(4, 2, 2)]["note"]
