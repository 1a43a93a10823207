"""The safety net solved beside the overlap objective's rounds, in a forked worker.

``plan()`` compares the solve's plan with the hand-written ones (DDP, FSDP, TP, FSDP+TP,
FSDP+TP+AC, each solved under its pins: :meth:`Planner.hand_written
<autoshard.planning.planner.Planner.hand_written>`) and answers with one where it is predicted
faster. Where the solve's cheap stages proved its additive plan (memory does not bind), nothing
of the solve depends on them, and the overlap objective's rounds that follow run on one core:
the hand-written plans are then solved in a worker forked at that point, on another core, and
only the faster one's name and step come back (LLaMA-8B on (8, 8): the net is 2.5-3 s of
solves). The answer is the one the in-process net gives: the same pinned solves in the
same time, from the same state; where the worker's plan is faster the planner solves that one
plan again under its pins, in process, to assemble it.

No worker where none can be forked (one core, a real process group, a process that is itself a
forked worker: a mesh search's, a pipeline stage's): the net then runs after the solve.
"""

from __future__ import annotations

import multiprocessing
from typing import Callable

#: :meth:`NetAhead.answer` where no worker ran: solve the net in process.
NOT_STARTED = object()


class NetAhead:
    """The hand-written plans of one plan's solve, solved ahead in a worker once :meth:`start`
    is called: ``net()`` returns ``(name, predicted step)`` of the fastest, or None."""

    def __init__(self, net: Callable[[], tuple[str, float] | None]):
        self.net = net
        self.pool = None

    def start(self) -> None:
        """Fork the worker (once; not where no worker may be forked)."""
        from autoshard.planning.shapebound import bounding_workers
        from autoshard.planning.shapeworkers import ShapeWorkers

        if self.pool is not None or multiprocessing.current_process().daemon or bounding_workers(2) < 2:
            return
        net = self.net

        def build(_key):
            return net(), None

        self.pool = ShapeWorkers(1, build, hold=0)
        self.pool.submit(("net",))

    def answer(self):
        """The worker's answer (waits for it), or :data:`NOT_STARTED`."""
        if self.pool is None:
            return NOT_STARTED
        try:
            return self.pool.next()
        finally:
            self.close()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
