r"""Pipeline stages planned with the rest: the partition, each stage's placements, the schedule.

A mesh axis ``axis`` of size ``p`` carries the pipeline: its ranks hold ``S = p * v`` stages
(``v`` virtual stages per rank, torch's loop placement), each a contiguous run of the model's
repeated layers (:func:`autoshard.graph.layers.layer_groups`), the first with what runs before
them (the embedding), the last with what runs after (the head and the loss). The batch is cut
into ``m`` microbatches. The stages are the modules torch's own splitter makes
(``torch.distributed.pipelining.pipeline`` with a split point at each stage's first layer):
the modules ``PipelineStage`` runs, with the model's parameter names.

Each stage is planned by :class:`~autoshard.planning.planner.Planner` on the mesh without
``axis`` (the stage's sub-mesh), at one microbatch, its boundary activation as input and, but
for the last stage, a loss whose gradient is the one the next stage sends back (``out.sum()``),
and but for the first, its input's gradient computed and returned (``input_grads``: what it
sends back).
Stages with the same role (first, middle, last) and layer count are the same problem and are
solved once (the distinct ones side by side in forked workers where cores allow), each
gradient move and each gather of a weight its matmuls keep for the backward charged ``1 / m``
(``PlanOptions(microbatches=m)``, :func:`autoshard.planning.problem.amortized_moves`:
the stage accumulates its microbatches' gradients where its backward leaves them and moves them
once; it gathers such a weight on its first microbatch and keeps it, a buffer live the whole
step, for the others, as FSDP does under torch's pipeline schedules with
``reshard_after_forward=False``), so the solver weighs sharding the parameters against holding
their gathered copies, and prefers reducing on the gradients' moves over reducing inside every
microbatch's backward. From stage ``s``'s plan:

- ``f_s``, ``b_s``: its simulated step (compute and exposed communication of one microbatch)
  without those once-per-step moves, cut in the ratio of its forward's and backward's compute,
  and ``r_s`` what those moves add to one microbatch's step (:meth:`Planner.pipeline_times`):
  a stage gathers its held weights in its first forward, accumulates its microbatches' gradients
  unreduced and reduces them once, after its last backward (as torch's ``PipelineStage`` has
  FSDP do), so each rank's step ends at its last action's end plus ``sum_(s on r) r_s``;
- ``a_s``: what one microbatch keeps from its forward for its backward (the memory account's
  ``saved_bytes``, forward values live when the backward starts, over the microbatches held);
- ``c_s``: the send of its boundary activation's local shard to stage ``s + 1`` over ``axis``
  (one rank to one other, priced as the ``all_to_all`` of two ranks each sending those bytes,
  as the ring attention's passes are).

The step is :func:`autoshard.planning.schedule.simulate` of the schedule with those times.

Memory: under its schedule stage ``s`` holds ``n_s`` microbatches in flight at most (1F1B:
``p - s``; GPipe: ``m``), known from the schedule's order alone. Each stage is solved with its
memory rows charging what a microbatch keeps for its backward ``n_s`` times over
(``PlanOptions(in_flight=n_s)``, :func:`autoshard.planning.problem.held_in_flight`; stages
alike take the largest ``n_s`` among them), so the solver itself weighs recomputation and
sharding against the in-flight microbatches, and its plan's peak is the stage's. Pipeline rank
``r`` then holds

    M_r = sum_(s on r) (peak_s + g_s)  <= budget

with ``g_s`` the unreduced gradients the stage accumulates (each gradient move's buffer) where
``peak_s`` does not hold them: a stage solved for ``m > 1`` microbatches has its gradients live
over the whole step in its rows (:func:`autoshard.planning.problem.amortized_moves`), so the
solver fits them, and ``g_s = 0``; one solved again pricing its moves per microbatch (below)
does not. Where
a rank breaks it (the gradients, or several stages on one rank), its stages are solved again
with their budget lowered by the excess (:data:`BUDGET_ROUNDS` times at most).

The partition is balanced by cost, not by count: the first solve cuts the layers evenly; with
``t`` a middle layer's time (``f + b`` per layer of a middle stage) and ``e_0``, ``e_last`` the
first and last stages' time beyond their layers, the layers are cut again to minimize
``max_s (n_s t + [s = 0] e_0 + [s = S-1] e_last)`` (:func:`balanced_partition`); the new cut's
stages are solved, once, where the stages solved estimate its step shorter (:func:`_estimated`)
and the time limit leaves at least what the first round of solves took, and it is kept where its
step, solved, is.

The microbatch count ``m`` is given, or (``"auto"``) chosen by planning the pipeline at a few
counts (:mod:`autoshard.planning.microbatches`, :func:`_choose_microbatches`) within the time limit.

What is not modelled yet: the optimizer step, zero-bubble schedules, and the choice of gathering
a weight per microbatch where its buffer would not fit for the whole step (a weight its view
takes aliased is gathered by its readers, per microbatch; one taken moved is held all step).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from autoshard.errors import ConfigError, MemoryBudgetError, first_line
from autoshard.graph.layers import layer_groups
from autoshard.mesh import axis_names_of
from autoshard.planfile import Plan
from autoshard.planning.schedule import ScheduleRun, check_schedule, simulate
from autoshard.planning.shapebound import bounding_workers
from autoshard.plansummary import pipeline_choice_line
from autoshard.units import human_bytes
from costmodel import load_profile
from costmodel.collectives import MeshTopology
from costmodel.profile import Profile
from costmodel.spec import Spec

log = logging.getLogger(__name__)

PIPELINE_VERSION = 1
"""The pipelined plan file's schema version."""

