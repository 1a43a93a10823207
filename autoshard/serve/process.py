"""Run ``autoshard serve`` as a child process (tests, benchmarks, local tooling)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time


class ServerProcess:
    """``autoshard serve`` on loopback with a given database; ``start`` waits for health."""

    def __init__(self, db: str, *extra: str, workers: int = 2, replica: str | None = None):
        import uuid

        self.db, self.extra, self.workers = db, extra, workers
        # One name across restarts: a restarted replica takes back its jobs at once.
        self.replica = replica or f"local-{uuid.uuid4().hex[:8]}"
        self.log_path = os.path.join(tempfile.gettempdir(), f"autoshard-serve-{self.replica}.log")
        self.log = None

    def output(self) -> str:
        """What the server printed (all its runs under this object)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.url = ""

    def start(self, timeout: float = 60.0) -> "ServerProcess":
        from autoshard.client import PlanClient, ServiceError
        from costmodel.calibrate import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        # A file, not a pipe: nobody reads the server's log while it runs, and a full pipe
        # would block the server.
        self._close_log()
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "autoshard", "serve", "--db", self.db, "--port",
                                      str(self.port), "--workers", str(self.workers), "--replica", self.replica,
                                      *self.extra], stdout=self.log, stderr=subprocess.STDOUT, env=env)
        client = PlanClient(self.url, timeout=5)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                client.health()
                return self
            except ServiceError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"autoshard serve exited: {self.output()[-3000:]}") from None
                time.sleep(0.2)
        raise RuntimeError(f"autoshard serve did not answer on {self.url} within {timeout:g} s")

    def _close_log(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs (what a crash or an OOM kill does)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self._close_log()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_log()
