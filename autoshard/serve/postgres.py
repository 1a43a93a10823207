"""A throwaway PostgreSQL server on loopback, from the binaries a distribution installed.

For tests, benchmarks and trying replicas on one machine (a production service points
``autoshard serve --db postgresql://...`` at the cluster's own database):

    with LocalPostgres() as pg:
        url = pg.url            # postgresql://postgres@127.0.0.1:PORT/postgres
        ...

The server refuses to run as root, so as root it runs as the ``postgres`` user that
the distribution's package creates (``runuser``); the data and socket directories
are private to it and removed on stop.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def postgres_bin() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``: ``$AUTOSHARD_PG_BIN``, the PATH, or
    the newest Debian/Ubuntu ``/usr/lib/postgresql/<version>/bin``."""
    env = os.environ.get("AUTOSHARD_PG_BIN")
    if env:
        return Path(env) if (Path(env) / "initdb").exists() else None
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    dirs = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda d: int(Path(d).parent.name)
                  if Path(d).parent.name.isdigit() else 0)
    return Path(dirs[-1]) if dirs and (Path(dirs[-1]) / "initdb").exists() else None


class LocalPostgres:
    def __init__(self, port: int | None = None):
        self.bin = postgres_bin()
        if self.bin is None:
            raise RuntimeError("no PostgreSQL server binaries found (initdb, pg_ctl): install the distribution's "
                               "postgresql package or set AUTOSHARD_PG_BIN to their directory")
        self.port = port
        self.dir: Path | None = None
        self.user: str | None = None

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *cmd: str) -> None:
        argv = [str(self.bin / cmd[0]), *cmd[1:]]
        if self.user:
            argv = ["runuser", "-u", self.user, "--", *argv]
        proc = subprocess.run(argv, capture_output=True, text=True)
        if proc.returncode != 0:
            log = (self.dir / "log").read_text()[-2000:] if self.dir and (self.dir / "log").exists() else ""
            raise RuntimeError(f"{' '.join(cmd[:2])} failed ({proc.returncode}): {proc.stderr[-2000:]}{log}")

    def start(self) -> "LocalPostgres":
        from costmodel.calibrate import free_port

        self.port = self.port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="autoshard-pg-"))
        if os.geteuid() == 0:
            import pwd

            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root and no 'postgres' user exists: PostgreSQL refuses to run "
                                   "as root (the distribution's package creates that user)") from None
            self.user = "postgres"
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", str(self.dir / "data"), "-A", "trust", "-U", "postgres", "--no-sync")
        # fsync off: a test server trades durability on power loss for speed; the service's
        # own crash tests kill the service, not the database.
        opts = f"-k {self.dir} -p {self.port} -h 127.0.0.1 -c fsync=off -c max_connections=200"
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-o", opts, "-l", str(self.dir / "log"), "-w",
                  "-t", "60", "start")
        return self

    def stop(self) -> None:
        if self.dir is None:
            return
        try:
            self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> "LocalPostgres":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