#: Solves of a stage, at most, with its budget lowered by what its in-flight microbatches add.
BUDGET_ROUNDS = 3


@dataclass
class Stage:
    """One pipeline stage: its layers and the plan that places them."""

    index: int
    rank: int
    """Its position on the pipeline axis (``index mod p``)."""
    layers: tuple[int, int]
    """``[start, end)`` in the layer group."""
    role: str
    """``"first"``, ``"middle"``, ``"last"`` or ``"only"``."""
    plan: Plan
    """The plan of its module on the sub-mesh (shared by the stages of the same role and layer
    count: their problems are the same; :func:`stage_plan` names its parameters for this stage)."""
    planned_layers: tuple[int, int]
    """The layers ``plan`` names (those of the first stage of this role and layer count)."""
    forward_us: float
    backward_us: float
    send_us: float
    """Its boundary activation's send to the next stage (0 for the last)."""
    activation_bytes: float
    """What one microbatch in flight holds (the plan's ``saved_bytes``)."""
    reduce_us: float = 0.0
    """Its gradients' reduction, once per step, exposed after its last backward."""
    gradient_bytes: float = 0.0
    """The unreduced gradients it accumulates over the microbatches where its plan's peak does not
    hold them (0 where the plan was made for several microbatches: its rows hold them)."""

    def to_json(self, plan_index: int) -> dict:
        return {"index": self.index, "rank": self.rank, "layers": list(self.layers), "role": self.role,
                "plan": plan_index, "planned_layers": list(self.planned_layers),
                "forward_us": round(self.forward_us, 3), "backward_us": round(self.backward_us, 3),
                "send_us": round(self.send_us, 3), "activation_bytes": int(self.activation_bytes),
                "reduce_us": round(self.reduce_us, 3), "gradient_bytes": int(self.gradient_bytes),
                "peak_bytes": int(self.plan.summary["peak_mem_bytes"]), "step_us": self.plan.summary["step_us"]}


