"""Forked worker processes that build each mesh shape once and keep it for the work that follows.

A mesh search (:mod:`autoshard.planning.meshsearch`) bounds every shape: it builds the shape's problem and
solves it with memory ignored (and, where memory binds, its hand-written plans). The few shapes
worth solving are then solved; built again in the searching process, each solve first paid for
the build and the stages the bounding had done (LLaMA-70B on a 3-D mesh: about 3 s of a 10 s
solve). Here each worker keeps what it built, by shape, and a later request for that shape runs
in the worker that holds it:

    pool = ShapeWorkers(workers=2, build=bound_fn, hold=3)
    pool.submit(shape, *args)           # build(shape, *args) -> (reply, kept) in an idle worker
    reply = pool.next()                 # the reply of the build submitted first, of those running
    out = pool.run(shape, fn, *args)    # fn(kept, *args) where ``shape`` is held; HELD_NOT if not
    pool.start(shape, fn, *args)        # the same without waiting (False where not held) ...
    shape, out = pool.next_run()        # ... and its answer, the first started of those running
    pool.abandon([shape])               # stop a run: its worker ends, what it kept is lost
    pool.keep(ranked)                   # each worker keeps at most ``hold`` of these, the first first

Workers are forked, so ``build`` and ``fn`` are module-level functions or closures made before
the pool (nothing of theirs is pickled); replies and arguments are pickled. An exception in a
worker is raised here as itself (or, where it does not pickle, as a ``RuntimeError`` with its
traceback). Requests run one at a time per worker; :meth:`run` waits for its answer, while
:meth:`start` lets shapes held by different workers run at once (a search's solves, one per core).

Answers come back in the order their requests were sent, not the order they finish: what the
caller decides from them (which shape to prune, which to solve next, when its stall rule
ends the search) then does not depend on which worker the machine ran faster, and the same
inputs give the same search (issue "reproducible solves").
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback
from collections.abc import Callable, Sequence

#: What :meth:`ShapeWorkers.run` answers for a shape no worker holds (never built in a worker,
#: or dropped): the caller builds it itself.
HELD_NOT = object()


def _serve(conn, build: Callable) -> None:
    """A worker's loop: requests in, replies out, until ``None`` comes or the pipe closes."""
    held: dict = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        kind, shape, payload = msg
        try:
            if kind == "build":
                reply, kept = build(shape, *payload)
                if kept is not None:
                    held[shape] = kept
                out = ("ok", reply, kept is not None)
            elif kind == "run":
                fn, args = payload
                out = ("ok", fn(held[shape], *args), True) if shape in held else ("missing", None, False)
            else:  # "drop"
                for s in payload:
                    held.pop(s, None)
                continue
        except BaseException as exc:  # raised in the parent as itself
            out = ("raise", exc, traceback.format_exc())
        try:
            conn.send(out)
        except (pickle.PicklingError, TypeError, AttributeError):
            conn.send(("raise", None, out[2] if out[0] == "raise" else traceback.format_exc()))


