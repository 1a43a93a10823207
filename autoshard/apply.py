"""Apply a plan: parameters become DTensors, the model's forward and backward run the plan.

``parallelize`` shards the parameters and buffers as planned and replaces the model's
``forward`` with the plan's lowered per-rank programs (:mod:`autoshard.runtime.lower`,
:mod:`autoshard.runtime.program`): every redistribute is the planner's own steps, and
``loss.backward()`` on any loss of the outputs runs the lowered backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autoshard._torch_compat import from_placements, is_persistent_buffer, quiet_tracing
from autoshard.errors import ConfigError, MeshError, PlanError
from autoshard.gcpause import fewer_gc_passes
from autoshard.mesh import axis_names_of, check_mesh, several_processes
from autoshard.planfile import Plan
from autoshard.runtime.program import StepFunction
from autoshard.runtime.shards import distribute, unsharded_meta_copy
from costmodel.spec import Spec


def check_plan_matches(model: nn.Module, plan: Plan, mesh) -> None:
    """Raise naming the first difference between the plan and (model, mesh)."""
    if list(mesh.shape) != list(plan.mesh_shape):
        raise MeshError(f"plan was made for mesh shape {plan.mesh_shape}, the mesh given has {list(mesh.shape)}")
    names = axis_names_of(mesh)
    if names != plan.axis_names:
        raise MeshError(f"plan was made for mesh axes {plan.axis_names}, the mesh given has {names}")
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    for fqn, t in state.items():
        if fqn not in plan.params:
            raise PlanError(
                f"model has {fqn} {tuple(t.shape)} which the plan does not place "
                f"(plan is for {plan.model.get('class', '?')}, model is {type(model).__name__})"
            )
        want = plan.params[fqn].shape
        if want and list(t.shape) != list(want):
            raise PlanError(f"{fqn}: plan was made for shape {tuple(want)}, the model has {tuple(t.shape)}")
    extra = [fqn for fqn in plan.params if fqn not in state]
    if extra:
        raise PlanError(f"plan places {extra[0]} which the model ({type(model).__name__}) does not have")


def load_full_state_dict(model: nn.Module, full_state_dict: dict) -> None:
    """Load unsharded tensors into a parallelized model, one tensor at a time.

    Rank 0 holds the full tensors (other ranks may pass ``{}``); each is scattered
    from rank 0 (``distribute_tensor(..., src_data_rank=0)``) and every rank keeps
    its shards, so no rank ever holds more than one full tensor at once.
    """
    import torch.distributed as dist

    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    state = list(model.named_parameters()) + list(model.named_buffers())
    missing = [fqn for fqn, _ in state if fqn not in full_state_dict]
    if rank0 and missing:
        persistent = set(model.state_dict())
        missing = [m for m in missing if m in persistent]
        if missing:
            raise PlanError(f"full_state_dict lacks {len(missing)} entries of the model, e.g. {missing[:3]}")
    with torch.no_grad():
        for fqn, t in state:
            src = full_state_dict.get(fqn)
            if src is None and rank0:
                continue  # a non-persistent buffer: the model computed it
            if src is None:
                src = torch.empty(t.shape, dtype=t.dtype)
            src = src.to(dtype=t.dtype)
            if isinstance(t, DTensor):
                spec = from_placements(t.placements, t.device_mesh)
                t.to_local().copy_(distribute(src, t.device_mesh, spec, src_data_rank=0).to_local())
            else:
                t.copy_(src)


def in_planned_spec(a: DTensor, mesh, spec: Spec) -> DTensor:
    """A DTensor input in its planned spec (a pipeline stage's input arrives in the spec the stage
    before handed it over in)."""
    from autoshard._torch_compat import placements_for

    want = placements_for(spec, mesh)
    return a if tuple(a.placements) == tuple(want) else a.redistribute(mesh, want)


class _PlannedForward:
    """The model's ``forward`` once parallelized: the plan's lowered forward and backward
    programs (one per input signature, lowered on first use)."""

    def __init__(self, model: nn.Module, template: nn.Module, plan: Plan, mesh, loss_fn, profile, bucket_mb,
                 overlap, compute_loss, compile=False, seed=None, accumulate=False):
        self.model, self.template, self.plan, self.mesh = model, template, plan, mesh
        self.seed, self.accumulate = seed, accumulate
        self.bucket_mb, self.overlap, self.compute_loss = bucket_mb, overlap, compute_loss
        self.compile = compile
        self.loss_fn, self.profile = loss_fn, profile
        self.input_specs = [Spec.parse(s) for s in plan.inputs]
        self.programs: dict[tuple, object] = {}

    def program(self, inputs: list[torch.Tensor], constants: dict):
        from autoshard.graph.tracing import trace
        from autoshard.runtime.program import PlannedProgram

        names = self.plan.keyword_inputs
        key = (tuple((tuple(x.shape), x.dtype) for x in inputs), repr(sorted(constants.items())))
        if key not in self.programs:
            with quiet_tracing():
                with torch.device("meta"):
                    shapes = [torch.empty(x.shape, dtype=x.dtype) for x in inputs]
                positional = shapes[: len(shapes) - len(names)]
                keywords = {**constants, **dict(zip(names, shapes[len(positional):]))}
                tg = trace(self.template, positional, self.loss_fn, example_kwargs=keywords,
                           input_grads=bool(self.plan.model.get("input_grads")))
            self.programs[key] = PlannedProgram(tg, self.plan, self.mesh, self.profile, self.bucket_mb,
                                                 self.overlap, self.compute_loss, compile=self.compile,
                                                 accumulate=self.accumulate)
            if self.seed is not None:
                self.programs[key]._base_seed = int(self.seed)
        return self.programs[key]

    def reduce_gradients(self) -> None:
        """Move the gradients the backward accumulated unreduced (``accumulate``) to their
        parameters' specs, once (DTensor's redistribution: an all-reduce, a reduce-scatter ...),
        into each parameter's ``.grad``."""
        from autoshard._torch_compat import placements_for

        params = dict(self.model.named_parameters())
        for program in self.programs.values():
            for fqn, g in program.pending.items():
                p = params[fqn]
                moved = g.redistribute(self.mesh, placements_for(self.plan.param_spec(fqn), self.mesh))
                p.grad = moved if p.grad is None else p.grad + moved
            program.pending = {}
            program.end_step()

    def discard_gradients(self) -> None:
        """Drop what the backwards accumulated (a pipeline stage's metadata inference runs one)."""
        for program in self.programs.values():
            program.pending = {}
            program.end_step()

    def __call__(self, *args, **kwargs):
        names = self.plan.keyword_inputs
        positional = len(self.input_specs) - len(names)
        tensor_kw = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        constants = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        if len(args) != positional or any(not isinstance(a, torch.Tensor) for a in args):
            types = [type(a).__name__ for a in args]
            raise PlanError(f"forward got {len(args)} positional arguments of types {types}, the plan was made for "
                            f"{positional} tensors")
        if set(tensor_kw) != set(names):
            raise PlanError(f"forward got tensor keyword inputs {sorted(tensor_kw)}, the plan was made for "
                            f"{sorted(names)}")
        inputs = list(args) + [tensor_kw[k] for k in names]
        dist_inputs = [in_planned_spec(a, self.mesh, spec) if isinstance(a, DTensor)
                       else distribute(a, self.mesh, spec, src_data_rank=None)
                       for a, spec in zip(inputs, self.input_specs)]
        program = self.program(dist_inputs, constants)
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        flat = [params[f] for f in program.tg.param_fqns] + [buffers[f] for f in program.tg.buffer_fqns]
        outs = iter(StepFunction.apply(program, *flat, *dist_inputs))
        if self.compute_loss:
            return next(outs)
        leaves = [next(outs) if isinstance(v, torch.fx.Node) else v for v in program.tg.outputs]
        return torch.utils._pytree.tree_unflatten(leaves, program.tg.output_tree)