@dataclass
class PipelinePlan:
    """A pipelined plan: stages, their plans, the schedule and what it is predicted to take."""

    axis: str
    schedule: str
    microbatches: int
    stages_per_rank: int
    group: str
    """The repeated-layer container the stages cut (``"layers"``)."""
    stages: list[Stage]
    run: ScheduleRun
    memory_bytes: list[float]
    """Per pipeline rank, the predicted peak (module docstring)."""
    budget_bytes: float
    mesh_shape: list[int] = field(default_factory=list)
    axis_names: list[str] = field(default_factory=list)
    seconds: float = 0.0

    step_us: float = 0.0
    """The schedule's run, each rank's gradient reduction after its last backward."""
    microbatch_search: list[dict] = field(default_factory=list)
    """Where the microbatch count was chosen (``microbatches="auto"``,
    :mod:`autoshard.planning.microbatches`): per count planned, in the order planned,
    ``{"microbatches", "step_us"}`` or ``{"microbatches", "error"}`` (it broke the budget), and its
    ``seconds``; a last ``{"stopped": why}`` where the time limit ended the climb. Empty where the
    count was given."""
    choice: dict = field(default_factory=dict)
    """Where pipelining was allowed, not required (:mod:`autoshard.planning.pipechoice`): this plan
    and the one without a pipeline, each's step and seconds; empty where the pipeline was asked for."""

    def to_json(self) -> dict:
        plans = []
        for s in self.stages:
            if not any(p is s.plan for p in plans):
                plans.append(s.plan)
        index = {id(p): k for k, p in enumerate(plans)}
        return {"version": PIPELINE_VERSION, "kind": "pipeline", "axis": self.axis, "schedule": self.schedule,
                "microbatches": self.microbatches, "stages_per_rank": self.stages_per_rank, "group": self.group,
                "mesh": {"shape": list(self.mesh_shape), "axis_names": list(self.axis_names)},
                "step_us": round(self.step_us, 3), "schedule_run": self.run.to_json(),
                "memory_bytes": [int(b) for b in self.memory_bytes], "budget_bytes": int(self.budget_bytes),
                "stages": [s.to_json(index[id(s.plan)]) for s in self.stages],
                "plans": [p.to_json() for p in plans], "seconds": round(self.seconds, 3),
                "microbatch_search": self.microbatch_search, "pipeline_choice": self.choice}

    @staticmethod
    def from_json(data: dict) -> "PipelinePlan":
        from autoshard.errors import PlanError

        if data.get("kind") != "pipeline" or data.get("version") != PIPELINE_VERSION:
            raise PlanError(f"pipeline plan: expected kind 'pipeline' version {PIPELINE_VERSION}, found kind "
                            f"{data.get('kind')!r} version {data.get('version')!r}")
        try:
            plans = [Plan.from_json(p) for p in data["plans"]]
            stages = [Stage(s["index"], s["rank"], tuple(s["layers"]), s["role"], plans[s["plan"]],
                            tuple(s["planned_layers"]), s["forward_us"], s["backward_us"], s["send_us"],
                            s["activation_bytes"], s["reduce_us"], s["gradient_bytes"]) for s in data["stages"]]
            r = data["schedule_run"]
            run = ScheduleRun(r["step_us"], r["busy_us"], r["bubble"], r["in_flight"], r["peak_activation_bytes"],
                              r["rank_end_us"])
            return PipelinePlan(axis=data["axis"], schedule=data["schedule"], microbatches=data["microbatches"],
                                stages_per_rank=data["stages_per_rank"], group=data["group"], stages=stages,
                                run=run, memory_bytes=data["memory_bytes"], budget_bytes=data["budget_bytes"],
                                mesh_shape=data["mesh"]["shape"], axis_names=data["mesh"]["axis_names"],
                                seconds=data.get("seconds", 0.0), step_us=data["step_us"],
                                microbatch_search=list(data.get("microbatch_search", [])),
                                choice=dict(data.get("pipeline_choice") or {}))
        except (KeyError, TypeError, IndexError) as exc:
            raise PlanError(f"pipeline plan: missing or malformed field {exc}") from None

    def save(self, path) -> None:
        import json
        from pathlib import Path

        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @staticmethod
    def load(path) -> "PipelinePlan":
        import json
        from pathlib import Path

        return PipelinePlan.from_json(json.loads(Path(path).read_text()))

    def distinct_stages(self) -> list[tuple[Stage, list[int]]]:
        """Each stage whose plan no earlier stage shares, with the indices of the stages that share
        it (one role and layer count: one problem, one plan)."""
        return [(s, [t.index for t in self.stages if t.plan is s.plan]) for k, s in enumerate(self.stages)
                if all(t.plan is not s.plan for t in self.stages[:k])]

    def describe(self) -> str:
        p = len(self.memory_bytes)
        lines = [f"pipeline over {self.axis!r} ({p} ranks, {len(self.stages)} stages), {self.schedule}, "
                 f"{self.microbatches} microbatches: step {self.step_us / 1e3:.1f} ms predicted, "
                 f"bubble {100 * self.run.bubble:.1f}%",
                 f"  {'stage':>5} {'rank':>4} {'layers':>9} {'fwd ms':>8} {'bwd ms':>8} {'send ms':>8} "
                 f"{'reduce ms':>9} {'in flight':>9} {'rank peak':>10}"]
        for s in self.stages:
            lines.append(f"  {s.index:>5} {s.rank:>4} {f'{s.layers[0]}-{s.layers[1] - 1}':>9} "
                         f"{s.forward_us / 1e3:>8.2f} {s.backward_us / 1e3:>8.2f} {s.send_us / 1e3:>8.3f} "
                         f"{s.reduce_us / 1e3:>9.2f} {self.run.in_flight[s.index]:>9} "
                         f"{human_bytes(self.memory_bytes[s.rank]):>10}")
        lines.append(f"  budget {human_bytes(self.budget_bytes)} per device")
        if self.microbatch_search:
            tried = [f"{r['microbatches']}: " + (f"{r['step_us'] / 1e3:.1f} ms" if "step_us" in r else "does not fit")
                     for r in self.microbatch_search if "microbatches" in r]
            stopped = [r["stopped"] for r in self.microbatch_search if "stopped" in r]
            lines.append(f"  microbatches chosen among {', '.join(tried)}" + (f" ({stopped[0]})" if stopped else ""))
        choice = pipeline_choice_line(self.choice)
        if choice:
            lines.append(choice)
        return "\n".join(lines)


def balanced_partition(layers: int, stages: int, layer_us: float, first_extra_us: float = 0.0,
                       last_extra_us: float = 0.0) -> list[int]:
    """Layers per stage, contiguous, minimizing the slowest stage's time ``n_s t + [s = 0] e_0
    + [s = S-1] e_last`` (ties: the least sum of squared stage times). Every stage gets a layer;
    the middle stages' counts differ by one at most."""
    if stages < 1 or layers < stages:
        raise ConfigError(f"pipeline: {stages} stages need at least as many repeated layers, found {layers}")
    if stages == 1:
        return [layers]
    best = None
    for first in range(1, layers - stages + 2):
        for last in range(1, layers - first - stages + 3):
            rest = layers - first - last
            if (stages == 2 and rest) or (stages > 2 and rest < stages - 2):
                continue
            mids = [] if stages == 2 else [rest // (stages - 2) + (1 if k < rest % (stages - 2) else 0)
                                           for k in range(stages - 2)]
            counts = [first] + mids + [last]
            times = ([first * layer_us + first_extra_us] + [n * layer_us for n in mids]
                     + [last * layer_us + last_extra_us])
            # Ties of the slowest stage: the most even times (the others wait least), then counts.
            key = (round(max(times), 6), round(sum(t * t for t in times), 6), counts)
            if best is None or key < best[0]:
                best = (key, counts)
    return best[1]


