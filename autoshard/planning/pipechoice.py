r"""Pipelining allowed: the plan with stages over a mesh axis and the plan without, the faster kept.

A pipeline pays where the data-parallel traffic it removes outweighs its bubble (LLaMA-3.1-405B
on (8, 16, 8): 18.2 s a step pipelined over the first axis against 68.6 s without) and loses
where it does not (LLaMA-8B on 64 ranks, whose plan keeps every rank busy). Which holds depends
on the model, the batch, the mesh and the links, so :func:`plan_or_pipeline` plans both on the
mesh given and keeps the one of least predicted step:

- **flat**: :func:`autoshard.plan` on the whole mesh, the pipeline axis one more axis of its
  placements (the plan a caller without pipelining gets, unchanged);
- **pipelined**: :func:`autoshard.planning.pipeline.plan_pipeline` over ``axis`` (stages,
  partition, microbatches, schedule), each stage planned on the other axes.

The pipelined plan is kept only where its step is strictly below the flat one's; a plan that
cannot meet the memory budget counts as infinitely slow, and a model that cannot be pipelined
(no repeated layers, a batch the pipeline ranks do not divide: any of autoshard's errors from
the pipeline's planning) leaves the flat plan, the reason recorded. Both are made within
``time_limit``: the flat plan in a forked worker while this process plans the pipeline (its
stages' own workers beside it), both given the whole limit, so the pair takes about as long as
the slower of the two; where no worker may be forked (one core, a real process group, a process
that is itself a worker) the flat plan is made first in half the limit, the pipeline in what is
left.

The answer records both (``pipeline_choice``: each alternative's step, peak or error, seconds;
which was kept): ``plan.summary["pipeline_choice"]`` for a flat plan,
``PipelinePlan.choice`` for a pipelined one, shown by ``describe()`` and ``explain``.
"""

from __future__ import annotations

import logging
import multiprocessing
import time

import torch

from autoshard.errors import AutoshardError, MemoryBudgetError, first_line
from autoshard.planfile import Plan
from autoshard.planning.pipeline import PipelinePlan, plan_pipeline
from autoshard.plansummary import pipeline_choice_line

log = logging.getLogger(__name__)

#: The share of ``time_limit`` the flat plan gets where it cannot be made beside the pipeline.
SEQUENTIAL_FLAT_SHARE = 0.5


def plan_or_pipeline(model: torch.nn.Module, example_inputs, mesh, *, axis: str = "pp",
                     microbatches: int | str = "auto", schedule: str = "1f1b", stages_per_rank: int = 1,
                     loss_fn=None, **overrides) -> Plan | PipelinePlan:
    """The faster of ``model``'s plan on ``mesh`` and its plan pipelined over ``axis`` (module
    docstring). ``microbatches``, ``schedule``, ``stages_per_rank`` are the pipeline's
    (:func:`~autoshard.planning.pipeline.plan_pipeline`); other keywords are
    :class:`~autoshard.options.PlanOptions` fields for both (``time_limit`` bounds the pair)."""
    from autoshard.options import resolve
    from autoshard.planning.pipeline import sub_mesh

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    sub_mesh(mesh, axis)  # a bad axis is the caller's error, not a reason to plan without a pipeline
    limit = float(resolve(None, overrides).time_limit)
    t0 = time.perf_counter()
    flat_kw = dict(overrides, loss_fn=loss_fn) if loss_fn is not None else dict(overrides)

    def flat(seconds: float):
        from autoshard.planning.planner import plan

        t = time.perf_counter()
        try:
            got = plan(model, example_inputs, mesh, **dict(flat_kw, time_limit=seconds))
        except MemoryBudgetError as exc:
            return exc, time.perf_counter() - t
        return got, time.perf_counter() - t

    def pipelined(seconds: float):
        t = time.perf_counter()
        try:
            got = plan_pipeline(model, example_inputs, mesh, axis=axis, microbatches=microbatches, schedule=schedule,
                                stages_per_rank=stages_per_rank, loss_fn=loss_fn,
                                **dict(overrides, time_limit=seconds))
        except AutoshardError as exc:  # a budget it cannot meet, a model it cannot cut, a trace it cannot make
            return exc, time.perf_counter() - t
        return got, time.perf_counter() - t

    beside = _may_fork()
    if beside:
        from autoshard.planning.shapeworkers import ShapeWorkers

        pool = ShapeWorkers(1, lambda _key: (flat(limit), None), hold=0)
        try:
            pool.submit(("flat",))
            piped, piped_s = pipelined(limit)
            flat_got, flat_s = pool.next()
        finally:
            pool.close()
    else:
        flat_got, flat_s = flat(limit * SEQUENTIAL_FLAT_SHARE)
        piped, piped_s = pipelined(max(1.0, limit - (time.perf_counter() - t0)))
    rows = [_row("flat", flat_got, flat_s), _row("pipeline", piped, piped_s)]
    flat_us = rows[0].get("step_us", float("inf"))
    piped_us = rows[1].get("step_us", float("inf"))
    if isinstance(flat_got, MemoryBudgetError) and isinstance(piped, Exception):
        floors = [e.min_feasible_bytes for e in (flat_got, piped) if isinstance(e, MemoryBudgetError)]
        raise MemoryBudgetError(f"no plan fits the memory budget with or without a pipeline over {axis!r}: "
                                f"without: {first_line(flat_got)}; pipelined: {first_line(piped)}",
                                flat_got.budget_bytes, min(floors))
    chosen = "pipeline" if piped_us < flat_us else "flat"
    choice = {"axis": axis, "chosen": chosen, "alternatives": rows, "beside": beside,
              "seconds": round(time.perf_counter() - t0, 3)}
    log.info(pipeline_choice_line(choice).strip())
    if chosen == "pipeline":
        piped.choice = choice
        return piped
    flat_got.summary["pipeline_choice"] = choice
    return flat_got


def _may_fork() -> bool:
    """Whether the flat plan may be made in a forked worker beside the pipeline's (which forks
    its own: a daemonic worker could not)."""
    from autoshard.planning.shapebound import bounding_workers

    return not multiprocessing.current_process().daemon and bounding_workers(2) >= 2


def _row(kind: str, got, seconds: float) -> dict:
    row = {"kind": kind, "seconds": round(seconds, 3)}
    if isinstance(got, Exception):
        return dict(row, error=first_line(got))
    if isinstance(got, PipelinePlan):
        return dict(row, step_us=round(got.step_us, 3), peak_mem_bytes=int(max(got.memory_bytes)),
                    microbatches=got.microbatches, stages=len(got.stages))
    return dict(row, step_us=round(got.summary["step_us"], 3), peak_mem_bytes=int(got.summary["peak_mem_bytes"]))