@fewer_gc_passes()
def parallelize(model: nn.Module, plan: Plan, mesh, *, init_fn=None, full_state_dict: dict | None = None,
                loss_fn=None, profile=None, bucket_mb: float = 25.0, overlap: bool = True,
                compute_loss: bool = False, compile: bool | str = False, seed: int | None = None,
                accumulate_gradients: bool = False) -> nn.Module:
    """Shard ``model`` in place as ``plan`` says and return it.

    Parameters and buffers become DTensors with the planned placements (a tied parameter
    stays one DTensor); each tensor argument of ``forward``, positional or keyword (as planned
    with ``example_kwargs``), is distributed with its planned spec (from the full tensor given
    on every rank; other keyword values must be those planned with). ``forward`` runs the plan's lowered
    forward program (:mod:`autoshard.runtime.lower`, lowered on first call per input shape) and
    returns the model's outputs as DTensors in their planned placements; ``backward`` on any
    loss of them runs the lowered backward program and leaves each gradient in its
    parameter's placement.

    ``loss_fn``: the loss the plan was made with, only needed where it reads a model output
    in a way the plan must know (default: the mean of the output). ``profile``: the plan's
    profile where the plan names one that is neither shipped nor carried in the plan.
    ``bucket_mb``: independent collectives of one kind and group (gradient all-reduces and
    reduce-scatters, parameter all-gathers) are merged into buckets of up to this many MiB
    (torch's bucketing passes on the lowered programs; 0 with ``overlap=False``: exactly one
    collective per planned step). ``overlap``: torch's overlap scheduler starts each collective
    early and waits late, costed by the plan's profile (:mod:`autoshard.runtime.passes`).
    ``compile``: ``torch.compile`` each rank's lowered forward and backward program (``True``:
    Inductor; a string names another backend, e.g. ``"aot_eager"``), whole-graph, static shapes,
    compiled on first use. On real processes only: under LocalTensorMode the programs of every
    rank run side by side, eagerly (the check of what the plan computes).
    ``compute_loss``: ``forward`` returns ``loss_fn(outputs)`` (the plan's loss; default the mean
    of the output), a replicated scalar DTensor, and the loss and its backward run as planned
    inside the lowered programs. The fast path for training: a loss computed outside the model
    runs by DTensor's eager rules instead (correct, but e.g. ``mean``'s backward then builds its
    full-size gradient on every rank). ``loss_fn`` sees the outputs only: targets that change
    per step must be model inputs, or the loss computed outside. ``seed``: the base of the
    random streams (dropout) the programs draw, the same on every rank of ``mesh``; default rank
    0's initial seed, broadcast over the world on the first forward (which every rank must then
    run together: a pipeline stage's mesh passes it instead). ``accumulate_gradients``: backwards
    add their gradients, unreduced, to a buffer and ``model.forward.reduce_gradients()`` reduces
    them into ``.grad`` once (a pipeline stage's microbatches: one reduction per step).

    A model on the meta device is never materialized whole: its parameters become
    meta DTensors, then ``to_empty`` allocates each rank's shards only, and either
    ``init_fn(model)`` initializes them (e.g. a model's ``init_weights``) or
    ``full_state_dict`` (the full tensors, needed on rank 0 only; other ranks pass
    ``{}``) is scattered from rank 0 tensor by tensor (with both, ``init_fn`` runs
    first and computes what no state dict holds, such as RoPE tables). With neither, the shards stay
    uninitialized for a sharded checkpoint load (``torch.distributed.checkpoint``).
    """
    check_mesh(mesh)
    check_plan_matches(model, plan, mesh)
    with quiet_tracing():
        template = unsharded_meta_copy(model)
    on_meta = any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    done: dict[int, nn.Parameter] = {}  # a tied parameter is one DTensor, under each of its names
    done_buffers: dict[int, DTensor] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for name, p in list(mod.named_parameters(recurse=False)):
            if id(p) in done:
                mod.register_parameter(name, done[id(p)])
                continue
            spec = plan.param_spec(prefix + name)
            dt = distribute(p.detach(), mesh, spec)
            # No gradient hook: the lowered backward delivers each gradient in its parameter's
            # spec (DDP's all-reduce, FSDP's reduce-scatter as planned), and a hook per parameter
            # cost 0.2 ms a step each.
            param = nn.Parameter(dt, requires_grad=p.requires_grad)
            mod.register_parameter(name, param)
            done[id(p)] = done[id(param)] = param
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is None:
                continue
            if id(b) not in done_buffers:
                shard = distribute(b, mesh, plan.param_spec(prefix + name))
                done_buffers[id(b)] = done_buffers[id(shard)] = shard
            mod.register_buffer(name, done_buffers[id(b)], persistent=is_persistent_buffer(mod, name))

    if on_meta:
        model.to_empty(device=mesh.device_type)
        if init_fn is None and full_state_dict is not None:
            computed = [f for f, _ in model.named_buffers() if f not in model.state_dict()]
            if computed:
                raise PlanError(f"meta-device model: buffers {computed[:4]} are not in any state dict "
                                "(non-persistent): pass init_fn to compute them")
    if init_fn is not None and on_meta:
        with torch.no_grad():
            init_fn(model)
    if full_state_dict is not None:
        load_full_state_dict(model, full_state_dict)
    if bucket_mb < 0:
        raise ConfigError(f"bucket_mb must be >= 0 (0: one collective per planned step), found {bucket_mb}")
    if not (isinstance(compile, bool) or (isinstance(compile, str) and compile)):
        raise ConfigError(f"compile: expected True, False or a torch.compile backend name, found {compile!r}")
    model.forward = _PlannedForward(model, template, plan, mesh, loss_fn, profile, bucket_mb, overlap, compute_loss,
                                    compile, seed, accumulate_gradients)
    model._autoshard_plan = plan
    return model


