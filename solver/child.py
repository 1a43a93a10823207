"""A search in a child interpreter, talking to the caller through files in a private folder.

Children are fresh interpreters (``python -m solver.<module> FOLDER``), not forks: the
caller may hold torch's thread pools, and a spawned ``multiprocessing`` child would re-run
an unguarded ``__main__``. Files are written to a temporary name and renamed, so a reader
never sees half of one.
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
        """``watch``: the child's stdout lines arrive in :attr:`lines` as ``(arrival time, text)``,
        ``(time, None)`` once it closes (a thread reads the pipe, so the child never blocks)."""
        self.dir = tempfile.TemporaryDirectory(prefix=prefix)
        self.folder = Path(self.dir.name)
        write(self.folder / "in.pkl", args)
        root = str(Path(__file__).resolve().parents[1])  # the folder holding the solver package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", f"solver.{module}", str(self.folder)],
                                     env=env, stdout=subprocess.PIPE if watch else subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.lines: queue.Queue = queue.Queue()
        if watch:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            self.lines.put((time.perf_counter(), raw.decode(errors="replace")))
        self.lines.put((time.perf_counter(), None))

    def line(self, timeout: float) -> tuple[float, str | None] | None:
        """The next line (see ``watch``), or None when none came within ``timeout`` seconds."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

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
