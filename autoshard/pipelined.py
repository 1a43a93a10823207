"""Run a pipelined plan: this rank's stages, parallelized as planned, in torch's schedule.

:func:`pipeline_schedule` splits the model as the plan was made (torch's splitter, a split
point at each stage's first layer), parallelizes each of this rank's stage modules with its
stage's plan on the sub-mesh (:func:`autoshard.parallelize`: DTensor parameters, the plan's
lowered forward and backward programs), wraps each in torch's ``PipelineStage`` over the
pipeline axis's process group and returns torch's schedule for them (``Schedule1F1B``,
``ScheduleGPipe``, ``ScheduleInterleaved1F1B``): ``schedule.step(inputs, target=...)`` on
every rank runs one training step, the loss on the last stage.

Between stages the boundary activation is a DTensor on the sub-mesh; a stage whose output spec
differs from the next stage's planned input spec hands it over in that spec (DTensor's
redistribution, before the send). A stage gathers the weights its plan holds (``Plan.held``) in
its step's first forward and its later microbatches' forwards reuse them (the lowered program of
:meth:`~autoshard.runtime.program.PlannedProgram.forward_held_program`), until the step's
gradients are reduced. Each microbatch's backward adds its gradients, unreduced
(its plan's spec before the move to the parameter's), to a buffer; after the last one the
stage moves them to their parameters' specs once (torch calls ``perform_reduce_grad`` there,
where it has FSDP reduce), then the schedule divides them by the microbatch count
(``scale_grads``), as the loss of the whole batch is the mean of the microbatches' losses.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from autoshard._torch_compat import pipeline_stage_class
from autoshard.errors import ConfigError, PlanError
from autoshard.graph.layers import layer_groups
from autoshard.mesh import axis_names_of, several_processes
from costmodel.spec import Spec


class _Boundary(nn.Module):
    """A parallelized stage module whose output is handed to the next stage in its planned input spec."""

    def __init__(self, stage: nn.Module, mesh, out_spec: Spec | None):
        super().__init__()
        self.stage, self.mesh, self.out_spec = stage, mesh, out_spec

    def forward(self, *args):
        from autoshard.apply import in_planned_spec

        out = self.stage(*args)
        if self.out_spec is not None and isinstance(out, DTensor):
            out = in_planned_spec(out, self.mesh, self.out_spec)
        return out


def _reduce(stage) -> None:
    stage.submod.stage.forward.reduce_gradients()


def _discard(stage) -> None:
    stage.submod.stage.forward.discard_gradients()


def pipeline_schedule(model: nn.Module, pplan, mesh, example_inputs, *, loss_fn, bucket_mb: float = 25.0,
                      overlap: bool = True):
    """(torch's schedule for this rank's stages of ``pplan``, those stage modules). ``example_inputs``:
    one batch of the model's inputs (the microbatches' shapes follow from it); ``loss_fn(output,
    target)``: the loss of the last stage's output, a mean over the microbatch."""
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    from autoshard.apply import parallelize
    from autoshard.planning.pipeline import split_batch, split_stages, stage_plan, sub_mesh

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    names = axis_names_of(mesh)
    if list(mesh.shape) != list(pplan.mesh_shape) or names != list(pplan.axis_names):
        raise PlanError(f"pipeline plan was made for mesh {dict(zip(pplan.axis_names, pplan.mesh_shape))}, "
                        f"the mesh given is {dict(zip(names, mesh.shape))}")
    groups = [g for g in layer_groups(model) if g[0].rpartition(".")[0] == pplan.group]
    total = pplan.stages[-1].layers[1]
    if not groups or len(groups[0]) != total:
        raise PlanError(f"pipeline plan cuts {total} layers of {pplan.group!r}; {type(model).__name__} has "
                        f"{[(g[0].rpartition('.')[0], len(g)) for g in layer_groups(model)]}")
    counts = [s.layers[1] - s.layers[0] for s in pplan.stages]
    mb = split_batch(example_inputs, pplan.microbatches)
    modules = split_stages(model, mb, groups[0], counts)
    sub = sub_mesh(mesh, pplan.axis)
    pp_rank = mesh.get_local_rank(pplan.axis)
    group = mesh.get_group(pplan.axis)
    device = torch.device(mesh.device_type)
    # Every rank is here together: rank 0's seed for every stage's random streams.
    box = [int(torch.initial_seed())]
    if several_processes():
        dist.broadcast_object_list(box, src=0)
    # torch's stage whose module's gradients, accumulated unreduced over the microbatches, are
    # reduced once where torch has FSDP reduce them (before the schedule scales them), and which
    # discards what torch's metadata inference's backward (first step, made-up inputs) added.
    stage_cls = pipeline_stage_class(_reduce, _discard)
    stages, mods = [], []
    for st in pplan.stages:
        if st.rank != pp_rank:
            continue
        mod = parallelize(modules[st.index], stage_plan(pplan, st), sub, bucket_mb=bucket_mb, overlap=overlap,
                          loss_fn=None, seed=box[0] + 1000003 * st.index, accumulate_gradients=True)
        nxt = st.index + 1
        out_spec = Spec.parse(pplan.stages[nxt].plan.inputs[0]) if nxt < len(pplan.stages) else None
        wrapped = _Boundary(mod, sub, out_spec)
        mods.append(wrapped)
        # Every boundary DTensor lives on the sub-mesh.
        stages.append(stage_cls(wrapped, st.index, len(pplan.stages), device, group=group,
                                get_mesh=lambda names, layout: sub))
    if not stages:
        raise ConfigError(f"pipeline rank {pp_rank} holds no stage of the plan")
    if pplan.schedule == "interleaved_1f1b":
        schedule = ScheduleInterleaved1F1B(stages, pplan.microbatches, loss_fn=loss_fn)
    else:
        cls = Schedule1F1B if pplan.schedule == "1f1b" else ScheduleGPipe
        schedule = cls(stages[0], pplan.microbatches, loss_fn=loss_fn)
    return schedule, mods