def sub_mesh(mesh, axis: str):
    """The mesh without ``axis``: where each stage's placements live."""
    names = axis_names_of(mesh)
    if axis not in names:
        raise ConfigError(f"pipeline axis {axis!r} is not an axis of the mesh {dict(zip(names, mesh.shape))}")
    rest = [n for n in names if n != axis]
    if not rest:
        raise ConfigError(f"pipeline axis {axis!r} is the mesh's only axis: add another (of size 1 for a "
                          "pipeline alone) for the stages' placements")
    return mesh[tuple(rest)] if len(rest) > 1 else mesh[rest[0]]


def split_stages(model: torch.nn.Module, microbatch_inputs, group: list[str], counts: list[int]):
    """Torch's split of ``model`` into stage modules, a split point at each stage's first layer
    (``SplitPoint.BEGINNING``): the modules its ``PipelineStage`` runs."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    starts = [sum(counts[:k]) for k in range(1, len(counts))]
    try:
        pipe = pipeline(model, mb_args=tuple(microbatch_inputs),
                        split_spec={group[k]: SplitPoint.BEGINNING for k in starts})
    finally:
        # The splitter wraps each split point's forward in place (and would wrap its own wrapper
        # on a second split: a recursion): the model is left as it was given.
        for k in starts:
            mod = model.get_submodule(group[k])
            for attr in ("forward", "_orig_forward"):
                mod.__dict__.pop(attr, None)
    from autoshard._torch_compat import run_as_code

    stages = [pipe.split_gm.get_submodule(f"submod_pp_{k}") for k in range(pipe.num_stages)]
    for stage in stages:
        run_as_code(stage)
    return stages


def _representatives(model: torch.nn.Module, microbatch_inputs, group: list[str], counts: list[int],
                     reps: list[int]) -> tuple[list, list[int]]:
    """(the modules of stages ``reps`` of the cut ``counts``, the first layer each holds): split
    from ``model`` with its layer container cut to those stages' layers, or (a forward that
    needs every layer) from the whole model."""
    from autoshard.graph.unroll import truncated

    mine = [counts[k] for k in reps]
    depth = sum(mine)
    if depth < len(group):
        try:
            with truncated(model, [group], depth):
                return split_stages(model, microbatch_inputs, group[:depth], mine), \
                    [sum(mine[:j]) for j in range(len(mine))]
        except Exception as exc:  # e.g. a forward looping over range(config.n_layers)
            log.info(f"pipeline: splitting the model cut to {depth} layers failed ({first_line(str(exc))}); "
                     "splitting it whole")
    modules = split_stages(model, microbatch_inputs, group, counts)
    return [modules[k] for k in reps], [sum(counts[:k]) for k in reps]


def split_batch(example_inputs, m: int, device=None) -> tuple:
    """One microbatch of each input (zeros: valid token ids), on ``device`` (default the input's)."""
    out = []
    for k, t in enumerate(example_inputs):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise ConfigError(f"pipeline: example input {k} must be a tensor with a batch dim, "
                              f"found {type(t).__name__}")
        if t.shape[0] % m:
            raise ConfigError(f"pipeline: example input {k}'s batch ({t.shape[0]}) is not divisible by "
                              f"microbatches ({m})")
        out.append(torch.zeros((t.shape[0] // m,) + tuple(t.shape[1:]), dtype=t.dtype, device=device or t.device))
    return tuple(out)


def _role(s: int, n: int) -> str:
    return "only" if n == 1 else "first" if s == 0 else "last" if s == n - 1 else "middle"


def _send_us(plan: Plan, boundary: torch.Tensor, profile: Profile, mesh_shape, axis_index: int) -> float:
    """The send of the next stage's input (``plan``: the next stage's) over the pipeline axis."""
    spec = Spec.parse(plan.inputs[0]) if plan.inputs else None
    sub = [n for k, n in enumerate(mesh_shape) if k != axis_index]
    shape = spec.local_shape(tuple(boundary.shape), tuple(sub)) if spec is not None else tuple(boundary.shape)
    nbytes = math.prod(shape) * boundary.element_size()
    intra = MeshTopology(tuple(mesh_shape), profile.devices_per_node).group_is_intra_node((axis_index,))
    return float(profile.collective_predictor("all_to_all", 2, intra)(2 * nbytes))


def plan_pipeline(model: torch.nn.Module, example_inputs, mesh, *, axis: str = "pp", microbatches: int | str = "auto",
                  schedule: str = "1f1b", stages_per_rank: int = 1, layers_per_stage=None,
                  loss_fn=None, baseline: str | None = None, **overrides) -> PipelinePlan:
    """Plan ``model`` pipelined over mesh axis ``axis`` (module docstring). ``layers_per_stage``:
    the partition (default: balanced by cost); ``baseline``: every stage a hand-written plan
    (:func:`autoshard.planning.baselines.baseline_pins`: ``"fsdp_tp"``, ``"fsdp_tp_ac"`` ... on the
    sub-mesh, its recomputation; torchtitan's FSDP + TP + PP), the rest solved under its pins, for
    comparison; ``microbatches``: a count, or ``"auto"`` to choose it by planning the pipeline at a
    few (:mod:`autoshard.planning.microbatches`, within ``time_limit`` in all); other keywords are
    :class:`~autoshard.options.PlanOptions` fields for every stage's solve (``profile``,
    ``memory_budget``, ``time_limit`` ... shared by the distinct stages)."""
    from autoshard.options import resolve, resolve_budget
    from autoshard.planning.planner import Planner

    t0 = time.perf_counter()
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    names = axis_names_of(mesh)
    sub = sub_mesh(mesh, axis)
    axis_index = names.index(axis)
    p = mesh.shape[axis_index]
    if microbatches == "auto":
        return _choose_microbatches(model, example_inputs, mesh, p, dict(
            axis=axis, schedule=schedule, stages_per_rank=stages_per_rank, layers_per_stage=layers_per_stage,
            loss_fn=loss_fn, baseline=baseline), overrides)
    if not isinstance(microbatches, int):
        raise ConfigError(f"microbatches: expected a count >= 1 or 'auto', found {microbatches!r}")
    check_schedule(schedule, p, microbatches, stages_per_rank)
    n_stages = p * stages_per_rank
    groups = layer_groups(model)
    if not groups:
        raise ConfigError(f"pipeline: {type(model).__name__} has no repeated layers to cut into stages "
                          "(a ModuleList of identical blocks)")
    group = max(groups, key=len)
    opts = resolve(None, overrides)
    profile = opts.profile if isinstance(opts.profile, Profile) else load_profile(opts.profile)
    if opts.compute_dtype:
        profile = profile.priced_as(opts.compute_dtype)
    budget = resolve_budget(opts.memory_budget, profile.memory_bytes)
    from autoshard.runtime.shards import unsharded_meta_copy

    # Planning never computes: the stages are split, run for their boundaries' shapes and traced
    # on the meta device.
    if any(not t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        model = unsharded_meta_copy(model)
    mb = split_batch(example_inputs, microbatches, device="meta")
    counts = list(layers_per_stage) if layers_per_stage is not None else balanced_partition(len(group), n_stages, 1.0)
    if len(counts) != n_stages or sum(counts) != len(group) or min(counts) < 1:
        raise ConfigError(f"layers_per_stage: expected {n_stages} counts >= 1 summing to {len(group)} layers, "
                          f"found {counts}")
    limit = float(opts.time_limit)
    # What each stage holds in flight depends on the schedule's order only (1F1B: p - s).
    flight = simulate(schedule, p, microbatches, [1.0] * n_stages, [2.0] * n_stages,
                      stages_per_rank=stages_per_rank).in_flight
    solved: dict[tuple, tuple] = {}

    def key_of(k: int, counts) -> tuple:
        return _role(k, n_stages), counts[k]

    def held(key, counts) -> int:
        # Stages alike are one problem, solved for the most microbatches any of them holds.
        return max(flight[j] for j in range(n_stages) if key_of(j, counts) == key)

    boundary: list[torch.Tensor] = []  # what every boundary between two stages carries

    def stage_plans(counts, budgets=None):
        # One module per distinct stage (its first occurrence), split from the model cut to
        # those stages' layers (LLaMA-405B: 51 of 126 layers, 4 s instead of 10 s); once the
        # boundary is known, the middle ones solved already are left out of the cut (the first
        # and last stay: the split gives its first piece the embedding, its last the head).
        # Each plan names the layers it was made for (its start here), stage_plan renames them.
        reps = []
        for k in range(n_stages):
            if all(key_of(j, counts) != key_of(k, counts) for j in reps):
                reps.append(k)
        todo = [k for k in reps if key_of(k, counts) not in solved]
        split = reps if not boundary else [k for k in reps if k in todo or _role(k, n_stages) != "middle"]
        modules, starts = _representatives(model, mb, group, counts, split) if todo else ([], [])
        if not boundary and n_stages > 1:
            with torch.no_grad():
                out = modules[0](*mb)  # reps[0] is stage 0
            out = out if isinstance(out, tuple) else (out,)
            if len(out) != 1:
                raise ConfigError(f"pipeline: stage 0 hands {len(out)} tensors to the next; one boundary "
                                  "activation is supported")
            boundary.append(out[0])
        # The distinct stages are independent problems: solved side by side where cores allow,
        # each given its share of the time left as the solves run in rounds of `workers`.
        jobs = [(split.index(k), key_of(k, counts)) for k in todo]
        workers = bounding_workers(len(jobs)) if len(jobs) > 1 else 1
        rounds = -(-len(jobs) // workers)
        seconds = max(5.0, (limit - (time.perf_counter() - t0)) / max(1, rounds))

        def solve(j: int, key) -> tuple:
            inputs = mb if key[0] in ("first", "only") else (torch.empty_like(boundary[0]),)
            return solve_stage(Planner, modules[j], inputs, sub, overrides, key[0], seconds, loss_fn,
                                (budgets or {}).get(key, budget), held(key, counts), microbatches, baseline)

        for (j, key), got in zip(jobs, _side_by_side(solve, jobs, workers)):
            solved[key] = got + (starts[j],)
        # Every boundary between two repeated layers has one shape.
        return [solved[key_of(k, counts)] for k in range(n_stages)], boundary * (n_stages - 1)

    def step_of(plans, boundaries) -> float:
        sends = [_send_us(plans[k + 1][0], boundaries[k], profile, tuple(mesh.shape), axis_index)
                 for k in range(n_stages - 1)] + [0.0]
        run = simulate(schedule, p, microbatches, [x[1] for x in plans], [x[2] for x in plans], sends,
                       stages_per_rank=stages_per_rank)
        return max(run.rank_end_us[r] + sum(plans[s][4] for s in range(r, n_stages, p)) for r in range(p))

    t1 = time.perf_counter()
    plans, boundaries = stage_plans(counts)
    first_round = time.perf_counter() - t1
    # A second round of solves (another cut) needs about the time the first took: where the limit
    # leaves less, its stages would be solved in less time than the first's and lose to them.
    rebalance = limit - (time.perf_counter() - t0) >= first_round
    if layers_per_stage is None and n_stages > 2 and not rebalance:
        log.info(f"pipeline: the cut balanced by cost not tried: {limit - (time.perf_counter() - t0):.1f} s "
                 f"left of the time limit, the first round of stage solves took {first_round:.1f} s")
    if layers_per_stage is None and n_stages > 2 and rebalance:
        per_layer = {k: (x[1] + x[2]) / counts[k] for k, x in enumerate(plans)
                     if _role(k, n_stages) == "middle"}
        t = min(per_layer.values())
        first_extra = plans[0][1] + plans[0][2] - counts[0] * t
        last_extra = plans[-1][1] + plans[-1][2] - counts[-1] * t
        better = balanced_partition(len(group), n_stages, t, first_extra, last_extra)
        before = step_of(plans, boundaries)
        guess = step_of(_estimated(better, solved, key_of, n_stages), boundaries) if better != counts else before
        if better != counts and guess >= before:
            log.info(f"pipeline: layers per stage {counts} -> {better} (balanced by cost) not solved: its step "
                     f"estimated from the stages solved is {guess / 1e3:.1f} ms, not below {before / 1e3:.1f} ms")
        elif better != counts:
            # A stage's time is not linear in its layers (another count can take another plan):
            # the new cut is kept only where its stages, solved, make the step shorter.
            again, at = stage_plans(better)
            after = step_of(again, at)
            log.info(f"pipeline: layers per stage {counts} -> {better} (balanced by cost): step "
                     f"{before / 1e3:.1f} -> {after / 1e3:.1f} ms" + ("" if after < before else ", kept the first"))
            if after < before:
                counts, plans, boundaries = better, again, at

    def rank_memory(plans) -> list[float]:
        # Each plan's peak holds its stage's microbatches in flight (PlanOptions.in_flight) and
        # the gradients it accumulates (g_s beside it where it was solved per microbatch).
        return [sum(plans[s][0].summary["peak_mem_bytes"] + plans[s][5] for s in range(r, n_stages, p))
                for r in range(p)]

    memory = rank_memory(plans)
    for _round in range(BUDGET_ROUNDS):
        over = {key_of(s, counts): memory[s % p] - budget for s in range(n_stages)
                if budget is not None and memory[s % p] > budget}
        if not over:
            break
        budgets = {key: solved[key][0].summary["memory_budget_bytes"] - excess / stages_per_rank
                   for key, excess in over.items()}
        if min(budgets.values()) <= 0:
            break
        for key in over:
            log.info(f"pipeline: {key[0]} stages of {key[1]} layers over the budget by {human_bytes(over[key])}; "
                     f"solving them again under {human_bytes(budgets[key])}")
            solved.pop(key)
        try:
            plans, boundaries = stage_plans(counts, budgets)
        except MemoryBudgetError:
            break
        memory = rank_memory(plans)
    worst = max(memory)
    if budget is not None and worst > budget:
        raise MemoryBudgetError(
            f"pipeline: rank {memory.index(worst)} needs {human_bytes(worst)} with {microbatches} microbatches "
            f"in {schedule} (stage {memory.index(worst)} holding {flight[memory.index(worst)]} in flight), above the "
            f"budget {human_bytes(budget)}: more stages, fewer microbatches in flight (1f1b) or more ranks per "
            "stage", budget, worst)

    sends = [_send_us(plans[k + 1][0], boundaries[k], profile, tuple(mesh.shape), axis_index)
             for k in range(n_stages - 1)] + [0.0]
    run = simulate(schedule, p, microbatches, [x[1] for x in plans], [x[2] for x in plans], sends,
                   [x[3] for x in plans], stages_per_rank)
    stages, start = [], 0
    for k in range(n_stages):
        pl, f, b, a, red, grads, at = plans[k]
        stages.append(Stage(k, k % p, (start, start + counts[k]), _role(k, n_stages), pl, (at, at + counts[k]),
                            f, b, sends[k], a, red, grads))
        start += counts[k]
    step = max(run.rank_end_us[r] + sum(s.reduce_us for s in stages if s.rank == r) for r in range(p))
    prefix = group[0].rpartition(".")[0]
    return PipelinePlan(axis=axis, schedule=schedule, microbatches=microbatches, stages_per_rank=stages_per_rank,
                        group=prefix, stages=stages, run=run, memory_bytes=memory, budget_bytes=budget or 0.0,
                        mesh_shape=list(mesh.shape), axis_names=names, seconds=time.perf_counter() - t0,
                        step_us=step)


#: The share of what is left of the time limit a microbatch climb gives each count it plans after
#: the start but the last it can afford (:func:`_choose_microbatches`).
CLIMB_SHARE = 0.5


def _choose_microbatches(model, example_inputs, mesh, p: int, fixed: dict, overrides: dict) -> PipelinePlan:
    """``plan_pipeline`` with the microbatch count climbed to (:mod:`autoshard.planning.microbatches`):
    the start planned within the whole time limit, as a count given would be (it is the plan kept
    where the limit ends the climb, and in a smaller share its cost-balanced cut has no time:
    LLaMA-70B's stages cut evenly are 4% slower), each later count in half of what is left, the
    last the limit affords in all of it; the plan of least step kept, every count tried recorded
    in it."""
    from autoshard.options import resolve
    from autoshard.planning import microbatches as mbs

    t0 = time.perf_counter()
    batch = int(example_inputs[0].shape[0])
    counts = mbs.candidates(batch, p, fixed["schedule"], fixed["stages_per_rank"])
    limit = float(resolve(None, overrides).time_limit)
    plans: dict[int, PipelinePlan] = {}
    record: list[dict] = []
    broke: list[MemoryBudgetError] = []

    def step_of(m: int) -> float:
        left = limit - (time.perf_counter() - t0)
        spent = [r["seconds"] for r in record]
        # A plan that would end past the limit is not started (the fastest so far says what one
        # takes: a pipeline's plan has a floor of splitting, tracing and solving each stage that
        # a smaller share does not lower); the first always is.
        if spent and left < min(spent):
            record.append({"stopped": f"the time limit ended the climb before {m} microbatches"})
            raise StopIteration
        # The start is planned as if it were given (a plan's searches end early where they can,
        # leaving time to the climb); the last count the limit affords gets all that is left.
        share = left if not spent or left < 2 * min(spent) else left * CLIMB_SHARE
        t1 = time.perf_counter()
        try:
            got = plan_pipeline(model, example_inputs, mesh, microbatches=m, **fixed,
                                **dict(overrides, time_limit=max(share, 1.0)))
        except MemoryBudgetError as exc:
            broke.append(exc)
            record.append({"microbatches": m, "error": first_line(exc), "seconds": round(time.perf_counter() - t1, 3)})
            log.info(f"pipeline: {m} microbatches: {first_line(exc)}")
            return math.inf
        plans[m] = got
        record.append({"microbatches": m, "step_us": round(got.step_us, 3),
                       "seconds": round(time.perf_counter() - t1, 3)})
        log.info(f"pipeline: {m} microbatches: step {got.step_us / 1e3:.1f} ms")
        return got.step_us

    chosen, _ = mbs.climb(counts, mbs.start(counts, p), step_of)
    if chosen not in plans:  # every count planned broke the budget
        errors = "; ".join(f"{r['microbatches']} microbatches: {r['error']}" for r in record if "error" in r)
        raise MemoryBudgetError(f"pipeline: no microbatch count planned fits the memory budget ({errors})",
                                broke[0].budget_bytes, min(e.min_feasible_bytes for e in broke))
    best = plans[chosen]
    best.microbatch_search = record
    best.seconds = time.perf_counter() - t0
    return best


def stage_plan(pplan: PipelinePlan, stage: Stage) -> Plan:
    """``stage``'s plan with its own parameter names: the shared plan's layers
    (``planned_layers``) renamed to the stage's (same structure, so the same graph and nodes)."""
    shift = stage.layers[0] - stage.planned_layers[0]
    if shift == 0:
        return stage.plan
    prefix = f"{pplan.group}." if pplan.group else ""

    def rename(fqn: str) -> str:
        if not fqn.startswith(prefix):
            return fqn
        head, _, tail = fqn[len(prefix):].partition(".")
        if not head.isdigit():
            return fqn
        return f"{prefix}{int(head) + shift}" + (f".{tail}" if tail else "")

    data = stage.plan.to_json()
    data["params"] = {rename(k): v for k, v in data["params"].items()}
    rc = data.get("recompute") or {}
    for field_name in ("nodes", "at"):
        if isinstance(rc.get(field_name), dict):
            rc[field_name] = {rename(k): v for k, v in rc[field_name].items()}
    return Plan.from_json(data)


def solve_stage(planner_cls, module, inputs, sub, overrides, role: str, seconds: float, loss_fn,
                 budget, in_flight: int, microbatches: int,
                 baseline: str | None = None) -> tuple[Plan, float, float, float, float, float]:
    """(plan, forward us, backward us, activation bytes of one microbatch, reduction us, unreduced
    gradient bytes) of one stage on the sub-mesh, ``in_flight`` microbatches held; ``baseline``:
    under that hand-written plan's pins, input spec and recomputation."""
    kw = dict(overrides)
    if baseline is not None:
        from autoshard.planning.baselines import baseline_pins, baseline_recompute

        pins, in_specs = baseline_pins(baseline, module, sub.ndim, tuple(sub.shape))
        kw.update(pins=pins, input_specs=in_specs, recompute=baseline_recompute(baseline), seed_baselines=False)
    kw["in_flight"] = int(in_flight)
    kw["microbatches"] = int(microbatches)
    kw["time_limit"] = seconds
    # A split stage's layers are called one by one from its graph: no shallower trace to unroll.
    kw["unroll_layers"] = False
    if budget is not None:
        kw["memory_budget"] = float(budget)
    if role in ("last", "only"):
        if loss_fn is not None:
            kw["loss_fn"] = loss_fn
    else:
        kw["loss_fn"] = _boundary_loss
    if role in ("middle", "last"):
        kw["input_grads"] = True  # the gradient it sends back to the stage before
    from autoshard.planning.planner import MIN_SOLVE_SECONDS, solve_within

    started = time.perf_counter()
    planner = planner_cls(module, tuple(inputs), sub, **kw)
    try:
        # The stage's seconds include its trace and build, as plan()'s time limit does, so the
        # rounds of stages end within the pipeline's time limit (405B: 3.3 s of trace and 1.3 s of
        # build per stage, four distinct stages in two rounds).
        pl = solve_within(planner, seconds, started)
    except MemoryBudgetError as exc:
        if microbatches <= 1:
            raise MemoryBudgetError(f"pipeline stage ({role}): {exc}", exc.budget_bytes,
                                    exc.min_feasible_bytes) from None
        # Cheap gradient moves draw the solve to replicated parameters, whose optimizer step
        # (AdamW's temporaries: the plan's account, not the solver's rows) can break the budget
        # the rows met: solved again pricing every microbatch's moves whole (the stage still
        # accumulates and moves them once).
        log.info(f"pipeline stage ({role}): {first_line(str(exc))}; solving it again with the gradient moves "
                 "priced per microbatch")
        left = max(MIN_SOLVE_SECONDS, seconds - (time.perf_counter() - started))
        return solve_stage(planner_cls, module, inputs, sub, overrides, role, left, loss_fn, budget, in_flight,
                            1, baseline)
    fwd, bwd, reduce = planner.pipeline_times(pl)
    act = float(pl.summary["memory"]["saved_bytes"]) / in_flight
    # Made for several microbatches, the plan's rows hold the gradients' accumulation buffers.
    grads = 0.0 if microbatches > 1 else float(sum(max(r.get("step_bytes") or [0]) for r in pl.redistributes
                                                   if r.get("arg") == "grad"))
    return pl, fwd, bwd, act, reduce, grads


def _estimated(counts: list[int], solved: dict, key_of, n_stages: int) -> list[tuple]:
    """Per stage of the cut ``counts``, ``solved``'s answer for its role and layer count where
    there is one, else an estimate from the solved stage of its role nearest in layers: a middle
    stage's times scaled per layer, a first or last stage's (its embedding or head besides its
    layers) plus or minus the nearest middle stage's time per layer. The plan (for the send to
    it) is the nearest stage's."""
    middles = sorted(key[1] for key in solved if key[0] == "middle")
    out = []
    for k in range(n_stages):
        key = key_of(k, counts)
        if key in solved:
            out.append(solved[key])
            continue
        near = min((s for s in solved if s[0] == key[0]), key=lambda s: (abs(s[1] - key[1]), s[1]))
        pl, f, b, a, red, grads = solved[near][:6]
        if key[0] == "middle" or not middles:
            scale = key[1] / near[1]
            out.append((pl, f * scale, b * scale, a, red * scale, grads))
            continue
        c = min(middles, key=lambda n: (abs(n - key[1]), n))
        mid, extra = solved[("middle", c)], (key[1] - near[1]) / c
        out.append((pl, f + extra * mid[1], b + extra * mid[2], a, red + extra * mid[4], grads))
    return out


def _side_by_side(solve, jobs: list[tuple], workers: int) -> list:
    """``[solve(*job) for job in jobs]``, in ``workers`` forked processes where more than one (the
    answers in the order of ``jobs``; an error raised in a worker is raised here)."""
    if workers <= 1:
        return [solve(*job) for job in jobs]
    from autoshard.planning.shapeworkers import ShapeWorkers

    pool = ShapeWorkers(workers, lambda k: (solve(*jobs[k]), None), hold=0)
    out, sent = [], 0
    try:
        while len(out) < len(jobs):
            while sent < len(jobs) and pool.has_room():
                pool.submit(sent)
                sent += 1
            out.append(pool.next())
    finally:
        pool.close()
    return out


def _boundary_loss(out):
    """A stage's stand-in loss: its output's gradient is a full tensor, as the one the next stage
    sends back."""
    return out.sum()