class ShapeWorkers:
    """``workers`` forked processes, each keeping what ``build`` made of the shapes it built (at
    most ``hold`` of them once :meth:`keep` ranks them). See the module doc."""

    def __init__(self, workers: int, build: Callable, hold: int = 3):
        if workers < 1 or hold < 0:
            raise ValueError(f"expected workers >= 1 and hold >= 0, found {workers} and {hold}")
        ctx = multiprocessing.get_context("fork")
        self.hold = hold
        self.conns: list = []
        self.procs: list = []
        for _ in range(workers):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(theirs, build), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)
        self.busy: dict[int, tuple] = {}
        """Worker index -> the shape it builds."""
        self.running_fn: dict[int, tuple] = {}
        """Worker index -> the shape it runs a function on (:meth:`start`)."""
        self.dead: set[int] = set()
        """Workers ended by :meth:`abandon`: they take no more work."""
        self.holder: dict[tuple, int] = {}
        """Shape -> the worker that keeps it."""
        self.sent: dict[int, int] = {}
        """Worker index -> when its running request was sent (a counter): answers go oldest first."""
        self._sent = 0

    @property
    def running(self) -> set[tuple]:
        return set(self.busy.values())

    def has_room(self) -> bool:
        return any(self.idle(k) for k in range(len(self.conns)))

    def submit(self, shape: tuple, *args) -> None:
        """``build(shape, *args)`` in an idle worker (there must be one: :meth:`has_room`)."""
        k = next(k for k in range(len(self.conns)) if self.idle(k))
        self.conns[k].send(("build", shape, args))
        self.busy[k] = shape
        self._stamp(k)

    def _stamp(self, k: int) -> None:
        self._sent += 1
        self.sent[k] = self._sent

    def next(self):
        """The reply of the build submitted first of those running (waits for it)."""
        if not self.busy:
            raise RuntimeError("no build is running")
        k = min(self.busy, key=self.sent.__getitem__)
        shape = self.busy.pop(k)
        status, reply, kept = self._recv(k)
        if kept:
            self.holder[shape] = k
        return reply

    def held(self, shape: tuple) -> int | None:
        """The index of the worker that keeps ``shape``, or None."""
        return self.holder.get(shape)

    def idle(self, k: int) -> bool:
        """Whether worker ``k`` neither builds nor runs (nor was ended)."""
        return k not in self.busy and k not in self.running_fn and k not in self.dead

    def start(self, shape: tuple, fn: Callable, *args) -> bool:
        """``fn(kept, *args)`` started in the worker that keeps ``shape``, which must be idle
        (:meth:`idle`); its answer is :meth:`next_run`'s. False where no worker keeps it."""
        k = self.holder.get(shape)
        if k is None:
            return False
        if not self.idle(k):  # a worker answers one request at a time
            raise RuntimeError(f"worker {k} is busy with {self.busy.get(k) or self.running_fn[k]}: "
                               f"start({shape}) must wait for its answer")
        self.conns[k].send(("run", shape, (fn, args)))
        self.running_fn[k] = shape
        self._stamp(k)
        return True

    def next_run(self, k: int | None = None):
        """(shape, answer) of the run started first of those running (worker ``k``'s where
        given), the answer :data:`HELD_NOT` where the worker had dropped the shape."""
        if not self.running_fn:
            raise RuntimeError("no run is running")
        if k is None:
            k = min(self.running_fn, key=self.sent.__getitem__)
        shape = self.running_fn.pop(k)
        status, reply, _ = self._recv(k)
        if status == "missing":
            del self.holder[shape]
            return shape, HELD_NOT
        return shape, reply

    def abandon(self, shapes: Sequence[tuple] | None = None) -> list[tuple]:
        """Stop the runs started on ``shapes`` (default: every one) and not yet answered: each one's
        worker is ended (what it kept is lost: :meth:`run` then answers :data:`HELD_NOT` for those
        shapes). Returns the shapes whose runs were stopped."""
        stopped = []
        for k, shape in sorted(self.running_fn.items()):
            if shapes is not None and shape not in shapes:
                continue
            self.procs[k].terminate()
            self.procs[k].join()
            stopped.append(shape)
            for s in [s for s, w in self.holder.items() if w == k]:
                del self.holder[s]
            self.dead.add(k)
            del self.running_fn[k]
        return stopped

    def run(self, shape: tuple, fn: Callable, *args):
        """``fn(kept, *args)`` in the worker that keeps ``shape``, waiting for its answer;
        :data:`HELD_NOT` where no worker keeps it. The worker must be idle (:meth:`start`)."""
        if not self.start(shape, fn, *args):
            return HELD_NOT
        return self.next_run(self.holder[shape])[1]

    def keep(self, ranked: Sequence[tuple]) -> None:
        """Each worker keeps the first ``hold`` of ``ranked`` it holds and drops every other
        shape (a shape pruned, or ranked below: its memory goes back)."""
        order = {shape: i for i, shape in enumerate(ranked)}
        for k, conn in enumerate(self.conns):
            mine = sorted((s for s, w in self.holder.items() if w == k), key=lambda s: order.get(s, len(order)))
            gone = [s for i, s in enumerate(mine) if s not in order or i >= self.hold]
            if gone:
                conn.send(("drop", None, gone))
                for s in gone:
                    del self.holder[s]

    def _recv(self, k: int):
        try:
            status, reply, extra = self.conns[k].recv()
        except EOFError:  # killed (out of memory?) or exited: its work is lost, say so
            self.procs[k].join(timeout=1.0)
            raise RuntimeError(f"mesh search worker {k} (pid {self.procs[k].pid}) ended without answering, "
                               f"exit code {self.procs[k].exitcode} (a negative code is the signal that "
                               "killed it: -9 is often the out-of-memory killer)") from None
        if status == "raise":
            if isinstance(reply, BaseException):
                raise reply
            raise RuntimeError(f"a mesh search worker failed:\n{extra}")
        return status, reply, extra

    def close(self) -> None:
        for k, conn in enumerate(self.conns):
            if k in self.dead:
                continue
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=1.0)
            if proc.is_alive():
                proc.terminate()
                proc.join()
        for conn in self.conns:
            conn.close()