@fewer_gc_passes()
def auto_parallel(model: nn.Module, example_inputs, mesh, *, compute_loss: bool = False, bucket_mb: float = 25.0,
                  overlap: bool = True, compile: bool | str = False, options=None, **plan_options) -> nn.Module:
    """Plan ``model`` for ``mesh`` and parallelize it with that plan: one call.

    ``options`` and ``plan_options`` are :class:`~autoshard.options.PlanOptions` (fields as
    keywords: ``memory_budget``, ``loss_fn``, ``example_kwargs`` ...) for :func:`autoshard.plan`;
    ``compute_loss``, ``bucket_mb``, ``overlap`` and ``compile`` go to :func:`parallelize`. On several real
    processes rank 0 plans and broadcasts the plan (a time-limited solve could differ between
    ranks). The plan is kept as ``model._autoshard_plan`` (save it to apply it later without
    planning)."""
    import torch.distributed as dist

    from autoshard.options import resolve
    from autoshard.planning.planner import plan as make_plan

    opts = resolve(options, plan_options)
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    shared = several_processes()
    box = [None]
    if not shared or dist.get_rank() == 0:
        box[0] = make_plan(model, example_inputs, mesh, options=opts).to_json()
    if shared:
        dist.broadcast_object_list(box, src=0)
    # The plan carries its profile (by name when shipped, whole otherwise).
    return parallelize(model, Plan.from_json(box[0]), mesh, loss_fn=opts.loss_fn, compute_loss=compute_loss,
                       bucket_mb=bucket_mb, overlap=overlap, compile=compile)
