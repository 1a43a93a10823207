r"""The number of microbatches of a pipelined step, chosen by solving the pipeline at a few.

With ``p`` pipeline ranks and ``m`` microbatches of a batch ``B``, 1F1B's step is about

    (m + p - 1) * (f(B / m) + b(B / m)) + r

where ``f``, ``b`` are a stage's forward and backward of one microbatch and ``r`` its gradients'
reduction once per step. Fewer microbatches leave a larger bubble (``(p - 1) / (m + p - 1)`` of
the step) and hold larger microbatches in flight (memory); more pay each microbatch's fixed
costs more often (latencies, exchanges that do not shrink with the microbatch) and run smaller
matmuls, down to a microbatch too small to split over the stage's data-parallel ranks (LLaMA-70B
on (pp 8, dp 8, tp 8), batch 512: 3,356 ms at 32 microbatches, 3,506 at 64, 12,025 at 128).
Those effects are the stage plans' own, so each candidate ``m`` is priced by planning the
pipeline at it (:func:`autoshard.planning.pipeline.plan_pipeline`), and the search visits few:

- candidates (:func:`candidates`): the ``m`` that divide the batch, that torch's schedule can run
  (:func:`autoshard.planning.schedule.check_schedule`), and with ``m >= p`` (below, the
  pipeline never fills: every rank idles more than half the step);
- a climb (:func:`climb`) over them in increasing order from a start (:func:`start`: four
  microbatches per pipeline rank, where 1F1B's bubble is ``(p - 1) / (5 p - 1)``, about a fifth):
  the start and its two neighbours are planned, then one more step in the direction that
  improved, until a candidate is no slower than both its neighbours. A candidate that breaks
  the memory budget counts as infinitely slow, so the climb leaves it toward the side that fits.

The step in ``m`` is not proved unimodal (a stage plan can change its recomputation between two
counts), so the climb finds a local best among the candidates; every count planned is recorded
in the plan (``PipelinePlan.microbatch_search``) with its step.
"""

from __future__ import annotations

import math
from typing import Callable

from autoshard.errors import ConfigError
from autoshard.planning.schedule import check_schedule


def candidates(batch: int, ranks: int, schedule: str, stages_per_rank: int = 1) -> list[int]:
    """The microbatch counts a pipeline of ``ranks`` ranks may run a batch of ``batch`` in,
    increasing (module doc)."""
    out = []
    for m in range(max(1, ranks), batch + 1):
        if batch % m:
            continue
        try:
            check_schedule(schedule, ranks, m, stages_per_rank)
        except ConfigError:
            continue
        out.append(m)
    if not out:
        raise ConfigError(f"microbatches='auto': no count m >= {ranks} (the pipeline ranks) divides the batch "
                          f"{batch} and runs under {schedule!r}; give a batch of at least {ranks} that the "
                          "pipeline ranks divide, or microbatches=N")
    return out


def start(counts: list[int], ranks: int) -> int:
    """The index in ``counts`` the climb starts from: the count nearest ``4 * ranks`` (ties: the
    larger), in ratio."""
    target = 4 * ranks
    return min(range(len(counts)), key=lambda k: (abs(math.log(counts[k] / target)), -counts[k]))


def climb(counts: list[int], first: int, step_of: Callable[[int], float]) -> tuple[int, dict[int, float]]:
    """(the count of least step found, every count planned -> its step): from ``counts[first]``
    and its neighbours, one step at a time toward the smaller step until a count is no slower
    than both its neighbours (module doc). ``step_of(m)``: the step planned at ``m``, ``inf``
    where it does not fit or was not planned; it is called once per count at most, and a
    ``StopIteration`` it raises ends the climb with what was found."""
    steps: dict[int, float] = {}

    def at(k: int) -> float:
        if not 0 <= k < len(counts):
            return math.inf
        if counts[k] not in steps:
            steps[counts[k]] = step_of(counts[k])
        return steps[counts[k]]

    best = first
    try:
        at(best)
        while True:
            lower, upper = at(best - 1), at(best + 1)
            here = steps[counts[best]]
            if math.isinf(min(here, lower, upper)):
                # Nothing fits here or beside: on to the nearest count not planned yet, more
                # microbatches (less in flight) first.
                nxt = _unvisited_side(counts, best, steps)
                if nxt is None:
                    break
                best = nxt
                at(best)
                continue
            if here <= min(lower, upper):
                break
            best = best - 1 if lower < upper else best + 1
    except StopIteration:
        pass
    done = [m for m in counts if m in steps]
    chosen = min(done, key=lambda m: (steps[m], m))
    return chosen, steps


def _unvisited_side(counts: list[int], k: int, steps: dict[int, float]) -> int | None:
    """The nearest index not planned yet above ``k`` (more microbatches), else below it; None
    where every count is planned."""
    for j in list(range(k + 1, len(counts))) + list(range(k - 1, -1, -1)):
        if counts[j] not in steps:
            return j
    return None
