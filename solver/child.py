"""A search in a child interpreter, talking to the caller through files in a private folder.

Children are fresh interpreters (``python -m solver.<module> FOLDER``), not forks: the
caller may hold torch's thread pools, and a spawned ``multiprocessing`` child would re-run
an unguarded ``__main__``. Files are written to a temporary name and renamed, so a reader
never sees half of one.

A watched child's lines carry two times: when they arrived (the caller's wall clock) and how
much CPU the child had used by then (:meth:`Child.cpu`): work, which a busy machine does not
stretch, so a rule that ends a search by it ends it at the same point of the search in every
run (issue "reproducible solves": LLaMA-70B's exact search ran 11 s in one run and 20 s in
another, ending at different plans, as the wall clock its stall rule read was shared).
"""

from __future__ import annotations

import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_seconds(pid: int) -> float | None:
    """CPU seconds (user and system) process ``pid`` has used, from ``/proc``; None where that
    cannot be read (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces, inside parentheses): utime and stime
    # are the 14th and 15th of the line.
    fields = data[data.rindex(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def write(path: Path, value) -> None:
    """Pickle ``value`` to ``path`` atomically."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def read(path: Path):
    """The value last written to ``path`` by :func:`write`, or None when there is none yet."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None


class Child:
    """``python -m solver.<module> FOLDER`` with ``FOLDER/in.pkl`` holding ``args``."""

    def __init__(self, module: str, args, prefix: str, watch: bool = False):
        """``watch``: the child's stdout lines arrive in :attr:`lines` as ``(arrival time, the
        child's CPU seconds then, text)``, with text None once it closes (a thread reads the pipe,
        so the child never blocks)."""
        self.dir = tempfile.TemporaryDirectory(prefix=prefix)
        self.folder = Path(self.dir.name)
        write(self.folder / "in.pkl", args)
        root = str(Path(__file__).resolve().parents[1])  # the folder holding the solver package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self._start([sys.executable, "-m", f"solver.{module}", str(self.folder)], env, watch)

    @classmethod
    def command(cls, argv: list[str], prefix: str = "solver-child-", watch: bool = True) -> Child:
        """A child running ``argv`` itself (its folder empty, no ``in.pkl``), watched as any."""
        self = cls.__new__(cls)
        self.dir = tempfile.TemporaryDirectory(prefix=prefix)
        self.folder = Path(self.dir.name)
        self._start(argv, None, watch)
        return self

    def _start(self, argv: list[str], env: dict | None, watch: bool) -> None:
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE if watch else subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.lines: queue.Queue = queue.Queue()
        self._cpu = 0.0
        # Where /proc cannot be read the work clock is the wall clock (as every rule read before).
        self.cpu_clock = process_seconds(os.getpid()) is not None
        if watch:
            threading.Thread(target=self._read, daemon=True).start()

    def cpu(self) -> float:
        """The child's CPU seconds so far (the last reading once it has exited); the caller's wall
        clock where ``/proc`` cannot be read (:attr:`cpu_clock` False)."""
        if not self.cpu_clock:
            return time.perf_counter()
        now = process_seconds(self.proc.pid)
        if now is not None:
            self._cpu = max(self._cpu, now)
        return self._cpu

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.put((time.perf_counter(), self.cpu(), raw.decode(errors="replace")))
        self.lines.put((time.perf_counter(), self.cpu(), None))

    def timed_line(self, timeout: float) -> tuple[float, float, str | None] | None:
        """The next line with both its times (see ``watch``), or None when none came within
        ``timeout`` seconds."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def line(self, timeout: float) -> tuple[float, str | None] | None:
        """The next line and when it arrived (see ``watch``), or None when none came within
        ``timeout`` seconds."""
        got = self.timed_line(timeout)
        return None if got is None else (got[0], got[2])

    def pending(self) -> bool:
        """Whether lines have come that :meth:`line` has not handed out yet."""
        return not self.lines.empty()

    def wait(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds; whether the child has exited. Raises when it failed."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        if self.proc.returncode != 0:
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            raise RuntimeError(f"the solver's child process {self.proc.args[2]} failed "
                               f"(exit {self.proc.returncode}):\n{err}")
        return True

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream:
                stream.close()
        self.dir.cleanup()
