"""``PlanOptions``: everything a plan depends on besides the model, its inputs and the mesh."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from autoshard.errors import ConfigError
from autoshard.planfile import RECOMPUTE_MODES
from costmodel import Profile
from solver import BACKENDS

#: Fields fixed once the model is traced and its problem built (a new Planner changes them).
TRACE_FIELDS = ("profile", "compute_dtype", "loss_fn", "example_kwargs", "tie_layers", "unroll_layers",
                "load_imbalance", "bucket_mb", "input_grads", "in_flight", "microbatches")
#: Fields each solve of a traced model may change (``Planner.solve(**overrides)``).
SOLVE_FIELDS = ("memory_budget", "pins", "input_specs", "recompute", "time_limit", "backend", "seed_baselines",
                "overlap_objective", "export_problem")
#: Share of a device's memory ``memory_budget="auto"`` leaves to what no plan holds: the CUDA
#: context and the libraries' workspaces (cuBLAS, the attention kernels), NCCL's buffers (a few
#: MiB per channel and peer, per communicator) and the caching allocator's fragmentation (what it
#: reserves beyond what is allocated). docs/planning.md gives the measurements it rests on.
MEMORY_RESERVE = 0.10


def resolve_budget(budget: float | str | None, device_bytes: int) -> float | None:
    """Bytes per device of a ``memory_budget`` (:attr:`PlanOptions.memory_budget`) on a device
    of ``device_bytes``."""
    if budget is None:
        return None
    if budget == "auto":
        return device_bytes * (1 - MEMORY_RESERVE)
    return budget * device_bytes if budget <= 1 else float(budget)


#: Values of ``PlanOptions.recompute``.
RECOMPUTE = ("auto", *RECOMPUTE_MODES)


@dataclass(frozen=True)
class PlanOptions:
    """How to plan. Give fields as keywords to :func:`autoshard.plan`, :class:`autoshard.Planner`
    and :func:`autoshard.auto_parallel`, or build one and pass it as ``options=``."""

    profile: str | Profile = "h100-sxm"
    """Hardware profile: a shipped name (``costmodel.builtin_profiles()``), a profile
    file written by ``autoshard calibrate``, or a :class:`costmodel.Profile`."""

    memory_budget: float | str | None = "auto"
    """Bytes per device the plan may use at its peak (a number above 1), or a share of the
    profile's device memory (a number in (0, 1]); ``"auto"``: the device memory less
    :data:`MEMORY_RESERVE` of it, for what no plan holds (:func:`resolve_budget`); ``None``: no
    memory constraint."""

    time_limit: float = 60.0
    """Seconds a plan may take (a proved optimum returns earlier): from the call of
    :func:`autoshard.plan` (tracing and building the problem included: the solve gets what they
    leave, at least ``planner.MIN_SOLVE_SECONDS``), for the whole mesh search with
    ``mesh="auto"``, for the solve alone in ``Planner.solve``."""

    backend: str = "highs"
    """MILP backend: ``"highs"`` (default) or ``"cbc"`` (through PuLP)."""

    tie_layers: bool = True
    """Repeated layers (a ``ModuleList`` of identical blocks) take the same specs, so the solver
    sees one layer however deep the model is."""

    unroll_layers: bool = True
    """With ``tie_layers``, a group of 8 or more layers is traced three and four layers deep and
    the three-layer graph unrolled to the full depth, when it then equals the four-layer trace
    node for node (:mod:`autoshard.graph.unroll`: a deep model traces in the time of four layers). ``False``
    traces every layer: for a model whose layers' graphs depend on their index in a way the
    first four layers do not show."""

    pins: Mapping[str, Any] | None = None
    """``{FQN glob of a parameter or module: spec}`` fixes those parameters' specs; a spec is text
    such as ``"S(0)[1,0]S(0)"`` or ``{axis name: placement}``."""

    input_specs: Sequence[Any] | None = None
    """One spec (or ``None``: the solver chooses) per planned input, positional inputs first, then
    the tensor keywords of ``example_kwargs`` in their order."""

    recompute: str = "auto"
    """Activation checkpointing of the repeated layers (:mod:`autoshard.graph.recompute`): ``"none"``
    keeps every activation the backward reads; ``"selective"`` keeps matmul and attention
    outputs and recomputes the rest; ``"full"`` keeps each layer's input and recomputes its
    forward; ``"auto"`` lets the plan choose: ``none`` when its plan is the memory-free optimum
    (recomputing can then only add time), else the cheapest of the three, each solved in an
    equal share of what is left of ``time_limit``."""

    load_imbalance: float = 1.0
    """Busiest expert-parallel rank's token load over the mean (:mod:`autoshard.planning.imbalance`):
    expert matmuls and the tokens moved into them cost this much more where a plan shards the
    experts. 1.0 is exact for capacity-based dispatch (every expert runs its padded capacity);
    raise it to cost a dropless runtime or routing measured to be skewed."""

    seed_baselines: bool = True
    """Unless the solve's cheap stages (heuristic start, memory-free optimum) prove its plan
    optimal, the hand-written plans (DDP, FSDP, TP, FSDP+TP, FSDP+TP with full recomputation)
    are solved under their pins (a quarter of ``time_limit`` in all) and the solve's long
    searches start from them, so the plan is never dearer than any of them."""

    compute_dtype: str | None = None
    """The dtype every op's FLOPs are priced in, as a torch dtype name (``"bfloat16"``): for a
    model traced in float32 that will train under mixed precision (bf16 matmuls over float32
    master weights; memory is still counted as traced). ``None`` (default): each op in the dtype
    it was traced in, which is what ``parallelize`` runs (on an H100 a float32 matmul, TF32
    off, runs at a fifteenth of the bf16 rate: ``Profile.dtype_tflops``). The plan carries the
    profile so priced (``Profile.priced_as``)."""

    overlap_objective: bool = True
    """The objective is the step with communication overlapped (:mod:`autoshard.planning.overlap`):
    each window of the run (a layer's forward, its backward) hides, at the profile's overlap
    share, as much of the communication that may run beside its compute as that compute lasts
    (:mod:`solver.overlap`); the plan of least simulated step among that objective's best plans
    and the additive optimum is kept. ``False``: the additive objective (every redistribute's
    time counted), its plans still ranked by simulated step. The predicted step
    (``summary["step_us"]``) is the simulation either way."""

    bucket_mb: float = 25.0
    """The executor's bucket cap the predicted step assumes (``parallelize(bucket_mb=...)``, whose
    default this is): independent collectives of one kind and group that run one after another
    are merged into one of up to this many MiB (:mod:`autoshard.runtime.buckets`), one latency each.
    0: every redistribute's collectives run as planned, one by one."""

    mesh_margin: float | None = 0.25
    """With ``mesh="auto"``: a shape of k axes is not bounded where every shape of k - 1 axes it
    refines (:func:`autoshard.planning.meshshapes.coarsenings`) is bounded, and each has a plan predicted
    at least ``1 + mesh_margin`` times the best plan of k - 1 axes (or, bounded without a plan, a
    bound ``1 + mesh_margin`` times the least of them), or was pruned; and a shape whose plan
    (its hand-written one, where memory binds) is predicted ``1 + mesh_margin`` times the best plan
    found is not solved, unless it refines the best plan's shape (it lays out that plan, which its
    own hand-written plans do not). A heuristic: a refinement lays out its coarser shapes' plans
    and mixes them, so it is rarely much faster than the best of them, and elsewhere a solve gains
    little on its shape's hand-written plan. ``None`` bounds every shape and solves every one its
    bounds allow (the search then costs about a shape's plan per shape, on each core)."""

    loss_fn: Callable | None = None
    """Maps the model's output to a scalar loss (default: the output's mean, or the model's own
    loss where it returns one)."""

    example_kwargs: Mapping[str, Any] | None = None
    """Keyword arguments of ``forward`` (``attention_mask``, ``labels`` ...): tensors are planned
    inputs after the positional ones, other values constants of the plan."""

    input_grads: bool = False
    """The step computes its floating-point inputs' gradients too, planned with the rest and
    returned by the lowered backward: a pipeline stage's (:mod:`autoshard.planning.pipeline`),
    which sends its input's gradient back to the stage before."""

    in_flight: int = 1
    """Microbatches whose forward values the step keeps at once for their backwards: the memory
    rows charge what a microbatch keeps this many times over (a pipeline stage's in-flight count
    under its schedule, :mod:`autoshard.planning.pipeline`). The plan's reported memory stays one
    microbatch's."""

    microbatches: int = 1
    """Microbatches one step runs through the program, their gradients accumulated where the
    backward leaves them and moved to their parameters' specs once, and the weights the forward
    keeps for the backward (a matmul's transposed weight) gathered once, on the first, and kept
    for the others: each of those moves is charged ``1 / microbatches`` in the solve and such a
    gathered weight lives the whole step (a pipeline stage's; the plan's step is then one
    microbatch's with its share of those moves, ``Plan.held`` names the weights held)."""

    export_problem: str | None = None
    """Also write the solver's problem (pins applied) to this path in the IOPDDL contest format
    (``.json`` or ``.json.gz``; ties and pins as extra keys)."""

    def __post_init__(self):
        if not isinstance(self.profile, (str, Profile)):
            raise ConfigError(f"profile: expected a profile name, a profile file or a Profile, "
                              f"found {type(self.profile).__name__}")
        b = self.memory_budget
        if not (b is None or b == "auto" or (isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0)):
            raise ConfigError(f"memory_budget: expected bytes (> 1), a share of the device's memory (in (0, 1]), "
                              f"'auto' or None, found {b!r}")
        if not (isinstance(self.time_limit, (int, float)) and self.time_limit > 0):
            raise ConfigError(f"time_limit: expected seconds > 0, found {self.time_limit!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend: expected one of {BACKENDS}, found {self.backend!r}")
        for name in ("in_flight", "microbatches"):
            v = getattr(self, name)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ConfigError(f"{name}: expected an int >= 1, found {v!r}")
        for name in ("tie_layers", "unroll_layers", "overlap_objective", "seed_baselines", "input_grads"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name}: expected True or False, found {getattr(self, name)!r}")
        if self.compute_dtype is not None and not _is_float_dtype(self.compute_dtype):
            raise ConfigError(f"compute_dtype: expected a floating-point torch dtype name (bfloat16, float16, "
                              f"float32) or None, found {self.compute_dtype!r}")
        f = self.load_imbalance
        if not (isinstance(f, (int, float)) and not isinstance(f, bool) and 1.0 <= f < float("inf")):
            raise ConfigError(f"load_imbalance: expected the busiest rank's load over the mean, a finite "
                              f"number >= 1.0, found {f!r}")
        if not (isinstance(self.bucket_mb, (int, float)) and not isinstance(self.bucket_mb, bool)
                and 0 <= self.bucket_mb < float("inf")):
            raise ConfigError(f"bucket_mb: expected MiB >= 0 (0: no buckets), found {self.bucket_mb!r}")
        m = self.mesh_margin
        if not (m is None or (isinstance(m, (int, float)) and not isinstance(m, bool) and 0 <= m < float("inf"))):
            raise ConfigError(f"mesh_margin: expected a share >= 0 (0.25: 25% slower) or None, found {m!r}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute: expected one of {RECOMPUTE}, found {self.recompute!r}")
        if self.pins is not None and not isinstance(self.pins, Mapping):
            raise ConfigError(f"pins: expected {{FQN glob: spec}}, found {type(self.pins).__name__}")
        if self.input_specs is not None and isinstance(self.input_specs, (str, Mapping)):
            raise ConfigError(f"input_specs: expected one spec (or None) per input, found {self.input_specs!r}")
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise ConfigError(f"loss_fn: expected a callable, found {type(self.loss_fn).__name__}")
        if self.example_kwargs is not None and not isinstance(self.example_kwargs, Mapping):
            raise ConfigError(f"example_kwargs: expected a dict, found {type(self.example_kwargs).__name__}")

    def replace(self, **overrides) -> PlanOptions:
        """A copy with ``overrides``; an unknown name is an error that lists the fields."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"unknown plan options {unknown}; expected some of "
                              f"{[f.name for f in dataclasses.fields(self)]}")
        return dataclasses.replace(self, **overrides) if overrides else self


def _is_float_dtype(name) -> bool:
    import torch

    return isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype) \
        and getattr(torch, name).is_floating_point


def resolve(options: PlanOptions | None, overrides: Mapping[str, Any]) -> PlanOptions:
    """``options`` (default ``PlanOptions()``) with keyword ``overrides`` applied."""
    if options is not None and not isinstance(options, PlanOptions):
        raise ConfigError(f"options: expected a PlanOptions, found {type(options).__name__}")
    return (options or PlanOptions()).replace(**overrides)
