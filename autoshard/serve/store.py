"""The service's SQLite store: jobs, plans, profiles; the schema migrates forward.

One file holds everything. The API process and the solve workers (separate
processes) each open their own connection; WAL mode lets readers run beside a
writer. Every state change is one transaction, so a plan is either stored whole
with its job marked done, or not at all.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid

#: Schema migrations, applied in order from the stored version: never edit one, append.
MIGRATIONS = [
    """
    CREATE TABLE jobs (id TEXT PRIMARY KEY, kind TEXT NOT NULL, key TEXT NOT NULL, status TEXT NOT NULL,
                       phase TEXT, request TEXT NOT NULL, error TEXT, created REAL, updated REAL);
    CREATE INDEX jobs_key ON jobs(key);
    CREATE INDEX jobs_status ON jobs(status);
    CREATE TABLE plans (key TEXT PRIMARY KEY, kind TEXT NOT NULL, body TEXT NOT NULL, summary TEXT,
                        created REAL);
    CREATE TABLE profiles (id TEXT PRIMARY KEY, name TEXT, body TEXT NOT NULL, created REAL);
    CREATE TABLE counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
    """,
    # v2: how many times a job was started (a restart re-runs interrupted jobs).
    "ALTER TABLE jobs ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0;",
]

ACTIVE = ("queued", "running")


class Store:
    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self.db = sqlite3.connect(path, check_same_thread=False, timeout=30, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self._migrate()

    def _migrate(self) -> None:
        with self._lock:
            self.db.execute("CREATE TABLE IF NOT EXISTS schema (version INTEGER NOT NULL)")
            row = self.db.execute("SELECT version FROM schema").fetchone()
            version = row[0] if row else 0
            if row is None:
                self.db.execute("INSERT INTO schema VALUES (0)")
            if version > len(MIGRATIONS):
                raise RuntimeError(f"database {self.path} has schema v{version}, newer than this autoshard "
                                   f"(v{len(MIGRATIONS)}): upgrade autoshard")
            for v in range(version, len(MIGRATIONS)):
                # One script per step, schema bump included: a step lands whole or not at all.
                self.db.executescript(f"BEGIN; {MIGRATIONS[v]} UPDATE schema SET version = {v + 1}; COMMIT;")

    def schema_version(self) -> int:
        return self.db.execute("SELECT version FROM schema").fetchone()[0]

    # -- jobs -------------------------------------------------------------
    def new_job(self, kind: str, key: str, request: dict) -> str:
        job_id = uuid.uuid4().hex[:16]
        now = time.time()
        with self._lock:
            self.db.execute("INSERT INTO jobs (id, kind, key, status, phase, request, created, updated) "
                            "VALUES (?, ?, ?, 'queued', 'queued', ?, ?, ?)",
                            (job_id, kind, key, json.dumps(request), now, now))
        return job_id

    def job(self, job_id: str) -> dict | None:
        row = self.db.execute("SELECT id, kind, key, status, phase, request, error, created, updated, attempts "
                              "FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return None
        keys = ("id", "kind", "key", "status", "phase", "request", "error", "created", "updated", "attempts")
        out = dict(zip(keys, row))
        out["request"] = json.loads(out["request"])
        return out

    def active_job_for(self, key: str) -> str | None:
        row = self.db.execute("SELECT id FROM jobs WHERE key = ? AND status IN ('queued', 'running') "
                              "ORDER BY created LIMIT 1", (key,)).fetchone()
        return row[0] if row else None

    def jobs_with_status(self, *status: str) -> list[str]:
        marks = ",".join("?" * len(status))
        return [r[0] for r in self.db.execute(f"SELECT id FROM jobs WHERE status IN ({marks}) ORDER BY created",
                                              status)]

    def count_status(self, status: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM jobs WHERE status = ?", (status,)).fetchone()[0]

    def set_status(self, job_id: str, status: str, phase: str | None = None, error: str | None = None,
                   started: bool = False) -> None:
        with self._lock:
            self.db.execute("UPDATE jobs SET status = ?, phase = COALESCE(?, phase), error = ?, updated = ?, "
                            "attempts = attempts + ? WHERE id = ?",
                            (status, phase, error, time.time(), 1 if started else 0, job_id))

    def set_phase(self, job_id: str, phase: str) -> None:
        with self._lock:
            self.db.execute("UPDATE jobs SET phase = ?, updated = ? WHERE id = ?", (phase, time.time(), job_id))

    def finish(self, job_id: str, key: str, kind: str, body: dict, summary: dict) -> None:
        """Store the result and mark the job done, atomically; count the solve."""
        now = time.time()
        with self._lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                self.db.execute("INSERT OR REPLACE INTO plans (key, kind, body, summary, created) "
                                "VALUES (?, ?, ?, ?, ?)",
                                (key, kind, json.dumps(body), json.dumps(summary), now))
                self.db.execute("UPDATE jobs SET status = 'done', phase = 'done', error = NULL, updated = ? "
                                "WHERE key = ? AND status IN ('queued', 'running')", (now, key))
                self.db.execute("INSERT INTO counters VALUES ('solves', 1) "
                                "ON CONFLICT(name) DO UPDATE SET value = value + 1")
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                raise

    # -- plans ------------------------------------------------------------
    def plan(self, key: str) -> dict | None:
        text = self.plan_text(key)
        return json.loads(text) if text is not None else None

    def plan_text(self, key: str) -> str | None:
        """The stored JSON text, served as is (no parse and re-serialize on the hot path)."""
        row = self.db.execute("SELECT body FROM plans WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def plans(self, limit: int = 100) -> list[dict]:
        rows = self.db.execute("SELECT key, kind, summary, created FROM plans ORDER BY created DESC LIMIT ?",
                               (limit,))
        return [{"key": k, "kind": kind, "summary": json.loads(s or "{}"), "created": c} for k, kind, s, c in rows]

    def counter(self, name: str) -> int:
        row = self.db.execute("SELECT value FROM counters WHERE name = ?", (name,)).fetchone()
        return row[0] if row else 0

    # -- profiles ---------------------------------------------------------
    def add_profile(self, profile_id: str, name: str, body: dict) -> None:
        with self._lock:
            self.db.execute("INSERT OR IGNORE INTO profiles (id, name, body, created) VALUES (?, ?, ?, ?)",
                            (profile_id, name, json.dumps(body), time.time()))

    def profile(self, profile_id: str) -> dict | None:
        row = self.db.execute("SELECT body FROM profiles WHERE id = ?", (profile_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def profiles(self) -> list[dict]:
        return [{"id": i, "name": n, "created": c}
                for i, n, c in self.db.execute("SELECT id, name, created FROM profiles ORDER BY created")]
