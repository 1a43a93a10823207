"""A search in a child interpreter, talking to the caller through files in a private folder.

Children are fresh interpreters (``python -m solver.<module> FOLDER``), not forks: the
caller may hold torch's thread pools, and a spawned ``multiprocessing`` child would re-run
an unguarded ``__main__``. Files are written to a temporary name and renamed, so a reader
never sees half of one.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
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

    def __init__(self, module: str, args, prefix: str):
        self.dir = tempfile.TemporaryDirectory(prefix=prefix)
        self.folder = Path(self.dir.name)
        write(self.folder / "in.pkl", args)
        root = str(Path(__file__).resolve().parents[1])  # the folder holding the solver package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", f"solver.{module}", str(self.folder)],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

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
        if self.proc.stderr:
            self.proc.stderr.close()
        self.dir.cleanup()
